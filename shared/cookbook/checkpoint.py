"""Resumable, atomically published checkpoints with torch.distributed.checkpoint (DCP), and
Hugging Face export.

A checkpoint is a folder ``<root>/step_00000100/`` holding DCP's shards, its ``.metadata``
and our ``meta.json``. Every rank writes into ``<root>/.tmp-step_00000100/``; only after all
ranks finished does rank 0 write ``meta.json`` and rename the folder to its final name. A
rename is atomic on POSIX file systems, so a crash at any point leaves either the old set of
complete checkpoints or the old set plus the new one, never a half-written ``step_*``.
With several nodes, ``root`` must be on a file system every node sees.

What goes in is up to the recipe: a dict of DCP `Stateful` objects. `ModelOptimizerState`
covers model and optimizer (moments included) for DDP, FSDP2 or a plain module via
``torch.distributed.checkpoint.state_dict``; `RankLocalState` covers per-rank state (data-loader
position, RNG streams) keyed by rank; `TrainState` holds the step and epoch; anything else with
``state_dict``/``load_state_dict`` (an LR scheduler) can be passed as is.

`ResumeGuard` is the one resume check of every recipe, whatever writes its checkpoints (DCP here, the
Hugging Face Trainer, Ray Train): a checkpoint is a folder named after its step or epoch that holds a
``meta.json`` (``step``, ``world_size``, ``config``, ...); the guard finds the newest complete one, turns
``checkpoint.resume`` (auto / none / a path) into a folder and refuses, before any worker starts, a
resume that would mix two runs (other settings, another world size, a stop point not after it, "none"
over an earlier run's checkpoints). `Checkpointer.check_resume` is the guard of DCP checkpoints.

References: https://pytorch.org/docs/stable/distributed.checkpoint.html,
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import time
from pathlib import Path
from typing import Any, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from cookbook.config import flatten
from cookbook.dist import barrier, get_logger

META_FILE = "meta.json"


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why and what to do."""


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _world_size() -> int:
    return dist.get_world_size() if dist.is_initialized() else 1


