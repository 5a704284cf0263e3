"""The entry point of a recipe's ``train.py``: errors from whichever rank found them, and an exit that cannot hang.

    @cookbook.cli(load, preflight)  # --check runs preflight(cfg, world size); main(cfg) is the run
    def main(cfg): ...              # if __name__ == "__main__": cookbook.run_main(main, user_errors=(ConfigError, ...))

Exit statuses (docs/bad-input.md, docs/failures.md): 0 finished or stopped at ``train.stop_at_step``; 1 a bug or
library failure, with its traceback; 2 bad configuration, data or checkpoint (`user_errors`) or a package that does
not import, one line; 3 lost contact with another rank, or a stall naming the rank behind; 4 a non-finite loss or
gradient norm; 75 preempted after a checkpoint; 130 interrupted. The rank that found an error prints
``error: [rank 1] <message>``; ranks that then fail in a collective print one line and wait a few seconds, so the
launcher sees the first failure first; under torchrun it is also written to ``TORCHELASTIC_ERROR_FILE``. The
process ends with ``os._exit`` after flushing, skipping the interpreter's teardown
(docs/notes.md#a-hang-in-the-process-groups-destructor-torch-213-gloo). `run_script` runs a ``train.py`` (its
``--check``) in the calling process instead, and returns the status.
"""

from __future__ import annotations

import atexit
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

from cookbook.builds import broken_build_in
from cookbook.config import cli_parser
from cookbook.dist import collective_timed_out, describe_stall, last_finished_step
from cookbook.errors import (AGENT_PID_ENV, EXIT_BUG, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_PEER_LOST,  # noqa: F401
                             EXIT_PREEMPTED, EXIT_USER_ERROR, LAST_STEP_KEY, LAUNCH_TIME_ENV, AlreadyComplete,
                             OneLineError)
from cookbook.errors import first_line as _first_line
from cookbook.requirements import import_error_line
from cookbook.run_lock import die_with_parent


# Seconds a rank that lost a peer waits before exiting: long enough for torchrun (which polls its
# workers every 0.1 s by default) to see the peer's exit first and stop this rank itself.
_PEER_LOST_GRACE_S = 5.0

# What gloo and NCCL say when the process at the other end of a collective is gone.
_PEER_LOST_MARKERS = ("connection closed by peer", "connection reset by peer", "broken pipe",
                      "remote process exited", "socket closed", "connection refused", "nccl communicator was aborted")


def cli(load: Callable[[str, list[str]], Any], preflight: Callable[[Any, int | None], str],
        show_examples: Callable[[Any, int], str] | None = None, *, sized: bool = True,
        ok: str = "config OK: {path} ({detail})"):
    """A recipe's ``main(cfg)`` (the run) as the ``main(argv)`` of ``--config FILE [--check] [--show-examples N]
    [overrides]``: ``cfg = load(FILE, overrides)``; ``--check`` prints `ok` (``config OK: FILE (<preflight(cfg,
    world size)>)``), NGPU x NNODES as launch.sh starts it (None without `sized`: Ray plans the workers); ``--show-examples
    N`` prints ``show_examples(cfg, N)``; else ``main(cfg)``."""
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


