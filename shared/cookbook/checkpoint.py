"""Resumable, atomically published checkpoints with torch.distributed.checkpoint (DCP), and Hugging Face export. A
checkpoint is a folder ``<root>/step_00000100/`` (DCP's shards, ``.metadata``, ``meta.json``): every rank writes into
``.tmp-step_00000100/``, then rank 0 writes ``meta.json`` and renames it (atomic). What goes in: DCP ``Stateful``
objects (`cookbook.state`, `cookbook.sampler.DataPosition`, an LR scheduler). `cookbook.resume` finds and checks
checkpoints; its names and `cookbook.state`'s are re-exported here. What survives which failure: docs/failures.md."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from cookbook.dist import barrier, get_logger
from cookbook.errors import CheckpointError, chain
from cookbook.resume import CHECKSUMS_KEY, META_FILE, ResumeGuard, checksums, read_meta, reason
from cookbook.resume import config_changes  # noqa: F401 (re-exported)
from cookbook.sampler import DataPosition
from cookbook.state import RankLocalState
from cookbook.state import ModelOptimizerState, RNGState, TrainState, rng_kept, seed_per_rank  # noqa: F401 (re-exported)

_LEFTOVER_PREFIXES = (".tmp-", ".old-")  # folders of a save or a publish that did not finish


class CheckpointSaveError(CheckpointError, OSError):
    """A checkpoint could not be written (disk full, I/O error, ...): one line, alike on every rank; ``errno`` set."""

    same_on_every_rank = True


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


def _mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path` (or its nearest existing folder)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


_ADVICE = {
    errno.EFBIG: "raise the file size limit (ulimit -f) or the largest file size of {fs}",  # a failed save's
    errno.EROFS: "make {fs} writable (it is mounted read-only)",
    **dict.fromkeys((errno.EACCES, errno.EPERM), "give this user write access to {root}"),
    errno.EIO: "check the storage of {fs} (the system log names the failing device)",
}


def _what_to_do(code: int | None, root: Path) -> str:
    """The advice of a failed save for the OS error number `code`, naming the file system of `root`."""
    fs = _mount_point(root)
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({shutil.disk_usage(fs).free / 2**30:.1f} GiB free now)"
        except OSError:
            free = ""
        return f"free space on {fs}{free}" + (" or raise your quota there" if code == errno.EDQUOT else "")
    return _ADVICE.get(code, "fix the cause on {fs}").format(fs=fs, root=root)


def from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a broadcast; without a process group, `value` itself)."""
    if _world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def os_error_in(exc: BaseException) -> OSError | None:
    """The `OSError` in `exc`'s chain of causes and contexts (itself included, outermost first), or ``None``."""
    return next((e for e in chain(exc) if isinstance(e, OSError)), None)


class _Writer(dcp.FileSystemWriter):
    """DCP's `FileSystemWriter`, whose failed write raises the `OSError` beneath it (not ``unexpected pos``)."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except Exception as exc:
            if (os_error := os_error_in(exc)) is None or os_error is exc:
                raise
            raise OSError(os_error.errno, os_error.strerror, os_error.filename) from exc


def _failure(exc: BaseException) -> tuple[str, str, int | None]:
    """``(kind, reason, errno)`` of rank 0's failed save, to broadcast: ``"os"`` an OSError, else ``"bug"``."""
    return ("os", reason(exc), exc.errno) if isinstance(exc, OSError) else ("bug", reason(exc), None)


def _os_failure(exc: BaseException) -> tuple[int, OSError] | None:
    """``(rank, OSError)`` of the first rank whose part of a DCP save failed with an OS error, or None."""
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        if (os_error := os_error_in(failure[0] if isinstance(failure, tuple) else failure)) is not None:
            return rank, os_error
    return None


