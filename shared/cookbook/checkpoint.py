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
position, RNG streams) keyed by rank; `TrainState` holds the step and epoch; `cookbook.sampler.DataPosition`
holds the data position of the whole job; anything else with ``state_dict``/``load_state_dict`` (an LR
scheduler) can be passed as is.

**Resize.** A checkpoint written by ``N`` ranks resumes on ``M`` ranks when the recipe allows it
(``Checkpointer(..., resizable=True)``, `ResumeGuard` ``resizable``) and its state holds a `DataPosition`:
DCP reshards the model and optimizer, the data continues at the global position (the samples of the epoch
the whole job consumed, the same whatever the number of ranks), and the per-rank state (`RankLocalState`:
data-loader workers, RNG streams) is not restored but starts as in a fresh run, with one line saying so
(`Checkpointer.load`). The global batch (``train.micro_batch_size x train.grad_accum_steps x ranks``) must stay
the checkpoint's, so that a step, ``max_steps``, the learning-rate schedule and the position keep their meaning;
``train.micro_batch_size`` and ``train.grad_accum_steps`` may change within it (`ResumeGuard.check`). Recipes
that cannot resize refuse another world size before any worker starts, naming the size to use and the recipes
that can (`resizable_recipes`: those whose train.py says ``RESIZABLE = True``).

