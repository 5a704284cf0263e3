"""Shared helpers: run a recipe's launch.sh as a user would, with this interpreter's tools on PATH."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports: the sockets are held together while the ports are picked (one at a time, a
    closed port can be handed out again by the next pick)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_launch(recipe: str, *overrides: str, config: str = "tiny.yaml", ngpu: int = 2, cwd: Path | None = None,
                 env: dict | None = None) -> subprocess.Popen:
    """Start ``recipes/<recipe>/launch.sh`` on CPU with `ngpu` processes in the background, its output piped."""
    full_env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
                "CONFIG_FILE": config, "NGPU": str(ngpu), "MASTER_PORT": str(free_port()),
                "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": "", **(env or {})}
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.pop("MLFLOW_RUN_ID", None)
    script = (cwd / "launch.sh") if cwd else ROOT / "recipes" / recipe / "launch.sh"
    return subprocess.Popen(["bash", str(script), *overrides], cwd=cwd or ROOT, env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def launch(recipe: str, *overrides: str, config: str = "tiny.yaml", ngpu: int = 2, cwd: Path | None = None,
           env: dict | None = None, timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``recipes/<recipe>/launch.sh`` on CPU with `ngpu` processes; returns the finished process."""
    proc = start_launch(recipe, *overrides, config=config, ngpu=ngpu, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def wait_for(proc: subprocess.Popen, ready, timeout: float = 300) -> None:
    """Poll `ready()` every 50 ms until it is true, `proc` has ended, or `timeout` seconds passed."""
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None and not ready():
        time.sleep(0.05)


def kill_worker(proc: subprocess.Popen, rank: str = "1") -> int:
    """SIGKILL the worker of global rank `rank` among the children of a launcher `start_launch` started (bash
    execs ``cookbook.launch``, which runs torchrun's agent in-process); returns its pid."""
    import psutil

    workers = {c.environ().get("RANK"): c for c in psutil.Process(proc.pid).children()}
    workers[rank].send_signal(signal.SIGKILL)
    return workers[rank].pid


def launch_and_kill(recipe: str, *overrides: str, once: Path, rank: str = "1",
                    timeout: int = 600) -> subprocess.CompletedProcess:
    """Run ``launch.sh`` of `recipe` (as `start_launch`), SIGKILL the worker of global rank `rank` as soon as the
    folder `once` exists (a checkpoint just published), and wait for the launcher; returns it finished."""
    proc = start_launch(recipe, *overrides)
    try:
        wait_for(proc, once.is_dir)
        kill_worker(proc, rank=rank)
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def load_recipe(recipe: str):
    """``recipes/<recipe>/train.py`` as a module (recipes are folders, not packages), loaded once."""
    import importlib.util

    name = recipe.replace("-", "_") + "_train"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "recipes" / recipe / "train.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def main_in_workers(recipe: str, *overrides: str, config: str = "tiny.yaml") -> None:
    """Run ``recipes/<recipe>/train.py``'s ``main`` (config + overrides) on 2 workers forked from this
    process, as launch.sh runs it after its --check: the recipe and its libraries are imported once here
    and inherited, which saves an interpreter start-up (~20 s on 2 cores) per run."""
    import cookbook

    load_recipe(recipe)
    cookbook.distributed(num_processes=2, start_method="fork")(_call_main).distributed(
        recipe, ["--config", str(ROOT / "recipes" / recipe / config), *overrides])


def _call_main(recipe: str, argv: list[str]) -> None:
    load_recipe(recipe).main(argv)


def check(recipe: str, *overrides: str, config: str = "tiny.yaml", world_size: int = 2) -> str:
    """Run ``recipes/<recipe>/train.py --check`` in this process: the validation ``launch.sh`` runs
    before torchrun starts, without a new interpreter's start-up (~8 s each). Returns what it printed;
    a refusal raises the recipe's error (``ConfigError`` and the like) to the test."""
    import contextlib
    import io

    env = {"COOKBOOK_WORLD_SIZE": str(world_size), "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            load_recipe(recipe).main(["--config", str(ROOT / "recipes" / recipe / config), "--check", *overrides])
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out.getvalue()


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def train_losses(path: Path) -> dict[int, float]:
    """step -> loss from a metrics.jsonl (a resumed run's later records win)."""
    return {r["step"]: r["loss"] for r in read_jsonl(path) if r["event"] == "train"}


@pytest.fixture(scope="session")
def ray_env(tmp_path_factory):
    """Environment for launches against one Ray head for the whole session, in a temporary folder
    (a head costs ~10 s to start on 2 cores; the Ray recipe tests share it)."""
    from ray_cluster import start_head, stop_head

    base = tmp_path_factory.mktemp("ray")
    head, env = start_head(base)
    yield {**env, "_BASE": str(base)}
    stop_head(head)


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
