"""A Ray head for the Ray recipe tests (the ``ray_env`` fixture in conftest.py starts one per test
session), inside a temporary folder (session files, and ``HOME`` for Ray's auth token), stopped by killing its own process group.

The recipes join it through ``RAY_ADDRESS``, the path users take for an existing cluster; a fresh
local instance per run would cost ~10 s more each time on a 2-core machine.

Faults are injected for real while a run goes on (``alongside=`` of `run_driver_forked` and `run_launch`):
`ray_processes` finds the run's Ray Train workers and controller among this head's processes, to be
killed (SIGKILL) or paused (`paused`: SIGSTOP, then SIGCONT); `registered` reads which checkpoint Ray
registered.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from conftest import ROOT, free_port, load_recipe


def start_head(base: Path, num_cpus: int = 3) -> tuple[subprocess.Popen, dict]:
    """Start ``ray start --head --block`` in its own session; returns the process and the environment
    (``RAY_ADDRESS`` set) a launch needs. 3 CPUs: 2 one-CPU workers and one left free (a Ray Data read needs a CPU of its own)."""
    port = free_port()  # and the 7 after it (conftest._PORT_STEP): every port the head's own processes listen on,
    # so a second Ray head on this machine (another test process, an engineer's) cannot take one of Ray's defaults first
    env = {
        **os.environ,
        "HOME": str(base / "home"),
        "RAY_AUTH_MODE": "disabled",
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2",
        "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",  # one actor less per run
        "TORCH_PROCESS_GROUP_SHUTDOWN_TIMEOUT_S": "3",  # Ray's wait on a stopped worker's group teardown (30 s)
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COOKBOOK_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
    }
    env.pop("RAY_ADDRESS", None)
    (base / "home").mkdir(parents=True, exist_ok=True)
    # Ray's session folder holds Unix sockets, whose paths may not exceed 107 bytes: a short folder of its own
    # (pytest's base/, with -n 2's popen-gw0/ in it, was too long), removed by `stop_head`.
    ray_tmp = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    log = open(base / "head.log", "w")  # noqa: SIM115  the head's own output, for the error below
    head = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "ray"),
            "start",
            "--head",
            "--block",
            f"--port={port}",
            f"--dashboard-agent-listen-port={port + 2}",
            f"--dashboard-agent-grpc-port={port + 3}",
            f"--runtime-env-agent-port={port + 4}",
            f"--metrics-export-port={port + 5}",
            f"--object-manager-port={port + 6}",
            f"--node-manager-port={port + 7}",
            "--node-ip-address=127.0.0.1",
            f"--num-cpus={num_cpus}",
            "--num-gpus=0",
            f"--temp-dir={ray_tmp}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if head.poll() is not None or time.monotonic() > deadline:
            tail = "".join((base / "head.log").read_text(errors="replace").splitlines(keepends=True)[-15:])
            raise RuntimeError(f"the Ray head did not start; its output ends:\n{tail}")
        time.sleep(0.3)
    time.sleep(2.0)  # the raylet registers after the GCS port opens
    head.ray_tmp = ray_tmp  # type: ignore[attr-defined]
    return head, {**env, "RAY_ADDRESS": f"127.0.0.1:{port}", "_HEAD_SESSION": str(head.pid), "_RAY_TMP": ray_tmp}


def stop_head(head: subprocess.Popen) -> None:
    """Stop the head and everything it started (its process group)."""
    try:
        os.killpg(head.pid, signal.SIGKILL)  # `ray start --block` ignores SIGTERM for ~30 s
        head.wait(timeout=10)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    shutil.rmtree(getattr(head, "ray_tmp", ""), ignore_errors=True)


def ray_processes(env: dict, name: str) -> list[int]:
    """Process ids of the ``ray::<name>`` processes (``RayTrainWorker``, ``TrainController``) of the Ray head
    `env` (from `ray_env`) started: those of its session, not another Ray instance's on this machine."""
    session, found = int(env["_HEAD_SESSION"]), []
    for proc in Path("/proc").iterdir():
        try:
            if (
                proc.name.isdigit()
                and os.getsid(int(proc.name)) == session
                and (proc / "cmdline").read_bytes().startswith(f"ray::{name}".encode())
            ):
                found.append(int(proc.name))
        except OSError:  # gone meanwhile
            pass
    return sorted(found)


