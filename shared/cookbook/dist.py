"""Process-group set-up and tear-down from torchrun's environment (NCCL on CUDA, gloo on CPU; a plain ``python
train.py`` is a world of one), stall reports (`describe_stall`: the rank that timed out names the one behind, exit
status 3; docs/failures.md#a-rank-that-stalls) and small rank helpers."""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import os
import re
import socket
import threading
import time
import traceback
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FuturesTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Mapping

import torch
import torch.distributed as dist

from cookbook.errors import EXIT_PEER_LOST, OneLineError, chain
from cookbook.errors import first_line as _first_line
from cookbook.logs import configure_logging as _configure_logging
from cookbook.logs import get_logger  # re-exported: the modules above import it from here


@dataclass(frozen=True)
class DistInfo:
    """Where this process sits: global ``rank``, ``local_rank`` (CUDA index), ``world_size``, ``device``, ``backend``"""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        """True on global rank 0, the rank that logs and writes shared files."""
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name) or default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def get_dist_info() -> DistInfo:
    """A `DistInfo` from the environment, without creating a group. Raises RuntimeError: fewer GPUs than local ranks."""
    rank = _env_int("RANK", 0)
    local_rank = _env_int("LOCAL_RANK", 0)
    world_size = _env_int("WORLD_SIZE", 1)
    force_cpu = os.environ.get("COOKBOOK_DEVICE", "").lower() == "cpu"
    if torch.cuda.is_available() and not force_cpu:
        n = torch.cuda.device_count()
        if local_rank >= n:
            raise RuntimeError(
                f"LOCAL_RANK={local_rank} but this node has {n} GPU(s): start at most {n} processes per node (NGPU={n})"
            )
        device, backend = torch.device("cuda", local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    return DistInfo(rank, local_rank, world_size, device, backend)


class CollectiveTimeout(OneLineError):
    """A collective waited past the group's timeout; the message (`describe_stall`) names the rank behind (exit 3)."""

    exit_status = EXIT_PEER_LOST


# What `init_distributed` set up, for `describe_stall`; holder: (rank, pid, host) of a rank that serves the store.
_STALL = dict(timeout_s=None, debug_dir=None, store=None, step=None, host=socket.gethostname(), holder=None)
_PROGRESS_KEY, _TIMED_OUT_KEY = "cookbook/progress/{}", "cookbook/timed_out/{}"
# What gloo (CPU) and NCCL say when a collective waited past the group's timeout.
_TIMEOUT_MARKERS = ("timed out waiting", "application timeout caused pair closure", "collective operation timeout")
_FLIGHT_RECORDER_ENTRIES = 2000  # collectives each rank keeps in torch's flight recorder (NCCL), as torch advises


def init_distributed(timeout_s: float = 1800.0, debug_dir: str | Path | None = None) -> DistInfo:
    """Create the default process group (``COOKBOOK_DEVICE=cpu`` forces gloo); returns this process's `DistInfo`.
    `timeout_s`: seconds a collective may wait; `debug_dir`: NCCL's flight recorder and a timed-out rank's stacks.
    Raises ValueError (`timeout_s` not positive), RuntimeError (more local ranks than GPUs)."""
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    info = get_dist_info()
    if info.device.type == "cuda":
        torch.cuda.set_device(info.device)
    if "MASTER_ADDR" not in os.environ and info.world_size == 1:
        with socket.socket() as s:  # a free port of this host
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    timeout = datetime.timedelta(seconds=timeout_s)
    if info.backend == "nccl" and debug_dir is not None:
        _enable_flight_recorder(Path(debug_dir))
    if not dist.is_initialized():
        # Binding the device id lets NCCL create its communicator eagerly and pick the right GPU.
        kwargs = {"device_id": info.device} if info.device.type == "cuda" else {}
        dist.init_process_group(backend=info.backend, timeout=timeout, **kwargs)
        atexit.register(destroy_distributed)
    elif _STALL["timeout_s"] != timeout_s:
        dist.distributed_c10d._set_pg_timeout(timeout)  # the group `cookbook.distributed` made, with its own timeout
    _STALL.update(
        timeout_s=timeout_s, debug_dir=Path(debug_dir) if debug_dir is not None else None, store=None, step=None
    )
    _configure_logging(info.rank)
    before = _align_autograd_threads(info.device)  # else compiled code recomputed in backward recompiles
    if before is not None and before != torch.get_num_threads() and info.rank == 0:
        get_logger().info(
            f"autograd's {info.device} thread: {before} -> {torch.get_num_threads()} intra-op threads (as the "
            f"training thread: compiled graphs guard on it)"
        )
    return info


def set_collective_timeout(timeout_s: float, store_rank: int | None = None) -> None:
    """Give the default group that another runtime made (Ray Train) the collective timeout, as `init_distributed` does.
    `store_rank`: the rank whose process serves the store (Ray: 0) or None (torchrun's agent); its pid and host are
    gathered now (collective), so a timeout whose store does not answer names it. Raises ValueError (not positive)."""
    if not timeout_s > 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    holder = None
    if dist.is_available() and dist.is_initialized():
        dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s))
        if store_rank is not None and dist.get_world_size() > 1:
            box = [(os.getpid(), _STALL["host"]) if dist.get_rank() == store_rank else None]
            dist.broadcast_object_list(box, src=store_rank)
            holder = (store_rank, *box[0])
    _STALL.update(timeout_s=timeout_s, store=None, step=None, holder=holder)


