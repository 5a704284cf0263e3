"""``python -m cookbook.torchrun [torchrun options] train.py [args]``: torchrun, with its failure report
cut to one line.

It takes torchrun's own options (https://pytorch.org/docs/stable/elastic/run.html) and runs the same
elastic agent (``torch.distributed.run.run``). When workers fail, torchrun prints a framed summary of
every failed process, picking as "root cause" the earliest failure by time. Here the worker that
failed first has already printed its own one-line message (`cookbook.entry.run_main`), so the launcher
adds one line naming that rank and its exit status, and exits with that status (2 for bad input,
128 + N for a worker killed by signal N), so scripts and schedulers can tell the failures apart.
"""

from __future__ import annotations

import signal
import sys

from cookbook.entry import EXIT_BUG, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_PREEMPTED, EXIT_USER_ERROR

_MEANING = {EXIT_BUG: "a failure, its traceback is above", EXIT_USER_ERROR: "bad configuration, data or checkpoint",
            EXIT_PEER_LOST: "it lost contact with another rank", EXIT_INTERRUPTED: "interrupted",
            EXIT_PREEMPTED: "preempted after a checkpoint"}
PREEMPTED = ("preempted: the workers were asked to save a checkpoint at a step boundary and stop; run the same "
             f"command again to continue (exit status {EXIT_PREEMPTED})")


def describe_failure(rank: int, exitcode: int) -> tuple[str, int]:
    """One line for the first failed worker, and the status the launcher exits with.

    Args:
        rank: the worker's global rank.
        exitcode: its exit status as torch's elastic agent reports it (negative: killed by that signal).

    Returns:
        ``(line, status)``: status is `exitcode`, or 128 + N for a worker killed by signal N (the
        shell's convention).
    """
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = f"signal {-exitcode}"
        return f"error: rank {rank} was killed by {name}; the other ranks were stopped", 128 - exitcode
    meaning = _MEANING.get(exitcode, "see its output above")
    return f"error: rank {rank} failed first (exit status {exitcode}: {meaning}); the other ranks were stopped", exitcode


def main(argv: list[str] | None = None) -> int:
    """Parse torchrun's arguments, run the workers, and return the exit status (0 when all succeeded)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    from torch.distributed.elastic.multiprocessing.api import SignalException

    args = parse_args(argv)
    # SIGUSR1 (Slurm's warning before a job's end) is passed on to the workers, whose training loop then
    # stops at the next step boundary with a checkpoint; torchrun itself passes SIGTERM on.
    signal.signal(signal.SIGUSR1, _forward_to_workers)
    try:
        run(args)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        if all(f.exitcode == EXIT_PREEMPTED for f in exc.failures.values()):
            print(PREEMPTED, file=sys.stderr)
            return EXIT_PREEMPTED
        line, status = describe_failure(rank, failure.exitcode)
        print(line, file=sys.stderr)
        return status or EXIT_BUG
    except SignalException as exc:  # SIGTERM to torchrun: it has passed it on and waited for the workers
        if exc.sigval == signal.SIGTERM:
            print(PREEMPTED, file=sys.stderr)
            return EXIT_PREEMPTED
        raise
    return 0


def _forward_to_workers(signum: int, frame) -> None:
    import psutil

    for child in psutil.Process().children():  # the workers (not their data-loader processes)
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


if __name__ == "__main__":
    sys.exit(main())
