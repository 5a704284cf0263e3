"""The driver side of a Ray recipe: the checks before Ray starts and the bookkeeping around the recipe's
``TorchTrainer(...).fit()``.

`RayDriver(cfg, ...)` checks the output folder (`check_output_dir`), the resume (cookbook's `ResumeGuard` over
Ray's checkpoint folders) and the worker count on this machine (`plan_workers`); `already_complete` says when a
re-run has nothing left to do; ``with driver.started():`` starts or joins Ray and sizes the worker group, and the
recipe builds its ``TorchTrainer`` there from `RayDriver.loop_config`, ``workers``, ``use_gpu`` and
``resources_per_worker``; `RayDriver.finish` reads the ``Result``.

``output_dir`` is Ray's run folder (``RunConfig(storage_path=<its parent>, name=<its last part>)``), so checkpoints
(``checkpoint_epoch_<n>/`` or ``checkpoint_step_<n>/``: ``state.pt``, ``meta.json``), ``metrics.jsonl`` and MLflow
sit side by side; a re-run resumes from the newest checkpoint Ray registered (the driver names it). SIGTERM or
SIGUSR1 stops every worker after the same step with a checkpoint (exit 75); a non-finite step that stops the run is
returned by the workers (Ray does not restart them for it) and raised here as `cookbook.loop.NonFiniteError` (exit 4).
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
from cookbook.checkpoint import CheckpointError, CheckpointSaveError, ResumeGuard, read_meta
from cookbook.config import ConfigError, to_dict
from cookbook.dist import CollectiveTimeout, stall_error
from cookbook.errors import EXIT_PREEMPTED
from cookbook.loop import PREEMPT_SIGNALS, NonFiniteError, NonFinitePolicy, Preempted
from cookbook.ray_train.worker import _STATE_FILE

_SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the run's registered checkpoints
DIVERGED = "diverged"  # in rank 0's return value (Ray's ``Result.return_value``): the NonFiniteError's message
SAVE_FAILED = "save_failed"  # in rank 0's return value: the CheckpointSaveError's message and errno


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
class EpochCheckpointConfig:
    """The ``checkpoint`` section of a Ray recipe that checkpoints once per epoch (Ray Train keeps them)."""

    keep_last: int = 2  # newest checkpoints kept; 0 keeps all


@dataclass
class EpochTrainConfig:
    """The keys of an epoch-based Ray recipe's ``train`` section that cookbook reads; the recipe's ``TrainConfig``
    subclasses it and adds its own (``epochs``, ``stop_at_epoch``, ``log_every``). The names, defaults and checks
    (`cookbook.loop.NonFinitePolicy.settings`) are those of `cookbook.config.TrainConfig`."""

    on_nonfinite: str = "stop"  # a step with a NaN/inf loss or gradient norm: stop (exit 4) or skip (drop its batch, go on)
    max_consecutive_skips: int = 5  # on_nonfinite=skip: the run stops at one more non-finite step in a row
    collective_timeout_s: float = 1800.0  # a collective waiting longer ends the run, naming the worker that is behind


@dataclass
class EpochRunConfig:
    """The top level of an epoch-based Ray recipe's schema; the recipe's ``Config`` subclasses it and adds
    ``model``, ``data``, ``optim`` and ``train`` (a subclass of `EpochTrainConfig`, with ``epochs``,
    ``stop_at_epoch``, ``log_every``)."""

    output_dir: str = "outputs/run"  # Ray's run folder: checkpoints, metrics, MLflow (shared storage on several nodes)
    run_name: str = "run"  # the trackers' run name
    mlflow: bool = True  # false: no MLflow, whatever `trackers` says
    trackers: list[str] = field(default_factory=lambda: ["mlflow"])  # beside metrics.jsonl: cookbook.config.TRACKERS
    ray: RayConfig = field(default_factory=RayConfig)
    checkpoint: EpochCheckpointConfig = field(default_factory=EpochCheckpointConfig)
    train: EpochTrainConfig = field(default_factory=EpochTrainConfig)


# Settings of an epoch-based Ray recipe that may differ between a checkpoint and the run that resumes it.
EPOCH_MAY_CHANGE = ("output_dir", "run_name", "mlflow", "trackers", "ray.*", "train.stop_at_epoch", "train.log_every",
                    "train.on_nonfinite", "train.max_consecutive_skips", "train.collective_timeout_s", "checkpoint.*")


class RecipeError(RuntimeError):
    """An exception of a class defined in the recipe's ``train.py`` (its ``DataError``, say), raised in a
    Ray worker and re-raised as this: the driver and Ray's controller cannot import the recipe module
    under the worker's name, so the original could not be sent back. The message starts with the
    original class name; the worker's traceback is in the run's log."""


# ----------------------------------------------------------------------------- the driver of a recipe
class RayDriver:
    """A Ray recipe's driver: the checks before Ray starts, then the bookkeeping around ``TorchTrainer.fit``.

    Args:
        cfg: the recipe's config dataclass: ``output_dir``, ``ray`` (`RayConfig`), ``checkpoint.keep_last``.
        may_change: dotted config keys a resume may change (a key ending in ``.*``: a whole section).
        stop_at: ``(key, value)`` of the run's stop setting, ``("train.stop_at_epoch", 1)`` or
            ``("train.stop_at_step", 8)``; its last word is the unit the run checkpoints in.

    Attributes:
        nnodes: ``COOKBOOK_NNODES`` (launch.sh's NNODES).
        resume: the checkpoint a run resumes from, or ``None``; ``meta``: its ``meta.json``.
        workers, use_gpu: as planned on this machine; ``None`` when joining ``RAY_ADDRESS`` or on
            several nodes (only the cluster knows its size); inside `started`, the worker group's.

    Raises:
        ConfigError: see `check_output_dir` and `plan_workers`; a bad ``train.on_nonfinite`` or
            ``train.max_consecutive_skips`` (`cookbook.loop.NonFinitePolicy.settings`); a
            ``train.collective_timeout_s`` that is not positive.
        CheckpointError: the newest checkpoint was written with other settings or by another number of
            workers, or the stop point is not after it (`ResumeGuard.check`).
    """

    def __init__(self, cfg: Any, may_change: tuple[str, ...], stop_at: tuple[str, int]):
        self.cfg = cfg
        NonFinitePolicy.settings(cfg.train)  # train.on_nonfinite, train.max_consecutive_skips: before Ray starts
        timeout_s = getattr(cfg.train, "collective_timeout_s", None)
        if timeout_s is not None and not timeout_s > 0:
            raise ConfigError(f"train.collective_timeout_s must be > 0 seconds, got {timeout_s:g}")
        self.nnodes = int(os.environ.get("COOKBOOK_NNODES", "1"))
        check_output_dir(cfg.output_dir, self.nnodes)
        self.unit = stop_at[0].rsplit("_", 1)[-1]
        self.guard = _RayCheckpoints(cfg.output_dir, self.unit)
        self.resume = _check_resume(self.guard, getattr(cfg.checkpoint, "resume", "auto"), to_dict(cfg), may_change,
                                    stop_at)
        self.meta = read_meta(self.resume) if self.resume is not None else None
        planned = _plan_workers_locally(cfg.ray, self.nnodes)
        self.workers, self.use_gpu = planned if planned is not None else (None, None)
        if self.workers is not None and self.resume is not None:
            self.guard.check_world_size(self.resume, self.meta, self.workers)

    @property
    def on_cpu(self) -> bool:
        """Whether the workers will train on CPUs (as planned here, else as ``ray.use_gpu`` says)."""
        return not self.use_gpu if self.use_gpu is not None else self.cfg.ray.use_gpu is False

    def already_complete(self, total: int | None, outputs: Mapping[str, str | Path] = {}) -> bool:
        """Whether the newest checkpoint ends the run and its `outputs` exist; if so, say so (stderr).

        Args:
            total: the run's epochs or steps (the unit of ``stop_at``); ``None``: not known before the
                workers start, the checkpoint and `outputs` decide.
            outputs: what a finished run wrote, e.g. ``{"model": <output_dir>/final}``.
        """
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
        """The recipe's ``TorchTrainer(...).fit()`` goes in this block. It holds the lock of ``output_dir`` (one run
        per folder, `cookbook.run_lock`), starts or joins Ray (`init_ray`), sizes the worker group on the cluster
        (`resolve_workers`: `workers`, `use_gpu`), checks that count against the checkpoint and the storage
        (`check_shared_storage`), and turns SIGTERM / SIGUSR1 into a stop request to the workers (`loop_config`'s
        ``stop_key``; a second signal ends the driver at once).

        Raises:
            CollectiveTimeout: a worker's collective waited past ``train.collective_timeout_s`` (``TorchConfig``'s
                ``timeout_s``) and Ray ended the run (no restart left): one line naming that worker and the
                stalled one (`cookbook.dist.describe_stall`; exit 3).
        """
        lock = run_lock.acquire(self.cfg.output_dir, os.environ.get("NODE_RANK", "0"))
        try:
            init_ray(self.cfg.ray, self.workers or 0)
            self.workers, self.use_gpu = resolve_workers(self.cfg.ray, self.nnodes)
            if self.resume is not None:
                self.guard.check_world_size(self.resume, self.meta, self.workers)
            check_shared_storage(self.cfg.output_dir)
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
        """``train_loop_config`` for `worker_entry`: the recipe file `script` (``__file__``, at the same path on every
        node), the config as a plain dict, the checkpoint announced (``resuming from ...``) and the stop key."""
        return {"script": str(Path(script).resolve()), "config": to_dict(self.cfg), "stop_key": self._stop.key,
                "announced": self.resume.name if self.resume is not None else None}

    @property
    def resources_per_worker(self) -> dict[str, float]:
        """``ScalingConfig.resources_per_worker``: ``ray.cpus_per_worker`` CPUs, and a GPU when the workers use GPUs."""
        return {"CPU": self.cfg.ray.cpus_per_worker, **({"GPU": 1} if self.use_gpu else {})}

    def finish(self, result: Any) -> Any:
        """Say how the run ended (stderr) and return Ray's ``Result``.

        Raises:
            NonFiniteError: the workers stopped at a non-finite step (`cookbook.ray_train.WorkerRun.skip_step`);
                its message names the step and the newest checkpoint (`cookbook.run_main`: one line, exit 4).
            Preempted: the workers stopped on SIGTERM / SIGUSR1 after a checkpoint (exit 75).
            CheckpointSaveError: a checkpoint could not be saved (`cookbook.ray_train.WorkerRun.checkpoint`): its
                one line (a `CheckpointError`: exit 2, as the torchrun recipes').
        """
        returned = result.return_value if isinstance(result.return_value, dict) else {}
        if returned.get(DIVERGED):
            raise NonFiniteError(returned[DIVERGED])
        if returned.get(SAVE_FAILED):
            error = CheckpointSaveError(returned[SAVE_FAILED][0])
            error.errno = returned[SAVE_FAILED][1]
            raise error
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
    """The `CollectiveTimeout` a worker raised (`worker_entry`) among the failures of Ray's ``WorkerGroupError``
    `exc`, naming that worker, or ``None``."""
    for rank, failure in sorted((getattr(exc, "worker_failures", None) or {}).items()):
        failure = getattr(failure, "_base_exc", failure)  # Ray's UserExceptionWithTraceback around it
        if isinstance(failure, CollectiveTimeout):
            return CollectiveTimeout(f"Ray Train worker {rank}: {failure}")
    return None


class _StopOnSignal:
    """While the run goes on (a ``with`` block in the main thread, Ray connected): the first SIGTERM or SIGUSR1
    asks the workers to stop (`request_stop` under `key`, from a thread: no Ray call inside a signal handler),
    a second one ends the process at once. ``signum``: the first signal, or ``None``."""

    def __init__(self) -> None:
        self.key = f"cookbook-stop-{uuid.uuid4().hex}"
        self.signum: int | None = None
        self._asked, self._done = threading.Event(), threading.Event()
        self._previous: dict = {}

    def __enter__(self) -> _StopOnSignal:
        def on_signal(signum, frame):
            if self.signum is not None:  # the second: at once
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            self.signum = signum
            self._asked.set()

        def ask() -> None:
            while not self._done.is_set():
                if self._asked.wait(0.2):
                    print(f"{signal.Signals(self.signum).name}: the workers stop after their next step and save a "
                          f"checkpoint (send it again to stop at once)", file=sys.stderr)
                    request_stop(self.key)
                    return

        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, on_signal) for sig in PREEMPT_SIGNALS}
        self._thread = threading.Thread(target=ask, name="cookbook-stop", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
        self._done.set()
        self._thread.join(timeout=5)
        if self.signum is not None:
            from ray.experimental.internal_kv import _internal_kv_del

            _internal_kv_del(self.key)


def request_stop(key: str) -> None:
    """Ask the workers of the run that got `key` (`RayDriver.loop_config`'s ``stop_key``) to stop after their next step and save a
    checkpoint there (`cookbook.ray_train.WorkerRun`): sets `key` in Ray's key-value store, which rank 0 reads
    (`cookbook.ray_train.worker.stop_requested`). Needs Ray connected (``ray.init``)."""
    from ray.experimental.internal_kv import _internal_kv_put

    _internal_kv_put(key, b"1")


# ----------------------------------------------------------------------------- resume
class _RayCheckpoints(ResumeGuard):
    """Ray Train's checkpoint folders ``checkpoint_<unit>_<n>`` (``state.pt``, ``meta.json``) in the run
    folder, under cookbook's resume guard. The workers' global batch depends on their count, so another
    count is refused.

    `latest` is the checkpoint a re-run resumes from: the newest in Ray Train's snapshot
    (``checkpoint_manager_snapshot.json``), the one ``ray.train.get_checkpoint()`` returns to the workers,
    and nothing without a snapshot (Ray then starts afresh). Ray registers a reported checkpoint once
    every worker has reported it, so after an interruption the folder of a later checkpoint can exist on
    disk, complete, although Ray will not resume from it (and none may be registered yet).
    """

    def __init__(self, output_dir: str | Path, unit: str):
        super().__init__(output_dir, folder=f"checkpoint_{unit}_<n>", files=(_STATE_FILE,), run_dir=output_dir,
                         processes="workers", same_size="ray.num_workers={n}",
                         cannot_remap="the global batch, learning rate and steps per epoch would change mid-run")

    def latest(self) -> Path | None:
        """The newest checkpoint Ray Train registered in the run folder, or ``None`` (no snapshot, or none
        registered in it). One found damaged (`ResumeGuard.verify`: a truncated ``state.pt`` does not match
        its checksum) gives way to the newest earlier one Ray registered; `register` then makes it Ray's.

        Raises:
            CheckpointError: the snapshot is unreadable, was written by another Ray version (Ray refuses
                both), or names a folder that is not a complete checkpoint.
        """
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
        """Make `path` the checkpoint Ray resumes from: rewrite the snapshot (atomically) without the damaged
        ones registered after it. Ray writes their folders again when the run reaches them."""
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
    """`ResumeGuard.check` of ``checkpoint.resume`` before the worker count is known; says which checkpoint
    the run resumes from, and which later folders Ray had not registered.

    Ray Train resumes a run from the newest checkpoint it registered in the run folder, so ``resume`` is
    ``auto`` (that one), ``none`` (refused over an earlier run's checkpoints, as everywhere) or that same folder.

    Raises:
        CheckpointError: see `ResumeGuard.check`; or another folder than the one Ray resumes from.
    """
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
def check_output_dir(output_dir: str, nnodes: int) -> None:
    """Refuse an ``output_dir`` that cannot be Ray's storage; cheap, call before `init_ray`.

    A URI (``s3://...``) is refused: the recipes write metrics and MLflow files with plain file
    I/O, so use a shared file system mount. With several nodes the parent folder must exist
    already (it is the shared mount; a typo would otherwise create a local folder on one node).

    Raises:
        ConfigError: naming ``output_dir`` and what to do.
    """
    if "://" in output_dir:
        raise ConfigError(f"output_dir={output_dir!r}: use a folder on a shared file system (NFS, Lustre, a "
                          f"mounted bucket), not a URI")
    parent = Path(output_dir).expanduser().resolve().parent
    if nnodes > 1 and not parent.is_dir():
        raise ConfigError(f"output_dir={output_dir!r}: the folder {parent} does not exist. With {nnodes} nodes "
                          f"output_dir must be on storage every node mounts; create it there first")


def init_ray(cfg: RayConfig, num_workers: int) -> None:
    """Join the cluster at ``RAY_ADDRESS``, or start a local Ray instance (session files in
    ``cfg.temp_dir`` when set) that declares at least `num_workers` x ``cpus_per_worker`` +
    ``reserve_cpus`` CPUs. The dashboard is off."""
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
    """``(num_workers, use_gpu)`` for a cluster of `gpus` GPUs and `cpus` CPUs.

    Raises:
        ConfigError: ``ray.use_gpu=true`` without GPUs, or more workers than GPUs or CPUs
            (``ray.num_workers`` x ``ray.cpus_per_worker``).
    """
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
    """`plan_workers` against this machine, before Ray starts (None when joining ``RAY_ADDRESS``
    or on several nodes, where only the cluster knows its size)."""
    if os.environ.get("RAY_ADDRESS") or nnodes > 1:
        return None
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return plan_workers(cfg, gpus, os.cpu_count() or 1)


def resolve_workers(cfg: RayConfig, nnodes: int = 1) -> tuple[int, bool]:
    """`plan_workers` against the running Ray cluster, after waiting up to ``cfg.join_timeout_s``
    for `nnodes` nodes (the launch script's NNODES) to join.

    Raises:
        ConfigError: too few nodes joined in time, or see `plan_workers`.
    """
    import ray

    deadline = time.monotonic() + cfg.join_timeout_s
    while (alive := len([n for n in ray.nodes() if n["Alive"]])) < nnodes:
        if time.monotonic() > deadline:
            raise ConfigError(f"only {alive} of NNODES={nnodes} Ray nodes joined within ray.join_timeout_s="
                              f"{cfg.join_timeout_s:g}: start launch.sh on every node")
        time.sleep(2.0)
    res = ray.cluster_resources()
    return plan_workers(cfg, int(res.get("GPU", 0)), int(res.get("CPU", 0)))


def check_shared_storage(output_dir: str) -> None:
    """On a cluster of several nodes, check that every node sees the same `output_dir`.

    Writes a marker file with a random token on the driver's node and reads it back from a task
    pinned to each node. Refuses a node-local path before training starts (Ray would otherwise
    write each node's checkpoints to its own disk, and a resume would miss them).

    Raises:
        ConfigError: a node cannot read the marker; the message names the node.
    """
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


def worker_entry(loop_config: dict) -> dict[str, str] | None:
    """Import the recipe's train.py by path in the worker and call its ``train_loop(config)``; returns
    ``{DIVERGED: message}`` when it stopped at a non-finite step (`NonFiniteError`, raised alike on every
    worker), ``{SAVE_FAILED: (message, errno)}`` when a checkpoint could not be saved (`CheckpointSaveError`), else
    ``None``. The divergence is returned, not raised, so that Ray does not restart the workers
    for it (``ray.max_failures``): they would resume from the same checkpoint and diverge at the same step. A
    collective that timed out (``train.collective_timeout_s``: another worker stalled) is raised as
    `cookbook.dist.CollectiveTimeout`, whose line names the stalled worker (`cookbook.dist.describe_stall`).

    Importing by path (rather than letting Ray pickle the driver's ``__main__`` by value) gives
    the recipe's config dataclasses a real module, which OmegaConf needs to read their type hints.
    The checkpoint the driver announced (``loop_config["announced"]``) is what the worker's
    `cookbook.ray_train.load_checkpoint` checks Ray's against.
    """
    import importlib.util

    from cookbook.ray_train import worker

    worker._announced = loop_config.get("announced")
    worker._stop_key = loop_config.get("stop_key")
    script = loop_config["script"]
    name = f"cookbook_recipe_{abs(hash(script))}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    try:
        sys.modules[name].train_loop(loop_config["config"])
    except NonFiniteError as exc:
        return {DIVERGED: str(exc)}
    except CheckpointSaveError as exc:  # returned, not raised: a restart would meet the same full disk
        return {SAVE_FAILED: (str(exc), exc.errno)}
    except Exception as exc:
        stalled = stall_error(exc)  # raised: Ray restarts the group (ray.max_failures) or the driver says it
        if stalled is not None:
            raise stalled from exc
        if type(exc).__module__ != name:
            raise
        raise RecipeError(f"{type(exc).__name__}: {exc}") from None
    return None
