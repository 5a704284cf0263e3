"""One run per ``output_dir`` at a time: the launcher holds the ``flock`` ``<output_dir>/.run.lock.node<N>`` from
before any worker starts; a second run there is refused in one line naming the holder. A finished run leaves
``<output_dir>/complete.json`` (`mark_complete`): the same command again is answered by the check (`complete_message`).
"""

from __future__ import annotations

import fcntl
import fnmatch
import json
import os
import socket
import sys
import time
from pathlib import Path
from typing import Mapping

from cookbook.errors import EXIT_USER_ERROR, OneLineError

_COMPLETE_FILE = "complete.json"  # in output_dir: written when a run has finished (`mark_complete`)
OUTPUT_DIR_FILE_ENV = "COOKBOOK_OUTPUT_DIR_FILE"  # where the check writes the run's output_dir for its launcher


class RunLocked(OneLineError):
    """Another live run holds the output_dir's run lock (bad input: exit status 2)."""

    exit_status = EXIT_USER_ERROR


def acquire(output_dir: str | Path, node_rank: int | str = 0) -> int:
    """Take the run lock of `output_dir` for this process (released when it exits); returns its descriptor.
    Raises RunLocked: ``output_dir=... is in use by the run of pid P on host H (since T)``."""
    path = Path(output_dir) / f".run.lock.node{node_rank}"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 512).decode(errors="replace").strip() or "another process"
        os.close(fd)
        raise RunLocked(
            f"output_dir={output_dir} is in use by the run of {holder}; wait for it to end, stop it, "
            f"or choose another output_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(
        fd, f"pid {os.getpid()} on host {socket.gethostname()} (since {time.strftime('%Y-%m-%d %H:%M:%S')})".encode()
    )
    return fd  # (not inherited by the processes this one starts: PEP 446)


def report_output_dir(output_dir: str | Path) -> None:
    """In a check started by a launcher (`OUTPUT_DIR_FILE_ENV` set): tell it the run's output_dir."""
    target = os.environ.get(OUTPUT_DIR_FILE_ENV)
    if target:
        Path(target).write_text(os.path.abspath(Path(output_dir).expanduser()))


def read_reported(target: str | Path) -> str | None:
    """The output_dir a check reported to `target`, or None (the recipe reports none)."""
    p = Path(target)
    return p.read_text() or None if p.is_file() else None


def _comparable(config: Mapping, may_change: tuple[str, ...], prefix: str = "") -> dict:
    """`config`'s settings by dotted key (``train.max_steps``), but for those that `may_change` matches."""
    out: dict = {}
    for k, v in config.items():
        if isinstance(v, Mapping):
            out.update(_comparable(v, may_change, f"{prefix}{k}."))
        elif not any(fnmatch.fnmatch(f"{prefix}{k}", p) for p in may_change):
            out[f"{prefix}{k}"] = v
    return out


def mark_complete(output_dir: str | Path, config: dict, message: str, outputs: dict[str, str]) -> None:
    """Write `_COMPLETE_FILE` (atomically, rank 0) with the run's `config`, the `message` a second run prints and
    the `outputs` (name -> path) that must still exist."""
    path = Path(output_dir) / _COMPLETE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        json.dumps(
            {"output_dir": os.path.abspath(output_dir), "config": config, "message": message, "outputs": outputs},
            default=str,
        )
    )
    os.replace(tmp, path)


def complete_message(output_dir: str | Path, config: dict, may_change: tuple[str, ...]) -> str | None:
    """The "already complete" line when `output_dir` holds a run finished there whose settings equal `config` but
    for `may_change` (glob patterns: ``checkpoint.*``) and whose outputs all exist; else None."""
    path = Path(output_dir).expanduser() / _COMPLETE_FILE
    try:
        done = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if (
        not isinstance(done, dict)
        or done.get("output_dir") != os.path.abspath(Path(output_dir).expanduser())
        or not all(Path(p).exists() for p in done.get("outputs", {}).values())
    ):
        return None  # a copied folder, or outputs deleted since: the run decides as usual
    same = _comparable(done.get("config", {}), may_change) == _comparable(
        json.loads(json.dumps(config, default=str)), may_change
    )
    return str(done.get("message")) if same else None


def report_complete() -> None:
    """In a check started by a launcher: tell it that the run is complete (it starts no worker)."""
    target = os.environ.get(OUTPUT_DIR_FILE_ENV)
    if target:
        Path(target + ".complete").write_text("1")


def reported_complete(target: str | Path) -> bool:
    return Path(str(target) + ".complete").is_file()


def die_with_parent() -> None:
    """On Linux, have the kernel SIGKILL this process when its parent (the launcher) dies (``PR_SET_PDEATHSIG``)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