def _align_autograd_threads(device: torch.device) -> int | None:
    """Give autograd's worker thread of `device` this thread's intra-op thread count; returns its previous count
    (None on CPU). docs/notes.md#recompiles-in-backward-under-activation-checkpointing-torch-213."""
    if device.type != "cuda":
        return None
    wanted, seen = torch.get_num_threads(), []

    def hook(grad: torch.Tensor) -> torch.Tensor:  # runs in the engine's thread for `device`
        seen.append(torch.get_num_threads())
        torch.set_num_threads(wanted)
        return grad

    y = torch.ones(1, device=device, requires_grad=True) * 2
    y.register_hook(hook)
    y.sum().backward()
    return seen[0] if seen else None


def apply_collective_timeout() -> None:
    """Give every process group that exists now (DeepSpeed's own ones too) the timeout `init_distributed` set."""
    timeout_s = _STALL["timeout_s"]
    if timeout_s is None or not (dist.is_available() and dist.is_initialized()):
        return
    for group in list(dist.distributed_c10d._world.pg_map):
        try:
            dist.distributed_c10d._set_pg_timeout(datetime.timedelta(seconds=timeout_s), group)
        except (ValueError, AssertionError, RuntimeError):  # a group this rank is not in
            pass


def _enable_flight_recorder(debug_dir: Path) -> None:
    """Turn on torch's NCCL flight recorder (both names of its variables), dumping into `debug_dir` on a timeout."""
    if not any(os.environ.get(k) for k in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")):
        os.environ["TORCH_FR_BUFFER_SIZE"] = os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] = str(_FLIGHT_RECORDER_ENTRIES)
    if not any(os.environ.get(k) for k in ("TORCH_FR_DUMP_TEMP_FILE", "TORCH_NCCL_DEBUG_INFO_TEMP_FILE")):
        debug_dir.mkdir(parents=True, exist_ok=True)
        os.environ["TORCH_FR_DUMP_TEMP_FILE"] = os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] = str(debug_dir / "rank_")
    os.environ.setdefault("TORCH_NCCL_DUMP_ON_TIMEOUT", "1")


def _store():
    """The default group's store (shared by every rank: torchrun's agent holds it), or ``None``."""
    if _STALL["store"] is None and dist.is_available() and dist.is_initialized():
        try:
            _STALL["store"] = dist.distributed_c10d._get_default_store()
        except (AttributeError, RuntimeError, ValueError):
            _STALL["store"] = False
    return _STALL["store"] or None


