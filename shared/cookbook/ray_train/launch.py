"""Start a Ray recipe's driver on one node, on a cluster it bootstraps, or on an existing cluster:
``python -m cookbook.ray_train.launch train.py --config config.yaml [overrides...]`` (what each ``launch.sh`` runs).

``RAY_ADDRESS``: the driver joins it; ``NNODES=1``: it starts a local Ray; ``NNODES>1``: node ``NODE_RANK=0`` runs
``--check``, the Ray head on ``MASTER_ADDR:RAY_PORT`` (6379) and the driver; every other node joins the head (retrying)
and exits when it goes. ``NGPU`` caps each node's GPUs."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from cookbook.config import config_beside
from cookbook.errors import killed_by
from cookbook.run_lock import die_with_parent


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "") or str(default)
    if not value.isdigit() or int(value) < (0 if name == "NODE_RANK" else 1):
        sys.exit(f"error: {name}={value} is not a {'non-negative' if name == 'NODE_RANK' else 'positive'} integer")
    return int(value)


def _ray_cli() -> str:
    beside = Path(sys.executable).parent / "ray"
    if not (found := str(beside) if beside.is_file() else shutil.which("ray")):
        sys.exit("error: the `ray` command is not installed in this environment (pip install 'ray[train]')")
    return found


def _run_forwarding_signals(cmd: list[str], env: dict[str, str] | None = None) -> int:
    """Run `cmd` in its own session (a terminal's Ctrl-C reaches it once) and return its exit status, passing on
    SIGINT, SIGTERM and SIGUSR1."""
    child = subprocess.Popen(cmd, env=env, start_new_session=True, preexec_fn=die_with_parent)  # ends with this one

    def forward(signum, frame):
        if child.poll() is None:
            child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
    try:
        code = child.wait()  # resumed after each forwarded signal (PEP 475)
        if code < 0:  # the driver ended by a signal (a second SIGTERM or Ctrl-C: at once, without a checkpoint)
            print(f"the driver was {killed_by(-code)} (exit status {128 - code})", file=sys.stderr)
        return 128 - code if code < 0 else code
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def main(argv: list[str]) -> int:
    """Run the driver script ``argv[0]`` with arguments ``argv[1:]``; returns its exit status."""
    if not argv:
        sys.exit(__doc__)
    driver = [sys.executable, argv[0], *config_beside(argv[0], argv[1:])]  # a relative config from its folder too
    nnodes, node_rank = _env_int("NNODES", 1), _env_int("NODE_RANK", 0)
    os.environ["COOKBOOK_NNODES"] = str(nnodes)
    if os.environ.get("RAY_ADDRESS") or nnodes == 1:
        return _run_forwarding_signals(driver)
    if not (master := os.environ.get("MASTER_ADDR", "")):
        sys.exit("error: NNODES>1 needs MASTER_ADDR, the address of node 0 (the Ray head)")
    port = _env_int("RAY_PORT", 6379)
    address, ray = f"{master}:{port}", _ray_cli()
    gpus = ["--num-gpus", os.environ["NGPU"]] if os.environ.get("NGPU") else []
    if node_rank == 0:
        if rc := subprocess.call([*driver, "--check"]):  # bad input fails before the cluster starts
            return rc
        head = [ray, "start", "--head", f"--port={port}", f"--node-ip-address={master}", "--disable-usage-stats"]
        subprocess.run([*head, "--include-dashboard=false", *gpus], check=True)
        try:
            return _run_forwarding_signals(driver, env={**os.environ, "RAY_ADDRESS": address})
        finally:
            subprocess.call([ray, "stop"])
    deadline = time.monotonic() + float(os.environ.get("RAY_JOIN_TIMEOUT_S", "600"))
    while True:  # the head may not be up yet
        started = time.monotonic()
        rc = subprocess.call([ray, "start", f"--address={address}", "--disable-usage-stats", "--block", *gpus])
        if rc == 0 or time.monotonic() - started > 30:  # it had joined: `--block` returns when the head goes
            print(f"node {node_rank}: the Ray head at {address} has gone; exiting", file=sys.stderr)
            return 0
        if time.monotonic() > deadline:
            print(
                f"error: could not join the Ray head at {address} (is launch.sh running with NODE_RANK=0 there?)",
                file=sys.stderr,
            )
            return rc
        time.sleep(5)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
