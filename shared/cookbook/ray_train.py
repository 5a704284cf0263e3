"""Ray Train plumbing shared by the Ray recipes (https://docs.ray.io/en/latest/train/train.html).

A Ray recipe's driver (``python train.py``) validates its config, then calls `init_ray` (start a
local Ray instance, or join the cluster named by ``RAY_ADDRESS``), `check_cluster` (wait for the
nodes the launch script announced, refuse more workers than the cluster has CPUs or GPUs for,
check that the storage folder is shared) and `fit`, which runs the recipe's per-worker function
with ``TorchTrainer`` (one process per GPU, DDP process group set up by Ray Train).

Inside a worker, `worker_info` gives the same `DistInfo` torchrun recipes get (and rank-0-only
logging); `report` sends metrics and, from rank 0, a checkpoint folder written with `torch.save`
to Ray; `load_checkpoint` returns the newest one after a restart (``FailureConfig``) or a re-run
with the same ``output_dir`` (Ray resumes a run from its storage folder and name). "Newest" is
Ray's: the newest checkpoint its snapshot file lists (`latest_checkpoint`), which the driver's
checks (`check_resume`, `check_resume_world_size`) read too, so they agree with what the workers
load. An exception of a class defined in the recipe reaches the driver as `RecipeError`.

Layout: ``output_dir`` is Ray's run folder (``storage_path`` = its parent, ``name`` = its last
part), so checkpoints (``checkpoint_<label>/``), ``metrics.jsonl`` and the MLflow store sit side
by side. With several nodes it must be on storage every node mounts.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist

from cookbook.checkpoint import config_changes
from cookbook.config import ConfigError, to_dict
from cookbook.dist import DistInfo, _configure_logging, get_logger

STATE_FILE = "state.pt"
META_FILE = "meta.json"


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


def storage_of(output_dir: str | Path) -> tuple[str, str]:
    """``(storage_path, name)`` for ``RunConfig`` so that Ray's run folder is `output_dir` itself."""
    out = Path(output_dir).expanduser().resolve()
    return str(out.parent), out.name


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


def plan_workers_locally(cfg: RayConfig, nnodes: int) -> tuple[int, bool] | None:
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


class RecipeError(RuntimeError):
    """An exception of a class defined in the recipe's ``train.py`` (its ``DataError``, say), raised in a
    Ray worker and re-raised as this: the driver and Ray's controller cannot import the recipe module
    under the worker's name, so the original could not be sent back. The message starts with the
    original class name; the worker's traceback is in the run's log."""


def _worker_entry(loop_config: dict) -> None:
    """Import the recipe's train.py by path in the worker and call its ``train_loop(config)``.

    Importing by path (rather than letting Ray pickle the driver's ``__main__`` by value) gives
    the recipe's config dataclasses a real module, which OmegaConf needs to read their type hints.
    """
    import importlib.util
    import sys

    script = loop_config["script"]
    name = f"cookbook_recipe_{abs(hash(script))}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    try:
        sys.modules[name].train_loop(loop_config["config"])
    except Exception as exc:
        if type(exc).__module__ != name:
            raise
        raise RecipeError(f"{type(exc).__name__}: {exc}") from None


def fit(script: str, config: Mapping[str, Any], output_dir: str, cfg: RayConfig, num_workers: int,
        use_gpu: bool, keep_last: int = 2) -> Any:
    """Run the function ``train_loop(config)`` of the recipe file `script` on `num_workers` Ray Train
    workers with DDP; returns the ``Result``. `script` must exist at the same path on every node;
    `config` is the run's config as a plain dict (rebuild it with `config_from_dict`).

    ``output_dir`` is the run folder (see the module docstring); a second call with the same one
    resumes from its newest checkpoint. Raises the training error when the run failed after
    ``cfg.max_failures`` restarts. `keep_last` newest checkpoints are kept (0: all).
    """
    from ray.train import CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    storage_path, name = storage_of(output_dir)
    trainer = TorchTrainer(
        _worker_entry,
        train_loop_config={"script": str(Path(script).resolve()), "config": dict(config)},
        scaling_config=ScalingConfig(num_workers=num_workers, use_gpu=use_gpu,
                                     resources_per_worker={"CPU": cfg.cpus_per_worker, **({"GPU": 1} if use_gpu else {})}),
        run_config=RunConfig(name=name, storage_path=storage_path, failure_config=FailureConfig(max_failures=cfg.max_failures),
                             checkpoint_config=CheckpointConfig(num_to_keep=keep_last or None)),
    )
    return trainer.fit()


