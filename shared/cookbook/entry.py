"""The entry point of a recipe's ``train.py``: errors from whichever rank found them, and an exit that cannot hang.

    @cookbook.cli(load, preflight)  # --check runs preflight(cfg, world size); main(cfg) is the run
    def main(cfg): ...              # if __name__ == "__main__": cookbook.run_main(main, user_errors=(ConfigError, ...))

Exit statuses: docs/bad-input.md, docs/failures.md. The rank that found an error prints ``error: [rank 1] <message>``
(and writes it to ``TORCHELASTIC_ERROR_FILE``); ranks that then fail in a collective wait a few seconds, so the
launcher sees the first failure first. The process ends with ``os._exit``, skipping the interpreter's teardown
(docs/notes.md#a-hang-in-the-process-groups-destructor-torch-213-gloo).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import json
import logging
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

import torch.distributed as dist

from cookbook.builds import broken_build_in, chain
from cookbook.config import cli_parser
from cookbook.dist import collective_timed_out, describe_stall, last_finished_step
from cookbook.errors import AGENT_PID_ENV, EXIT_BUG, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_LOST, EXIT_USER_ERROR
from cookbook.errors import LAST_STEP_KEY, AlreadyComplete, OneLineError, check_passed
from cookbook.errors import first_line as _first_line
from cookbook.requirements import import_error_line
from cookbook.run_lock import die_with_parent


_PEER_LOST_GRACE_S = 5.0  # a rank that lost a peer waits so long: torchrun sees the peer's exit first

# What gloo and NCCL say when the process at the other end of a collective is gone.
_PEER_LOST_MARKERS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "remote process exited",
    "socket closed",
    "connection refused",
    "nccl communicator was aborted",
)


def cli(
    load: Callable[[str, list[str]], Any],
    preflight: Callable[[Any, int | None], str],
    show_examples: Callable[[Any, int], str] | None = None,
    *,
    sized: bool = True,
    ok: str = "config OK: {path} ({detail})",
):
    """A recipe's ``main(cfg)`` as the ``main(argv)`` of ``--config FILE [--check] [--show-examples N] [overrides]``:
    ``--check`` prints `ok` with ``preflight(cfg, world size)`` (None without `sized`: Ray plans the workers)."""

    def wrap(main: Callable[[Any], None]) -> Callable[[list[str]], None]:
        parser = cli_parser(main.__globals__.get("__doc__"), show_examples=show_examples is not None)

        @functools.wraps(main)
        def dispatch(argv: list[str]) -> None:
            args = parser.parse_args(argv)
            cfg = load(args.config, args.overrides)
            if show_examples is not None and args.show_examples:  # one process, no worker: what training sees
                print(show_examples(cfg, args.show_examples))
            elif args.check:  # one process, before any worker starts
                from cookbook.launch import check_world_size  # here: python -m cookbook.launch imports this package

                print(ok.format(path=args.config, detail=preflight(cfg, check_world_size() if sized else None)))
            else:
                main(cfg)

        return dispatch

    return wrap


def run_main(
    main: Callable[[list[str]], Any], user_errors: Sequence[type[BaseException]] = (), argv: list[str] | None = None
) -> NoReturn:
    """Run ``main(argv)`` (default ``sys.argv[1:]``) and exit the process with its status; never returns.
    `user_errors` (bad input) and an ``ImportError`` are one line ``error: [rank N] <message>``, status 2."""
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    where = f"[rank {rank}] " if world > 1 else ""
    if os.environ.get(AGENT_PID_ENV) == str(os.getppid()):  # a worker of cookbook.torchrun: ends with its launcher
        die_with_parent()
        if os.getppid() != int(os.environ[AGENT_PID_ENV]):  # it died before the line above
            _exit(EXIT_PEER_LOST)
    try:
        if not check_passed():  # started while the launcher's check ran, which failed or found the run complete
            _exit(EXIT_OK)  # the check said so
    except KeyboardInterrupt:
        _exit(EXIT_INTERRUPTED)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except AlreadyComplete as exc:  # nothing to do: said once, by rank 0
        if rank in ("", "0"):
            print(str(exc), file=sys.stderr, flush=True)
        _exit(EXIT_OK)
    except tuple(user_errors) as exc:
        _fail(where, exc, EXIT_USER_ERROR)
    except ImportError as exc:  # a missing or broken package: the launcher does not restart 2, which would fail alike
        broken = broken_build_in(exc)  # a package built for another torch: its own line names the build
        _fail(where, exc, EXIT_USER_ERROR, broken or import_error_line(exc, _requirements_beside(main)))
    except OneLineError as exc:
        _fail(where, exc, exc.exit_status)
    except KeyboardInterrupt as exc:  # its message, if it has one (cookbook.distributed's); else the launcher's line
        if str(exc):
            print(f"{where}{exc}", file=sys.stderr)
        _exit(EXIT_INTERRUPTED)
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        _exit(exc.code if isinstance(exc.code, int) else (0 if exc.code is None else EXIT_BUG))
    except BaseException as exc:  # noqa: BLE001 - every failure ends the process with a status
        if world > 1 and collective_timed_out(exc):  # this rank is healthy: its line names the stalled one, first
            _fail(where, RuntimeError(describe_stall(exc)), EXIT_PEER_LOST)
        if (broken := broken_build_in(exc)) is not None:  # re-raised by a library (transformers) as another error
            _fail(where, broken, EXIT_USER_ERROR)
        if world > 1 and peer_lost(exc):
            print(
                f"error: {where}stopped: another rank is gone ({_first_line(exc)}); the first rank to fail says why",
                file=sys.stderr,
            )
            _exit(EXIT_PEER_LOST, wait=_PEER_LOST_GRACE_S)
        _record(exc)
        traceback.print_exc()
        _exit(EXIT_BUG)
    _exit(EXIT_OK)


_QUIET_RANK_WAIT_S = 1.0  # a rank quiet about an error every rank raised waits so long: rank 0 is reported first


def peer_lost(exc: BaseException) -> bool:
    """True if `exc` (or an exception it was raised from) is a collective that failed because the process at the
    other end exited (gloo's "Connection closed by peer", NCCL's "remote process exited", `DistNetworkError`)."""
    network = getattr(dist, "DistNetworkError", ())
    return any(isinstance(e, network) or any(m in str(e).lower() for m in _PEER_LOST_MARKERS) for e in chain(exc))


def _requirements_beside(main: Callable) -> Path | None:
    """The requirements.txt in the folder of `main`'s file (a recipe's own extra packages), if there is one."""
    code = getattr(inspect.unwrap(main), "__code__", None)
    path = Path(code.co_filename).resolve().with_name("requirements.txt") if code is not None else None
    return path if path is not None and path.is_file() else None


def _fail(where: str, exc: BaseException, status: int, line: object = None) -> NoReturn:
    """Record `exc`, print ``error: <where><line, else exc>`` in a single write (the lines of ranks printing at once
    do not interleave) and exit with `status`. An error raised alike on every rank (its class sets
    ``same_on_every_rank``) is printed by rank 0 alone."""
    _record(exc)
    if getattr(exc, "same_on_every_rank", False) and os.environ.get("RANK", "0") not in ("", "0"):
        time.sleep(_QUIET_RANK_WAIT_S)
    else:
        sys.stderr.write(f"error: {where}{exc if line is None else line}\n")
        sys.stderr.flush()
    _exit(status)


def _record(exc: BaseException) -> None:
    """Write `exc` (and the last finished step) to torchrun's per-worker error file, if torchrun gave one."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    with contextlib.suppress(Exception):  # the error itself is printed either way
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
        if (step := last_finished_step()) is not None:  # the launcher tells a failure that repeats at one step
            path = Path(os.environ["TORCHELASTIC_ERROR_FILE"])
            data = json.loads(path.read_text())
            data["message"]["extraInfo"][LAST_STEP_KEY] = step
            path.write_text(json.dumps(data))


def _exit(status: int, wait: float = 0.0) -> NoReturn:
    """Run the ``atexit`` handlers (not with `wait`: they may talk to a lost peer), flush, wait, ``os._exit``; while
    `cookbook.launch` runs the check in its own process, raise SystemExit(status) instead."""
    from cookbook import launch  # here: python -m cookbook.launch imports this package

    if launch.checking:
        raise SystemExit(status)
    if not wait:
        atexit._run_exitfuncs()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):  # a closed stream cannot block the exit
            stream.flush()
    if wait:
        time.sleep(wait)
    os._exit(status)