def run_main(main: Callable[[list[str]], Any], user_errors: Sequence[type[BaseException]] = (),
             argv: list[str] | None = None) -> NoReturn:
    """Run ``main(argv)`` (default ``sys.argv[1:]``) and exit the process with the module docstring's statuses;
    never returns.

    `user_errors`: exception classes that mean bad input: printed as one line ``error: <message>`` (``[rank N]`` with
    several processes), status 2. An ``ImportError`` too: one line naming the module, its cause and the install line
    of the requirements.txt beside `main`'s file.
    """
    rank, world = os.environ.get("RANK", "0"), int(os.environ.get("WORLD_SIZE", "1") or 1)
    where = f"[rank {rank}] " if world > 1 else ""
    if os.environ.get(AGENT_PID_ENV) == str(os.getppid()):  # a worker of cookbook.torchrun: ends with its launcher
        die_with_parent()
        if os.getppid() != int(os.environ[AGENT_PID_ENV]):  # it died before the line above
            _exit(EXIT_PEER_LOST)
    try:
        main(sys.argv[1:] if argv is None else argv)
    except AlreadyComplete as exc:  # nothing to do: said once, by rank 0
        if rank in ("", "0"):
            print(str(exc), file=sys.stderr, flush=True)
        _exit(EXIT_OK)
    except tuple(user_errors) as exc:
        _say_once(exc, rank, where)
        _exit(EXIT_USER_ERROR)
    except ImportError as exc:  # a missing or broken package: the launcher does not restart 2, which would fail alike
        _record(exc)
        broken = broken_build_in(exc)  # a package built for another torch: its own line names the build
        _say(f"error: {where}{broken if broken is not None else import_error_line(exc, _requirements_beside(main))}")
        _exit(EXIT_USER_ERROR)
    except OneLineError as exc:
        _say_once(exc, rank, where)
        _exit(exc.exit_status)
    except KeyboardInterrupt as exc:  # its message, if it has one (cookbook.distributed's)
        print(f"{where}{exc or 'interrupted'}", file=sys.stderr)
        _exit(EXIT_INTERRUPTED)
    except SystemExit as exc:
        code = exc.code
        if isinstance(code, str):
            print(code, file=sys.stderr)
        _exit(code if isinstance(code, int) else (0 if code is None else EXIT_BUG))
    except BaseException as exc:  # noqa: BLE001 - every failure ends the process with a status
        if world > 1 and collective_timed_out(exc):  # this rank is healthy: its line names the stalled one, first
            line = describe_stall(exc)
            _record(RuntimeError(line))
            _say(f"error: {where}{line}")
            _exit(EXIT_PEER_LOST)
        if (broken := broken_build_in(exc)) is not None:  # re-raised by a library (transformers) as another error
            _record(broken)
            _say(f"error: {where}{broken}")
            _exit(EXIT_USER_ERROR)
        if world > 1 and peer_lost(exc):
            print(f"error: {where}stopped: another rank is gone ({_first_line(exc)}); the first rank to fail "
                  f"says why", file=sys.stderr)
            _exit(EXIT_PEER_LOST, wait=_PEER_LOST_GRACE_S)
        _record(exc)
        traceback.print_exc()
        _exit(EXIT_BUG)
    _exit(EXIT_OK)


# Seconds a rank that stays quiet about an error every rank raised alike waits, so that rank 0 exits (and is
# reported by the launcher) first.
_QUIET_RANK_WAIT_S = 1.0


def _quiet(exc: BaseException, rank: str) -> bool:
    """An error raised alike on every rank (its class sets ``same_on_every_rank``: a diverged step, a failed
    save) is printed by rank 0 alone."""
    return bool(getattr(exc, "same_on_every_rank", False)) and rank not in ("", "0")


def _say_once(exc: BaseException, rank: str, where: str) -> None:
    _record(exc)
    if _quiet(exc, rank):
        time.sleep(_QUIET_RANK_WAIT_S)
    else:
        _say(f"error: {where}{exc}")


def peer_lost(exc: BaseException) -> bool:
    """True if `exc` (or an exception it was raised from) is a collective that failed because the
    process at the other end exited: gloo's "Connection closed by peer", NCCL's "remote process
    exited", torch's `DistNetworkError`."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, getattr(dist, "DistNetworkError", ())) or any(
                m in str(exc).lower() for m in _PEER_LOST_MARKERS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _requirements_beside(main: Callable) -> Path | None:
    """The requirements.txt in the folder of `main`'s file (a recipe's own extra packages), if there is one."""
    code = getattr(inspect.unwrap(main), "__code__", None)
    path = Path(code.co_filename).resolve().with_name("requirements.txt") if code is not None else None
    return path if path is not None and path.is_file() else None


def _say(line: str) -> None:
    """Print one line to stderr in a single write, so that the lines of ranks printing at once do not interleave."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _record(exc: BaseException) -> None:
    """Write `exc` to torchrun's per-worker error file (if torchrun gave one), so that its failure
    summary holds this rank's message and the time it failed."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

        ErrorHandler().record_exception(exc)
        if (step := last_finished_step()) is not None:  # the launcher tells a failure that repeats at one step
            path = os.environ["TORCHELASTIC_ERROR_FILE"]
            with open(path) as f:
                data = json.load(f)
            data["message"]["extraInfo"][LAST_STEP_KEY] = step
            with open(path, "w") as f:
                json.dump(data, f)
    except Exception:  # noqa: BLE001 - the error itself is printed either way
        pass


class _Exit(BaseException):
    """`_exit`'s status inside `run_script`: raised to it instead of ending the process."""

    def __init__(self, status: int):
        super().__init__(status)
        self.status = status