class Checkpointer(ResumeGuard):
    """Save, find and load DCP checkpoints under `root`; collective. `keep_last`: newest kept (0: all); `run_dir`:
    named in the advice; `resizable`: another world size resumes with the same global batch (`load` needs a
    `DataPosition`); `cannot_remap`: why another world size is refused."""

    def __init__(
        self,
        root: str | Path,
        keep_last: int = 3,
        run_dir: str | Path | None = None,
        resizable: bool = False,
        cannot_remap: str | None = None,
    ):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        super().__init__(
            root, run_dir=run_dir, resizable=resizable, **({"cannot_remap": cannot_remap} if cannot_remap else {})
        )
        self.keep_last = keep_last

    def check_resume(
        self,
        resume: str | None,
        world_size: int,
        config: Mapping[str, Any] | None = None,
        may_change: tuple[str, ...] = (),
        stop_at_step: int = -1,
    ) -> Path | None:
        """The checkpoint folder to resume from (None: start fresh), checked by `ResumeGuard.check`."""
        return self.check(resume, world_size, config, may_change, ("train.stop_at_step", stop_at_step))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Mapping[str, Any], extra_meta: Mapping[str, Any] | None = None) -> Path:
        """Write `state` (name -> ``Stateful`` or nested dict) with DCP and publish it as ``step_<step>``; returns the
        folder. Leftovers go first; checkpoints beyond `keep_last` and older damaged ones after. `extra_meta`: more
        ``meta.json``. Raises CheckpointSaveError on every rank when any rank could not write or publish."""
        final, tmp = self.root / f"step_{step:08d}", self.root / f".tmp-step_{step:08d}"
        start, failure = time.perf_counter(), None
        if _rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_leftovers()
                tmp.mkdir()
            except OSError as exc:
                failure = _failure(exc)
        self._agree(step, final, failure)
        try:
            dcp.save(dict(state), checkpoint_id=str(tmp), storage_writer=_Writer(str(tmp)))
        except OSError as exc:  # raised here before DCP's collectives agreed: only this rank knows
            raise self._save_error(step, final, _rank(), exc) from exc
        except CheckpointException as exc:  # every rank has it (DCP gathers and broadcasts failures)
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()
            if (found := _os_failure(exc)) is None:
                raise
            raise self._save_error(step, final, *found) from None
        barrier()
        failure = error = None
        if _rank() == 0:
            meta = {"step": step, "world_size": _world_size(), "time": time.time(), **(extra_meta or {})}
            try:
                meta[CHECKSUMS_KEY] = checksums(tmp)
                with open(tmp / META_FILE, "w") as f:
                    json.dump(meta, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                publish(tmp, final)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they would wait forever
                error, failure = exc, _failure(exc)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._prune(final)
        self._agree(step, final, failure, error)
        self.bad.pop(final, None)
        self.verified.add(final)
        get_logger().info(f"checkpoint saved: {final} ({time.perf_counter() - start:.1f}s)")
        return final

    def _remove_leftovers(self) -> None:  # rank 0: what interrupted saves left under `root`
        for path in self.root.iterdir():
            if path.name.startswith(_LEFTOVER_PREFIXES):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        path.unlink()

    def _agree(self, step: int, final: Path, failure: tuple | None, error: BaseException | None = None) -> None:
        """Raise on every rank what rank 0 met: `failure` (`_failure`, or None) broadcast; a "bug" is `error` there."""
        failure = from_rank0(failure)
        if failure is None:
            return
        kind, why, code = failure
        if kind == "bug":
            if error is not None:
                raise error
            raise RuntimeError(f"rank 0 failed to publish the checkpoint {final}: {why}")
        raise self._save_error(step, final, 0, OSError(code, why) if code is not None else OSError(why), why) from error

    def _save_error(
        self, step: int, final: Path, rank: int, exc: OSError, why: str | None = None
    ) -> CheckpointSaveError:
        return save_error(step, final, self.latest(), rank if _world_size() > 1 else None, exc, why)

    def _prune(self, published: Path) -> None:
        """Delete damaged folders older than `published`, then checkpoints beyond `keep_last` (rank 0)."""
        complete = self.complete_checkpoints()
        stale = [p for n, p in self.candidates() if n < self.number(published) and p not in complete]
        for old in stale + (complete[: -self.keep_last] if self.keep_last > 0 else []):
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def load(self, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load `state` in place from `path` (DCP reshards); returns its ``meta.json``. On another world size a
        `resizable` checkpointer loads all but the per-rank state. Raises CheckpointError: incomplete, damaged, or
        per-rank state of another world size; ValueError: resized without a `DataPosition`."""
        path = Path(path)
        if (problem := self.problem(path)) is not None:
            raise CheckpointError(f"{path} is not a complete checkpoint ({problem})")
        meta = read_meta(path)
        local = [k for k, v in state.items() if isinstance(v, RankLocalState)]
        written_by, now = meta.get("world_size"), _world_size()
        resized = written_by not in (None, now)
        if resized and not self.resizable and local:
            self.check_world_size(path, meta, now)  # raises
        if resized and self.resizable:
            positions = [v for v in state.values() if isinstance(v, DataPosition)]
            if not positions:
                raise ValueError(
                    "a resizable Checkpointer loads another world size's checkpoint only with a "
                    "DataPosition in the state (the data position of the whole job)"
                )
            dropped = "; ".join(f"{k}: {', '.join(state[k].items)}" for k in local)
            state = {k: v for k, v in state.items() if k not in local}
        dcp.load(dict(state), checkpoint_id=str(path))
        if resized and self.resizable:
            get_logger().info(self.resized(path, meta, now, positions[0].describe(), dropped))
        get_logger().info(f"resumed from {path} (step {meta['step']})")
        return meta


def save_error(
    step: int, final: Path, previous: Path | None, rank: int | None, exc: OSError, why: str | None = None
) -> CheckpointSaveError:
    """The one-line `CheckpointSaveError` of the failed save of `step` to `final`, naming `exc` (or `why`), the
    `rank` that met it (None: one process) and the intact `previous` checkpoint."""
    where = f"rank {rank}: " if rank is not None else ""
    kept = f"the previous checkpoint {previous} is intact" if previous is not None else "there is no earlier checkpoint"
    again = f"it resumes from {previous}" if previous is not None else "it starts from step 0"
    todo = _what_to_do(exc.errno, Path(final).parent)
    error = CheckpointSaveError(
        f"could not save the checkpoint of step {step} to {final} ({where}{why or reason(exc)}); {kept}. "
        f"{todo[0].upper()}{todo[1:]} and run the same command again: {again}"
    )
    error.errno = exc.errno
    return error


def publish(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished folder `tmp` to `final` (atomic), replacing an older `final` (put back if the rename
    fails). Call on one rank."""
    tmp, final = Path(tmp), Path(final)
    if final.exists():
        trash = final.with_name(f".old-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        try:
            os.rename(tmp, final)
        except BaseException:
            os.rename(trash, final)
            raise
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    with contextlib.suppress(OSError):  # the rename is durable once the folder is synced
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def publish_pretrained(
    model: Any, out_dir: str | Path, tokenizer: Any = None, config: Mapping[str, Any] = {}, **kwargs: Any
) -> Path:
    """``model.save_pretrained(..., **kwargs)`` and `tokenizer`'s files published whole as `out_dir` (`publish`),
    `config` updating the saved ``config.json``. Call on one rank; returns `out_dir`."""
    out = Path(out_dir)
    tmp = out.with_name(f".tmp-{out.name}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **kwargs)
    if config:
        config_file = tmp / "config.json"
        config_file.write_text(json.dumps({**json.loads(config_file.read_text()), **config}, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    publish(tmp, out)
    return out


def export_hf(
    model: torch.nn.Module, out_dir: str | Path, tokenizer: Any = None, dtype: torch.dtype | None = None
) -> Path | None:
    """Save the full model (DDP, FSDP2 or plain) in Hugging Face format (+ `tokenizer`) into `out_dir`, published
    whole; collective. `dtype`: cast floating-point tensors first. Returns `out_dir` on rank 0, None elsewhere."""
    out = Path(out_dir)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    if _rank() == 0:  # the saved dtype in config.json, so that from_pretrained(dtype="auto") picks it
        config = {"dtype": str(dtype).removeprefix("torch.")} if dtype is not None else {}
        publish_pretrained(inner, out, tokenizer, config, state_dict=state, safe_serialization=True)
    barrier()
    return out if _rank() == 0 else None