def prepare_driver(cfg: Any, may_change: tuple[str, ...], stop_at: tuple[str, int]) -> tuple[int, dict | None, tuple[int, bool] | None]:
    """The driver's checks before Ray starts, common to the Ray recipes: `check_output_dir`,
    `check_resume` and `plan_workers_locally` for a recipe config with ``output_dir`` and ``ray``.

    Args:
        cfg: the recipe's config dataclass.
        may_change, stop_at: as for `check_resume`.

    Returns:
        ``(nnodes, newest checkpoint's meta or None, (workers, use_gpu) planned on this machine or None)``;
        nnodes comes from ``COOKBOOK_NNODES`` (launch.sh's NNODES).

    Raises:
        ConfigError: see the three checks.
    """
    nnodes = int(os.environ.get("COOKBOOK_NNODES", "1"))
    check_output_dir(cfg.output_dir, nnodes)
    done = check_resume(cfg.output_dir, to_dict(cfg), may_change, stop_at)
    planned = plan_workers_locally(cfg.ray, nnodes)
    if planned is not None:
        check_resume_world_size(cfg.output_dir, done, planned[0])
    return nnodes, done, planned


def check_resume_world_size(output_dir: str, meta: Mapping[str, Any] | None, num_workers: int) -> None:
    """Refuse to resume a checkpoint written by another number of workers: the global batch, the
    learning rate scaled from it and the steps per epoch would change in the middle of the run.

    Raises:
        ConfigError: `meta` (a checkpoint's ``meta.json``) records another ``world_size``.
    """
    if meta is not None and meta.get("world_size", num_workers) != num_workers:
        raise ConfigError(f"{output_dir}: its newest checkpoint was written by {meta['world_size']} workers and this run "
                          f"has {num_workers}: the global batch, learning rate and steps per epoch would change mid-run. "
                          f"Resume with ray.num_workers={meta['world_size']}, or use a new output_dir")


def run(script: str, cfg: Any, nnodes: int, planned: tuple[int, bool] | None) -> Any:
    """Start or join Ray (`init_ray`), size the worker group (`resolve_workers`), check the storage
    (`check_shared_storage`), train (`fit`) and say where the results are; returns Ray's ``Result``.

    Args:
        script: the recipe's ``train.py`` (``__file__``), which defines ``train_loop(config)``.
        cfg: the recipe's config dataclass (``output_dir``, ``ray``, ``checkpoint.keep_last``).
        nnodes, planned: from `prepare_driver`.
    """
    init_ray(cfg.ray, planned[0] if planned else 0)
    num_workers, use_gpu = resolve_workers(cfg.ray, nnodes)
    if planned is None:  # otherwise prepare_driver checked it against the same count
        check_resume_world_size(cfg.output_dir, latest_meta(cfg.output_dir), num_workers)
    check_shared_storage(cfg.output_dir)
    result = fit(script, to_dict(cfg), cfg.output_dir, cfg.ray, num_workers, use_gpu, cfg.checkpoint.keep_last)
    print(f"done: {result.metrics} | checkpoint {result.checkpoint.path if result.checkpoint else None} | metrics "
          f"{Path(cfg.output_dir) / 'metrics.jsonl'}", file=sys.stderr)
    return result


