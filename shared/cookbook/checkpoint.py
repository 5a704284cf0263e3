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
``state_dict``/``load_state_dict`` (an LR scheduler) can be passed as is. `Checkpointer.check_resume`
refuses, before any worker starts, a resume that would mix two runs.

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

_STEP_DIR = re.compile(r"^step_(\d+)$")
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


class Checkpointer:
    """Save, find and load checkpoints under one folder.

    Args:
        root: the checkpoints folder (created if needed). Shared by all nodes.
        keep_last: number of newest complete checkpoints to keep; older ones are deleted
            after a new one is published. ``0`` keeps all.

    Every method is collective: call it on every rank.
    """

    def __init__(self, root: str | Path, keep_last: int = 3):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    # ------------------------------------------------------------------ finding
    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first. Temporary folders of interrupted saves are ignored."""
        if not self.root.is_dir():
            return []
        found = []
        for p in self.root.iterdir():
            m = _STEP_DIR.match(p.name)
            if m and (p / META_FILE).is_file() and (p / ".metadata").is_file():
                found.append((int(m.group(1)), p))
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        ckpts = self.complete_checkpoints()
        return ckpts[-1] if ckpts else None

    def resolve_resume(self, resume: str | None) -> Path | None:
        """Turn a config's ``resume`` value into a checkpoint folder.

        Args:
            resume: ``"auto"`` (newest complete checkpoint under `root`, or none),
                ``"none"``/``""``/``None`` (start fresh), or a path to a ``step_*`` folder.

        Raises:
            CheckpointError: an explicit path that is not a complete checkpoint.
        """
        if resume in (None, "", "none", "null"):
            return None
        if resume == "auto":
            return self.latest()
        path = Path(resume)
        if not ((path / META_FILE).is_file() and (path / ".metadata").is_file()):
            raise CheckpointError(
                f"checkpoint.resume={resume!r} is not a complete checkpoint folder "
                f"(expected {META_FILE} and .metadata inside); use 'auto' or 'none'"
            )
        return path

    def check_resume(self, resume: str | None, world_size: int, config: Mapping[str, Any] | None = None,
                     may_change: tuple[str, ...] = (), stop_at_step: int = -1) -> Path | None:
        """Find the checkpoint to resume from and check that this run can continue it.

        Cheap and collective-free: call it in a single process before any worker starts, and
        again in the workers.

        Args:
            resume: as in `resolve_resume`.
            world_size: the number of processes this run will have.
            config: this run's config as a flat or nested dict; compared with the one stored in the
                checkpoint's ``meta.json`` (written by `save` when given ``extra_meta={"config": ...}``).
            may_change: dotted keys allowed to differ (e.g. ``"train.log_every"``); a key ending in
                ``.*`` allows a whole section.
            stop_at_step: the run's ``train.stop_at_step``; when > 0 it must be after the checkpoint's step.

        Returns:
            The checkpoint folder, or ``None`` to start fresh.

        Raises:
            CheckpointError: no such checkpoint; ``resume`` is "none" but the folder holds
                checkpoints; it was written by a different number of ranks; it was written with
                different settings (the message lists them and what to do); or `stop_at_step` is
                not after it.
        """
        path = self.resolve_resume(resume)
        if path is None:
            if self.latest() is not None:
                raise CheckpointError(
                    f"checkpoint.resume={resume!r} but {self.root} holds checkpoints of an earlier run, which a later "
                    f"resume=auto would pick up: use a new output_dir, or delete {self.root}"
                )
            return None
        meta = json.loads((path / META_FILE).read_text())
        _check_world_size(path, meta, world_size)
        if config is not None and "config" in meta:
            diff = config_changes(meta["config"], config, may_change)
            if diff:
                raise CheckpointError(
                    f"{path} was written with other settings ({diff}); resuming "
                    f"would mix two runs. Use the same settings, or a new output_dir to start afresh"
                )
        if 0 < stop_at_step <= meta["step"]:
            raise CheckpointError(f"train.stop_at_step={stop_at_step} is not after the checkpoint {path} (step "
                                  f"{meta['step']}): raise it, or remove it to train to the end")
        return path

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
            _check_world_size(path, meta, _world_size())
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


def _check_world_size(path: Path, meta: Mapping[str, Any], world_size: int) -> None:
    """Refuse per-rank state written by another number of ranks (it cannot be remapped)."""
    if meta.get("world_size") not in (None, world_size):
        raise CheckpointError(
            f"{path} was written by {meta['world_size']} ranks but this job has {world_size}: its per-rank "
            f"data-loader and RNG state cannot be remapped. Resume with the same number of processes "
            f"(NGPU x NNODES = {meta['world_size']}), or start afresh with a new output_dir"
        )


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
