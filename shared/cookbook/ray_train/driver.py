"""The driver side of a Ray recipe: the checks before Ray starts and the bookkeeping around the recipe's own
``TorchTrainer(...).fit()``: `RayDriver`.

``output_dir`` is Ray's run folder (``RunConfig(storage_path=<its parent>, name=<its last part>)``): checkpoints
(``checkpoint_epoch_<n>/`` or ``checkpoint_step_<n>/``: ``state.pt``, ``meta.json``), ``metrics.jsonl`` and MLflow
side by side. A re-run resumes from the newest checkpoint Ray registered (the driver names it); SIGTERM / SIGUSR1
stop every worker after the same step with a checkpoint (exit 75); a non-finite stop or a failed save that the
workers return is raised here as the torchrun recipes' `NonFiniteError` (exit 4) or `CheckpointSaveError` (exit 2).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import os
import signal
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from cookbook import run_lock
from cookbook.checkpoint import CheckpointError, ResumeGuard, read_meta
from cookbook.config import ConfigError, to_dict
from cookbook.dist import CollectiveTimeout
from cookbook.errors import EXIT_PREEMPTED
from cookbook.policy import NonFiniteError, NonFinitePolicy, Preempted, StopRequest
from cookbook.ray_train.worker import DIVERGED, SAVE_FAILED, STATE_FILE, raise_save_error

_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the run's registered checkpoints


@dataclass
class RayConfig:
    """The ``ray`` section of a Ray recipe's config."""

    num_workers: int = -1  # training processes; -1: one per GPU in the cluster (2 on a CPU-only cluster)
    use_gpu: bool | None = None  # null: GPUs when the cluster has any (COOKBOOK_DEVICE=cpu forces CPU)
    cpus_per_worker: float = 1.0
    reserve_cpus: int = 1  # extra CPUs a local Ray instance declares beyond the workers' (Ray's own actors, Ray Data)
    max_failures: int = 0  # restarts of the worker group after a failure, each from the newest checkpoint
    join_timeout_s: float = 300.0  # how long to wait for the nodes NNODES announces
    temp_dir: str | None = None  # Ray's session folder for a local instance (default /tmp/ray)


@dataclass
class _EpochCheckpointConfig:
    keep_last: int = 2  # newest checkpoints kept (Ray Train keeps them); 0 keeps all


@dataclass
class EpochTrainConfig:
    """The ``train`` keys of an epoch-based Ray recipe that cookbook reads, as `cookbook.config.TrainConfig`'s; the
    recipe's ``TrainConfig`` adds its own (``epochs``, ``stop_at_epoch``, ``log_every``)."""

    on_nonfinite: str = "stop"  # a step with a NaN/inf loss or gradient norm: stop (exit 4) or skip (drop its batch, go on)
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the worker that is behind


@dataclass
class EpochRunConfig:
    """The top level of an epoch-based Ray recipe's schema; the recipe's ``Config`` adds ``model``, ``data``,
    ``optim`` and ``train`` (an `EpochTrainConfig`)."""

    output_dir: str = "outputs/run"  # Ray's run folder: checkpoints, metrics, MLflow (shared storage on several nodes)
    run_name: str = "run"  # the trackers' run name
    mlflow: bool = True  # false: no MLflow, whatever `trackers` says
    trackers: list[str] = field(default_factory=lambda: ["mlflow"])  # beside metrics.jsonl: cookbook.config.TRACKERS
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: _EpochCheckpointConfig = field(default_factory=_EpochCheckpointConfig)
    train: EpochTrainConfig = field(default_factory=EpochTrainConfig)


# Settings of an epoch-based Ray recipe that may differ between a checkpoint and the run that resumes it.
EPOCH_MAY_CHANGE = ("output_dir", "run_name", "mlflow", "trackers", "ray.*", "train.stop_at_epoch", "train.log_every",
                    "train.on_nonfinite", "train.max_consecutive_skips", "train.collective_timeout_s", "checkpoint.*")


