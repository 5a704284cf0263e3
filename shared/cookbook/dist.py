"""Process-group set-up and tear-down from torchrun's environment, and small rank helpers.

torchrun (https://pytorch.org/docs/stable/elastic/run.html) exports RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT to every worker. `init_distributed` reads them,
picks NCCL on CUDA and gloo on CPU, binds the worker to its GPU, and registers the
group's destruction at exit. `distributed_context` does the same as a context manager
that also tears the group down when the body raises.

A plain `python train.py` (no torchrun) runs as a world of one, with a process group of one.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import logging
import os
import socket
import sys
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

logger = logging.getLogger("cookbook")


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits in the job.

    Attributes:
        rank: global rank, 0 .. world_size - 1.
        local_rank: rank on this node; also the CUDA device index.
        world_size: number of processes in the job.
        device: the torch device this rank computes on (``cuda:<local_rank>`` or ``cpu``).
        backend: ``"nccl"`` or ``"gloo"``.
    """

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes shared files."""
        return self.rank == 0

    @property
    def num_gpus(self) -> int:
        """GPUs in the job (0 on CPU)."""
        return self.world_size if self.device.type == "cuda" else 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def get_dist_info() -> DistInfo:
    """Read rank, local rank and world size from the environment, without creating a group.

    Returns:
        A `DistInfo` whose `backend` is the one `init_distributed` would choose.

    Raises:
        RuntimeError: CUDA is present but this node has fewer GPUs than local ranks
            (e.g. ``NGPU=8`` on a 2-GPU node).
    """
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    force_cpu = os.environ.get("COOKBOOK_DEVICE", "").lower() == "cpu"
    if torch.cuda.is_available() and not force_cpu:
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has {n} GPU(s): start at most {n} "
                f"processes per node (NGPU={n})"
            )
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    return DistInfo(rank, local_rank, world_size, device, backend)


def init_distributed(timeout_minutes: float = 30.0) -> DistInfo:
    """Create the default process group from torchrun's environment.

    NCCL when CUDA is available (each rank bound to ``cuda:LOCAL_RANK``), gloo otherwise.
    Set ``COOKBOOK_DEVICE=cpu`` to force CPU/gloo on a GPU machine. A plain ``python train.py``
    (no torchrun, so no MASTER_ADDR) gets a group of one on a free local port, so DDP and
    collectives work unchanged. The group is destroyed at interpreter exit (``atexit``); call
    `destroy_distributed` earlier if you like.

    Args:
        timeout_minutes: collective timeout; a hung peer raises after this long.

    Returns:
        This process's `DistInfo`.

    Raises:
        RuntimeError: more local ranks than GPUs on the node (see `get_dist_info`).
    """
    info = get_dist_info()
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if "MASTER_ADDR" not in os.environ and info.world_size == 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    if not dist.is_initialized():
        # Binding the device id lets NCCL create its communicator eagerly and pick the right GPU.
        kwargs = {"device_id": info.device} if info.device.type == "cuda" else {}
        dist.init_process_group(
            backend=info.backend,
            timeout=datetime.timedelta(minutes=timeout_minutes),
            **kwargs,
        )
        atexit.register(destroy_distributed)
    _configure_logging(info.rank)
    return info


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Process groups destroyed by `destroy_distributed`, kept referenced until the process ends (see there).
_DESTROYED_GROUPS: list = []


def destroy_distributed() -> None:
    """Destroy the default process group if one exists (safe to call twice).

    The group object itself is kept referenced until the process ends. A DDP reducer or an FSDP
    mesh still holds it, and without this reference the group's C++ destructor would run whenever
    the last such object is freed (often when ``main`` returns), joining gloo's worker threads
    while the caller holds the GIL. A worker thread that is still releasing the tensors of the last
    collective needs the GIL for that: the two wait for each other forever (seen at the end of 2 of
    4 CPU runs of a DDP recipe; the worker thread in ``~AsyncAllgatherWork``, the main thread in
    ``~ProcessGroupGloo`` under ``~Reducer``). Recipes end with `cookbook.run_main`, which exits
    without freeing it at all.
    """
    if dist.is_available() and dist.is_initialized():
        world = getattr(dist.distributed_c10d, "_world", None)  # every group: the default one and subgroups (meshes)
        _DESTROYED_GROUPS.extend(list(world.pg_map) if world is not None else [dist.group.WORLD])
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_context(timeout_minutes: float = 30.0) -> Iterator[DistInfo]:
    """``with distributed_context() as info:`` initialises the group and always destroys it,
    also when the body raises."""
    info = init_distributed(timeout_minutes)
    try:
        yield info
    finally:
        destroy_distributed()


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        # Warnings and errors from any rank get through, prefixed with the rank.
        if record.levelno >= logging.WARNING:
            record.msg = f"[rank{self.rank}] {record.msg}"
            return True
        return self.rank == 0


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted, not the one
    that was current when the handler was made (notebooks and test runners replace ``sys.stderr``)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure_logging(rank: int) -> None:
    root = logging.getLogger("cookbook")
    if any(getattr(h, "_cookbook", False) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler._cookbook = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def get_logger() -> logging.Logger:
    """The ``cookbook`` logger: INFO from rank 0 only, warnings and errors from every rank."""
    return logging.getLogger("cookbook")


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_mean(values: Mapping[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks in one collective.

    Args:
        values: metric name -> Python number or 0-d tensor (any device).
        device: the device of this rank's collective (``cuda:i`` for NCCL, ``cpu`` for gloo).

    Returns:
        name -> mean over ranks, as Python floats. Without a group, the inputs as floats.
    """
    return _all_reduce(values, device, mean=True)


