"""The bottom layer of `cookbook`: exit statuses, the errors every layer raises, and the environment variables a
launcher sets for its workers. Imports nothing of `cookbook`; `cookbook.entry.run_main` maps them to statuses. Each
class keeps as ``__module__`` the module recipes import it from (``cookbook.config.ConfigError``): tracebacks and
`cookbook.launcher.WorkerError.exc_type` name it so, as before this module existed."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

EXIT_OK, EXIT_BUG, EXIT_USER_ERROR, EXIT_PEER_LOST, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_DIVERGED = 4  # a non-finite loss or gradient norm stopped the run before the update (cookbook.loop)
EXIT_PREEMPTED = 75  # EX_TEMPFAIL: stopped on SIGTERM / SIGUSR1 after a checkpoint; run the same command again

LAUNCH_TIME_ENV = "COOKBOOK_LAUNCH_TIME"  # Unix time (s) of the launch (cookbook.launch, cookbook.torchrun): startup_s
AGENT_PID_ENV = "COOKBOOK_AGENT_PID"  # the launcher process that runs torchrun's agent (cookbook.torchrun)
VERDICT_ENV = "COOKBOOK_CHECK_VERDICT"  # the file where cookbook.launch writes "go" or "stop" once its check ended
RESTART_COUNT_ENV = "COOKBOOK_RESTART_COUNT"  # what the workers of a restarted group find: 1, 2, ... (0 at first)
LAST_STEP_KEY = "cookbook_last_step"  # in a worker's error file: its last finished optimizer step


def killed_by(signum: int) -> str:
    """``killed by SIGKILL``, or ``killed by signal N`` for a number that names no signal."""
    try:
        return f"killed by {signal.Signals(signum).name}"
    except ValueError:
        return f"killed by signal {signum}"


class OneLineError(RuntimeError):
    """A failure that its message explains whole: `run_main` prints it as one line, ``error: [rank N] <message>``,
    without a traceback, and exits with the class's `exit_status` (`cookbook.loop.NonFiniteError`: 4)."""

    __module__ = "cookbook.entry"

    exit_status = EXIT_BUG


class AlreadyComplete(Exception):
    """The run in this output_dir finished with these settings (`cookbook.run_lock.complete_message`): `run_main`
    prints the message as it is (no ``error:``) and exits with status 0; a launcher starts no worker."""

    __module__ = "cookbook.entry"


class ConfigError(ValueError):
    """A config file or override is invalid; the message names the key and its source."""

    __module__ = "cookbook.config"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why and what to do."""

    __module__ = "cookbook.checkpoint"


def not_a_file(path: str | os.PathLike, what: str = "file") -> str:
    """The message for a `what` at `path` that is not a file: a folder is named as one; a relative path not found
    says from which folder it was looked for (the current one)."""
    p = Path(path)
    if p.is_dir():
        return f"{p} is a folder, not a {what}"
    return f"{what} not found: {p}" + ("" if p.is_absolute() else f" (from {Path.cwd()})")


def chain(exc: BaseException | None) -> list[BaseException]:
    """`exc` and the exceptions it was raised from, outermost first."""
    found = []
    while exc is not None and exc not in found:
        found.append(exc)
        exc = exc.__cause__ or exc.__context__
    return found


def first_line(exc: BaseException, limit: int = 160) -> str:
    """The first line of `exc`'s message (its class name if empty), cut to `limit` characters."""
    text = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return text if len(text) <= limit else text[: limit - 3] + "..."


def check_passed() -> bool:
    """For a worker that `cookbook.launch` started while its check ran (``COOKBOOK_CHECK_VERDICT`` set): wait for the
    verdict; True for "go" (and outside such a launch), False for "stop" (the check failed or found the run complete,
    and said so) or a launcher that is gone."""
    path, parent = os.environ.get(VERDICT_ENV), os.getppid()
    while path and not os.path.isfile(path):
        if os.getppid() != parent:
            return False
        time.sleep(0.02)
    if not path:
        return True
    with open(path) as f:
        return f.read() == "go"
