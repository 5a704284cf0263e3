"""The driver side of a Ray recipe, `RayDriver`: the checks before Ray starts and the bookkeeping around the recipe's
``TorchTrainer(...).fit()`` in ``output_dir``, Ray's run folder; a re-run resumes from the newest checkpoint Ray
registered; SIGTERM / SIGUSR1 stop every worker after the same step with a checkpoint (exit 75)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
import types
import uuid
from dataclasses import dataclass, field
from importlib.metadata import distributions
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch

from cookbook import run_lock
from cookbook.checkpoint import CheckpointError, ResumeGuard, read_meta
from cookbook.config import MAY_CHANGE, ConfigError, to_dict
from cookbook.dist import CollectiveTimeout
from cookbook.errors import EXIT_PREEMPTED, AlreadyComplete
from cookbook.metrics import shown
from cookbook.policy import NonFiniteError, NonFinitePolicy, Preempted, StopRequest
from cookbook.ray_train.worker import DIVERGED, SAVE_FAILED, STATE_FILE, raise_save_error, worker_entry

_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the run's registered checkpoints


@dataclass
class RayConfig:  # the ``ray`` section of a Ray recipe's config
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
class EpochTrainConfig:  # the ``train`` keys of an epoch-based Ray recipe that cookbook reads; the recipe adds its own
    # a step with a NaN/inf loss or gradient norm: stop (exit 4) or skip (drop its batch, go on)
    on_nonfinite: str = "stop"
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the worker that is behind


@dataclass
class EpochRunConfig:  # the top level of an epoch-based Ray recipe's schema; the recipe adds model, data, optim, train
    output_dir: str = "outputs/run"  # Ray's run folder: checkpoints, metrics, MLflow (shared storage on several nodes)
    run_name: str = "run"  # the trackers' run name
    mlflow: bool = True  # false: no MLflow, whatever `trackers` says
    trackers: list[str] = field(default_factory=lambda: ["mlflow"])  # beside metrics.jsonl: requirements.TRACKERS
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: _EpochCheckpointConfig = field(default_factory=_EpochCheckpointConfig)
    train: EpochTrainConfig = field(default_factory=EpochTrainConfig)


# Settings of an epoch-based Ray recipe that may differ between a checkpoint and the run that resumes it: those of the
# shared sections (cookbook.config's; its train.stop_at_step, eval_every and profile_step no epoch recipe has), and these.
EPOCH_MAY_CHANGE = (*MAY_CHANGE, "ray.*", "train.stop_at_epoch")


class RayDriver:
    """Constructing it checks the ``train`` failure settings, ``output_dir`` and the worker count here (``workers``,
    ``use_gpu``; ``None`` on ``RAY_ADDRESS`` or several nodes); `check_resume`, after the recipe's data check, the
    resume. `stop_at`: ``("train.stop_at_epoch", 1)`` or ``("train.stop_at_step", 8)``, whose last word is the unit."""

    def __init__(self, cfg: Any, stop_at: tuple[str, int]):
        self.cfg, self.stop_at, self.unit = cfg, stop_at, stop_at[0].rsplit("_", 1)[-1]
        NonFinitePolicy.settings(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips: before Ray starts
        if (timeout_s := getattr(cfg.train, "collective_timeout_s", None)) is not None and not timeout_s > 0:
            raise ConfigError(f"train.collective_timeout_s must be > 0 seconds, got {timeout_s:g}")
        self.nnodes = int(os.environ.get("COOKBOOK_NNODES", "1"))
        _check_output_dir(cfg.output_dir, self.nnodes)
        self.guard = _RayCheckpoints(cfg.output_dir, self.unit)
        self._total: int | None = None  # the run's length in its unit (`started`), when known
        self.workers = self.use_gpu = None  # planned on the cluster, after Ray started, on RAY_ADDRESS or several nodes
        if not os.environ.get("RAY_ADDRESS") and self.nnodes == 1:
            self.workers, self.use_gpu = plan_workers(cfg.ray, torch.cuda.device_count(), os.cpu_count() or 1)

    def check_resume(self, may_change: tuple[str, ...]) -> RayDriver:
        """Check the resume (``resume``, its ``meta``) but for the settings `may_change`; returns the driver."""
        self.resume = _check_resume(
            self.guard, getattr(self.cfg.checkpoint, "resume", "auto"), to_dict(self.cfg), may_change, self.stop_at
        )
        self.meta = read_meta(self.resume) if self.resume is not None else None
        self._check_workers()
        return self

    def _check_workers(self) -> None:  # the resume's worker count, once the workers are planned
        if self.workers is not None and self.resume is not None:
            self.guard.check_world_size(self.resume, self.meta, self.workers)

    @property
    def on_cpu(self) -> bool:
        return not self.use_gpu if self.use_gpu is not None else self.cfg.ray.use_gpu is False

    def _complete(self, total: int | None, outputs: Mapping[str, str | Path]) -> str | None:
        """The message when the newest checkpoint ends the run (`total` epochs or steps; ``None``: not known) and
        `outputs` (``{"model": <output_dir>/final}``) exist, else ``None``."""
        done = (self.meta or {}).get(self.unit, 0)
        if self.meta is None or (total is not None and done < total) or not all(map(os.path.exists, outputs.values())):
            return None
        where = {**outputs, "metrics": Path(self.cfg.output_dir) / "metrics.jsonl"}
        return self.guard.already_complete(done, total, self.unit, where)

    @contextlib.contextmanager
    def started(self, total: int | None, outputs: Mapping[str, str | Path] = {}) -> Iterator[RayDriver]:
        """The block of ``TorchTrainer(...).fit()``: ``output_dir`` locked, Ray started or joined, the workers sized on
        the cluster, SIGTERM / SIGUSR1 a stop request; a worker's timed-out collective one `CollectiveTimeout`.
        AlreadyComplete (exit 0): the newest checkpoint ends the run (`total`) and `outputs` exist."""
        if (done := self._complete(total, outputs)) is not None:
            raise AlreadyComplete(done)
        self._total = total
        lock = run_lock.acquire(self.cfg.output_dir, os.environ.get("NODE_RANK", "0"))
        try:
            _init_ray(self.cfg.ray, self.workers or 0)
            self.workers, self.use_gpu = _resolve_workers(self.cfg.ray, self.nnodes)
            self._check_workers()
            _check_shared_storage(self.cfg.output_dir)
            with _StopOnSignal() as self._stop:
                try:
                    yield self
                except Exception as exc:  # Ray's WorkerGroupError: a stalled worker is one line (exit 3)
                    if (stalled := _stalled_worker(exc)) is None:
                        raise
                    raise stalled from None
        finally:
            os.close(lock)

    def worker_loop(self, script: str) -> dict[str, Any]:
        """``TorchTrainer`` arguments: `worker_entry` runs the recipe file `script`'s ``train_loop(config)`` on each
        worker (the config, the resume, the stop key); ``torch_config``: ``train.collective_timeout_s``."""
        from ray.train.torch import TorchConfig

        config = {
            "script": str(Path(script).resolve()),
            "config": to_dict(self.cfg),
            "stop_key": self._stop.key,
            "announced": self.resume.name if self.resume is not None else None,
        }
        timeout = TorchConfig(timeout_s=self.cfg.train.collective_timeout_s)
        return {"train_loop_per_worker": worker_entry, "train_loop_config": config, "torch_config": timeout}

    @property
    def scaling(self) -> dict[str, Any]:
        """``ScalingConfig`` arguments: the workers planned, one per GPU on GPUs, ``ray.cpus_per_worker`` CPUs each."""
        resources = {"CPU": self.cfg.ray.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}
        return {"num_workers": self.workers, "use_gpu": self.use_gpu, "resources_per_worker": resources}

    @property
    def run_options(self) -> dict[str, Any]:
        """``RunConfig`` arguments: ``output_dir`` as Ray's run folder (storage_path / name), ``checkpoint.keep_last``
        (Ray deletes older checkpoints; 0 keeps all), ``ray.max_failures`` (restarts, from the newest checkpoint)."""
        from ray.train import CheckpointConfig, FailureConfig

        out = Path(self.cfg.output_dir).expanduser().resolve()
        return {
            "name": out.name,
            "storage_path": str(out.parent),
            "checkpoint_config": CheckpointConfig(num_to_keep=self.cfg.checkpoint.keep_last or None),
            "failure_config": FailureConfig(max_failures=self.cfg.ray.max_failures),
        }

    def finish(self, result: Any) -> None:
        """Say how Ray's ``Result`` ended the run; raises the workers' `NonFiniteError` (exit 4) or
        `CheckpointSaveError` (exit 2), or `Preempted` after a stop request."""
        returned = result.return_value if isinstance(result.return_value, dict) else {}
        if returned.get(DIVERGED):
            raise NonFiniteError(returned[DIVERGED])
        raise_save_error(returned.get(SAVE_FAILED))
        checkpoint = result.checkpoint.path if result.checkpoint else None
        if self._stop.signum is not None and (result.metrics or {}).get("preempted"):
            print(
                f"preempted ({signal.Signals(self._stop.signum).name}): every worker stopped after step "
                f"{result.metrics.get('step')}{f' and saved {checkpoint}' if checkpoint else ''}; run the same "
                f"command again to continue (exit status {EXIT_PREEMPTED})",
                file=sys.stderr,
            )
            raise Preempted(EXIT_PREEMPTED)
        metrics = Path(self.cfg.output_dir) / "metrics.jsonl"
        (key, stop), total, reached = self.stop_at, self._total, (result.metrics or {}).get(self.unit)
        if stop > 0 and reached == stop and (total is None or stop < total):  # as the torchrun loop says it
            print(
                f"stopped at {self.unit} {stop}{f' of {total}' if total else ''} ({key}): {shown(result.metrics)} | "
                f"checkpoint {checkpoint}; run again without {key} (or with a larger value) to continue",
                file=sys.stderr,
            )
            return
        print(f"done: {shown(result.metrics or {})} | checkpoint {checkpoint} | metrics {metrics}", file=sys.stderr)


def _stalled_worker(exc: BaseException) -> CollectiveTimeout | None:
    """The `CollectiveTimeout` a worker raised among the failures of Ray's ``WorkerGroupError`` `exc`, or ``None``."""
    for rank, failure in sorted((getattr(exc, "worker_failures", None) or {}).items()):
        failure = getattr(failure, "_base_exc", failure)  # Ray's UserExceptionWithTraceback around it
        if isinstance(failure, CollectiveTimeout):
            return CollectiveTimeout(f"Ray Train worker {rank}: {failure}")


