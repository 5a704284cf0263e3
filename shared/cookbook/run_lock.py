"""One run per ``output_dir`` at a time: the launcher holds ``<output_dir>/.run.lock.node<N>`` (an ``flock``) for as
long as it lives, so the kernel releases it when the launcher ends in any way, SIGKILL included.

The check (``train.py --check``) writes the resolved ``output_dir`` to the file ``COOKBOOK_OUTPUT_DIR_FILE`` names
(`cookbook.config.check_run`), and `cookbook.launch` `acquire`s the lock before any worker starts; a Ray driver
holds it while it runs (`cookbook.ray_train.RayDriver.run`). A second run on the same folder is refused in one line
naming the holder's host and pid.
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from pathlib import Path

from cookbook.entry import EXIT_USER_ERROR, OneLineError

OUTPUT_DIR_FILE_ENV = "COOKBOOK_OUTPUT_DIR_FILE"  # where the check writes the run's output_dir for its launcher


class RunLocked(OneLineError):
    """Another live run holds the output_dir's run lock (bad input: exit status 2)."""

    exit_status = EXIT_USER_ERROR


def lock_path(output_dir: str | Path, node_rank: int | str = 0) -> Path:
    return Path(output_dir) / f".run.lock.node{node_rank}"


def acquire(output_dir: str | Path, node_rank: int | str = 0) -> int:
    """Take the run lock of `output_dir` for this process (released when it exits); returns its descriptor.

    Raises:
        RunLocked: a live process holds it: ``output_dir=... is in use by the run of pid P on host H (since T)``.
    """
    path = lock_path(output_dir, node_rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunLocked(f"output_dir={output_dir} is in use by the run of {holder}; wait for it to end, stop it, "
                          f"or choose another output_dir") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"pid {os.getpid()} on host {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})"
             .encode())
    os.set_inheritable(fd, False)
    return fd


def report_output_dir(output_dir: str | Path) -> None:
    """In a check started by a launcher (`OUTPUT_DIR_FILE_ENV` set): tell it the run's output_dir."""
    target = os.environ.get(OUTPUT_DIR_FILE_ENV)
    if target:
        Path(target).write_text(os.path.abspath(Path(output_dir).expanduser()))


def read_reported(target: str | Path) -> str | None:
    """The output_dir a check reported to `target`, or None (the recipe reports none)."""
    p = Path(target)
    return p.read_text() or None if p.is_file() else None
