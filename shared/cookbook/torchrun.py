"""``python -m cookbook.torchrun [torchrun options] train.py [args]``: torchrun, with its failure report
cut to one line and restarts only for failures that a restart can cure.

It takes torchrun's own options (https://pytorch.org/docs/stable/elastic/run.html) and runs the same
elastic agent (``torch.distributed.run.run``). When workers fail, torchrun prints a framed summary of
every failed process, picking as "root cause" the earliest failure by time. Here the worker that
failed first has already printed its own one-line message (`cookbook.entry.run_main`), so the launcher
adds one line naming that rank and its exit status, and exits with that status (2 for bad input,
128 + N for a worker killed by signal N), so scripts and schedulers can tell the failures apart.

**Restarts** (``--max-restarts N``, torchrun's option; default 0). torchrun's own restarts follow any
failure, also those that would only repeat. Here the agent runs with ``max_restarts=0`` and the whole
group is started again, up to N times, only when the first failure (`should_restart`) is

- a worker killed by a signal other than one that asks to stop (SIGKILL from the out-of-memory killer,
  SIGSEGV, SIGBUS, SIGABRT from a collective's watchdog, ...), or
- exit status 1 (a bug or library failure, e.g. a GPU's fault) or 3 (lost contact with another rank),

and not when the failure repeats the previous attempt's (same rank, status, error message and last finished step:
`_failure_signature`), and never after 2 (bad input), 4 (diverged), 75 (preempted), 130 (interrupted), a worker ended by SIGTERM, SIGINT,
SIGHUP, SIGQUIT or SIGUSR1, nor once the launcher itself was sent SIGTERM or SIGUSR1 (Slurm's warning:
the job still ends with 75). Each restart prints one line::

    restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint

(after a stall, the rank a healthy rank's timed-out collective waited for: ``rank 1 stalled (rank 0's collective
timed out waiting for it)``).

The restarted workers find ``COOKBOOK_RESTART_COUNT`` (1, 2, ...; 0 on the first start) in their
environment, and ``COOKBOOK_LAUNCH_TIME`` set to the restart's time (their ``startup_s`` counts from it); they
resume as any re-run does (``checkpoint.resume: auto``, every recipe's default: the
newest complete checkpoint, or a fresh start when the failure came before the first one). After the last
restart the failure line says how many were used.

Each attempt meets at a rendezvous of its own, so that nothing of the failed attempt's store is reused:
on one node a free port (torchrun's ``--standalone``); with a static rendezvous over several nodes
(``--master-addr``/``--master-port``, what `cookbook.launch` uses), attempt k meets at ``--master-port + k``
(open those ports between the nodes); with ``--rdzv-endpoint host:port``, at ``port + k`` under the id
``<rdzv-id>-restart<k>``.

Several nodes: every node runs this launcher, and every node sees the failure: the node of the failed
worker as that worker's status, the others as their workers' exit 3 (they lose the peer; with NCCL this
can take until the collective's timeout, which ends in SIGABRT, also restarted). Each launcher decides
by itself from what its workers did, so all nodes restart together when the failure is one that restarts
(a kill, a crash, a lost peer) and all stop when every node's workers stopped alike (preemption: 75 on
every node). A node whose own workers failed with 2 stops while the others, which saw only the lost
peer (3), restart and wait at the next rendezvous until its timeout (600 s; ``--rdzv-conf timeout=S``)
before they fail too. The restart counts are per node and agree as long as every failure reaches every
node.
"""

from __future__ import annotations

import copy
import os
import re
import signal
import sys
import time
from typing import Iterable, Sequence

from cookbook.errors import (AGENT_PID_ENV, EXIT_BUG, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_PEER_LOST, EXIT_PREEMPTED,
                             EXIT_USER_ERROR, LAST_STEP_KEY, LAUNCH_TIME_ENV, RESTART_COUNT_ENV)

