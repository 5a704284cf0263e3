"""``python -m cookbook.torchrun [torchrun options] train.py [args]``: torchrun's agent, with its failure report cut
to one line naming the first failed rank and its status (the exit status; 128 + N for signal N). ``--max-restarts N``
restarts the whole group only for what a restart can cure (`should_restart`) and not for the previous attempt's
failure again; each restart prints one line and meets at a rendezvous of its own (`attempt_args`). docs/failures.md.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import signal
import sys
import time
from typing import Iterable, Iterator, Sequence

from cookbook.errors import AGENT_PID_ENV, EXIT_BUG, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_PREEMPTED
from cookbook.errors import EXIT_USER_ERROR, LAST_STEP_KEY, LAUNCH_TIME_ENV, RESTART_COUNT_ENV, killed_by

_MEANING = {
    EXIT_BUG: "a failure, its traceback is above",
    EXIT_USER_ERROR: "bad configuration, data or checkpoint",
    EXIT_PEER_LOST: "it lost contact with another rank",
    EXIT_INTERRUPTED: "interrupted",
    EXIT_PREEMPTED: "preempted after a checkpoint",
    EXIT_DIVERGED: "a non-finite loss or gradient",
}
_PREEMPTED = (
    "preempted: the workers were asked to save a checkpoint at a step boundary and stop (none if they had not "
    f"reached their first step); run the same command again to continue (exit status {EXIT_PREEMPTED})"
)
_INTERRUPTED = (
    "interrupted (Ctrl-C): the workers were stopped; run the same command again to resume from the newest "
    f"checkpoint, if one was saved (Ctrl-C saves none, SIGTERM does) (exit status {EXIT_INTERRUPTED})"
)
_RESTARTED_STATUSES = (EXIT_BUG, EXIT_PEER_LOST)
# Signals that ask a process to stop (a scheduler, a terminal, Slurm's warning): a worker they ended is not restarted.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

_stop_asked = False  # the launcher was sent SIGUSR1 (or SIGTERM): no restart after it


def describe_failure(rank: int, exitcode: int, cause: str | None = None) -> tuple[str, int]:
    """``(line, status)`` for the first failed worker `rank`, with the `cause` it recorded (`_cause`); `exitcode`
    negative: killed by that signal (128 + N)."""
    line = f"error: {_failed(rank, exitcode, ' first')}{f': {cause}' if cause else ''}; the other ranks were stopped"
    return line, 128 - exitcode if exitcode < 0 else exitcode


def _recorded(failure) -> dict:
    """What a failed worker recorded in its error file (`cookbook.entry` through torch's ``ErrorHandler``):
    ``{"message": "<class>: <text>", "extraInfo": {...}}``; {} for a signal or no record."""
    info = failure.error_file_data.get("message") if isinstance(failure.error_file_data, dict) else None
    return info if isinstance(info, dict) and failure.exitcode >= 0 else {}


def _cause(failure) -> str | None:
    """The first line of the error a failed worker recorded (`_recorded`), without the ``<class>: `` torch puts
    before it; None for a signal or no record."""
    message = _recorded(failure).get("message")
    if not isinstance(message, str) or not message.strip():
        return None
    return re.sub(r"^[A-Za-z_][\w.]*: ", "", message.strip().splitlines()[0], count=1)


def _failed(rank: int, exitcode: int, first: str = "") -> str:
    """``rank N was killed by SIGX`` (`exitcode` negative) or ``rank N failed<first> (exit status S: meaning)``."""
    if exitcode >= 0:
        return f"rank {rank} failed{first} (exit status {exitcode}: {_MEANING.get(exitcode, 'see its output above')})"
    return f"rank {rank} was {killed_by(-exitcode)}"


def should_restart(exitcode: int, exitcodes: Iterable[int] = ()) -> bool:
    """Whether a failed group is worth starting again: the first failure (`exitcode`; negative: a signal) is a
    kill by a signal not in `STOP_SIGNALS`, or status 1 or 3, and none of `exitcodes` is 2, 4, 75 or 130."""
    if {exitcode, *exitcodes} & {EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_INTERRUPTED}:
        return False
    if exitcode < 0:
        return -exitcode not in [int(s) for s in STOP_SIGNALS]
    return exitcode in _RESTARTED_STATUSES


# The stalled ranks in `cookbook.dist.describe_stall`'s line, which a healthy rank whose collective timed out
# records in its error file: ": rank 1 (pid 4242 on node7) last finished step 2, ... - it is stalled".
_STALLED = re.compile(
    r": ((?:rank \d+(?: \(pid [^)]*\))?, )*rank \d+(?: \(pid [^)]*\))?) "
    r"(?:last finished|are behind|did not reach).* - (?:it is|they are) stalled"
)


def _stalled_ranks(failures: Iterable) -> list[int]:
    """The ranks named as stalled by the first of the failed workers whose recorded message (`_recorded`) names any."""
    for failure in failures:
        message = _recorded(failure).get("message")
        if isinstance(message, str) and (m := _STALLED.search(message)):
            return [int(r) for r in re.findall(r"rank (\d+)", m.group(1))]
    return []


def _failure_signature(rank: int, failure) -> tuple | None:
    """``(rank, exit status, error message, last finished step)`` from a failed worker's error file, or ``None`` (a
    signal, no step yet). Two attempts with one signature fail alike: a restart would repeat it."""
    info = _recorded(failure)
    step = info.get("extraInfo", {}).get(LAST_STEP_KEY)
    if step is None:
        return None
    return rank, failure.exitcode, info.get("message"), step


def _restart_line(attempt: int, max_restarts: int, rank: int, exitcode: int, stalled: Sequence[int] = ()) -> str:
    """The line printed before restart `attempt` (1-based): `rank`'s failure, or the `stalled` ranks it waited for."""
    if stalled:
        many = len(stalled) > 1
        what = (
            f"rank{'s' if many else ''} {', '.join(map(str, stalled))} stalled (rank {rank}'s collective timed "
            f"out waiting for {'them' if many else 'it'})"
        )
    else:
        what = _failed(rank, exitcode)
    return f"restart {attempt} of {max_restarts}: {what}; the workers resume from the newest checkpoint"


