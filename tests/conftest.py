"""Shared helpers: run a recipe's launch.sh as a user would, with this interpreter's tools on PATH."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# One torch / OpenMP thread per process: 2 xdist workers, each forking or launching 2 ranks, share 2 cores; more
# threads than cores oversubscribe them (set before torch is imported, so this process's pool has one thread too).
# numpy's OpenBLAS starts a pool of its own (a thread per core, which spin a while after each call) in every process.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_var, "1")

# A child forked from a test process (the tests' forked ranks, ``main_in_workers``, the Ray drivers) never collects
# the garbage it inherited: that garbage holds what earlier tests of the same process left in reference cycles, e.g. a
# failed launch's rendezvous store, whose destructor joins a server thread that exists only in the parent. A child
# that collected it died with SIGSEGV ("Garbage-collecting" in accelerate's free_memory, which calls gc.collect() as
# the Trainer starts: test_unsloth_axolotl_configs's forked ranks in a fresh-clone CI run, 2026-12-02). The child's
# own garbage is collected as usual.
os.register_at_fork(after_in_child=gc.freeze)


FP32_EPS = 2.0**-23  # torch.finfo(torch.float32).eps


def fp32_sum_atol(terms: int, scale: float) -> float:
    """Absolute tolerance for an fp32 result that sums `terms` values of magnitude up to `scale`, compared with the
    same sum in another order or in float64: rounding grows as ~eps * sqrt(terms) * scale, times 4 for the few
    roundings each term carries (a product, an exp). A wrong term, scale or order of ops is far outside it."""
    return 4 * FP32_EPS * math.sqrt(terms) * float(scale)


def fp32_sum_rtol(terms: int) -> float:
    """Relative tolerance for an fp32 sum of `terms` positive values (a summed loss) against float64 or another
    order: each addition rounds at ~eps of the partial sum, ~eps * sqrt(terms) of the total in all."""
    return FP32_EPS * math.sqrt(terms)


def assert_fp32_close(got, want, terms: int, msg: str | None = None) -> None:
    """`got` (fp32) equals the float64 reference `want` up to `fp32_sum_atol` of `terms` terms of want's largest
    magnitude."""
    import torch

    torch.testing.assert_close(
        got.double(), want.double(), rtol=0, atol=fp32_sum_atol(terms, want.abs().max()), msg=msg
    )


# Ports for rendezvous and Ray heads come from a block of this test process's own, below Linux's ephemeral range
# (32768-60999, where the kernel picks the ports of gloo's connections and of bind(0)): the pytest-xdist workers
# (README's test command: -n 2) never hand out the same port, and no connection takes one between its pick and
# its use. Picks step by 8, so a launcher's restarts (MASTER_PORT + attempt) stay inside the pick.
# A pytest run without xdist takes one of the last 4 blocks by its pid, so that two runs at once (an engineer's
# and CI's) rarely share one.
_PORT_BLOCK = 1000
_PORT_STEP = 8
_worker = os.environ.get("PYTEST_XDIST_WORKER", "")
_PORT_BASE = 20000 + _PORT_BLOCK * (int(_worker[2:]) % 8 if _worker[2:].isdigit() else 8 + os.getpid() % 4)
_next_port = _PORT_BASE


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A free TCP port on 127.0.0.1, never the same twice in one test session (see `_PORT_BLOCK`)."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """`n` distinct free ports from this test process's block (each the start of `_PORT_STEP` free ones)."""
    global _next_port
    ports: list[int] = []
    for _ in range(_PORT_BLOCK // _PORT_STEP):
        port = _next_port
        _next_port = _PORT_BASE + (_next_port - _PORT_BASE + _PORT_STEP) % _PORT_BLOCK
        if all(_bindable(port + k) for k in range(_PORT_STEP)):
            ports.append(port)
            if len(ports) == n:
                return ports
    raise RuntimeError(f"no {n} free ports in {_PORT_BASE}-{_PORT_BASE + _PORT_BLOCK - 1}")


RECORD = Path(__file__).with_name("suite_record.json")  # the last recorded run: scripts/record_test_run.sh


def order_groups(groups: dict[str, list], seconds: dict[str, float]) -> list[str]:
    """Group names, the longest first by `seconds` (a recorded run), unrecorded ones first of all (unknown cost);
    ties keep the collection order. ``--dist loadgroup`` hands groups out in this order, so the long ones start
    early and the short ones fill the gaps at the end."""
    return sorted(groups, key=lambda g: -seconds.get(g, float("inf")))


# tryfirst: xdist's own hook turns the marks into node ids in the workers, so the marks must be there before it runs
@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Marks for ``--dist loadgroup`` (`xdist_group`), and the items reordered group by group, longest first
    (`order_groups`; pytest.ini turns xdist's own reordering by test count off)."""
    ray_modules = {i.nodeid.split("::")[0] for i in items if "ray_env" in getattr(i, "fixturenames", ())}
    groups: dict[str, list] = {}
    for item in items:
        module = item.nodeid.split("::")[0]
        groups.setdefault("ray" if module in ray_modules else module, []).append(item)
    recorded = json.loads(RECORD.read_text())["module_seconds"] if RECORD.is_file() else {}
    seconds = {
        g: sum(recorded[m] for m in {i.nodeid.split("::")[0] for i in members} if m in recorded)
        for g, members in groups.items()
        if any(i.nodeid.split("::")[0] in recorded for i in members)
    }
    items[:] = [item for g in order_groups(groups, seconds) for item in groups[g]]
    for name, members in groups.items():
        for item in members:
            item.add_marker(pytest.mark.xdist_group(name))


def start_launch(
    recipe: str,
    *overrides: str,
    config: str = "tiny.yaml",
    ngpu: int = 2,
    cwd: Path | None = None,
    env: dict | None = None,
) -> subprocess.Popen:
    """Start ``recipes/<recipe>/launch.sh`` on CPU with `ngpu` processes in the background, its output piped."""
    full_env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "CONFIG_FILE": config,
        "NGPU": str(ngpu),
        "MASTER_PORT": str(free_port()),
        "COOKBOOK_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        **(env or {}),
    }
    full_env.pop("MLFLOW_TRACKING_URI", None)
    full_env.pop("MLFLOW_RUN_ID", None)
    script = (cwd / "launch.sh") if cwd else ROOT / "recipes" / recipe / "launch.sh"
    return subprocess.Popen(
        ["bash", str(script), *overrides],
        cwd=cwd or ROOT,
        env=full_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def launch(
    recipe: str,
    *overrides: str,
    config: str = "tiny.yaml",
    ngpu: int = 2,
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: int = 600,
) -> subprocess.CompletedProcess:
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


def launch_and_kill(
    recipe: str, *overrides: str, once: Path, rank: str = "1", timeout: int = 600
) -> subprocess.CompletedProcess:
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


def recipe_modules(recipe: str, *names: str) -> list:
    """Modules beside ``recipes/<recipe>/train.py`` (``expert_parallel``...), imported with its folder on ``sys.path``."""
    import importlib

    folder = str(ROOT / "recipes" / recipe)
    if folder not in sys.path:
        sys.path.insert(0, folder)
    return [importlib.import_module(n) for n in names]


def load_recipe(recipe: str):
    """``recipes/<recipe>/train.py`` as a module (recipes are folders, not packages; the folder goes on
    ``sys.path``), loaded once."""
    import importlib.util

    name = recipe.replace("-", "_") + "_train"
    if name not in sys.modules:
        recipe_modules(recipe)  # its folder on sys.path: its sibling modules import, as when train.py runs as a script
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
        recipe, ["--config", str(ROOT / "recipes" / recipe / config), *overrides]
    )


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
def _fresh_process_state():
    """End what a test left of this process's global state, since with ``-n 2`` any test module may run before
    another in the same process, and tests that fork workers from it (`main_in_workers`) inherit it: a process
    group (a forked child's gloo group has no worker threads: its first collective never returns), the
    ``cookbook`` logger as `cookbook.init_distributed` sets it up (no propagation: ``caplog`` sees nothing), and
    MLflow's active run and tracking / registry URIs."""
    import logging

    log = logging.getLogger("cookbook")
    saved = list(log.handlers), log.propagate, log.level
    root_level = logging.getLogger().level  # a recipe imported in-process may set it (torchrec-dlrm: ERROR)
    environ = dict(os.environ)
    yield
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    # torchrun's variables that `cookbook.init_distributed` sets for a group of one (accelerate's PartialState,
    # which TrainingArguments creates, would start a group from them), and whatever else a test set directly
    os.environ.clear()
    os.environ.update(environ)
    accelerate_state = sys.modules.get("accelerate.state")
    if accelerate_state is not None:  # a singleton: the next TrainingArguments looks at the process afresh
        accelerate_state.AcceleratorState._reset_state(reset_partial_state=True)
    log.handlers[:], log.propagate = saved[0], saved[1]
    log.setLevel(saved[2])
    logging.getLogger().setLevel(root_level)
    mlflow = sys.modules.get("mlflow")
    if mlflow is not None:
        while mlflow.active_run() is not None:
            mlflow.end_run()
        import mlflow.tracking._model_registry.utils as registry
        import mlflow.tracking._tracking_service.utils as tracking

        tracking._tracking_uri = None
        registry._registry_uri = None


@pytest.fixture(autouse=True)
def _quiet_env(monkeypatch):
    monkeypatch.setenv("TOKENIZERS_PARALLELISM", "false")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