_in_script = False  # `run_script` is running a script in this process


def run_script(script: Path, argv: list[str], env: dict[str, str]) -> int:
    """Run `script` in this process as ``python script *argv`` with `env` added would (its module as ``__main__``, its
    folder first on ``sys.path``, torch's threads as ``OMP_NUM_THREADS`` says); returns its exit status: `run_main`'s, a ``SystemExit``'s, or 1 with the traceback
    of an exception that escapes. Put back afterwards: the environment, ``sys.argv``, ``sys.path``, the standard
    streams, the working folder, signal handlers, warnings filters, the root logger, torch's thread count, and the
    modules imported from the script's folder; ``atexit`` handlers the script registered run at this process's end.
    Not undone: the other imports, and CUDA if the script initialised it.
    """
    import runpy
    import signal
    import warnings

    import torch

    global _in_script
    folder, environ, saved = str(script.parent), dict(os.environ), (sys.argv, sys.path, sys.stdout, sys.stderr)
    cwd, threads, modules, root = os.getcwd(), torch.get_num_threads(), set(sys.modules), logging.getLogger()
    handlers = {s: signal.getsignal(s) for s in signal.valid_signals()}
    logs = (root.level, list(root.handlers), logging.root.manager.disable)
    # python -m put the working folder first on sys.path, where python script puts the script's folder
    from_cwd = getattr(sys.modules["__main__"], "__spec__", None) is not None and not sys.flags.safe_path \
        and bool(sys.path) and os.path.abspath(sys.path[0] or ".") == cwd
    os.environ.update(env)
    sys.argv, sys.path = [str(script), *argv], [folder, *sys.path[1 if from_cwd else 0:]]
    if os.environ.get("OMP_NUM_THREADS", "").isdigit() and int(os.environ["OMP_NUM_THREADS"]) > 0:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))  # what a new process's torch reads at import
    _in_script = True
    try:
        with warnings.catch_warnings():
            runpy.run_path(str(script), run_name="__main__")
        status = EXIT_OK
    except _Exit as exc:
        status = exc.status
    except SystemExit as exc:  # as the interpreter reads it
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
        status = exc.code if isinstance(exc.code, int) else (EXIT_OK if exc.code is None else EXIT_BUG)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = EXIT_INTERRUPTED
    except BaseException as exc:  # noqa: BLE001 - raised before run_main (an import): as python (cookbook.builds' hook)
        if (broken := broken_build_in(exc)) is not None:
            _say(f"error: {broken}")
            status = EXIT_USER_ERROR
        else:
            traceback.print_exc()
            status = EXIT_BUG
    finally:
        _in_script = False
        _flush()
        sys.argv, sys.path, sys.stdout, sys.stderr = saved
        for key in set(os.environ) - set(environ):
            del os.environ[key]
        os.environ.update({k: v for k, v in environ.items() if os.environ.get(k) != v})
        os.chdir(cwd)
        for sig, handler in handlers.items():
            if handler is not None and signal.getsignal(sig) is not handler:
                signal.signal(sig, handler)
        root.setLevel(logs[0])
        root.handlers[:] = logs[1]
        logging.disable(logs[2])
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        for name in set(sys.modules) - modules:  # the recipe's own modules: another script may have its own "data"
            if str(getattr(sys.modules[name], "__file__", None) or "").startswith(folder + os.sep):
                del sys.modules[name]
    return status


def _exit(status: int, wait: float = 0.0) -> NoReturn:
    """Run the ``atexit`` handlers, flush, optionally wait, and end the process with ``os._exit``. A rank that lost a
    peer (``wait`` > 0) skips the handlers: they may talk to the peer that is gone. In `run_script`: raises the status
    to it (its process goes on: no handlers, no logging shutdown).
    """
    if _in_script:
        raise _Exit(status)
    if not wait:
        atexit._run_exitfuncs()
    logging.shutdown()
    _flush()
    if wait:
        time.sleep(wait)
    os._exit(status)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a closed stream cannot block the exit
            pass