def record_progress(step: int) -> None:
    """Record in the group's store that this rank finished `step` steps, for `describe_stall`. Never raises."""
    _STALL["step"] = step
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2 or (store := _store()) is None:
        return
    try:
        store.set(_PROGRESS_KEY.format(dist.get_rank()), f"{step} {os.getpid()} {_STALL['host']}")
    except Exception:  # noqa: BLE001 - a diagnostic must not stop training
        _STALL["store"] = False


def last_finished_step() -> int | None:
    """The step this process last passed to `record_progress`, or ``None`` before the first."""
    return _STALL["step"]


def collective_timed_out(exc: BaseException) -> bool:
    """True if `exc` (or one it was raised from) is a collective that waited past the group's timeout (gloo, NCCL)."""
    return any(m in str(e).lower() for e in chain(exc) for m in _TIMEOUT_MARKERS)


def stall_error(exc: BaseException) -> CollectiveTimeout | None:
    """The `CollectiveTimeout` for `exc` when it is a collective that timed out among several ranks, else None.
    Call it before the group is destroyed (the line reads the ranks' progress from its store)."""
    if (
        isinstance(exc, OneLineError)
        or not (dist.is_available() and dist.is_initialized())
        or dist.get_world_size() < 2
        or not collective_timed_out(exc)
    ):
        return None
    return CollectiveTimeout(describe_stall(exc))