`ResumeGuard` is the one resume check of every recipe, whatever writes its checkpoints (DCP here, the
Hugging Face Trainer, Ray Train): a checkpoint is a folder named after its step or epoch that holds a
``meta.json`` (``step``, ``world_size``, ``config``, ...); the guard finds the newest complete one, turns
``checkpoint.resume`` (auto / none / a path) into a folder and refuses, before any worker starts, a
resume that would mix two runs (other settings, another world size, a stop point not after it, "none"
over an earlier run's checkpoints). `Checkpointer.check_resume` is the guard of DCP checkpoints.

What survives which failure (each one is injected for real in ``tests/test_checkpoint_faults.py``):

- **A damaged checkpoint** (a truncated or missing shard, ``.metadata`` missing or unreadable,
  ``meta.json`` missing, empty or not JSON, bytes overwritten in place) is not complete: `ResumeGuard.problem` says what is wrong,
  from ``meta.json`` and DCP's index alone (every file ``.metadata`` names exists and is as long as its
  entries need; no collective, no tensor read); in a layout without such an index (the Hugging Face
  Trainer's), from the file sizes that ``meta.json`` lists (`file_sizes`). The checkpoint a resume takes is also
  read whole once and compared with the checksum of each file that ``meta.json`` holds (`checksums`, written at
  publish time: xxh3_64, or crc32 without the ``xxhash`` package), which finds bytes overwritten in place
  (`ResumeGuard.verify`). ``resume=auto`` skips a damaged newest checkpoint and
  resumes from the previous complete one, with one warning line (rank 0 / the ``--check`` process)
  naming the folder and what is wrong; with none left it refuses and says so. An explicit
  ``resume=<path>`` that is damaged is refused, naming what is wrong. Every reader (the resume, `latest`,
  the pruning of old checkpoints, `Checkpointer.load`) uses this one notion of complete.
- **A crash during a save** (the job killed, a node lost) leaves the previous checkpoints as they were
  and ``resume=auto`` picks the newest of them; the next save removes every leftover ``.tmp-*`` and
  ``.old-*`` folder under ``root`` before it writes.
- **A failed save** (disk full, a file too large, an I/O error, a read-only file system) on any rank
  fails the save on every rank (DCP gathers its errors; rank 0's ``meta.json`` and rename failures are
  broadcast), removes its temporary folder, keeps the previous checkpoint and raises
  `CheckpointSaveError`, whose one-line message names the checkpoint, the OS error and its rank, the
  previous checkpoint that is intact and what to do; `cookbook.run_main` prints it and exits with 2.
- **An unwritable output folder** is refused before any worker starts (`cookbook.config.check_run`).

References: https://pytorch.org/docs/stable/distributed.checkpoint.html,
https://pytorch.org/tutorials/recipes/distributed_checkpoint_recipe.html
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import random
import re
import shutil
import time
import zlib
from pathlib import Path
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from cookbook.config import flatten
from cookbook.dist import barrier, get_logger
from cookbook.sampler import DataPosition
from cookbook.errors import RESTART_COUNT_ENV

META_FILE = "meta.json"
DCP_METADATA = ".metadata"  # DCP's index of a checkpoint: which bytes of which file hold each tensor
FILES_KEY = "files"  # meta.json's list of a checkpoint's files and sizes, where no index names them (file_sizes)
CHECKSUMS_KEY = "checksums"  # meta.json's checksum of each file, written at publish time (checksums)
LEFTOVER_PREFIXES = (".tmp-", ".old-")  # folders of a save or a publish that did not finish
BATCH_KEYS = ("train.micro_batch_size", "train.grad_accum_steps")  # with the world size, they make the global batch
LENGTH_KEYS = {"train.max_steps": "step", "train.epochs": "epoch"}  # the run's length, with the unit meta.json counts


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used for this run; the message says why and what to do."""


class CheckpointSaveError(CheckpointError, OSError):
    """A checkpoint could not be written (disk full, file too large, I/O error, read-only file system).

    Raised on every rank, with the same message (`cookbook.run_main` prints rank 0's). Nothing of the failed checkpoint was kept and the previous one is intact; the
    one-line message names the checkpoint, the OS error (and the rank that met it), the previous checkpoint
    and what to do. ``errno`` is the OS error's. An `OSError` too, so that code catching storage errors
    catches it."""

    same_on_every_rank = True


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

    On a different world size `Checkpointer.load` refuses it (per-rank positions cannot be remapped), or, for a
    resizable checkpoint (one with a `cookbook.sampler.DataPosition`), leaves it out: these objects then keep
    the state this run gave them at its start.
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


def seed_per_rank(seed: int, rank: int) -> None:
    """Seed this process's random streams (Python, NumPy if installed, torch CPU and every CUDA device) with
    ``seed + rank``, so that each rank draws its own dropout masks (and augmentations). Call after the model's
    initialisation (which must be the same on every rank) and before a resume restores the saved streams."""
    random.seed(seed + rank)
    try:
        import numpy as np

        np.random.seed(seed + rank)
    except ImportError:
        pass
    torch.manual_seed(seed + rank)  # also seeds every CUDA device


@contextlib.contextmanager
def rng_kept() -> Iterator[None]:
    """Leave this process's random streams (`RNGState`) as they were before the block: an evaluation (its data
    loader draws a seed from torch's generator) does not change what training draws next."""
    saved = RNGState().state_dict()
    try:
        yield
    finally:
        RNGState().load_state_dict(saved)


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
        resizable: the run resumes a checkpoint of another world size when the global batch is the checkpoint's
            (`check_world_size`); ``train.micro_batch_size`` and ``train.grad_accum_steps`` may then change as long
            as it is. For DCP checkpoints whose data position is global (`cookbook.sampler.DataPosition`).
        published: a folder appears under `root` only once complete (renamed there), so one without ``meta.json``
            or a file of `files` is damaged (warned of); ``False``: written in place (Ray Train), so it is an
            interrupted save, passed over silently. Default: whether `files` holds DCP's ``.metadata``.
    """

    def __init__(self, root: str | Path, *, folder: str = "step_<n>", files: tuple[str, ...] = (".metadata",),
                 run_dir: str | Path | None = None, resume_key: str = "checkpoint.resume", processes: str = "ranks",
                 cannot_remap: str = "its per-rank data-loader and RNG state cannot be remapped",
                 same_size: str = "the same number of processes (NGPU x NNODES = {n})", resizable: bool = False,
                 published: bool | None = None):
        self.root = Path(root)
        self.published = DCP_METADATA in files if published is None else published
        self.bad: dict[Path, str] = {}  # folders whose files did not match their checksums (verify), with why
        self.verified: set[Path] = set()  # folders this process verified (verify) or wrote itself
        self.folder, self.files = folder, tuple(files)
        self._name = re.compile(re.escape(folder).replace(re.escape("<n>"), r"(\d+)"))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.resume_key, self.processes = resume_key, processes
        self.cannot_remap, self.same_size = cannot_remap, same_size
        self.resizable = resizable

    # ------------------------------------------------------------------ finding
    def problem(self, path: str | Path) -> str | None:
        """What is wrong with the checkpoint folder `path`, or ``None`` when it is complete.

        Cheap and collective-free: reads ``meta.json`` and, when `files` holds DCP's ``.metadata``, DCP's
        index (``FileSystemReader(path).read_metadata()``), and checks that every file the index names
        exists and holds the bytes its entries need (``offset + length``); no tensor is read. A ``meta.json``
        that lists the folder's files with their sizes (``files``, `file_sizes`: the Hugging Face Trainer's
        layout, which has no such index) has each of them checked for that exact size.

        Returns:
            ``None``, or what is wrong as words for a message: ``"no meta.json inside"``, ``"meta.json is
            empty"``, ``"meta.json is not JSON (...)"``, ``".metadata is unreadable (...)"``,
            ``"__0_0.distcp is missing (its index names it)"``, ``"__0_0.distcp is 1234 bytes, its index says
            5678 are needed"``, ``"global_step6/zero_pp_rank_1_mp_rank_00_optim_states.pt is 1000 bytes,
            meta.json says 1236479"``.
        """
        path = Path(path)
        if path in self.bad:
            return self.bad[path]
        missing = self._missing(path)
        if missing:
            return f"no {', '.join(missing)} inside"
        try:
            text = (path / META_FILE).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            return f"{META_FILE} is unreadable ({_reason(exc)})"
        if not text.strip():
            return f"{META_FILE} is empty"
        try:
            meta = json.loads(text)
        except ValueError as exc:
            return f"{META_FILE} is not JSON ({_reason(exc)})"
        if not isinstance(meta, dict):
            return f"{META_FILE} is not a JSON object"
        if isinstance(meta.get(FILES_KEY), Mapping):
            listed = _sizes_problem(path, meta[FILES_KEY], listed=True)
            if listed is not None:
                return listed
        return _dcp_problem(path) if DCP_METADATA in self.files else None

    def _missing(self, path: Path) -> list[str]:
        """The files of a checkpoint (``meta.json`` and `files`) that `path` lacks."""
        return [f for f in (META_FILE, *self.files) if not (path / f).is_file()]

    def verify(self, path: str | Path) -> str | None:
        """What is wrong with the checkpoint folder `path`, reading every file it lists in ``meta.json``'s
        ``checksums`` (`checksums`) and comparing: `problem`, then ``"__0_0.distcp does not match its checksum
        (xxh3_64 ... in meta.json, ... now)"``, or ``None``. A folder without checksums (written before they
        existed) passes on `problem` alone. A folder found wrong is remembered (`bad`): `problem`, `latest` and
        the pruning of old checkpoints treat it as damaged from then on; one found right joins `verified`.
        Costs one read of the folder (xxh3_64: several GB/s)."""
        path = Path(path)
        found = self.problem(path)
        if found is None:
            sums = read_meta(path).get(CHECKSUMS_KEY)
            found = _checksum_problem(path, sums) if isinstance(sums, Mapping) else None
            if found is not None:
                self.bad[path] = found
        if found is None:
            self.verified.add(path)
        return found

    def verified_latest(self) -> Path | None:
        """The newest complete checkpoint that this process verified or wrote (`verified`), or ``None``: what a
        message may call the last good one (it held finite weights when written: `cookbook.loop` saves none
        else)."""
        for _, path in reversed(self.candidates()):
            if path in self.verified and self.is_complete(path):
                return path
        return None

    def is_complete(self, path: str | Path) -> bool:
        """Whether `path` is a complete checkpoint (`problem` finds nothing wrong)."""
        return self.problem(path) is None

    def number(self, path: str | Path) -> int:
        """The step or epoch in the name of the checkpoint folder `path`; ``-1`` for another name."""
        m = self._name.fullmatch(Path(path).name)
        return int(m.group(1)) if m else -1

    def candidates(self) -> list[tuple[int, Path]]:
        """``(number, folder)`` of every folder under `root` named like a checkpoint (complete or not), oldest
        first."""
        if not self.root.is_dir():
            return []
        return sorted((int(m.group(1)), p) for p in self.root.iterdir() if (m := self._name.fullmatch(p.name)))

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints under `root`, oldest first (by the number in their name). Folders of
        interrupted saves (another name) and damaged or unpublished ones (`problem`) are left out."""
        return [p for _, p in self.candidates() if self.is_complete(p)]

    def latest(self) -> Path | None:
        """The checkpoint ``resume=auto`` takes: the newest complete one, or ``None``."""
        for _, path in reversed(self.candidates()):
            if self.is_complete(path):
                return path
        return None

    def damaged(self, newer_than: str | Path | None = None) -> list[tuple[Path, str]]:
        """Checkpoint folders that are damaged, oldest first, with what is wrong (`problem`).

        A folder whose ``meta.json`` or a file of `files` is missing counts as damaged for DCP checkpoints
        (published only once complete); for other layouts (Ray Train writes its folders in place) it is an
        interrupted save and is left out.

        Args:
            newer_than: only folders numbered after this checkpoint folder; ``None``: all.
        """
        after = self.number(newer_than) if newer_than is not None else -1
        found = []
        for number, path in self.candidates():
            if number <= after:
                continue
            problem = self.problem(path)
            if problem is not None and (self.published or path in self.bad or not self._missing(path)):
                found.append((path, problem))
        return found

    def resolve(self, resume: str | None) -> Path | None:
        """Turn a ``resume`` value into a checkpoint folder.

        With ``"auto"``, damaged checkpoints newer than the one found are skipped with one warning line
        (rank 0): ``checkpoint <folder> is damaged (<what>); resuming from <folder> instead``.

        Args:
            resume: ``"auto"`` (`latest`, or none), ``"none"``/``""``/``None`` (start fresh), or the path
                of a checkpoint folder.

        Raises:
            CheckpointError: an explicit path that is not a complete checkpoint (the message says what is
                missing or damaged); ``"auto"`` where every checkpoint under `root` is damaged.
        """
        if resume in (None, "", "none", "null"):
            return None
        if resume == "auto":
            path = self.latest()
            while path is not None and self.verify(path) is not None:  # remembered as bad: latest moves on
                path = self.latest()
            skipped = self.damaged(newer_than=path)
            what = "; ".join(f"{p} ({problem})" for p, problem in skipped)
            if skipped and path is None:
                raise CheckpointError(
                    f"{self.resume_key}=auto: no complete checkpoint remains under {self.root}, every one is damaged: "
                    f"{what}. Restore them from a copy, or start afresh with {self.start_afresh()}")
            if skipped and _rank() == 0 and not (os.environ.get("COOKBOOK_CHECKED") and not restarted()):
                # (workers of a first attempt are quiet: `cookbook.launch`'s --check process has said it)
                which = (f"checkpoint {skipped[0][0]} is damaged ({skipped[0][1]})" if len(skipped) == 1
                         else f"checkpoints {what} are damaged")
                get_logger().warning(f"warning: {which}; resuming from {path} instead")
            return path
        path = Path(resume)
        problem = self.verify(path)
        if self._missing(path):
            raise CheckpointError(f"{self.resume_key}={resume!r} is not a complete checkpoint folder ({problem}): "
                                  f"use {self.resume_key}=auto (the newest one under {self.root}), none, or the path "
                                  f"of a {self.folder} folder")
        if problem is not None:
            raise CheckpointError(f"{self.resume_key}={resume!r} is a damaged checkpoint ({problem}): use "
                                  f"{self.resume_key}=auto (the newest complete one under {self.root}), none, or the "
                                  f"path of another {self.folder} folder")
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
                written by another world size (unless `resizable`), with another global batch (`resizable`), or
                with other settings (the message lists them and what to do); or the stop point is not after it.

        A worker of a group that its launcher restarted after a failure (`restarted`) resumes from the newest
        checkpoint whatever `resume` says, once the job has one: it continues its own run.
        """
        if restarted() and self.latest() is not None:
            resume = "auto"
        path = self.resolve(resume)
        if path is None:
            if self.latest() is not None or self.damaged():
                raise CheckpointError(
                    f"{self.resume_key}={resume!r} but {self.root} holds checkpoints of an earlier run, which a later "
                    f"resume=auto would pick up: start afresh with a new output_dir (or delete "
                    f"{self.run_dir or self.root})")
            return None
        meta = read_meta(path)
        if world_size is not None:
            self.check_world_size(path, meta, world_size, config)
            if self.resizable:  # checked as one number, the global batch
                may_change = (*may_change, *BATCH_KEYS)
        diff = config_changes(meta["config"], config, may_change) if config is not None and "config" in meta else ""
        if diff:
            raise CheckpointError(f"{path} was written with other settings ({diff}); resuming would mix two runs. " +
                                  (self._length_changed(path, meta, config) or
                                   f"Use the same settings, or start afresh with {self.start_afresh()}"))
        key, value = stop_at
        unit = key.rsplit("_", 1)[-1]
        if 0 < value <= meta.get(unit, 0):
            raise CheckpointError(f"{key}={value} is not after the checkpoint {path} ({unit} {meta[unit]}): raise it, "
                                  f"or remove it to train to the end")
        return path

    def _length_changed(self, path: Path, meta: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
        """Why a resume may not change the run's length (`LENGTH_KEYS`: ``train.max_steps``, ``train.epochs``)
        and what to do instead, as sentences that follow the list of changed settings; ``None`` when the length
        is the checkpoint's.

        A finished run (its checkpoint at the end of its length) cannot be extended, nor an unfinished one
        lengthened or shortened: the learning-rate schedule is laid out over the length (the decay ends there,
        ``optim.warmup_ratio`` is a fraction of it), so the steps after the checkpoint would follow another
        schedule than the one the run that wrote it followed."""
        old, new = flatten(meta["config"]), flatten(config)
        by_steps = all(isinstance(c.get("train.max_steps"), int) and c["train.max_steps"] > 0 for c in (old, new))
        key = next((k for k in LENGTH_KEYS if k in old and old.get(k) != new.get(k)
                    and not (k == "train.epochs" and by_steps)), None)  # train.max_steps > 0 overrides train.epochs
        if key is None:
            return None
        unit, was, done = LENGTH_KEYS[key], old[key], meta.get(LENGTH_KEYS[key], 0)
        finished = isinstance(was, int) and 0 < was <= done
        where = f"It is {unit} {done} of a run of {key}={was}" if unit == "step" else f"It was written by a run of {key}={was}"
        what = (f"It is the end of a finished run ({unit} {done} of {key}={was}), and a finished run cannot be extended"
                if finished else f"{where}, and a resume cannot change a run's length")
        stop = next((k for k in (f"train.stop_at_{unit}", "train.stop_at_step", "train.stop_at_epoch") if k in new), None)
        weights = ("; it starts from model.name_or_path, so name the model this run exported there (such as its "
                   "output_dir's final folder) to start from this run's weights" if "model.name_or_path" in new else "")
        split = f". To split one run into parts, keep {key} and set {stop} (each part resumes the last)" if stop else ""
        return (f"{what}: the learning-rate schedule is laid out over {key} (its decay ends there, a warm-up ratio is a "
                f"fraction of it), so the steps after the checkpoint would follow another schedule than the one that "
                f"brought the run there. To train longer, start a new run with {key}={new.get(key)} in "
                f"{self.start_afresh()}{weights}{split}")

    def check_world_size(self, path: str | Path, meta: Mapping[str, Any], world_size: int,
                         config: Mapping[str, Any] | None = None) -> None:
        """Refuse a checkpoint that `meta` (its ``meta.json``) says another number of processes wrote; one
        that did not record it passes. With `resizable`, refuse instead a global batch other than the
        checkpoint's (`global_batch` of its ``config`` and of `config`), on any world size.

        Args:
            config: this run's config (flat or nested); needed with `resizable`.

        Raises:
            CheckpointError: not `resizable`: naming both sizes, why (`cannot_remap`), what to do and which recipes
                resume on another size. `resizable`: naming both global batches and the ``train.grad_accum_steps``
                or ``train.micro_batch_size`` that keeps it, or (without both configs) that it cannot be told.
        """
        n = meta.get("world_size")
        if self.resizable:
            self._check_global_batch(path, meta, world_size, config)
        elif n not in (None, world_size):
            raise CheckpointError(f"{path} was written by {n} {self.processes} but this job has {world_size}: "
                                  f"{self.cannot_remap} (resuming on another number of processes is supported by "
                                  f"{resizable_recipes()} only). Resume with {self.same_size.format(n=n)}, or start "
                                  f"afresh with {self.start_afresh()}")

    def _check_global_batch(self, path: str | Path, meta: Mapping[str, Any], world_size: int,
                            config: Mapping[str, Any] | None) -> None:
        """`check_world_size` of a resizable run: the global batch must be the checkpoint's."""
        n = meta.get("world_size")
        if config is None or "config" not in meta:
            if n not in (None, world_size):
                raise CheckpointError(f"{path} was written by {n} {self.processes} but this job has {world_size}, and "
                                      f"its global batch cannot be told (no config to compare): resume with "
                                      f"{self.same_size.format(n=n)}")
            return
        if n is None:
            return
        was, now = global_batch(meta["config"], n), global_batch(config, world_size)
        target, micro, accum = was[0], now[1], now[2]
        if now[0] == target:
            return
        ways = []  # one key changed, the other kept
        if target % (micro * world_size) == 0:
            k = target // (micro * world_size)
            ways.append(f"{BATCH_KEYS[1]}={k} ({micro} x {k} x {world_size} = {target})")
        if target % (accum * world_size) == 0 and target // (accum * world_size) != micro:
            k = target // (accum * world_size)
            ways.append(f"{BATCH_KEYS[0]}={k} ({k} x {accum} x {world_size} = {target})")
        todo = (f"set {' or '.join(ways)}" if ways else
                f"no micro-batch x accumulation x {world_size} makes {target}" if target % world_size else
                f"set {BATCH_KEYS[0]} x {BATCH_KEYS[1]} = {target // world_size}")
        raise CheckpointError(
            f"{path} was written with a global batch of {target} samples ({was[1]} micro-batch x {was[2]} accumulation "
            f"x {n} {_plural(self.processes, n)}) but this job's is {now[0]} ({micro} x {accum} x {world_size}); a resume "
            f"keeps the global batch, so that a step, max_steps, the learning-rate schedule and the data position keep "
            f"their meaning. To continue on {world_size} {_plural(self.processes, world_size)}, {todo}; or resume with "
            f"{self.same_size.format(n=n)}, or start afresh with {self.start_afresh()}")

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