class ModelOptimizerState:
    """DCP `Stateful` for a model and its optimizer (DDP, FSDP2 or plain module).

    Uses ``get_state_dict``/``set_state_dict``, which strip the DDP ``module.`` prefix, keep
    FSDP2 parameters as sharded DTensors (so each rank writes only its shard) and key the
    optimizer state (``exp_avg``, ``exp_avg_sq``, ``step``) by parameter name.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 options: StateDictOptions | None = None):
        self.model = model
        self.optimizer = optimizer
        self.options = options  # e.g. StateDictOptions(ignore_frozen_params=True): adapters only (LoRA)

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model, options=self.options)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizers = [] if self.optimizer is None else self.optimizer
        set_state_dict(
            self.model,
            optimizers,
            model_state_dict=state["model"],
            optim_state_dict=state.get("optim", {}) if self.optimizer is not None else {},
            options=self.options,
        )


class RankLocalState:
    """DCP `Stateful` for state that differs per rank: stored under ``rank<i>`` so ranks do not
    overwrite each other, and restored to the same rank.

    Args:
        items: name -> object with ``state_dict()``/``load_state_dict()`` (e.g. a torchdata
            ``StatefulDataLoader``), or `RNGState()`.

    Restoring on a different world size is refused by `Checkpointer.load` (per-rank
    positions cannot be remapped), with a message that says so.
    """

    def __init__(self, **items: Any):
        self.items = items

    def state_dict(self) -> dict[str, Any]:
        return {f"rank{_rank()}": {name: obj.state_dict() for name, obj in self.items.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state[f"rank{_rank()}"]
        for name, obj in self.items.items():
            obj.load_state_dict(mine[name])


class RNGState:
    """The RNG streams of this process (Python, NumPy if installed, torch CPU and CUDA) as a
    `Stateful`, so dropout and shuffling continue identically after a resume."""

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
        try:
            import numpy as np

            state["numpy"] = np.random.get_state()
        except ImportError:
            pass
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        random.setstate(state["python"])
        torch.set_rng_state(state["torch"].cpu())
        if "numpy" in state:
            import numpy as np

            np.random.set_state(state["numpy"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"].cpu())


class TrainState:
    """Optimizer steps done and the current epoch, as a DCP `Stateful` (``step``, ``epoch``)."""

    def __init__(self) -> None:
        self.step = 0
        self.epoch = 0

    def state_dict(self) -> dict[str, int]:
        return {"step": self.step, "epoch": self.epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.step, self.epoch = int(state["step"]), int(state["epoch"])


class ResumeGuard:
    """Find a run's newest complete checkpoint and refuse a resume that would mix two runs.

    A checkpoint is a folder under `root` named after `folder` that holds ``meta.json`` (``step``,
    ``world_size``, ``config`` and, for runs counted in epochs, ``epoch``) and every file of `files`.
    Cheap and collective-free: call it in one process before any worker starts, and again in the workers.

    Args:
        root: the folder holding the checkpoint folders.
        folder: a checkpoint folder's name, ``<n>`` standing for its number (digits), which orders them:
            ``"step_<n>"`` (DCP), ``"checkpoint-<n>"`` (Hugging Face Trainer), ``"checkpoint_epoch_<n>"`` (Ray).
        files: files besides ``meta.json`` that a complete checkpoint holds (DCP's ``.metadata``).
        run_dir: the run's output folder; the advice to start afresh names it ("or delete <run_dir>": its
            metrics and MLflow run id go too). ``None``: the advice is a new output_dir alone.
        resume_key: the config key of the resume setting, as messages name it.
        processes: what the world size counts, as messages name it (``"ranks"``, ``"workers"``).
        cannot_remap: why a checkpoint written by another world size cannot be resumed (the technique's reason:
            per-rank state, ZeRO partitions, the global batch).
        same_size: how to resume with the checkpoint's world size, ``{n}`` standing for it.
    """

    def __init__(self, root: str | Path, *, folder: str = "step_<n>", files: tuple[str, ...] = (".metadata",),
                 run_dir: str | Path | None = None, resume_key: str = "checkpoint.resume", processes: str = "ranks",
                 cannot_remap: str = "its per-rank data-loader and RNG state cannot be remapped",
                 same_size: str = "the same number of processes (NGPU x NNODES = {n})"):
        self.root = Path(root)
        self.folder, self.files = folder, tuple(files)
        self._name = re.compile(re.escape(folder).replace(re.escape("<n>"), r"(\d+)"))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.resume_key, self.processes = resume_key, processes
        self.cannot_remap, self.same_size = cannot_remap, same_size

    # ------------------------------------------------------------------ finding
    def is_complete(self, path: str | Path) -> bool:
        """Whether `path` holds ``meta.json`` and every file of `files`."""
        return all((Path(path) / f).is_file() for f in (META_FILE, *self.files))

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints under `root`, oldest first (by the number in their name). Folders of
        interrupted saves (another name, or a file missing) are left out."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := self._name.fullmatch(p.name)) and self.is_complete(p)]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The checkpoint ``resume=auto`` takes: the newest complete one, or ``None``."""
        found = self.complete_checkpoints()
        return found[-1] if found else None

    def resolve(self, resume: str | None) -> Path | None:
        """Turn a ``resume`` value into a checkpoint folder.

        Args:
            resume: ``"auto"`` (`latest`, or none), ``"none"``/``""``/``None`` (start fresh), or the path
                of a checkpoint folder.

        Raises:
            CheckpointError: an explicit path that is not a complete checkpoint.
        """
        if resume in (None, "", "none", "null"):
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not self.is_complete(path):
            missing = ", ".join(f for f in (META_FILE, *self.files) if not (path / f).is_file())
            raise CheckpointError(f"{self.resume_key}={resume!r} is not a complete checkpoint folder (no {missing} "
                                  f"inside): use {self.resume_key}=auto (the newest one under {self.root}), none, or "
                                  f"the path of a {self.folder} folder")
        return path

    # ------------------------------------------------------------------ checking
    def start_afresh(self) -> str:
        """The advice to start afresh that every message gives: ``"a new output_dir (or delete <run_dir>)"``."""
        return "a new output_dir" + (f" (or delete {self.run_dir})" if self.run_dir is not None else "")

    def check(self, resume: str | None, world_size: int | None, config: Mapping[str, Any] | None = None,
              may_change: tuple[str, ...] = (), stop_at: tuple[str, int] = ("train.stop_at_step", -1)) -> Path | None:
        """Find the checkpoint to resume from and check that this run can continue it.

        Args:
            resume: as in `resolve`.
            world_size: the number of processes this run will have; ``None`` when not known yet (check it
                later with `check_world_size`).
            config: this run's config as a flat or nested dict, compared with the checkpoint's ``config``.
            may_change: dotted keys allowed to differ (``"train.log_every"``); a key ending in ``.*`` allows a
                whole section.
            stop_at: ``(key, value)`` of the run's stop setting, ``("train.stop_at_step", 20)`` or
                ``("train.stop_at_epoch", 1)``; when ``value > 0`` it must be after the checkpoint's step or
                epoch (the key's last word).

        Returns:
            The checkpoint folder, or ``None`` to start fresh.

        Raises:
            CheckpointError: no such checkpoint; ``resume`` is "none" but `root` holds checkpoints; it was
                written by another world size or with other settings (the message lists them and what to
                do); or the stop point is not after it.
        """
        path = self.resolve(resume)
        if path is None:
            if self.latest() is not None:
                raise CheckpointError(
                    f"{self.resume_key}={resume!r} but {self.root} holds checkpoints of an earlier run, which a later "
                    f"resume=auto would pick up: start afresh with a new output_dir (or delete "
                    f"{self.run_dir or self.root})")
            return None
        meta = read_meta(path)
        if world_size is not None:
            self.check_world_size(path, meta, world_size)
        diff = config_changes(meta["config"], config, may_change) if config is not None and "config" in meta else ""
        if diff:
            raise CheckpointError(f"{path} was written with other settings ({diff}); resuming would mix two runs. Use "
                                  f"the same settings, or start afresh with {self.start_afresh()}")
        key, value = stop_at
        unit = key.rsplit("_", 1)[-1]
        if 0 < value <= meta.get(unit, 0):
            raise CheckpointError(f"{key}={value} is not after the checkpoint {path} ({unit} {meta[unit]}): raise it, "
                                  f"or remove it to train to the end")
        return path

    def check_world_size(self, path: str | Path, meta: Mapping[str, Any], world_size: int) -> None:
        """Refuse a checkpoint that `meta` (its ``meta.json``) says another number of processes wrote; one
        that did not record it passes.

        Raises:
            CheckpointError: naming both sizes, why (`cannot_remap`) and what to do.
        """
        if meta.get("world_size") not in (None, world_size):
            n = meta["world_size"]
            raise CheckpointError(f"{path} was written by {n} {self.processes} but this job has {world_size}: "
                                  f"{self.cannot_remap}. Resume with {self.same_size.format(n=n)}, or start afresh "
                                  f"with {self.start_afresh()}")

    def already_complete(self, done: int, total: int | None, unit: str = "step",
                         outputs: Mapping[str, str | Path] = {}) -> str:
        """The message for a run that has nothing left to do (its newest checkpoint is at the end and its
        outputs are written): ``already complete: 40 of 40 steps; model in <dir>/final, metrics in ...
        To train again, use a new output_dir (or delete <run_dir>).``

        Args:
            done, total: steps or epochs done and planned (``total=None``: not known here).
            unit: ``"step"`` or ``"epoch"``.
            outputs: what is where, e.g. ``{"model": final_dir, "metrics": jsonl}``.
        """
        count = f"{done} of {total}" if total is not None else f"{done}"
        where = "".join(f"{', ' if i else '; '}{what} in {path}" for i, (what, path) in enumerate(outputs.items()))
        return f"already complete: {count} {unit}s{where}. To train again, use {self.start_afresh()}."


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint folder `path`."""
    return json.loads((Path(path) / META_FILE).read_text())


class Checkpointer:
    """Save, find and load checkpoints under one folder.

    Args:
        root: the checkpoints folder (created if needed). Shared by all nodes.
        keep_last: number of newest complete checkpoints to keep; older ones are deleted
            after a new one is published. ``0`` keeps all.
        run_dir: the run's output folder, named in the resume guard's advice ("or delete <run_dir>").

    Every method is collective: call it on every rank.
    """

    def __init__(self, root: str | Path, keep_last: int = 3, run_dir: str | Path | None = None):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.guard = ResumeGuard(self.root, run_dir=run_dir)

    # ------------------------------------------------------------------ finding
    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first. Temporary folders of interrupted saves are ignored."""
        return self.guard.complete_checkpoints()

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        return self.guard.latest()

    def resolve_resume(self, resume: str | None) -> Path | None:
        """Turn a config's ``resume`` value into a checkpoint folder (`ResumeGuard.resolve`).

        Raises:
            CheckpointError: an explicit path that is not a complete checkpoint.
        """
        return self.guard.resolve(resume)

    def check_resume(self, resume: str | None, world_size: int, config: Mapping[str, Any] | None = None,
                     may_change: tuple[str, ...] = (), stop_at_step: int = -1) -> Path | None:
        """Find the checkpoint to resume from and check that this run can continue it (`ResumeGuard.check`
        with ``train.stop_at_step``).

        Returns:
            The checkpoint folder, or ``None`` to start fresh.

        Raises:
            CheckpointError: see `ResumeGuard.check`.
        """
        return self.guard.check(resume, world_size, config, may_change, ("train.stop_at_step", stop_at_step))

    # ------------------------------------------------------------------ saving
    def save(self, step: int, state: Mapping[str, Any], extra_meta: Mapping[str, Any] | None = None) -> Path:
        """Write `state` with DCP and publish it atomically as ``step_<step>``.

        Args:
            step: optimizer steps completed; names the folder.
            state: name -> DCP `Stateful` or (nested) dict of tensors / picklable objects.
            extra_meta: JSON-serialisable facts stored in ``meta.json`` (e.g. epoch, loss).

        Returns:
            The published folder.
        """
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}"
        start = time.perf_counter()
        if _rank() == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a save that crashed
        barrier()
        dcp.save(dict(state), checkpoint_id=str(tmp))
        barrier()
        if _rank() == 0:
            meta = {"step": step, "world_size": _world_size(), "time": time.time(), **(extra_meta or {})}
            with open(tmp / META_FILE, "w") as f:
                json.dump(meta, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            _publish(tmp, final)
            self._prune()
        barrier()
        get_logger().info(f"checkpoint saved: {final} ({time.perf_counter() - start:.1f}s)")
        return final

    def _prune(self) -> None:
        if self.keep_last == 0:
            return
        for old in self.complete_checkpoints()[: -self.keep_last]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def load(self, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load `state` in place from the checkpoint folder `path`.

        Model and optimizer states reshard automatically (DCP); per-rank state
        (`RankLocalState`) needs the world size the checkpoint was written with.

        Returns:
            The checkpoint's ``meta.json`` as a dict (``step``, ``world_size``, extras).

        Raises:
            CheckpointError: the folder is incomplete, or it holds per-rank state written by a
                different number of ranks.
        """
        path = Path(path)
        meta_file = path / META_FILE
        if not meta_file.is_file():
            raise CheckpointError(f"{path} is not a complete checkpoint (no {META_FILE})")
        meta = json.loads(meta_file.read_text())
        if any(isinstance(v, RankLocalState) for v in state.values()):
            self.guard.check_world_size(path, meta, _world_size())
        dcp.load(dict(state), checkpoint_id=str(path))
        get_logger().info(f"resumed from {path} (step {meta['step']})")
        return meta


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], may_change: tuple[str, ...] = ()) -> str:
    """The settings that differ between two configs (flat or nested dicts), as ``"key: old -> new, ..."``
    (at most six, then ``...``); ``""`` when none. Keys in `may_change` are ignored (a key ending in ``.*``
    ignores a whole section)."""
    old, new = flatten(old), flatten(new)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
               and not any(k == m or (m.endswith(".*") and k.startswith(m[:-1])) for m in may_change)]
    diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
    return diff + (", ..." if len(changed) > 6 else "")


def publish(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished folder `tmp` to `final` (atomic on one file system), replacing an older `final`
    only once the new one is complete. Call on one rank."""
    _publish(Path(tmp), Path(final))


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished folder to its final name (atomic), replacing an older one of that name."""
    if final.exists():
        trash = final.with_name(f".old-{final.name}")
        shutil.rmtree(trash, ignore_errors=True)
        os.rename(final, trash)
        os.rename(tmp, final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        os.rename(tmp, final)
    _fsync_dir(final.parent)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def export_hf(model: torch.nn.Module, out_dir: str | Path, tokenizer: Any = None, dtype: torch.dtype | None = None) -> Path | None:
    """Save the full model in Hugging Face format (safetensors + config [+ tokenizer]).

    Gathers a full, unsharded state dict on rank 0 (works for DDP, FSDP2 and plain
    modules), writes it with ``save_pretrained`` into a temporary folder and renames it to
    `out_dir`, replacing an older export only once the new one is complete. The result loads
    with ``AutoModel*.from_pretrained(out_dir)``. Collective: call on every rank.

    Args:
        model: a ``transformers.PreTrainedModel``, possibly wrapped in DDP or sharded with FSDP2.
        out_dir: destination folder.
        tokenizer: saved beside the weights when given.
        dtype: cast floating-point tensors to this dtype before writing (e.g. ``torch.bfloat16``
            to halve the size of a model trained with fp32 master weights); ``None`` keeps them.

    Returns:
        `out_dir` on rank 0, ``None`` on other ranks.
    """
    out = Path(out_dir)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    result = None
    if _rank() == 0:
        tmp = out.with_name(f".tmp-{out.name}")
        shutil.rmtree(tmp, ignore_errors=True)
        inner.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        if dtype is not None:  # record the saved dtype so from_pretrained(dtype="auto") picks it
            config_file = tmp / "config.json"
            config = json.loads(config_file.read_text())
            config["dtype"] = str(dtype).removeprefix("torch.")
            config_file.write_text(json.dumps(config, indent=2))
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        _publish(tmp, out)
        result = out
    barrier()
    return result