def describe_stall(exc: BaseException, grace_s: float | None = None) -> str:
    """One line for a collective that timed out on this rank: where it waited, and which rank stalled. A rank whose
    last recorded step is lower never reached it; when all finished the same step, this rank marks itself timed out
    and waits up to `grace_s` (default: a quarter of the timeout, at most 10 s) for the others: one that does not is
    the stalled one. Writes this rank's stacks to the debug folder first. Never raises."""
    timeout_s = _STALL["timeout_s"]
    up = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if up else (_env_int("RANK", 0), _env_int("WORLD_SIZE", 1))
    mine = _STALL["step"]
    head = (
        (f"a collective did not finish within {timeout_s:g} s" if timeout_s else "a collective timed out")
        + f" ({_collective_site(exc)})"
        + (f" at step {mine + 1}" if mine is not None else "")
    )
    stacks = _dump_stacks(exc, rank)
    dumps = f"; this rank's stacks: {stacks}" if stacks is not None else ""
    fr = os.environ.get("TORCH_FR_DUMP_TEMP_FILE") or os.environ.get("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    if fr and up and dist.get_backend() == "nccl":
        dumps += f"; see the flight recorder dump in {Path(fr).parent}"
    if grace_s is None:
        grace_s = min(10.0, (timeout_s or 40.0) / 4)
    holder = _STALL["holder"] if _STALL["holder"] is not None and _STALL["holder"][0] != rank else None
    try:
        if holder is not None and _STALL["store"] is False:  # a progress record failed: the store did not answer
            raise OSError("a write to it failed")
        read = _within(grace_s + 6.0, _read_progress, rank, world, mine, grace_s)  # its reads: 5 s each, at most
    except Exception as read_error:  # noqa: BLE001 - the store itself may be gone or stopped
        if holder is None:
            return f"{head}: the other ranks' progress could not be read ({_first_line(read_error)}){dumps}"
        why = f"serves the group's store, which did not answer ({_first_line(read_error)})"
        return _stalled(head, [holder[0]], {holder[0]: (None, *holder[1:])}, why, dumps)
    if read is None:
        return f"{head}: which rank is behind is not known (no process group store to read their progress from){dumps}"
    progress, timed_out, behind = read
    silent = [r for r in range(world) if r != rank and r not in timed_out]
    if behind:
        steps = {progress[r][0] if r in progress else None for r in behind}
        if len(steps) == 1 and None not in steps:
            return _stalled(head, behind, progress, f"last finished step {steps.pop()}, this rank step {mine}", dumps)
        each = ", ".join(f"rank {r}: " + (f"step {progress[r][0]}" if r in progress else "no step") for r in behind)
        return _stalled(head, behind, progress, f"are behind ({each}), this rank step {mine}", dumps)
    if silent:
        every = f"every rank last finished step {mine}, but " if mine is not None else ""
        it = "it" if len(silent) == 1 else "they"
        why = f"did not reach it ({every}{it} did not time out with this rank within {grace_s:g} s)"
        return _stalled(head, silent, progress, why, dumps)
    return (
        f"{head}: every rank timed out waiting, none is behind: the ranks are in different collectives "
        f"(a code path that not every rank takes){dumps}"
    )


def _stalled(head: str, suspects: list[int], progress: dict, detail: str, dumps: str) -> str:
    """`describe_stall`'s line naming the stalled `suspects` (with the pid and host that `progress` holds)."""
    names = ", ".join(
        f"rank {r}" + (f" (pid {progress[r][1]} on {progress[r][2]})" if r in progress else "") for r in suspects
    )
    verb = "it is" if len(suspects) == 1 else "they are"
    hint = ""
    if len(suspects) == 1 and suspects[0] in progress:
        _, pid, host = progress[suspects[0]]
        hint = f"; `py-spy dump --pid {pid}` on {host} shows where it is"
    return f"{head}: {names} {detail} - {verb} stalled (stopped, hung, or much slower){hint}{dumps}"


def _within(seconds: float, fn, *args):
    """``fn(*args)``, or `TimeoutError` past `seconds` (it goes on in a daemon thread: a store nobody answers)."""
    answer: Future = Future()

    def run() -> None:
        try:
            answer.set_result(fn(*args))
        except BaseException as exc:  # noqa: BLE001 - raised in the caller
            answer.set_exception(exc)

    threading.Thread(target=run, daemon=True).start()
    try:
        return answer.result(timeout=seconds)
    except FuturesTimeout:
        raise TimeoutError(f"no answer within {seconds:g} s") from None


def _read_progress(rank: int, world: int, mine: int | None, grace_s: float) -> tuple[dict, set, list] | None:
    """``({rank: (step, pid, host)}, ranks that marked a timeout, ranks behind step `mine`)`` after marking this
    rank's timeout and waiting up to `grace_s` for the others' when no rank is behind; None without a store."""
    store = _store()
    if store is None:
        return None
    store.set_timeout(datetime.timedelta(seconds=5))
    store.set(_TIMED_OUT_KEY.format(rank), str(mine))
    deadline = time.monotonic() + grace_s
    while True:
        progress = {}
        for r in range(world):
            key = _PROGRESS_KEY.format(r)
            if store.check([key]):
                step, pid, host = store.get(key).decode().split(" ", 2)
                progress[r] = (int(step), int(pid), host)
        timed_out = {r for r in range(world) if store.check([_TIMED_OUT_KEY.format(r)])}
        behind = [r for r in range(world) if r != rank and mine is not None and progress.get(r, (-1,))[0] < mine]
        if behind or len(timed_out) == world or time.monotonic() >= deadline:
            return progress, timed_out, behind
        time.sleep(0.2)


# A decorator's wrapper line, which says nothing of where a rank waited (DeepSpeed's `instrument_w_nvtx`).
_PASS_THROUGH = re.compile(r"(return |\w+ = )?\w+\(\*args, \*\*kwargs\)")


def _collective_site(exc: BaseException) -> str:
    """Where this rank waited, e.g. ``all_reduce: `dist.all_reduce(flat)`, dist.py:262`` (torch's function, then
    the innermost call outside torch that is not a decorator's pass-through)."""
    torch_dir = os.path.dirname(torch.__file__) + os.sep
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    op = next((f.name for f in reversed(frames) if f.filename.startswith(torch_dir + "distributed")), None)
    if op is None and any(f.filename.startswith(torch_dir + "autograd") for f in frames):
        op = "a gradient collective in backward"
    ours = [f for f in frames if not f.filename.startswith(torch_dir) and not _PASS_THROUGH.fullmatch(f.line or "")]
    if not ours:
        return op or "where is not known"
    site = ours[-1]
    code = f"`{site.line.split('  #')[0].strip()}`, " if site.line else ""  # without an inline comment
    return (f"{op}: " if op else "") + f"{code}{Path(site.filename).name}:{site.lineno}"


def _dump_stacks(exc: BaseException, rank: int) -> Path | None:
    """Write the timeout's traceback and every thread's stack of this process to the debug folder."""
    folder = _STALL["debug_dir"]
    if folder is None:
        return None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"stacks_rank{rank}.txt"
        with open(path, "w") as f:
            f.write("".join(traceback.format_exception(exc)) + "\nEvery thread of this process:\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        return path
    except OSError:
        return None


_DESTROYED_GROUPS: list = []  # kept referenced until the process ends (see `destroy_distributed`)


def destroy_distributed() -> None:
    """Destroy the default process group if one exists (safe twice); the group objects stay referenced until exit
    (docs/notes.md#a-hang-in-the-process-groups-destructor-torch-213-gloo)."""
    _STALL.update(timeout_s=None, debug_dir=None, store=None, step=None)  # of the group that ends here
    if dist.is_available() and dist.is_initialized():
        _DESTROYED_GROUPS.extend(dist.distributed_c10d._world.pg_map)  # every group: the default one and subgroups
        dist.destroy_process_group()


@contextlib.contextmanager
def distributed_context(timeout_minutes: float = 30.0) -> Iterator[DistInfo]:
    """``with distributed_context() as info:`` initialises the group and always destroys it."""
    info = init_distributed(timeout_minutes * 60)
    try:
        yield info
    finally:
        destroy_distributed()


def barrier() -> None:
    """Wait for every rank (no-op without a process group)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: Mapping[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Sum scalar metrics (name -> number or 0-d tensor) over ranks in one collective; name -> float."""
    if not values:
        return {}
    numbers = [torch.as_tensor(v, dtype=torch.float64).to(device).reshape(()) for v in values.values()]
    flat = torch.stack(numbers).detach()
    if dist.is_initialized():
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
    return dict(zip(values, flat.tolist()))


def all_reduce_mean(values: Mapping[str, float | torch.Tensor], device: torch.device) -> dict[str, float]:
    """Average scalar metrics over ranks in one collective; see `all_reduce_sum`."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    return {k: v / world for k, v in all_reduce_sum(values, device).items()}


def all_gather_object(obj: object) -> list[object]:
    """Gather one picklable object from every rank; returns a list indexed by rank."""
    if not dist.is_initialized():
        return [obj]
    out: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


@torch.no_grad()
def param_fingerprint(model: torch.nn.Module, chunk: int = 1 << 24) -> list[float]:
    """``[sum, weighted_sum]`` (float64) of a model's parameters, to compare replicas across ranks; the weight
    ``1 + (i mod 97) / 97`` makes swapped values count. Plain tensors only (not DTensors), `chunk` entries at a time."""
    total = weighted = None
    for p in model.parameters():
        flat = p.detach().reshape(-1)
        if total is None:
            total, weighted = (torch.zeros((), dtype=torch.float64, device=flat.device) for _ in range(2))
        for start in range(0, flat.numel(), chunk):
            part = flat[start : start + chunk].to(total.device, torch.float64)
            w = 1.0 + (torch.arange(start, start + part.numel(), dtype=torch.float64, device=total.device) % 97) / 97.0
            total += part.sum()
            weighted += (part * w).sum()
    return [0.0, 0.0] if total is None else [total.item(), weighted.item()]