class _StopOnSignal(StopRequest):
    """The first SIGTERM / SIGUSR1 sets `key` in Ray's key-value store for the workers' rank 0 (from a thread: no Ray
    call in a signal handler); a second ends the process."""

    def __init__(self) -> None:
        super().__init__()
        self.key, self._asked = f"cookbook-stop-{uuid.uuid4().hex}", threading.Event()

    def __call__(self, signum: int | None = None) -> None:
        if self.signum is not None:  # the second: at once
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        super().__call__(signum)
        self._asked.set()

    def _ask(self) -> None:  # set by a signal or by __exit__
        from ray.experimental.internal_kv import _internal_kv_put

        if self._asked.wait() and self.signum is not None:
            print(
                f"{signal.Signals(self.signum).name}: the workers stop after their next step and save a "
                f"checkpoint (send it again to stop at once)",
                file=sys.stderr,
            )
            _internal_kv_put(self.key, b"1")

    def __enter__(self) -> _StopOnSignal:
        self.listen()
        self._handlers = {sig: h if h is not None else signal.SIG_DFL for sig, h in self._handlers.items()}
        self._thread = threading.Thread(target=self._ask, name="cookbook-stop", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.restore()
        self._asked.set()
        self._thread.join(timeout=5)
        if self.signum is not None:
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(self.key)


class _RayCheckpoints(ResumeGuard):
    """Ray Train's ``checkpoint_<unit>_<n>`` folders under the resume guard (another worker count is refused).
    `latest` is the newest in Ray's snapshot, the one Ray hands the workers; a later complete folder may be
    unregistered (Ray registers a report once every worker has made it)."""

    def __init__(self, output_dir: str | Path, unit: str):
        super().__init__(
            output_dir,
            folder=f"checkpoint_{unit}_<n>",
            files=(STATE_FILE,),
            run_dir=output_dir,
            processes="workers",
            same_size="ray.num_workers={n}",
            cannot_remap="the global batch, learning rate and steps per epoch would change mid-run",
        )

    def latest(self) -> Path | None:
        """The newest checkpoint Ray registered (a damaged one gives way to the newest earlier one), or ``None``."""
        data = self._snapshot()
        if not (name := ((data or {}).get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")):
            return None
        path = self.root / name
        if path not in self.bad and not self.is_complete(path):
            raise CheckpointError(
                f"{path}: Ray Train registered it as the run's newest checkpoint, but it is missing "
                f"or incomplete (it needs {', '.join(('meta.json', *self.files))}): restore it, or "
                f"start afresh with {self.start_afresh()}"
            )
        return next(
            (p for p in [path, *self._registered(data)[::-1]] if p not in self.bad and self.is_complete(p)), None
        )

    def _snapshot(self) -> dict[str, Any] | None:
        if not (snapshot := self.root / _SNAPSHOT_FILE).is_file():
            return None
        try:
            data = json.loads(snapshot.read_text())
            if not isinstance(data, dict) or not isinstance(data.get("latest_checkpoint_result") or {}, dict):
                raise ValueError("not the object Ray Train writes")
        except (OSError, ValueError) as exc:
            raise CheckpointError(
                f"{snapshot}: Ray Train's record of the run's checkpoints is unreadable "
                f"({type(exc).__name__}: {exc}), and Ray cannot resume without it: start afresh "
                f"with {self.start_afresh()}"
            ) from None
        wrote, installed = data.get("ray_version"), next((d.version for d in distributions(name="ray")), None)
        if wrote and installed and wrote != installed:
            raise CheckpointError(
                f"{snapshot} was written by Ray {wrote}, and Ray {installed} does not resume from "
                f"it: install ray=={wrote} to continue this run, or start afresh with "
                f"{self.start_afresh()}"
            )
        return data

    def _registered(self, data: Mapping[str, Any]) -> list[Path]:
        results = data.get("checkpoint_results") or []
        order = data.get("checkpoint_report_indices") or list(range(len(results)))
        return [self.root / r["checkpoint_dir_name"] for _, r in sorted(zip(order, results), key=lambda x: x[0])]

    def register(self, path: Path) -> None:
        """Make `path` the one Ray resumes from: rewrite the snapshot (atomically) without the damaged ones."""
        data = self._snapshot()
        if ((data.get("latest_checkpoint_result") or {}).get("checkpoint_dir_name")) == path.name:
            return
        results = data.get("checkpoint_results") or []
        keep = [i for i, r in enumerate(results) if self.root / r["checkpoint_dir_name"] not in self.bad]
        data.update(
            {k: [data[k][i] for i in keep] for k in ("checkpoint_results", "checkpoint_report_indices") if k in data}
        )
        data["latest_checkpoint_result"] = next(
            r for r in data["checkpoint_results"] if self.root / r["checkpoint_dir_name"] == path
        )
        (tmp := self.root / f".{_SNAPSHOT_FILE}.tmp").write_text(json.dumps(data))
        os.replace(tmp, self.root / _SNAPSHOT_FILE)


def _check_resume(
    guard: _RayCheckpoints,
    resume: str | None,
    config: Mapping[str, Any],
    may_change: tuple[str, ...],
    stop_at: tuple[str, int],
) -> Path | None:
    """`ResumeGuard.check` of ``checkpoint.resume`` (``auto``, ``none`` or the newest folder Ray registered) before
    the worker count is known; says where the run resumes and which later folders Ray had not registered."""
    path = guard.check(resume, None, config, may_change, stop_at)
    latest = guard.latest()
    if path is not None and guard.bad:  # Ray's newest is damaged: Ray resumes from the one the guard fell back to
        guard.register(path)
    if path is not None and latest is not None and path.resolve() != latest.resolve():
        raise CheckpointError(
            f"{guard.resume_key}={resume!r}: Ray Train resumes a run from the newest checkpoint it "
            f"registered in its output_dir, {latest}; use {guard.resume_key}=auto, or start afresh "
            f"with {guard.start_afresh()}"
        )
    found, unit = guard.complete_checkpoints(), stop_at[0].rsplit("_", 1)[-1]
    if path is not None:
        later = [p.name for p in found[found.index(path) + 1 :]] if path in found else []
        meta = read_meta(path)
        mid_epoch = f", step {meta.get('step')}" if unit == "epoch" and "_step_" in path.name else ""
        unregistered = "were written after it but not registered by Ray before the run stopped, and will be replaced"
        line = f"resuming from {path} ({unit} {meta.get(unit)}{mid_epoch})"
        print(line + (f"; {', '.join(later)} {unregistered}" if later else ""), file=sys.stderr)
    elif found:  # written, but the run stopped before Ray registered any: Ray starts afresh
        print(
            f"starting at {unit} 0: {', '.join(p.name for p in found)} in {guard.root} were written but not "
            f"registered by Ray Train before the run stopped (Ray resumes only from a checkpoint it registered), "
            f"and will be replaced",
            file=sys.stderr,
        )
    return path


def _check_output_dir(output_dir: str, nnodes: int) -> None:
    """Refuse a URI (metrics and MLflow files are plain files) and, on several nodes, a missing parent folder."""
    if "://" in output_dir:
        raise ConfigError(
            f"output_dir={output_dir!r}: use a folder on a shared file system (NFS, Lustre, a "
            f"mounted bucket), not a URI"
        )
    parent = Path(output_dir).expanduser().resolve().parent
    if nnodes > 1 and not parent.is_dir():
        raise ConfigError(
            f"output_dir={output_dir!r}: the folder {parent} does not exist. With {nnodes} nodes "
            f"output_dir must be on storage every node mounts; create it there first"
        )


def _init_ray(cfg: RayConfig, num_workers: int) -> None:
    """Join ``RAY_ADDRESS``, or start a local Ray with CPUs for `num_workers` and ``reserve_cpus``."""
    import ray

    kwargs: dict[str, Any] = {}
    if not (address := os.environ.get("RAY_ADDRESS") or None):
        needed = int(max(num_workers, 1) * cfg.cpus_per_worker + 0.999) + cfg.reserve_cpus
        kwargs = {
            "num_cpus": max(os.cpu_count() or 1, needed),
            **({"_temp_dir": str(Path(cfg.temp_dir).resolve())} if cfg.temp_dir else {}),
        }
    if not sys.stderr.isatty():  # a log file: Ray's prefixes without colour codes
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    hook = {"worker_process_setup_hook": _by_value(_quiet_ray_logs)}
    ray.init(address=address, include_dashboard=False, log_to_driver=True, runtime_env=hook, **kwargs)


def _by_value(fn: Any) -> Any:
    """`fn` as a function Ray's cloudpickle sends by value: a Ray process runs it without importing cookbook (and
    torch, which its controller and helper actors otherwise never import: seconds each)."""
    return types.FunctionType(fn.__code__, {}, fn.__name__)


def _quiet_ray_logs() -> None:
    """In each Ray process: drop three of Ray Train's log lines. The placement-group cleaner's "Failed to query"
    warning, which it repeats every few seconds when the dashboard (the State API's server) is off, as here; every
    worker's "Reporting training result" and rank 0's "Checkpoint successfully created", which repeat the recipe's
    own eval and checkpoint lines, from every rank."""
    import importlib.util
    import logging

    execution = "ray.train.v2._internal.execution"
    try:  # the module layout of the pinned Ray; another Ray keeps its lines
        context = importlib.util.find_spec(f"{execution}.context").origin  # its logger is named by its path
    except (ImportError, AttributeError):
        return
    for name, start in [
        (f"{execution}.controller.placement_group_cleaner", "Failed to query Ray Train Controller actor state"),
        (context, "Reporting training result"),
        (f"{execution}.storage", "Checkpoint successfully created"),
    ]:
        logging.getLogger(name).addFilter(lambda record, start=start: not record.getMessage().startswith(start))


def plan_workers(cfg: RayConfig, gpus: int, cpus: int) -> tuple[int, bool]:
    """``(num_workers, use_gpu)`` for a cluster of `gpus` GPUs and `cpus` CPUs (ConfigError: too few)."""
    force_cpu = os.environ.get("COOKBOOK_DEVICE", "").lower() == "cpu"
    use_gpu = (gpus > 0 and not force_cpu) if cfg.use_gpu is None else cfg.use_gpu
    if use_gpu and gpus == 0:
        raise ConfigError("ray.use_gpu=true but the Ray cluster has no GPUs")
    n = cfg.num_workers if cfg.num_workers > 0 else (gpus if use_gpu else 2)
    if use_gpu and n > gpus:
        raise ConfigError(
            f"ray.num_workers={n} but the Ray cluster has {gpus} GPU(s): one worker per GPU, so at most {gpus}"
        )
    if n * cfg.cpus_per_worker > cpus:
        raise ConfigError(
            f"ray.num_workers={n} x ray.cpus_per_worker={cfg.cpus_per_worker:g} CPUs, but the Ray cluster "
            f"has {cpus} CPUs: at most {int(cpus // cfg.cpus_per_worker)} worker(s)"
        )
    return n, use_gpu


def _resolve_workers(cfg: RayConfig, nnodes: int) -> tuple[int, bool]:
    """`plan_workers` on the cluster once `nnodes` nodes joined (ConfigError after ``cfg.join_timeout_s``)."""
    import ray

    deadline = time.monotonic() + cfg.join_timeout_s
    while (alive := len([n for n in ray.nodes() if n["Alive"]])) < nnodes:
        if time.monotonic() > deadline:
            raise ConfigError(
                f"only {alive} of NNODES={nnodes} Ray nodes joined within ray.join_timeout_s="
                f"{cfg.join_timeout_s:g}: start launch.sh on every node"
            )
        time.sleep(2.0)
    return plan_workers(cfg, int((res := ray.cluster_resources()).get("GPU", 0)), int(res.get("CPU", 0)))


def _check_shared_storage(output_dir: str) -> None:
    """On several nodes, refuse an `output_dir` a node does not see: a task pinned to each reads back a marker."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    nodes = [n for n in ray.nodes() if n["Alive"]]
    if len(nodes) < 2:
        return

    @ray.remote(num_cpus=0)
    def probe(path: str) -> str | None:
        return Path(path).read_text() if Path(path).is_file() else None

    pinned = [probe.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)) for n in nodes]
    (out := Path(output_dir).expanduser().resolve()).mkdir(parents=True, exist_ok=True)
    (marker := out / f".shared-storage-{(token := uuid.uuid4().hex)}").write_text(token)
    try:
        seen = ray.get([p.remote(str(marker)) for p in pinned])
    finally:
        marker.unlink(missing_ok=True)
    if blind := [n["NodeManagerAddress"] for n, s in zip(nodes, seen) if s != token]:
        raise ConfigError(
            f"output_dir={output_dir!r} is not shared: node(s) {', '.join(blind)} do not see {out}. "
            f"Checkpoints must be on storage every node mounts (NFS, Lustre, a mounted bucket)"
        )