_MEANING = {EXIT_BUG: "a failure, its traceback is above", EXIT_USER_ERROR: "bad configuration, data or checkpoint",
            EXIT_PEER_LOST: "it lost contact with another rank", EXIT_INTERRUPTED: "interrupted",
            EXIT_PREEMPTED: "preempted after a checkpoint", EXIT_DIVERGED: "a non-finite loss or gradient"}
_PREEMPTED = ("preempted: the workers were asked to save a checkpoint at a step boundary and stop; run the same "
             f"command again to continue (exit status {EXIT_PREEMPTED})")
_RESTARTED_STATUSES = (EXIT_BUG, EXIT_PEER_LOST)
# Signals that ask a process to stop (a scheduler, a terminal, Slurm's warning): a worker they ended is not restarted.
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1)

_stop_asked = False  # the launcher was sent SIGUSR1 (or SIGTERM): no restart after it


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
        line = f"error: rank {rank} was killed by {_signal_name(-exitcode)}; the other ranks were stopped"
        return line, 128 - exitcode
    meaning = _MEANING.get(exitcode, "see its output above")
    return f"error: rank {rank} failed first (exit status {exitcode}: {meaning}); the other ranks were stopped", exitcode


def should_restart(exitcode: int, exitcodes: Iterable[int] = ()) -> bool:
    """Whether a failed worker group is worth starting again (resuming from its newest checkpoint).

    Args:
        exitcode: the first failed worker's exit status as torch's elastic agent reports it (negative:
            killed by that signal).
        exitcodes: every failed worker's status (the first one's included, or not).

    Returns:
        ``True`` when the first failure is a kill by a signal not in `_STOP_SIGNALS`, or status 1 (a bug or
        library failure) or 3 (lost a peer, or a collective timed out), and no worker stopped with 2 (bad input:
        it would fail again), 4 (diverged: it would diverge again), 75 (preempted: the scheduler takes over) or
        130 (interrupted). ``False`` for any other status.
    """
    if any(code in (EXIT_USER_ERROR, EXIT_DIVERGED, EXIT_PREEMPTED, EXIT_INTERRUPTED) for code in (exitcode, *exitcodes)):
        return False
    if exitcode < 0:
        return -exitcode not in [int(s) for s in _STOP_SIGNALS]
    return exitcode in _RESTARTED_STATUSES


# The stalled ranks in `cookbook.dist.describe_stall`'s line, which a healthy rank whose collective timed out
# records in its error file: ": rank 1 (pid 4242 on node7) last finished step 2, ... - it is stalled".
_STALLED = re.compile(r": ((?:rank \d+(?: \(pid [^)]*\))?, )*rank \d+(?: \(pid [^)]*\))?) "
                      r"(?:last finished|are behind|did not reach).* - (?:it is|they are) stalled")


def _stalled_ranks(message: str | dict | None) -> list[int]:
    """The ranks a failed worker's error-file message (``ProcessFailure.message``: text, or torch's record
    ``{"message": text, ...}``) names as stalled (`cookbook.dist.describe_stall`); ``[]`` if none."""
    if isinstance(message, dict):
        message = message.get("message")
    m = _STALLED.search(message) if isinstance(message, str) else None
    return [int(r) for r in re.findall(r"rank (\d+)", m.group(1))] if m else []


def _failure_signature(rank: int, failure) -> tuple | None:
    """``(rank, exit status, error message, last finished step)`` of a failed worker whose error file
    (`cookbook.entry.run_main`) records both its message and its step; ``None`` otherwise (a signal, no step
    yet). Two attempts with one signature fail deterministically: a restart would repeat it."""
    info = failure.error_file_data.get("message", {})
    step = info.get("extraInfo", {}).get(LAST_STEP_KEY) if isinstance(info, dict) else None
    if failure.exitcode < 0 or step is None:
        return None
    return rank, failure.exitcode, info.get("message"), step