def kill_a_worker(env: dict) -> int:
    """SIGKILL one Ray Train worker of the running run (the newest process); returns its pid."""
    workers = ray_processes(env, "RayTrainWorker")
    assert len(workers) == 2, f"expected the run's 2 Ray Train workers, found {workers}"
    os.kill(workers[-1], signal.SIGKILL)
    return workers[-1]


@contextlib.contextmanager
def paused(pid: int) -> Iterator[None]:
    """SIGSTOP the process `pid` for the body (e.g. Ray Train's controller: no report gets registered), then SIGCONT."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def wait_for(condition: Callable[[], object], what: str, timeout: float = 240.0) -> None:
    """Poll `condition` every 20 ms until it is true. Raises AssertionError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {what}"
        time.sleep(0.02)


def registered(out: Path) -> str | None:
    """The checkpoint folder Ray Train registered last in the run folder `out` (its snapshot), or ``None``."""
    try:
        latest = json.loads((Path(out) / "checkpoint_manager_snapshot.json").read_text())["latest_checkpoint_result"]
    except (OSError, ValueError, KeyError):  # none yet, or being written
        return None
    return (latest or {}).get("checkpoint_dir_name")


def train_steps(out: Path) -> list[int]:
    """The steps of the training records in the run folder `out`'s metrics.jsonl so far, in order (all runs)."""
    try:
        lines = (Path(out) / "metrics.jsonl").read_text().splitlines()
    except OSError:
        return []
    steps = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:  # the line being written
            continue
        if record["event"] == "train":
            steps.append(record["step"])
    return steps


@contextlib.contextmanager
def _alongside(action: Callable[[int], None] | None, pid: int) -> Iterator[None]:
    """Run ``action(pid)`` in a thread while the body runs; re-raise what it raised once the body is done."""
    errors: list[BaseException] = []

    def run() -> None:
        try:
            action(pid)
        except BaseException as exc:  # noqa: BLE001  re-raised in the test
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True) if action is not None else None
    if thread is not None:
        thread.start()
    yield
    if thread is not None:
        thread.join(timeout=30)
    if errors:
        raise errors[0]