def attempt_args(args, attempt: int):
    """A copy of torchrun's parsed `args` for restart `attempt` (0: unchanged) that meets at a rendezvous of its own:
    a free port (``--standalone``), ``--master-port + k``, or ``port + k`` with the id ``<rdzv-id>-restart<k>``."""
    from torch.distributed.run import parse_min_max_nnodes

    args = copy.deepcopy(args)
    if attempt == 0 or args.standalone:  # standalone: torchrun picks a free port and a new id on every run
        return args
    if parse_min_max_nnodes(args.nnodes)[1] == 1 and args.rdzv_backend == "static" and not args.rdzv_endpoint:
        args.standalone = True  # one node: a free port (--master-port may still be held by the failed attempt)
    elif args.rdzv_backend == "static" and not args.rdzv_endpoint:
        args.master_port = (args.master_port or 29500) + attempt  # every node computes the same port
    elif args.rdzv_endpoint:
        host, _, port = args.rdzv_endpoint.rpartition(":")
        if host and port.isdigit():
            args.rdzv_endpoint = f"{host}:{int(port) + attempt}"
        args.rdzv_id = f"{args.rdzv_id}-restart{attempt}"
    return args


@contextlib.contextmanager
def environ_kept(*keys: str) -> Iterator[None]:
    """Put `keys` of ``os.environ`` back as they were (unset where they were unset) when the block ends."""
    saved = {key: os.environ.get(key) for key in keys}
    try:
        yield
    finally:
        for key, value in saved.items():
            os.environ.pop(key, None)
            if value is not None:
                os.environ[key] = value


def main(argv: list[str] | None = None) -> int:
    """Run torchrun with `argv`, restarting as the module docstring says; returns the exit status."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    max_restarts, args.max_restarts = args.max_restarts, 0  # the restarts are decided here
    # SIGUSR1 (Slurm's warning before a job's end) goes on to the workers, which save and stop; torchrun passes SIGTERM.
    previous = signal.signal(signal.SIGUSR1, _forward_to_workers)
    with environ_kept(RESTART_COUNT_ENV, LAUNCH_TIME_ENV, AGENT_PID_ENV):  # as they were, for a caller here
        os.environ[AGENT_PID_ENV] = str(os.getpid())  # its workers end when this process does (cookbook.entry.run_main)
        attempt, last_seen = 0, None
        try:
            while True:
                os.environ[RESTART_COUNT_ENV] = str(attempt)  # the workers inherit the launcher's environment
                if attempt:  # a restarted group's startup_s counts from its restart (cookbook.metrics.launch_time)
                    os.environ[LAUNCH_TIME_ENV] = repr(time.time())
                try:
                    run(attempt_args(args, attempt))
                    return 0
                except ChildFailedError as exc:
                    rank, failure = exc.get_first_failure()
                    codes = [f.exitcode for f in exc.failures.values()]
                    if all(code == EXIT_PREEMPTED for code in codes):
                        print(_PREEMPTED, file=sys.stderr)
                        return EXIT_PREEMPTED
                    seen = _failure_signature(rank, failure)
                    repeated = seen[-1] if attempt and seen is not None and seen == last_seen else None
                    last_seen = seen
                    restart = should_restart(failure.exitcode, codes) and repeated is None and not _stop_asked
                    if restart and attempt < max_restarts:
                        attempt += 1
                        stalled = _stalled_ranks((failure, *exc.failures.values()))
                        line = _restart_line(attempt, max_restarts, rank, failure.exitcode, stalled)
                        print(line, file=sys.stderr, flush=True)
                        continue
                    line, status = describe_failure(rank, failure.exitcode, _cause(failure))
                    if repeated is not None:
                        line += (
                            f"; the same error as before restart {attempt}, after the same step "
                            f"({repeated}): not restarted again, it would repeat"
                        )
                    elif attempt:
                        line += f" (after {attempt} restart{'s' if attempt > 1 else ''})"
                    print(line, file=sys.stderr)
                    return status or EXIT_BUG
        except SignalException as exc:  # SIGTERM / Ctrl-C to torchrun: it has passed it on and waited for the workers
            if exc.sigval == signal.SIGTERM:
                print(_PREEMPTED, file=sys.stderr)
                return EXIT_PREEMPTED
            if exc.sigval == signal.SIGINT:
                print(_INTERRUPTED, file=sys.stderr)
                return EXIT_INTERRUPTED
            raise
        finally:  # as it was, for a caller in the same process
            signal.signal(signal.SIGUSR1, previous)


def _forward_to_workers(signum: int, frame) -> None:
    import psutil

    global _stop_asked
    _stop_asked = True
    for child in psutil.Process().children():  # the workers (not their data-loader processes)
        with contextlib.suppress(psutil.Error):
            child.send_signal(signum)


if __name__ == "__main__":
    sys.exit(main())
