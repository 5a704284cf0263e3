"""A Ray head for the Ray recipe tests (the ``ray_env`` fixture in conftest.py starts one per test
session), inside a temporary folder (session files, and ``HOME`` for Ray's auth token), stopped by killing its own process group.

The recipes join it through ``RAY_ADDRESS``, the path users take for an existing cluster; a fresh
local instance per run would cost ~10 s more each time on a 2-core machine.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import ROOT, free_port, load_recipe


def start_head(base: Path, num_cpus: int = 3) -> tuple[subprocess.Popen, dict]:
    """Start ``ray start --head --block`` in its own session; returns the process and the environment
    (``RAY_ADDRESS`` set) a launch needs. 3 CPUs: 2 one-CPU workers and one left free (a Ray Data read needs a CPU of its own)."""
    port = free_port()
    env = {**os.environ, "HOME": str(base / "home"), "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
           "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2", "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # one actor less per run
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("RAY_ADDRESS", None)
    (base / "home").mkdir(parents=True, exist_ok=True)
    head = subprocess.Popen([str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
                             "--node-ip-address=127.0.0.1", f"--num-cpus={num_cpus}", "--num-gpus=0",
                             f"--temp-dir={base / 'ray'}", "--include-dashboard=false", "--disable-usage-stats"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if head.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the Ray head did not start")
        time.sleep(0.3)
    time.sleep(2.0)  # the raylet registers after the GCS port opens
    return head, {**env, "RAY_ADDRESS": f"127.0.0.1:{port}"}


def stop_head(head: subprocess.Popen) -> None:
    """Stop the head and everything it started (its process group)."""
    try:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` ignores SIGTERM for ~30 s
        head.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass


def run_launch(recipe: str, env: dict, *overrides: str, config: str = "tiny.yaml", timeout: int = 300) -> subprocess.CompletedProcess:
    """``recipes/<recipe>/launch.sh`` with `env` (from `ray_env`), as a user runs it."""
    env = {k: v for k, v in env.items() if not k.startswith("_")}
    env.update(CONFIG_FILE=config)
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run(["bash", str(ROOT / "recipes" / recipe / "launch.sh"), *overrides], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def run_driver_forked(recipe: str, env: dict, *overrides: str, config: str = "tiny.yaml",
                      timeout: int = 300) -> subprocess.CompletedProcess:
    """The recipe's driver (``train.py``'s ``main``, what launch.sh runs against ``RAY_ADDRESS``) in a child
    forked from this process, with `env` (from `ray_env`); returns what it printed as a finished process.

    The child inherits the recipe and Ray Train already imported here, which saves the driver's interpreter
    start-up and imports (~10 s on 2 cores); Ray starts the workers as for launch.sh. This process never
    joins Ray itself (only the child calls ``ray.init``), so later forks (``main_in_workers``) stay safe."""
    import tempfile
    import traceback

    import ray.train.torch  # noqa: F401  imported once here, inherited by the child

    module = load_recipe(recipe)
    argv = ["--config", str(ROOT / "recipes" / recipe / config), *overrides]
    child_env = {k: v for k, v in env.items() if not k.startswith("_")}
    child_env.pop("MLFLOW_TRACKING_URI", None)
    child_env.update(OMP_NUM_THREADS=child_env.get("OMP_NUM_THREADS", "1"), COOKBOOK_NNODES="1")
    with tempfile.TemporaryFile() as log:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into pytest
            code = 1
            try:
                os.dup2(log.fileno(), 1)
                os.dup2(log.fileno(), 2)
                sys.stdout = open(1, "w", buffering=1, closefd=False)
                sys.stderr = open(2, "w", buffering=1, closefd=False)
                os.environ.clear()
                os.environ.update(child_env)
                import torch

                torch.set_num_threads(1)  # an inherited OpenMP pool can hang a forked child's first parallel op
                module.main(argv)
                code = 0
            except SystemExit as exc:  # as the interpreter would exit
                code = 0 if exc.code is None else exc.code if isinstance(exc.code, int) else 1
                if isinstance(exc.code, str):
                    print(exc.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
            finally:
                try:
                    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
                        sys.modules["ray"].shutdown()  # as the driver's exit does
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(code)
        deadline = time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                status = os.waitpid(pid, 0)[1]
                break
            time.sleep(0.2)
        log.seek(0)
        text = log.read().decode(errors="replace")
    return subprocess.CompletedProcess(["train.py", *argv], os.waitstatus_to_exitcode(status), "", text)


def recipe_module(recipe: str):
    """recipes/<recipe>/train.py as a module (recipes are folders, not packages)."""
    return load_recipe(recipe)


def summary(records: list[dict]) -> dict:
    """The last summary record of a metrics.jsonl."""
    return [r for r in records if r["event"] == "summary"][-1]