def all_reduce_sum(values: Mapping[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Sum scalar metrics (counts, token totals) over ranks in one collective; see `all_reduce_mean`."""
    return _all_reduce(values, device, mean=False)


def _all_reduce(values: Mapping[str, float | torch.Tensor], device: torch.device, mean: bool) -> dict[str, float]:
    names = list(values)
    if not names:
        return {}
    flat = torch.stack(
        [v.detach().to(device=device, dtype=torch.float64).reshape(()) if isinstance(v, torch.Tensor)
         else torch.tensor(float(v), dtype=torch.float64, device=device) for v in values.values()]
    )
    if dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        if mean:
            flat /= dist.get_world_size()
    return dict(zip(names, flat.tolist()))


def all_gather_object(obj: object) -> list[object]:
    """Gather one picklable object from every rank; returns a list indexed by rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def param_fingerprint(model: torch.nn.Module, chunk: int = 1 << 24) -> list[float]:
    """Two float64 checksums of a model's parameters, to compare replicas across ranks.

    The first is the plain sum of all entries, the second a position-weighted sum
    (entry i of parameter p weighted by 1 + (i mod 97) / 97) so that swapped values change it.
    Identical parameters give identical fingerprints; DDP replicas that drifted apart do not.
    Works on plain tensors only (call it on a DDP module or an unwrapped model, not on
    FSDP-sharded DTensors).

    Computed where each parameter lives (the GPU for a model there), `chunk` entries at a time, so
    a model of billions of parameters takes well under a second on a GPU and at most
    ``chunk`` x 8 bytes x a few of temporary memory; values on different devices can differ in the
    last bits (summation order), so compare fingerprints computed on the same kind of device.

    Returns:
        ``[sum, weighted_sum]`` as Python floats.
    """
    total = weighted = None
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if total is None:
            total = torch.zeros((), dtype=torch.float64, device=flat.device)
            weighted = torch.zeros((), dtype=torch.float64, device=flat.device)
        for start in range(0, flat.numel(), chunk):
            part = flat[start:start + chunk].to(total.device, torch.float64)
            w = 1.0 + (torch.arange(start, start + part.numel(), dtype=torch.float64, device=total.device) % 97) / 97.0
            total += part.sum()
            weighted += (part * w).sum()
    if total is None:
        return [0.0, 0.0]
    return [total.item(), weighted.item()]