def run_launch(
    recipe: str,
    env: dict,
    *overrides: str,
    config: str = "tiny.yaml",
    timeout: int = 300,
    alongside: Callable[[int], None] | None = None,
) -> subprocess.CompletedProcess:
    """``recipes/<recipe>/launch.sh`` with `env` (from `ray_env`), as a user runs it; ``alongside(pid)`` runs in
    a thread meanwhile (a fault to inject; `pid`: the launcher's, which launch.sh execs), and what it raises is
    raised after the run."""
    env = {k: v for k, v in env.items() if not k.startswith("_")}
    env.update(CONFIG_FILE=config)
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.Popen(
        ["bash", str(ROOT / "recipes" / recipe / "launch.sh"), *overrides],
        env=env,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    with _alongside(alongside, proc.pid):
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, err = proc.communicate()
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def run_driver_forked(
    recipe: str,
    env: dict,
    *overrides: str,
    config: str = "tiny.yaml",
    timeout: int = 300,
    alongside: Callable[[int], None] | None = None,
    run_main: bool = False,
) -> subprocess.CompletedProcess:
    """The recipe's driver (``train.py``'s ``main``, what launch.sh runs against ``RAY_ADDRESS``) in a child
    forked from this process, with `env` (from `ray_env`); returns what it printed as a finished process.
    ``alongside(pid)`` runs in a thread of this process meanwhile (started after the fork; `pid`: the
    child's), as in `run_launch`. ``run_main``: through ``cookbook.run_main`` (one-line errors and their exit
    statuses, as ``python train.py``; no user errors).

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
                if run_main:
                    import cookbook

                    cookbook.run_main(module.main, argv=argv)  # exits
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
        with _alongside(alongside, pid):
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


class LocalTorchTrainer:
    """``ray.train.torch.TorchTrainer`` (the arguments the recipes give it) without Ray, for the driver's and the
    workers' handling of a run at no Ray start-up (~20 s a fit on 2 cores): `fit` runs the worker function
    (``ray_train.worker_entry``) on ``scaling_config.num_workers`` gloo workers forked from this process, each in
    Ray Train's local mode (its ``LocalTrainFnUtils``: ``ray.train.get_context()``'s rank, world size and device,
    ``prepare_model`` and ``prepare_data_loader`` as in a Ray worker). What Ray's storage and controller do with
    checkpoints is done here: the folder rank 0 reports is copied to ``<output_dir>/<checkpoint_dir_name>`` and
    named the newest in Ray's snapshot file (the one the driver's resume reads), and the checkpoint the driver
    announced is what ``ray.train.get_checkpoint()`` hands the workers. `fit` returns a ``ray.train.Result`` whose
    ``return_value`` is rank 0's and whose ``metrics`` and ``checkpoint`` are the newest checkpoint's, as Ray's.

    Not covered: Ray's restarts (``failure_config``), ``checkpoint_config.num_to_keep``, stop requests,
    ``torch_config`` (the workers' `WorkerRun` sets the collective timeout)."""

    def __init__(
        self, train_loop_per_worker, *, train_loop_config: dict, scaling_config, run_config, torch_config=None
    ):
        self.fn, self.num_workers = train_loop_per_worker, scaling_config.num_workers
        self.loop_config = {**train_loop_config, "stop_key": None}  # no Ray key-value store to read a request from
        self.out = Path(run_config.storage_path) / run_config.name

    def fit(self):
        import cookbook

        announced = self.loop_config["announced"]
        values = cookbook.distributed(num_processes=self.num_workers, start_method="fork")(_local_worker).distributed(
            self.fn, self.loop_config, self.out, announced
        )
        return_value, metrics, name = values[0]
        from ray.train import Checkpoint, Result

        return Result(
            metrics=metrics,
            checkpoint=Checkpoint.from_directory(self.out / name) if name else None,
            error=None,
            path=str(self.out),
            return_value=return_value,
        )


def _local_worker(fn, loop_config: dict, out: Path, announced: str | None) -> tuple:
    """One worker of `LocalTorchTrainer.fit`: ``(return value, the newest checkpoint's metrics, its folder name)``."""
    import importlib.metadata
    import logging
    import shutil

    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.train_fn_utils import LocalTrainFnUtils, set_train_fn_utils

    from cookbook import get_dist_info

    class Stored(LocalTrainFnUtils):
        newest, metrics = announced, None
        handed = Checkpoint.from_directory(out / announced) if announced else None

        def report(self, metrics, checkpoint=None, checkpoint_dir_name=None, **kwargs):
            if checkpoint is not None and self.get_context().get_world_rank() == 0:  # its folder goes after the call
                shutil.copytree(checkpoint.path, out / checkpoint_dir_name)
                snapshot = {
                    "ray_version": importlib.metadata.version("ray"),
                    "latest_checkpoint_result": {"checkpoint_dir_name": checkpoint_dir_name},
                }
                (out / "checkpoint_manager_snapshot.json").write_text(json.dumps(snapshot))
                self.newest, self.metrics = checkpoint_dir_name, dict(metrics)
            super().report(metrics, checkpoint, checkpoint_dir_name, **kwargs)

        def get_checkpoint(self):
            return self.handed

    log = logging.getLogger("cookbook")
    for handler in [h for h in log.handlers if getattr(h, "_cookbook", False)]:
        log.removeHandler(handler)  # inherited from pytest's process: each worker sets up its own (rank 0's INFO)
    logging.getLogger("ray").setLevel(
        logging.WARNING
    )  # local mode's "Reported metrics", to a stream pytest may have closed
    info = get_dist_info()
    utils = Stored(
        experiment_name=out.name,
        world_size=info.world_size,
        world_rank=info.rank,
        local_rank=info.local_rank,
        local_world_size=info.world_size,
    )
    set_train_fn_utils(utils)
    return fn(loop_config), utils.metrics, utils.newest


def without_ray(monkeypatch) -> None:
    """Make a recipe's driver (``train.py``'s ``main``, in this process) train through `LocalTorchTrainer`: no Ray
    instance is started or joined (2 CPU workers, no shared-storage probe)."""
    import ray.train.torch

    from cookbook.ray_train import driver

    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(driver, "_init_ray", lambda cfg, num_workers: None)
    monkeypatch.setattr(driver, "_resolve_workers", lambda cfg, nnodes=1: (2, False))
    monkeypatch.setattr(driver, "_check_shared_storage", lambda output_dir: None)
    monkeypatch.setattr(ray.train.torch, "TorchTrainer", LocalTorchTrainer)


def floats_in(state) -> list:
    """The floating-point tensors of a checkpoint's state (nested dicts, lists and tuples of tensors)."""
    import torch

    if isinstance(state, torch.Tensor):
        return [state] if state.is_floating_point() else []
    if isinstance(state, dict):
        state = list(state.values())
    return [t for v in state for t in floats_in(v)] if isinstance(state, (list, tuple)) else []