# ----------------------------------------------------------------------------- inside a worker
def config_from_dict(schema: type, data: Mapping[str, Any]) -> Any:
    """The recipe's config dataclass from the plain dict `fit` sent (a worker's first call)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(data)))


def worker_info() -> DistInfo:
    """This Ray Train worker's rank, local rank, world size and device, as a `DistInfo`; also
    switches the ``cookbook`` logger to INFO from rank 0 only (warnings from every rank)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    backend = dist.get_backend() if dist.is_initialized() else ("nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_world_size(), device, backend)
    _configure_logging(info.rank)
    return info


def report(metrics: Mapping[str, float], state: Mapping[str, Any] | None = None, label: str | None = None,
           meta: Mapping[str, Any] | None = None) -> None:
    """``ray.train.report`` on every worker; rank 0 also saves `state` as a checkpoint.

    Collective: every worker must call it the same number of times (it is Ray Train's barrier).

    Args:
        metrics: numbers attached to the report (rank 0's are kept by Ray).
        state: on rank 0, the objects to checkpoint (state dicts, ints); ``None``: metrics only.
            Other ranks' `state` is ignored (DDP replicas are identical).
        label: the checkpoint folder is ``checkpoint_<label>`` (e.g. ``epoch_0003``).
        meta: JSON facts written beside the state as ``meta.json`` (step, epoch, config).
    """
    import ray.train
    from ray.train import Checkpoint

    rank = ray.train.get_context().get_world_rank()
    if state is None or rank != 0:
        ray.train.report(dict(metrics))
        return
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(dict(state), Path(tmp) / STATE_FILE)
        (Path(tmp) / META_FILE).write_text(json.dumps(dict(meta or {}), indent=2))
        ray.train.report(dict(metrics), checkpoint=Checkpoint.from_directory(tmp),
                         checkpoint_dir_name=f"checkpoint_{label}" if label else None)
    get_logger().info(f"checkpoint saved: {label or ''} ({', '.join(f'{k} {v}' for k, v in (meta or {}).items() if k != 'config')})")


def load_checkpoint(map_location: torch.device | str = "cpu") -> tuple[dict[str, Any], dict[str, Any]] | None:
    """The newest checkpoint of this run as ``(state, meta)``, or ``None`` on a fresh start.

    On the CPU (the default) the file is memory-mapped (``torch.load(mmap=True)``): the workers of
    a node share one copy in the page cache instead of each reading the whole state (model and
    optimizer: 12 bytes per parameter for AdamW in fp32) into its own memory or GPU. Copy the values
    into the model and optimizer with ``load_state_dict``, then drop `state`."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        state = torch.load(Path(d) / STATE_FILE, map_location=map_location, weights_only=False,
                           mmap=torch.device(map_location).type == "cpu")
        meta = json.loads((Path(d) / META_FILE).read_text())
    get_logger().info(f"resumed from {ckpt.path} ({', '.join(f'{k} {v}' for k, v in meta.items() if k != 'config')})")
    return state, meta


SNAPSHOT_FILE = "checkpoint_manager_snapshot.json"  # Ray Train's record of the run's registered checkpoints


def complete_checkpoints(output_dir: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """``(folder name, meta)`` of every checkpoint folder under `output_dir` that holds both files,
    oldest first (by step), whether or not Ray registered it."""
    root, found = Path(output_dir), []
    if root.is_dir():
        for p in root.glob("checkpoint_*"):
            if (p / META_FILE).is_file() and (p / STATE_FILE).is_file():
                found.append((p.name, json.loads((p / META_FILE).read_text())))
    return sorted(found, key=lambda item: item[1].get("step", 0))


def latest_checkpoint(output_dir: str | Path) -> tuple[str, dict[str, Any]] | None:
    """``(folder name, meta)`` of the checkpoint a re-run with this `output_dir` resumes from, or
    ``None`` for a fresh start (no Ray needed).

    That is the newest checkpoint in Ray Train's snapshot (``checkpoint_manager_snapshot.json``),
    the one ``ray.train.get_checkpoint()`` returns to the workers. Ray registers a reported
    checkpoint once every worker has reported it, so after an interruption the folder of a later
    checkpoint can exist on disk although Ray will not resume from it. Without a readable
    snapshot (a run that stopped before its first checkpoint, or a Ray version that writes
    another format) the newest complete folder on disk is taken.
    """
    root = Path(output_dir)
    try:
        latest = json.loads((root / SNAPSHOT_FILE).read_text()).get("latest_checkpoint_result")
    except (OSError, ValueError, AttributeError):
        found = complete_checkpoints(root)
        return found[-1] if found else None
    name = (latest or {}).get("checkpoint_dir_name")
    if not name or not (root / name / META_FILE).is_file():
        return None
    return name, json.loads((root / name / META_FILE).read_text())


def latest_meta(output_dir: str | Path) -> dict[str, Any] | None:
    """``meta.json`` of `latest_checkpoint`, or ``None``."""
    latest = latest_checkpoint(output_dir)
    return latest[1] if latest else None


def check_resume(output_dir: str, config: Mapping[str, Any], may_change: tuple[str, ...], stop_at: tuple[str, int]) -> dict | None:
    """Refuse, before Ray starts, a re-run that would mix two runs in one ``output_dir``.

    Args:
        output_dir: the run folder.
        config: this run's config (nested dict); compared with the one in the newest checkpoint.
        may_change: dotted keys allowed to differ; a key ending in ``.*`` allows a section.
        stop_at: ``(key, value)`` of the run's stop setting (``("train.stop_at_epoch", 1)``); when
            > 0 it must be after the checkpoint's value of that unit.

    Returns:
        The newest checkpoint's meta, or ``None``.

    Raises:
        ConfigError: the settings differ (the message lists them), or the stop point is not after the checkpoint.
    """
    latest = latest_checkpoint(output_dir)
    if latest is None:
        return None
    name, meta = latest
    diff = config_changes(meta.get("config", {}), config, may_change)
    if diff:
        raise ConfigError(f"{output_dir} holds checkpoints written with other settings ({diff}); resuming would mix "
                          f"two runs. Use the same settings or a new output_dir")
    key, value = stop_at
    unit = key.rsplit("_", 1)[-1]
    if 0 < value <= meta.get(unit, 0):
        raise ConfigError(f"{key}={value} is not after the newest checkpoint in {output_dir} ({unit} {meta[unit]}): "
                          f"raise it, or remove it to train to the end")
    later = [n for n, m in complete_checkpoints(output_dir) if m.get("step", 0) > meta.get("step", 0)]
    print(f"resuming from {Path(output_dir) / name} ({unit} {meta.get(unit)})"
          + (f"; {', '.join(later)} were written after it but not registered by Ray before the run stopped, "
             f"and will be replaced" if later else ""), file=sys.stderr)
    return meta


def worker_summary(model: torch.nn.Module, reports: int) -> dict[str, list]:
    """What every worker did, gathered on all of them (collective): ``reports_per_worker`` (calls
    of `report`; equal counts mean no worker fell behind) and ``param_fingerprints`` (equal values
    mean the DDP replicas stayed identical)."""
    from cookbook.dist import all_gather_object, param_fingerprint

    return {"reports_per_worker": all_gather_object(reports), "param_fingerprints": all_gather_object(param_fingerprint(model))}