def resizable_recipes() -> str:
    """The recipes that resume on another world size, as words (``"modernbert-ddp, qwen-fsdp2-sft and
    retinanet-ddp"``): those whose ``train.py`` declares ``RESIZABLE = True`` beside this package (in the
    repository); installed elsewhere, ``"the recipes whose train.py says RESIZABLE = True"``."""
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    names = sorted(t.parent.name for t in recipes.glob("*/train.py")
                   if re.search(r"^RESIZABLE = True\b", t.read_text(), re.M))
    if not names:
        return "the recipes whose train.py says RESIZABLE = True"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _plural(word: str, n: int) -> str:
    """`word` (a plural: ``"ranks"``) for a count of `n`: ``"rank"`` for 1."""
    return word.removesuffix("s") if n == 1 else word


def global_batch(config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """``(global batch, micro-batch, accumulation)`` of a run's config (flat or nested) on `world_size` processes:
    ``train.micro_batch_size x train.grad_accum_steps x world_size`` samples per optimizer step (a key the config
    lacks counts as 1)."""
    flat = flatten(config)
    micro, accum = (int(flat.get(k) or 1) for k in BATCH_KEYS)
    return micro * accum * world_size, micro, accum


def restarted() -> bool:
    """Whether this process is a worker of a group that its launcher started again after a failure:
    ``COOKBOOK_RESTART_COUNT`` (`cookbook.torchrun`) or torchrun's own ``TORCHELASTIC_RESTART_COUNT`` above 0."""
    return any(os.environ.get(k, "0").strip() not in ("", "0")
               for k in (RESTART_COUNT_ENV, "TORCHELASTIC_RESTART_COUNT"))


def read_meta(path: str | Path) -> dict[str, Any]:
    """The ``meta.json`` of the checkpoint folder `path`."""
    return json.loads((Path(path) / META_FILE).read_text())


def _reason(exc: BaseException, limit: int = 120) -> str:
    """An exception as a short phrase for a one-line message: ``"JSONDecodeError: Expecting value: ..."``; an OS
    error as its name and text, and its file if it has one: ``"ENOSPC, No space left on device: '/ckpt/meta.json'"``."""
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        text = f"{errno.errorcode[exc.errno]}, {exc.strerror or os.strerror(exc.errno)}"
        return text + (f": {exc.filename!r}" if exc.filename else "")
    text = (str(exc).strip().splitlines() or [""])[0]
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def file_sizes(folder: str | Path) -> dict[str, int]:
    """Every file under `folder` but ``meta.json``, by its path relative to `folder` (``/``-separated), with its
    size in bytes: what a checkpoint layout without an index of its own (the Hugging Face Trainer's:
    DeepSpeed's shards, ``model.safetensors``, ...) lists in ``meta.json`` under ``files``, for `ResumeGuard.problem`
    to check."""
    folder = Path(folder)
    return {p.relative_to(folder).as_posix(): p.stat().st_size for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != META_FILE}


def _hasher() -> tuple[str, Any]:
    """``(name, new)`` of the checksum `checksums` writes: xxh3_64 (``xxhash``), else zlib's crc32."""
    try:
        import xxhash

        return "xxh3_64", xxhash.xxh3_64
    except ImportError:
        return "crc32", _Crc32


class _Crc32:
    def __init__(self) -> None:
        self.value = 0

    def update(self, data: bytes) -> None:
        self.value = zlib.crc32(data, self.value)

    def hexdigest(self) -> str:
        return f"{self.value:08x}"


def _file_checksum(file: Path, kind: str) -> str:
    """``"<kind>:<hex>"`` of the bytes of `file` (read in 4 MiB blocks)."""
    new = {"crc32": _Crc32}.get(kind) or _hasher()[1]
    h = new()
    with open(file, "rb") as f:
        while block := f.read(4 << 20):
            h.update(block)
    return f"{kind}:{h.hexdigest()}"


def checksums(folder: str | Path) -> dict[str, str]:
    """Every file under `folder` but ``meta.json``, by its path relative to `folder`, with the checksum of its bytes:
    ``{"__0_0.distcp": "xxh3_64:9f0c..."}`` (crc32 without the ``xxhash`` package). What a writer stores in
    ``meta.json`` under ``checksums`` at publish time, for `ResumeGuard.verify` to compare on resume."""
    folder, kind = Path(folder), _hasher()[0]
    return {p.relative_to(folder).as_posix(): _file_checksum(p, kind) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.relative_to(folder).as_posix() != META_FILE}


def _checksum_problem(path: Path, sums: Mapping[str, Any]) -> str | None:
    """The first file of `sums` (``meta.json``'s ``checksums``) whose bytes under `path` do not match, as words:
    ``"__0_0.distcp does not match its checksum (xxh3_64:... in meta.json, xxh3_64:... now)"``; ``None``."""
    for name, want in sorted(sums.items()):
        kind = str(want).split(":", 1)[0]
        try:
            have = _file_checksum(path / name, kind if kind in ("xxh3_64", "crc32") else "xxh3_64")
        except FileNotFoundError:
            return f"{name} is missing ({META_FILE} lists it)"
        except OSError as exc:
            return f"{name} is unreadable ({_reason(exc)})"
        if have != want:
            return f"{name} does not match its checksum ({want} in {META_FILE}, {have} now)"
    return None


def _sizes_problem(path: Path, sizes: Mapping[str, Any], listed: bool) -> str | None:
    """What is wrong with the files of the checkpoint folder `path` that `sizes` names (relative path -> bytes), or
    ``None``. `listed`: the sizes are ``meta.json``'s list of the folder's files (`file_sizes`), which each must
    match exactly; else DCP's index, which says how many bytes each file must hold at least."""
    for name, size in sorted(sizes.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing ({META_FILE} lists it)" if listed else f"{name} is missing (its index names it)"
        except OSError as exc:
            return f"{name} is unreadable ({_reason(exc)})"
        if listed and have != size:
            return f"{name} is {have} bytes, {META_FILE} says {size}"
        if have < size:
            return f"{name} is {have} bytes, its index says {size} are needed"
    return None


def _dcp_problem(path: Path) -> str | None:
    """What is wrong with the DCP files of the checkpoint folder `path` (see `ResumeGuard.problem`), or ``None``.

    Reads DCP's index (``.metadata``: ``storage_data`` maps each tensor chunk to a ``_StorageInfo(relative_path,
    offset, length)``) and checks that each file it names exists and is at least as long as its last entry
    ends (bytes)."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything (EOFError, UnpicklingError, ...)
        return f"{DCP_METADATA} is unreadable ({_reason(exc)})"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return f"{DCP_METADATA} holds no index of the files"
    needed: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    return _sizes_problem(path, needed, listed=False)


def _mount_point(path: Path) -> Path:
    """The mount point of the file system holding `path` (or of its nearest existing folder)."""
    path = path.expanduser().absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:
        path = path.parent
    return path


def _what_to_do(code: int | None, root: Path) -> str:
    """The advice of a failed save for the OS error number `code`, naming the file system of `root`."""
    fs = _mount_point(root)
    if code in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = f" ({shutil.disk_usage(fs).free / 2**30:.1f} GiB free now)"
        except OSError:
            free = ""
        quota = " or raise your quota there" if code == errno.EDQUOT else ""
        return f"free space on {fs}{free}{quota}"
    if code == errno.EFBIG:
        return f"raise the file size limit (ulimit -f) or the largest file size of {fs}"
    if code == errno.EROFS:
        return f"make {fs} writable (it is mounted read-only)"
    if code in (errno.EACCES, errno.EPERM):
        return f"give this user write access to {root}"
    if code == errno.EIO:
        return f"check the storage of {fs} (the system log names the failing device)"
    return f"fix the cause on {fs}"


def _from_rank0(value: Any) -> Any:
    """Rank 0's `value` on every rank (a broadcast; without a process group, `value` itself)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _os_error_in(exc: BaseException) -> OSError | None:
    """The `OSError` in `exc`'s chain of causes and contexts (itself included), or ``None``."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


class _Writer(dcp.FileSystemWriter):
    """DCP's `FileSystemWriter`, whose failed write raises the OS error beneath it.

    ``torch.save`` writes each tensor through a zip writer that reports a failed write (disk full, file too
    large) as ``RuntimeError: ... unexpected pos 704 vs 598``, with the `OSError` only as its context, which
    DCP's gathering of errors from every rank drops (exceptions pickle without their context)."""

    def write_data(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().write_data(*args, **kwargs)
        except Exception as exc:
            os_error = _os_error_in(exc)
            if os_error is None or os_error is exc:
                raise
            raise OSError(os_error.errno, os_error.strerror, os_error.filename) from exc


def _os_failure(exc: BaseException) -> tuple[int, OSError] | None:
    """``(rank, OSError)`` of the first rank whose part of a DCP save failed with an OS error, from DCP's
    `CheckpointException` (its ``failures``: rank -> (exception, traceback)); ``None`` when none did."""
    for rank, failure in sorted(getattr(exc, "failures", {}).items()):
        os_error = _os_error_in(failure[0] if isinstance(failure, tuple) else failure)
        if os_error is not None:
            return rank, os_error
    return None


class Checkpointer:
    """Save, find and load checkpoints under one folder.

    Args:
        root: the checkpoints folder (created if needed). Shared by all nodes.
        keep_last: number of newest complete checkpoints to keep; older ones are deleted
            after a new one is published. ``0`` keeps all.
        run_dir: the run's output folder, named in the resume guard's advice ("or delete <run_dir>").
        resizable: a checkpoint written by another world size may be resumed when the global batch is kept
            (`ResumeGuard` ``resizable``); `load` then needs a `cookbook.sampler.DataPosition` in the state.
        cannot_remap: why another world size's checkpoint cannot be resumed, for the refusal (`ResumeGuard`);
            default: the per-rank data-loader and RNG state.

    Every method is collective: call it on every rank.
    """

    def __init__(self, root: str | Path, keep_last: int = 3, run_dir: str | Path | None = None,
                 resizable: bool = False, cannot_remap: str | None = None):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.guard = ResumeGuard(self.root, run_dir=run_dir, resizable=resizable,
                                 **({"cannot_remap": cannot_remap} if cannot_remap else {}))

    # ------------------------------------------------------------------ finding
    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest first. Temporary folders of interrupted saves are ignored."""
        return self.guard.complete_checkpoints()

    def latest(self) -> Path | None:
        """The newest complete checkpoint, or ``None``."""
        return self.guard.latest()

    def verified_latest(self) -> Path | None:
        """The newest checkpoint this process saved or verified on resume (`ResumeGuard.verified_latest`), or
        ``None``: the one the stop message of a diverged run names."""
        return self.guard.verified_latest()

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

        Rank 0 first removes every leftover ``.tmp-*`` / ``.old-*`` folder under `root` (saves or publishes
        that a crash interrupted). After publishing, checkpoints beyond `keep_last` and damaged folders
        older than this one are deleted.

        Args:
            step: optimizer steps completed; names the folder.
            state: name -> DCP `Stateful` or (nested) dict of tensors / picklable objects.
            extra_meta: JSON-serialisable facts stored in ``meta.json`` (e.g. epoch, loss).

        Returns:
            The published folder.

        Raises:
            CheckpointSaveError: on every rank, when any rank could not write its part, or rank 0 could not
                prepare the folder, write ``meta.json`` or publish (an `OSError`: disk full, file too large,
                I/O error, ...). The temporary folder is removed and the previous checkpoint is intact.
            Other exceptions of ``dcp.save`` (a bug in a ``state_dict``, a lost peer) pass through as they
                are; the next save removes what they left.
        """
        final = self.root / f"step_{step:08d}"
        tmp = self.root / f".tmp-step_{step:08d}"
        start = time.perf_counter()
        failure = None
        if _rank() == 0:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                self._remove_leftovers()
                tmp.mkdir()
            except OSError as exc:
                failure = ("os", _reason(exc), exc.errno)
        self._raise_failure(step, final, _from_rank0(failure))
        try:
            dcp.save(dict(state), checkpoint_id=str(tmp), storage_writer=_Writer(str(tmp)))
        except OSError as exc:  # raised here before DCP's collectives agreed: only this rank knows
            raise self._save_error(step, final, _rank(), exc) from exc
        except CheckpointException as exc:  # every rank has it (DCP gathers and broadcasts failures)
            if _rank() == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            barrier()
            found = _os_failure(exc)
            if found is None:
                raise
            raise self._save_error(step, final, *found) from None
        barrier()
        failure, error = None, None
        if _rank() == 0:
            meta = {"step": step, "world_size": _world_size(), "time": time.time(), **(extra_meta or {})}
            try:
                meta[CHECKSUMS_KEY] = checksums(tmp)
                with open(tmp / META_FILE, "w") as f:
                    json.dump(meta, f, indent=2)
                    f.flush()
                    os.fsync(f.fileno())
                _publish(tmp, final)
            except Exception as exc:  # noqa: BLE001 - every rank must hear of it, or they would wait forever
                error = exc
                failure = ("os", _reason(exc), exc.errno) if isinstance(exc, OSError) else ("bug", _reason(exc), None)
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                self._prune(final)
        failure = _from_rank0(failure)
        if failure is None:
            self.guard.bad.pop(final, None)
            self.guard.verified.add(final)
        if error is not None and failure[0] == "bug":
            raise error
        self._raise_failure(step, final, failure, error)
        get_logger().info(f"checkpoint saved: {final} ({time.perf_counter() - start:.1f}s)")
        return final

    def _remove_leftovers(self) -> None:
        """Delete what interrupted saves left under `root`: ``.tmp-*`` and ``.old-*`` folders (rank 0)."""
        for path in self.root.iterdir():
            if path.name.startswith(LEFTOVER_PREFIXES):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path, ignore_errors=True)
                else:
                    with contextlib.suppress(OSError):
                        path.unlink()

    def _raise_failure(self, step: int, final: Path, failure: tuple[str, str, int | None] | None,
                       error: BaseException | None = None) -> None:
        """Raise, on every rank, the failure that rank 0 met (``(kind, reason, errno)`` as broadcast)."""
        if failure is None:
            return
        kind, reason, code = failure
        if kind == "bug":
            raise RuntimeError(f"rank 0 failed to publish the checkpoint {final}: {reason}")
        exc = OSError(code, reason) if code is not None else OSError(reason)
        raise self._save_error(step, final, 0, exc, reason) from error

    def _save_error(self, step: int, final: Path, rank: int, exc: OSError, reason: str | None = None) -> CheckpointSaveError:
        """The one-line `CheckpointSaveError` of a save that failed on `rank` with `exc`."""
        return save_error(step, final, self.latest(), rank if _world_size() > 1 else None, exc, reason)

    def _prune(self, published: Path) -> None:
        """Delete checkpoints beyond `keep_last` and damaged folders older than `published` (rank 0)."""
        complete, stale = [], []
        for number, path in self.guard.candidates():
            if self.guard.is_complete(path):
                complete.append(path)
            elif number < self.guard.number(published):
                stale.append(path)
        stale += complete[: -self.keep_last] if self.keep_last > 0 else []
        for old in stale:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------------ loading
    def load(self, path: str | Path, state: Mapping[str, Any]) -> dict[str, Any]:
        """Load `state` in place from the checkpoint folder `path`.

        Model and optimizer states reshard automatically (DCP). Per-rank state (`RankLocalState`) needs the
        world size the checkpoint was written with; on another one a `resizable` checkpointer whose `state`
        holds a `cookbook.sampler.DataPosition` loads everything else (the data then continues at the global
        position) and leaves the per-rank state as this run set it up, with one line (rank 0) saying what was
        resharded, where the data continues and what was not restored. Check the global batch before, with
        `check_resume` (the guard's `ResumeGuard.check_world_size`).

        Returns:
            The checkpoint's ``meta.json`` as a dict (``step``, ``world_size``, extras).

        Raises:
            CheckpointError: the folder is incomplete or damaged (`ResumeGuard.problem`), or it holds
                per-rank state written by a different number of ranks (not `resizable`).
            ValueError: `resizable`, another world size, and `state` holds no `DataPosition`.
        """
        path = Path(path)
        problem = self.guard.problem(path)
        if problem is not None:
            raise CheckpointError(f"{path} is not a complete checkpoint ({problem})")
        meta = read_meta(path)
        local = [k for k, v in state.items() if isinstance(v, RankLocalState)]
        written_by, now = meta.get("world_size"), _world_size()
        resized = written_by not in (None, now)
        if resized and not self.guard.resizable and local:
            self.guard.check_world_size(path, meta, now)  # raises
        if resized and self.guard.resizable:
            positions = [v for v in state.values() if isinstance(v, DataPosition)]
            if not positions:
                raise ValueError("a resizable Checkpointer loads another world size's checkpoint only with a "
                                 "DataPosition in the state (the data position of the whole job)")
            dropped = "; ".join(f"{k}: {', '.join(state[k].items)}" for k in local)
            state = {k: v for k, v in state.items() if k not in local}
        dcp.load(dict(state), checkpoint_id=str(path))
        if resized and self.guard.resizable:
            batch = global_batch(meta["config"], written_by)[0] if "config" in meta else None
            get_logger().info(
                f"resized: {path} was written by {written_by} {_plural(self.guard.processes, written_by)}, this job has "
                f"{now}. Resharded by "
                f"DCP: the model and optimizer state. Remapped: the data position, {positions[0].describe()} in the "
                f"same order" + (f" (global batch {batch} samples, as before)" if batch else "")
                + (f". Not restored, as in a fresh run (seeded at start-up): the per-rank state ({dropped})"
                   if local else ""))
        get_logger().info(f"resumed from {path} (step {meta['step']})")
        return meta


def save_error(step: int, final: Path, previous: Path | None, rank: int | None, exc: OSError,
               reason: str | None = None) -> CheckpointSaveError:
    """The one-line `CheckpointSaveError` of the save of step `step` to the folder `final` that failed with `exc`.

    Args:
        previous: the newest complete checkpoint, which the failed save left intact (``None``: there is none).
        rank: the rank that met the error, named in the message; ``None`` in a job of one process.
        reason: the error as words, when `exc` was rebuilt from another rank's (default: from `exc`).

    Returns:
        ``could not save the checkpoint of step 4 to <final> (rank 1: EFBIG, File too large: '<file>'); the previous
        checkpoint <previous> is intact. Raise the file size limit (ulimit -f) ... and run the same command again: it
        resumes from <previous>``, with ``errno`` set to the OS error's.
    """
    where = f"rank {rank}: " if rank is not None else ""
    kept = f"the previous checkpoint {previous} is intact" if previous is not None else "there is no earlier checkpoint"
    again = f"it resumes from {previous}" if previous is not None else "it starts from step 0"
    todo = _what_to_do(exc.errno, Path(final).parent)
    error = CheckpointSaveError(
        f"could not save the checkpoint of step {step} to {final} ({where}{reason or _reason(exc)}); {kept}. "
        f"{todo[0].upper()}{todo[1:]} and run the same command again: {again}")
    error.errno = exc.errno
    return error


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], may_change: tuple[str, ...] = ()) -> str:
    """The settings that differ between two configs (flat or nested dicts), as ``"key: old -> new, ..."``
    (at most six, then ``...``); ``""`` when none. Keys in `may_change` are ignored (a key ending in ``.*``
    ignores a whole section; ``"key=value"`` ignores a key that `old` lacks, a setting added since, when `new`
    has it at that value, its default)."""
    old, new = flatten(old), flatten(new)
    added = dict(m.split("=", 1) for m in may_change if "=" in m)
    changed = [k for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)
               and not any(k == m or (m.endswith(".*") and k.startswith(m[:-1])) for m in may_change)
               and not (k in added and k not in old and str(new.get(k)) == added[k])]
    diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
    return diff + (", ..." if len(changed) > 6 else "")


def publish(tmp: str | Path, final: str | Path) -> None:
    """Rename the finished folder `tmp` to `final` (atomic on one file system), replacing an older `final`
    only once the new one is complete. Call on one rank."""
    _publish(Path(tmp), Path(final))


def _publish(tmp: Path, final: Path) -> None:
    """Rename a finished folder to its final name (atomic), replacing an older one of that name; if the
    rename fails, the older one is put back."""
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