def _restart_line(attempt: int, max_restarts: int, rank: int, exitcode: int, stalled: Sequence[int] = ()) -> str:
    """The line printed before restart `attempt` (1-based) of `max_restarts`, naming the failure (`rank`'s
    `exitcode`, negative for a signal) that caused it; with `stalled` (`_stalled_ranks` of a failed worker's
    record), the ranks that stalled instead: `rank`'s collective timed out waiting for them."""
    if stalled:
        many = len(stalled) > 1
        what = (f"rank{'s' if many else ''} {', '.join(map(str, stalled))} stalled (rank {rank}'s collective timed "
                f"out waiting for {'them' if many else 'it'})")
    elif exitcode < 0:
        what = f"rank {rank} was killed by {_signal_name(-exitcode)}"
    else:
        what = f"rank {rank} failed (exit status {exitcode}: {_MEANING.get(exitcode, 'see its output above')})"
    return f"restart {attempt} of {max_restarts}: {what}; the workers resume from the newest checkpoint"


def attempt_args(args, attempt: int):
    """torchrun's parsed arguments for restart `attempt` (``0``: the first start): a copy that meets at a
    rendezvous of its own (see the module docstring), so that the failed attempt's store is not reused.

    Args:
        args: ``torch.distributed.run.parse_args``'s namespace (not changed).
        attempt: ``0`` for the first start, ``k`` for the k-th restart.

    Returns:
        A new namespace; for ``attempt == 0`` an unchanged copy.
    """
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


def main(argv: list[str] | None = None) -> int:
    """Parse torchrun's arguments, run the workers (restarting them as the module docstring says), and
    return the exit status (0 when all succeeded)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    max_restarts, args.max_restarts = args.max_restarts, 0  # the restarts are decided here
    # SIGUSR1 (Slurm's warning before a job's end) is passed on to the workers, whose training loop then
    # stops at the next step boundary with a checkpoint; torchrun itself passes SIGTERM on.
    previous = signal.signal(signal.SIGUSR1, _forward_to_workers), os.environ.get(RESTART_COUNT_ENV)
    launched = os.environ.get(LAUNCH_TIME_ENV)
    agent = os.environ.get(AGENT_PID_ENV)
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
                seen, repeated = _failure_signature(rank, failure), None
                if attempt and seen is not None and seen == last_seen:
                    repeated = seen[-1]
                last_seen = seen
                if (attempt < max_restarts and not _stop_asked and repeated is None
                        and should_restart(failure.exitcode, codes)):
                    attempt += 1
                    stalled = next((found for f in (failure, *exc.failures.values())
                                    if (found := _stalled_ranks(f.message))), [])
                    print(_restart_line(attempt, max_restarts, rank, failure.exitcode, stalled), file=sys.stderr,
                          flush=True)
                    continue
                line, status = describe_failure(rank, failure.exitcode)
                if repeated is not None:
                    line += (f"; the same error as before restart {attempt}, after the same step "
                             f"({repeated}): not restarted again, it would repeat")
                elif attempt:
                    line += f" (after {attempt} restart{'s' if attempt > 1 else ''})"
                print(line, file=sys.stderr)
                return status or EXIT_BUG
    except SignalException as exc:  # SIGTERM to torchrun: it has passed it on and waited for the workers
        if exc.sigval == signal.SIGTERM:
            print(_PREEMPTED, file=sys.stderr)
            return EXIT_PREEMPTED
        raise
    finally:  # as they were, for a caller in the same process
        signal.signal(signal.SIGUSR1, previous[0])
        if previous[1] is None:
            os.environ.pop(RESTART_COUNT_ENV, None)
        else:
            os.environ[RESTART_COUNT_ENV] = previous[1]
        if launched is None:
            os.environ.pop(LAUNCH_TIME_ENV, None)
        else:
            os.environ[LAUNCH_TIME_ENV] = launched
        if agent is None:
            os.environ.pop(AGENT_PID_ENV, None)
        else:
            os.environ[AGENT_PID_ENV] = agent


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def _forward_to_workers(signum: int, frame) -> None:
    import psutil

    global _stop_asked
    _stop_asked = True
    for child in psutil.Process().children():  # the workers (not their data-loader processes)
        try:
            child.send_signal(signum)
        except psutil.Error:
            pass


if __name__ == "__main__":
    sys.exit(main())