class RayDriver:
    """A Ray recipe's driver. Constructing it checks, before Ray starts, the ``train`` failure settings, ``output_dir``
    and the worker count here (`plan_workers`: ``workers``, ``use_gpu``; ``None`` on ``RAY_ADDRESS`` or several
    nodes); `check_resume`, called after the recipe's data check, the resume. ConfigError or CheckpointError.
    `stop_at`: ``("train.stop_at_epoch", 1)`` or ``("train.stop_at_step", 8)``, whose last word is the unit."""

    def __init__(self, cfg: Any, stop_at: tuple[str, int]):
        self.cfg, self.stop_at, self.unit = cfg, stop_at, stop_at[0].rsplit("_", 1)[-1]
        NonFinitePolicy.settings(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips: before Ray starts
        timeout_s = getattr(cfg.train, "collective_timeout_s", None)
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"train.collective_timeout_s must be > 0 seconds, got {timeout_s:g}")
        self.nnodes = int(os.environ.get("COOKBOOK_NNODES", "1"))
        _check_output_dir(cfg.output_dir, self.nnodes)
        self.guard = _RayCheckpoints(cfg.output_dir, self.unit)
        planned = _plan_workers_locally(cfg.ray, self.nnodes)
        self.workers, self.use_gpu = planned if planned is not None else (None, None)

    def check_resume(self, may_change: tuple[str, ...]) -> RayDriver:
        """Check the resume (`ResumeGuard` over Ray's folders: ``resume``, its ``meta``), `may_change` the settings
        a resume may change; returns the driver."""
        self.resume = _check_resume(self.guard, getattr(self.cfg.checkpoint, "resume", "auto"), to_dict(self.cfg),
                                    may_change, self.stop_at)
        self.meta = read_meta(self.resume) if self.resume is not None else None
        if self.workers is not None and self.resume is not None:
            self.guard.check_world_size(self.resume, self.meta, self.workers)
        return self

    @property
    def on_cpu(self) -> bool:
        """Whether the workers will train on CPUs (as planned here, else as ``ray.use_gpu`` says)."""
        return not self.use_gpu if self.use_gpu is not None else self.cfg.ray.use_gpu is False

    def already_complete(self, total: int | None, outputs: Mapping[str, str | Path] = {}) -> bool:
        """Whether the newest checkpoint ends the run (`total` epochs or steps; ``None``: not known here) and
        `outputs` (``{"model": <output_dir>/final}``) exist; if so, say so (stderr)."""
        if self.meta is None:
            return False
        done = self.meta.get(self.unit, 0)
        if (total is not None and done < total) or not all(Path(p).exists() for p in outputs.values()):
            return False
        where = {**outputs, "metrics": Path(self.cfg.output_dir) / "metrics.jsonl"}
        print(self.guard.already_complete(done, total, self.unit, where), file=sys.stderr)
        return True

    @contextlib.contextmanager
    def started(self) -> Iterator[RayDriver]:
        """The block of the recipe's ``TorchTrainer(...).fit()``: ``output_dir``'s lock held, Ray started or joined, the
        worker group sized on the cluster and checked, SIGTERM / SIGUSR1 a stop request to the workers. A worker's
        timed-out collective that ended the run is raised as one `CollectiveTimeout` naming the stalled worker."""
        lock = run_lock.acquire(self.cfg.output_dir, os.environ.get("NODE_RANK", "0"))
        try:
            _init_ray(self.cfg.ray, self.workers or 0)
            self.workers, self.use_gpu = _resolve_workers(self.cfg.ray, self.nnodes)
            if self.resume is not None:
                self.guard.check_world_size(self.resume, self.meta, self.workers)
            _check_shared_storage(self.cfg.output_dir)
            with _StopOnSignal() as self._stop:
                try:
                    yield self
                except Exception as exc:  # Ray's WorkerGroupError: a stalled worker is one line (exit 3)
                    stalled = _stalled_worker(exc)
                    if stalled is None:
                        raise
                    raise stalled from None
        finally:
            os.close(lock)

    def loop_config(self, script: str) -> dict[str, Any]:
        """``train_loop_config`` for `cookbook.ray_train.worker_entry`: the recipe file `script` (``__file__``, at the
        same path on every node), the config as a dict, the checkpoint announced and the stop request's key."""
        return {"script": str(Path(script).resolve()), "config": to_dict(self.cfg), "stop_key": self._stop.key,
                "announced": self.resume.name if self.resume is not None else None}

    @property
    def resources_per_worker(self) -> dict[str, float]:
        """``ScalingConfig.resources_per_worker``: ``ray.cpus_per_worker`` CPUs, and a GPU when the workers use GPUs."""
        return {"CPU": self.cfg.ray.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def finish(self, result: Any) -> Any:
        """Say how the run ended (stderr) and return Ray's ``Result``; raises the workers' `NonFiniteError` (exit 4)
        or `CheckpointSaveError` (exit 2), or `Preempted` after a stop on SIGTERM / SIGUSR1 (exit 75)."""
        returned = result.return_value if isinstance(result.return_value, dict) else {}
        if returned.get(DIVERGED):
            raise NonFiniteError(returned[DIVERGED])
        raise_save_error(returned.get(SAVE_FAILED))
        checkpoint = result.checkpoint.path if result.checkpoint else None
        if self._stop.signum is not None and (result.metrics or {}).get("preempted"):
            print(f"preempted ({signal.Signals(self._stop.signum).name}): every worker stopped after step "
                  f"{result.metrics.get('step')}{f' and saved {checkpoint}' if checkpoint else ''}; run the same "
                  f"command again to continue (exit status {EXIT_PREEMPTED})", file=sys.stderr)
            raise Preempted(EXIT_PREEMPTED)
        print(f"done: {result.metrics} | checkpoint {checkpoint} | metrics {Path(self.cfg.output_dir) / 'metrics.jsonl'}",
              file=sys.stderr)
        return result


def _stalled_worker(exc: BaseException) -> CollectiveTimeout | None:
    """The `CollectiveTimeout` a worker raised among the failures of Ray's ``WorkerGroupError`` `exc`, or ``None``."""
    for rank, failure in sorted((getattr(exc, "worker_failures", None) or {}).items()):
        failure = getattr(failure, "_base_exc", failure)  # Ray's UserExceptionWithTraceback around it
        if isinstance(failure, CollectiveTimeout):
            return CollectiveTimeout(f"Ray Train worker {rank}: {failure}")
    return None


class _StopOnSignal(StopRequest):
    """`StopRequest` for a driver with Ray connected: the first SIGTERM / SIGUSR1 sets `key` in Ray's key-value store,
    which the workers' rank 0 reads (from a thread: no Ray call in a signal handler); a second ends the process."""

    def __init__(self) -> None:
        super().__init__()
        self.key = f"cookbook-stop-{uuid.uuid4().hex}"
        self._asked, self._done = threading.Event(), threading.Event()

    def __call__(self, signum: int | None = None) -> None:
        if self.signum is not None:  # the second: at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        super().__call__(signum)
        self._asked.set()

    def _ask(self) -> None:
        from ray.experimental.internal_kv import _internal_kv_put

        while not self._done.is_set():
            if self._asked.wait(0.2):
                print(f"{signal.Signals(self.signum).name}: the workers stop after their next step and save a "
                      f"checkpoint (send it again to stop at once)", file=sys.stderr)
                _internal_kv_put(self.key, b"1")
                return

    def __enter__(self) -> _StopOnSignal:
        self.listen()
        self._handlers = {sig: h if h is not None else signal.SIG_DFL for sig, h in self._handlers.items()}
        self._thread = threading.Thread(target=self._ask, name="cookbook-stop", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
        self._done.set()
        self._thread.join(timeout=5)
        if self.signum is not None:
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(self.key)


# ----------------------------------------------------------------------------- resume
class _RayCheckpoints(ResumeGuard):
    """Ray Train's checkpoint folders ``checkpoint_<unit>_<n>`` in the run folder under cookbook's resume guard
    (another worker count is refused: the global batch depends on it). `latest` is the newest checkpoint in Ray's
    snapshot (``checkpoint_manager_snapshot.json``), the one Ray hands the workers; a later folder can be on disk,
    complete, yet not registered (Ray registers a report once every worker has made it)."""

    def __init__(self, output_dir: str | Path, unit: str):
        super().__init__(output_dir, folder=f"checkpoint_{unit}_<n>", files=(STATE_FILE,), run_dir=output_dir,
                         processes="workers", same_size="ray.num_workers={n}",
                         cannot_remap="the global batch, learning rate and steps per epoch would change mid-run")

    def latest(self) -> Path | None:
        """The newest checkpoint Ray registered, or ``None``; a damaged one (`ResumeGuard.verify`) gives way to the
        newest earlier one (`register` makes it Ray's). CheckpointError: an unreadable or other Ray version's
        snapshot, or an incomplete folder in it."""
        data = self._snapshot()
        name = ((data or {}).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")
        if not name:
            return None
        path = self.root / name
        if path not in self.bad and not self.is_complete(path):
            raise CheckpointError(f"{path}: Ray Train registered it as the run's newest checkpoint, but it is missing "
                                  f"or incomplete (it needs {', '.join(('meta.json', *self.files))}): restore it, or "
                                  f"start afresh with {self.start_afresh()}")
        for earlier in [path, *self._registered(data)[::-1]]:
            if earlier not in self.bad and self.is_complete(earlier):
                return earlier
        return None

    def _snapshot(self) -> dict[str, Any] | None:
        snapshot = self.root / _SNAPSHOT_FILE
        if not snapshot.is_file():
            return None
        try:
            data = json.loads(snapshot.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("latest_checkpoint_result") or {}, dict):
                raise ValueError("not the object Ray Train writes")
        except (OSError, ValueError) as exc:
            raise CheckpointError(f"{snapshot}: Ray Train's record of the run's checkpoints is unreadable "
                                  f"({type(exc).__name__}: {exc}), and Ray cannot resume without it: start afresh "
                                  f"with {self.start_afresh()}") from None
        wrote, installed = data.get("ray_version"), _ray_version()
        if wrote and installed and wrote != installed:
            raise CheckpointError(f"{snapshot} was written by Ray {wrote}, and Ray {installed} does not resume from "
                                  f"it: install ray=={wrote} to continue this run, or start afresh with "
                                  f"{self.start_afresh()}")
        return data

    def _registered(self, data: Mapping[str, Any]) -> list[Path]:
        """The checkpoint folders the snapshot lists, in the order Ray registered them (its report indices)."""
        results = data.get("checkpoint_results") or []
        order = data.get("checkpoint_report_indices") or list(range(len(results)))
        return [self.root / r["checkpoint_dir_name"] for _, r in sorted(zip(order, results), key=lambda x: x[0])]

    def register(self, path: Path) -> None:
        """Make `path` the checkpoint Ray resumes from: rewrite the snapshot (atomically) without the damaged ones
        registered after it."""
        data = self._snapshot()
        if ((data.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")) == path.name:
            return
        keep = [i for i, r in enumerate(data.get("checkpoint_results") or [])
                if self.root / r["checkpoint_dir_name"] not in self.bad]
        for key in ("checkpoint_results", "checkpoint_report_indices"):
            if key in data:
                data[key] = [data[key][i] for i in keep]
        data["latest_checkpoint_result"] = next(r for r in data["checkpoint_results"]
                                                if self.root / r["checkpoint_dir_name"] == path)
        tmp = self.root / f".{_SNAPSHOT_FILE}.tmp"
        tmp.write_text(json.dumps(data))
        os.replace(tmp, self.root / _SNAPSHOT_FILE)


def _ray_version() -> str | None:
    try:
        return importlib.metadata.version("ray")
    except importlib.metadata.PackageNotFoundError:
        return None


def _check_resume(guard: _RayCheckpoints, resume: str | None, config: Mapping[str, Any], may_change: tuple[str, ...],
                  stop_at: tuple[str, int]) -> Path | None:
    """`ResumeGuard.check` of ``checkpoint.resume`` before the worker count is known (``auto``, ``none`` or the folder
    Ray resumes from, the newest it registered; CheckpointError for another); says which checkpoint the run resumes
    from and which later folders Ray had not registered."""
    path = guard.check(resume, None, config, may_change, stop_at)
    latest = guard.latest()
    if path is not None and guard.bad:  # Ray's newest is damaged: Ray resumes from the one the guard fell back to
        guard.register(path)
    if path is not None and latest is not None and path.resolve() != latest.resolve():
        raise CheckpointError(f"{guard.resume_key}={resume!r}: Ray Train resumes a run from the newest checkpoint it "
                              f"registered in its output_dir, {latest}; use {guard.resume_key}=auto, or start afresh "
                              f"with {guard.start_afresh()}")
    found = guard.complete_checkpoints()
    unit = stop_at[0].rsplit("_", 1)[-1]
    if path is not None:
        later = [p.name for p in found[found.index(path) + 1:]] if path in found else []
        meta = read_meta(path)
        mid_epoch = f", step {meta.get('step')}" if unit == "epoch" and "_step_" in path.name else ""
        print(f"resuming from {path} ({unit} {meta.get(unit)}{mid_epoch})"
              + (f"; {', '.join(later)} were written after it but not registered by Ray before the run stopped, "
                 f"and will be replaced" if later else ""), file=sys.stderr)
    elif found:  # written, but the run stopped before Ray registered any: Ray starts afresh
        print(f"starting at {unit} 0: {', '.join(p.name for p in found)} in {guard.root} were written but not "
              f"registered by Ray Train before the run stopped (Ray resumes only from a checkpoint it registered), "
              f"and will be replaced", file=sys.stderr)
    return path


# ----------------------------------------------------------------------------- checks and Ray
def _check_output_dir(output_dir: str, nnodes: int) -> None:
    """Refuse a URI (the recipes write metrics and MLflow files with plain file I/O) and, on several nodes, a parent
    folder that does not exist (the shared mount: a typo would create a local folder on one node)."""
    if "://" in output_dir:
        raise ConfigError(f"output_dir={output_dir!r}: use a folder on a shared file system (NFS, Lustre, a "
                          f"mounted bucket), not a URI")
    parent = Path(output_dir).expanduser().resolve().parent
    if nnodes > 1 and not parent.is_dir():
        raise ConfigError(f"output_dir={output_dir!r}: the folder {parent} does not exist. With {nnodes} nodes "
                          f"output_dir must be on storage every node mounts; create it there first")


def _init_ray(cfg: RayConfig, num_workers: int) -> None:
    """Join ``RAY_ADDRESS``, or start a local Ray instance (in ``cfg.temp_dir``) declaring at least `num_workers` x
    ``cpus_per_worker`` + ``reserve_cpus`` CPUs; no dashboard."""
    import ray

    address = os.environ.get("RAY_ADDRESS") or None
    kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
    if address is None:
        if cfg.temp_dir:
            kwargs["_temp_dir"] = str(Path(cfg.temp_dir).resolve())
        needed = int(max(num_workers, 1) * cfg.cpus_per_worker + 0.999) + cfg.reserve_cpus
        kwargs["num_cpus"] = max(os.cpu_count() or 1, needed)
    ray.init(address=address, **kwargs)


def plan_workers(cfg: RayConfig, gpus: int, cpus: int) -> tuple[int, bool]:
    """``(num_workers, use_gpu)`` for a cluster of `gpus` GPUs and `cpus` CPUs (ConfigError: ``ray.use_gpu=true``
    without GPUs, or more workers than GPUs or CPUs)."""
    force_cpu = os.environ.get("COOKBOOK_DEVICE", "").lower() == "cpu"
    use_gpu = (gpus > 0 and not force_cpu) if cfg.use_gpu is None else cfg.use_gpu
    if use_gpu and gpus == 0:
        raise ConfigError("ray.use_gpu=true but the Ray cluster has no GPUs")
    n = cfg.num_workers if cfg.num_workers > 0 else (gpus if use_gpu else 2)
    if use_gpu and n > gpus:
        raise ConfigError(f"ray.num_workers={n} but the Ray cluster has {gpus} GPU(s): one worker per GPU, so at most {gpus}")
    if n * cfg.cpus_per_worker > cpus:
        raise ConfigError(f"ray.num_workers={n} x ray.cpus_per_worker={cfg.cpus_per_worker:g} CPUs, but the Ray cluster "
                          f"has {cpus} CPUs: at most {int(cpus // cfg.cpus_per_worker)} worker(s)")
    return n, use_gpu


def _plan_workers_locally(cfg: RayConfig, nnodes: int) -> tuple[int, bool] | None:
    """`plan_workers` against this machine before Ray starts (``None`` on ``RAY_ADDRESS`` or several nodes)."""
    if os.environ.get("RAY_ADDRESS") or nnodes > 1:
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return plan_workers(cfg, gpus, os.cpu_count() or 1)


def _resolve_workers(cfg: RayConfig, nnodes: int = 1) -> tuple[int, bool]:
    """`plan_workers` against the running cluster, once `nnodes` nodes joined (ConfigError after
    ``cfg.join_timeout_s``)."""
    import ray

    deadline = time.monotonic() + cfg.join_timeout_s
    while (alive := len([n for n in ray.nodes() if n["Alive"]])) < nnodes:
        if time.monotonic() > deadline:
            raise ConfigError(f"only {alive} of NNODES={nnodes} Ray nodes joined within ray.join_timeout_s="
                              f"{cfg.join_timeout_s:g}: start launch.sh on every node")
        time.sleep(2.0)
    res = ray.cluster_resources()
    return plan_workers(cfg, int(res.get("GPU", 0)), int(res.get("CPU", 0)))


def _check_shared_storage(output_dir: str) -> None:
    """On several nodes, refuse an `output_dir` that a node does not see: a marker with a random token, written here,
    is read back by a task pinned to each node (ConfigError naming the blind nodes)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return
    out = Path(output_dir).expanduser().resolve()
    out.mkdir(parents=True, exist_ok=True)
    token = uuid.uuid4().hex
    marker = out / f".shared-storage-{token}"
    marker.write_text(token)

    @ray.remote(num_cpus=0)
    def probe(path: str) -> str | None:
        p = Path(path)
        return p.read_text() if p.is_file() else None

    try:
        seen = ray.get([probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False))
                        .remote(str(marker)) for n in nodes])
    finally:
        marker.unlink(missing_ok=True)
    blind = [n["NodeManagerAddress"] for n, s in zip(nodes, seen) if s != token]
    if blind:
        raise ConfigError(f"output_dir={output_dir!r} is not shared: node(s) {', '.join(blind)} do not see {out}. "
                          f"Checkpoints must be on storage every node mounts (NFS, Lustre, a mounted bucket)")
