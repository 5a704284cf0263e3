"""Which checkpoint a run resumes from, and whether it may: `ResumeGuard`, the one resume check of every recipe
(DCP, the Hugging Face Trainer, Ray Train), and its damage checks of a checkpoint folder (DCP's index, the sizes and
checksums ``meta.json`` lists). `cookbook.checkpoint` re-exports the names recipes import."""

from __future__ import annotations

import errno
import json
import os
import re
import zlib
from pathlib import Path
from typing import Any, Mapping

import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from cookbook.config import flatten
from cookbook.dist import get_logger
from cookbook.errors import RESTART_COUNT_ENV, CheckpointError, first_line

try:
    from xxhash import xxh3_64 as _xxh3_64
except ImportError:
    _xxh3_64 = None

META_FILE = "meta.json"
_DCP_METADATA = ".metadata"  # DCP's index of a checkpoint: which bytes of which file hold each tensor
FILES_KEY = "files"  # meta.json's list of a checkpoint's files and sizes, where no index names them (file_sizes)
CHECKSUMS_KEY = "checksums"  # meta.json's checksum of each file, written at publish time (checksums)
_BATCH_KEYS = ("train.micro_batch_size", "train.grad_accum_steps")  # with the world size, they make the global batch
_LENGTH_KEYS = {"train.max_steps": "step", "train.epochs": "epoch"}  # the run's length, with the unit meta.json counts
_CHECKSUM = "xxh3_64" if _xxh3_64 is not None else "crc32"  # the checksum `checksums` writes


class ResumeGuard:
    """Find a run's newest complete checkpoint and refuse a resume that would mix two runs; collective-free.
    A checkpoint is a folder under `root` named like `folder` (``<n>``: its number) holding ``meta.json`` (``step``,
    ``world_size``, ``config``, maybe ``epoch``) and `files`. `run_dir`, `resume_key`, `processes`, `cannot_remap`
    and `same_size` word the messages. `resizable`: another world size resumes with the same global batch.
    `published` (default: DCP's ``.metadata`` in `files`): an incomplete folder is damage, else an unfinished save."""

    resume_key = "checkpoint.resume"  # the config key the messages name

    def __init__(
        self,
        root: str | Path,
        *,
        folder: str = "step_<n>",
        files: tuple[str, ...] = (".metadata",),
        run_dir: str | Path | None = None,
        processes: str = "ranks",
        cannot_remap: str = "its per-rank data-loader and RNG state cannot be remapped",
        same_size: str = "the same number of processes (NGPU x NNODES = {n})",
        resizable: bool = False,
        published: bool | None = None,
    ):
        self.root = Path(root)
        self.published = _DCP_METADATA in files if published is None else published
        self.bad: dict[Path, str] = {}  # folders whose files did not match their checksums (verify), with why
        self.verified: set[Path] = set()  # folders this process verified (verify) or wrote itself
        self.folder, self.files = folder, tuple(files)
        self._name = re.compile(re.escape(folder).replace(re.escape("<n>"), r"(\d+)"))
        self.run_dir = Path(run_dir) if run_dir is not None else None
        self.processes, self.cannot_remap = processes, cannot_remap
        self.same_size, self.resizable = same_size, resizable

    # ------------------------------------------------------------------ finding
    def problem(self, path: str | Path) -> str | None:
        """What is wrong with the checkpoint folder `path` (words: ``"no meta.json inside"``), or None when complete.
        Reads ``meta.json`` and DCP's index or the sizes ``meta.json`` lists (`file_sizes`); no tensor is read."""
        path = Path(path)
        if path in self.bad:
            return self.bad[path]
        if missing := self._missing(path):
            return f"no {', '.join(missing)} inside"
        try:
            text = (path / META_FILE).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            return f"{META_FILE} is unreadable ({reason(exc)})"
        if not text.strip():
            return f"{META_FILE} is empty"
        try:
            meta = json.loads(text)
        except ValueError as exc:
            return f"{META_FILE} is not JSON ({reason(exc)})"
        if not isinstance(meta, dict):
            return f"{META_FILE} is not a JSON object"
        if isinstance(meta.get(FILES_KEY), Mapping) and (listed := _sizes_problem(path, meta[FILES_KEY], listed=True)):
            return listed
        return _dcp_problem(path) if _DCP_METADATA in self.files else None

    def _missing(self, path: Path) -> list[str]:
        return [f for f in (META_FILE, *self.files) if not (path / f).is_file()]

    def verify(self, path: str | Path) -> str | None:
        """`problem`, then each file's checksum against ``meta.json``'s ``checksums``; None when right. A folder
        found wrong joins `bad` (damaged from then on), one found right `verified`. Reads the whole folder."""
        path = Path(path)
        found = self.problem(path)
        sums = read_meta(path).get(CHECKSUMS_KEY) if found is None else None
        if isinstance(sums, Mapping) and (found := checksum_problem(path, sums)) is not None:
            self.bad[path] = found
        if found is None:
            self.verified.add(path)
        return found

    def verified_latest(self) -> Path | None:
        """The newest complete checkpoint this process verified or wrote (the last good one of a message), or None."""
        return next((p for _, p in reversed(self.candidates()) if p in self.verified and self.is_complete(p)), None)

    def is_complete(self, path: str | Path) -> bool:
        return self.problem(path) is None

    def number(self, path: str | Path) -> int:
        """The step or epoch in the name of the checkpoint folder `path`; ``-1`` for another name."""
        m = self._name.fullmatch(Path(path).name)
        return int(m.group(1)) if m else -1

    def candidates(self) -> list[tuple[int, Path]]:
        """``(number, folder)`` of every folder under `root` named like a checkpoint, oldest first."""
        found = self.root.iterdir() if self.root.is_dir() else ()
        return sorted((int(m.group(1)), p) for p in found if (m := self._name.fullmatch(p.name)))

    def complete_checkpoints(self) -> list[Path]:
        """Complete checkpoints under `root`, oldest first (by number)."""
        return [p for _, p in self.candidates() if self.is_complete(p)]

    def latest(self) -> Path | None:
        """The checkpoint ``resume=auto`` takes: the newest complete one, or None."""
        return next((p for _, p in reversed(self.candidates()) if self.is_complete(p)), None)

    def damaged(self, newer_than: str | Path | None = None) -> list[tuple[Path, str]]:
        """Damaged checkpoint folders (numbered after `newer_than`; None: all), oldest first, with `problem`; an
        incomplete folder counts only where folders are published complete."""
        after = self.number(newer_than) if newer_than is not None else -1
        found = [(p, self.problem(p)) for number, p in self.candidates() if number > after]
        return [(p, why) for p, why in found if why and (self.published or p in self.bad or not self._missing(p))]

    def resolve(self, resume: str | None) -> Path | None:
        """A ``resume`` value as a checkpoint folder: ``"auto"`` (`latest`, damaged newer ones skipped with one
        warning), ``"none"`` / ``""`` / None (start fresh), or a folder's path. Raises CheckpointError: a path that is
        not a complete checkpoint; ``"auto"`` where every checkpoint is damaged."""
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
                    f"{what}. Restore them from a copy, or start afresh with {self.start_afresh()}"
                )
            rank0 = not dist.is_initialized() or dist.get_rank() == 0
            if skipped and rank0 and not (os.environ.get("COOKBOOK_CHECKED") and not restarted()):
                # (workers of a first attempt are quiet: `cookbook.launch`'s --check process has said it)
                (first, why), *more = skipped
                which = f"checkpoints {what} are damaged" if more else f"checkpoint {first} is damaged ({why})"
                get_logger().warning(f"warning: {which}; resuming from {path} instead")
            return path
        path = Path(resume)
        if (problem := self.verify(path)) is not None:  # files missing: not a checkpoint; else a damaged one
            what, newest, other = (
                ("not a complete checkpoint folder", "newest", "a")
                if self._missing(path)
                else ("a damaged checkpoint", "newest complete", "another")
            )
            raise CheckpointError(
                f"{self.resume_key}={resume!r} is {what} ({problem}): use {self.resume_key}=auto (the {newest} one "
                f"under {self.root}), none, or the path of {other} {self.folder} folder"
            )
        return path

    # ------------------------------------------------------------------ checking
    def start_afresh(self) -> str:
        """``"a new output_dir (or delete <run_dir>)"``"""
        return "a new output_dir" + (f" (or delete {self.run_dir})" if self.run_dir is not None else "")

    def check(
        self,
        resume: str | None,
        world_size: int | None,
        config: Mapping[str, Any] | None = None,
        may_change: tuple[str, ...] = (),
        stop_at: tuple[str, int] = ("train.stop_at_step", -1),
    ) -> Path | None:
        """The checkpoint to resume from (None: start fresh), checked against this run: `world_size` (None: later,
        `check_world_size`), `config` but for `may_change` (dotted keys, ``section.*``), and `stop_at` ``(key, value)``.
        A restarted worker resumes from the newest checkpoint. Raises CheckpointError: no such checkpoint; "none"
        over existing ones; another world size or global batch; other settings; a stop point not after it."""
        if restarted() and self.latest() is not None:
            resume = "auto"
        path = self.resolve(resume)
        if path is None:
            if self.latest() is not None or self.damaged():
                raise CheckpointError(
                    f"{self.resume_key}={resume!r} but {self.root} holds checkpoints of an earlier run, which a later "
                    f"resume=auto would pick up: start afresh with a new output_dir (or delete "
                    f"{self.run_dir or self.root})"
                )
            return None
        meta = read_meta(path)
        if world_size is not None:
            self.check_world_size(path, meta, world_size, config)
            if self.resizable:  # checked as one number, the global batch
                may_change = (*may_change, *_BATCH_KEYS)
        diff = config_changes(meta["config"], config, may_change) if config is not None and "config" in meta else ""
        if diff:
            same = f"Use the same settings, or start afresh with {self.start_afresh()}"
            todo = self._length_changed(path, meta, config) or same
            raise CheckpointError(
                f"{path} was written with other settings ({diff}); resuming would mix two runs. {todo}"
            )
        key, value = stop_at
        unit = key.rsplit("_", 1)[-1]
        if 0 < value <= meta.get(unit, 0):
            raise CheckpointError(
                f"{key}={value} is not after the checkpoint {path} ({unit} {meta[unit]}): raise it, "
                f"or remove it to train to the end"
            )
        return path

    def _length_changed(self, path: Path, meta: Mapping[str, Any], config: Mapping[str, Any]) -> str | None:
        """Why a resume may not change ``train.max_steps`` / ``train.epochs``, or None when the length is the same."""
        old, new = flatten(meta["config"]), flatten(config)
        by_steps = all(isinstance(c.get("train.max_steps"), int) and c["train.max_steps"] > 0 for c in (old, new))
        kept = "train.epochs" if by_steps else None  # max_steps > 0 overrides epochs
        key = next((k for k in _LENGTH_KEYS if k in old and old.get(k) != new.get(k) and k != kept), None)
        if key is None:
            return None
        unit, was, done = _LENGTH_KEYS[key], old[key], meta.get(_LENGTH_KEYS[key], 0)
        finished = isinstance(was, int) and 0 < was <= done
        where = f"It is {unit} {done} of a run" if unit == "step" else "It was written by a run"
        what = (
            f"It is the end of a finished run ({unit} {done} of {key}={was}), and a finished run cannot be extended"
            if finished
            else f"{where} of {key}={was}, and a resume cannot change a run's length"
        )
        stops = (f"train.stop_at_{unit}", "train.stop_at_step", "train.stop_at_epoch")
        stop = next((k for k in stops if k in new), None)
        weights = (
            "; it starts from model.name_or_path, so name the model this run exported there (such as its output_dir's "
            "final folder) to start from this run's weights"
        )
        split = f". To split one run into parts, keep {key} and set {stop} (each part resumes the last)" if stop else ""
        return (
            f"{what}: the learning-rate schedule is laid out over {key} (its decay ends there, a warm-up ratio is a "
            f"fraction of it), so the steps after the checkpoint would follow another schedule than the one that "
            f"brought the run there. To train longer, start a new run with {key}={new.get(key)} in "
            f"{self.start_afresh()}{weights if 'model.name_or_path' in new else ''}{split}"
        )

    def check_world_size(
        self, path: str | Path, meta: Mapping[str, Any], world_size: int, config: Mapping[str, Any] | None = None
    ) -> None:
        """Raise CheckpointError for a checkpoint another number of processes wrote (with `resizable`: another
        global batch, `config` needed), naming both, why, and what to set instead."""
        n = meta.get("world_size")
        if n is None or (n == world_size and not self.resizable):
            return
        written = f"{path} was written by {n} {self.processes} but this job has {world_size}"
        same = self.same_size.format(n=n)
        if not self.resizable:
            raise CheckpointError(
                f"{written}: {self.cannot_remap} (resuming on another number of processes is supported by "
                f"{resizable_recipes()} only). Resume with {same}, or start afresh with {self.start_afresh()}"
            )
        if config is None or "config" not in meta:
            if n != world_size:
                raise CheckpointError(
                    f"{written}, and its global batch cannot be told (no config to compare): resume with {same}"
                )
            return
        was, now = global_batch(meta["config"], n), global_batch(config, world_size)
        target, micro, accum = was[0], now[1], now[2]
        if now[0] == target:
            return
        k, rest = divmod(target, micro * world_size)  # the ways: one key changed, the other kept
        ways = [f"{_BATCH_KEYS[1]}={k} ({micro} x {k} x {world_size} = {target})"] if not rest else []
        k, rest = divmod(target, accum * world_size)
        if not rest and k != micro:
            ways.append(f"{_BATCH_KEYS[0]}={k} ({k} x {accum} x {world_size} = {target})")
        todo = (
            f"set {' or '.join(ways)}"
            if ways
            else f"no micro-batch x accumulation x {world_size} makes {target}"
            if target % world_size
            else f"set {_BATCH_KEYS[0]} x {_BATCH_KEYS[1]} = {target // world_size}"
        )
        raise CheckpointError(
            f"{path} was written with a global batch of {target} samples ({was[1]} micro-batch x {was[2]} accumulation "
            f"x {n} {_plural(self.processes, n)}) but this job's is {now[0]} ({micro} x {accum} x {world_size}); a resume "
            f"keeps the global batch, so that a step, max_steps, the learning-rate schedule and the data position keep "
            f"their meaning. To continue on {world_size} {_plural(self.processes, world_size)}, {todo}; or resume with "
            f"{same}, or start afresh with {self.start_afresh()}"
        )

    def resized(self, path: Path, meta: Mapping[str, Any], world_size: int, data: str, per_rank: str) -> str:
        """The line of a resizable resume from `path` (`meta`) on `world_size` processes: `data` the remapped data
        position, `per_rank` the per-rank state not restored (``""``: none)."""
        written_by = meta["world_size"]
        batch = global_batch(meta["config"], written_by)[0] if "config" in meta else None
        kept = f" (global batch {batch} samples, as before)" if batch else ""
        lost = f". Not restored, as in a fresh run (seeded at start-up): the per-rank state ({per_rank})"
        return (
            f"resized: {path} was written by {written_by} {_plural(self.processes, written_by)}, this job has "
            f"{world_size}. Resharded by DCP: the model and optimizer state. Remapped: the data position, {data} in "
            f"the same order{kept}{lost if per_rank else ''}"
        )

    def already_complete(
        self, done: int, total: int | None, unit: str = "step", outputs: Mapping[str, str | Path] = {}
    ) -> str:
        """``already complete: 40 of 40 steps; model in <dir>/final. To train again, use a new output_dir ...``."""
        count = f"{done} of {total}" if total is not None else f"{done}"
        where = "".join(f"{', ' if i else '; '}{what} in {path}" for i, (what, path) in enumerate(outputs.items()))
        return f"already complete: {count} {unit}s{where}. To train again, use {self.start_afresh()}."


def resizable_recipes() -> str:
    """The recipes whose ``train.py`` says ``RESIZABLE = True`` (they resume on another world size), as words."""
    recipes = Path(__file__).resolve().parents[2] / "recipes"
    names = sorted(
        t.parent.name for t in recipes.glob("*/train.py") if re.search(r"^RESIZABLE = True\b", t.read_text(), re.M)
    )
    if not names:
        return "the recipes whose train.py says RESIZABLE = True"
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


def _plural(word: str, n: int) -> str:
    return word.removesuffix("s") if n == 1 else word


def global_batch(config: Mapping[str, Any], world_size: int) -> tuple[int, int, int]:
    """``(micro x accumulation x world_size, micro, accumulation)`` of a config (flat or nested); a missing key is 1."""
    flat = flatten(config)
    micro, accum = (int(flat.get(k) or 1) for k in _BATCH_KEYS)
    return micro * accum * world_size, micro, accum


def restarted() -> bool:
    """Whether the launcher restarted this worker's group (``COOKBOOK_RESTART_COUNT`` or torchrun's count above 0)."""
    return any(
        os.environ.get(k, "0").strip() not in ("", "0") for k in (RESTART_COUNT_ENV, "TORCHELASTIC_RESTART_COUNT")
    )


def read_meta(path: str | Path) -> dict[str, Any]:
    return json.loads((Path(path) / META_FILE).read_text())


def reason(exc: BaseException) -> str:
    """An exception as a short phrase: ``"JSONDecodeError: Expecting ..."``, ``"ENOSPC, No space left on device"``."""
    if isinstance(exc, OSError) and exc.errno in errno.errorcode:
        text = f"{errno.errorcode[exc.errno]}, {exc.strerror or os.strerror(exc.errno)}"
        return text + (f": {exc.filename!r}" if exc.filename else "")
    return f"{type(exc).__name__}: {first_line(exc, 120)}" if str(exc).strip() else type(exc).__name__


def file_sizes(folder: str | Path) -> dict[str, int]:
    """Every file under `folder` but ``meta.json`` (relative ``/`` path) with its size in bytes, for ``files``."""
    return {name: p.stat().st_size for name, p in _files(folder).items()}


def _files(folder: str | Path) -> dict[str, Path]:
    found = {p.relative_to(folder).as_posix(): p for p in sorted(Path(folder).rglob("*")) if p.is_file()}
    found.pop(META_FILE, None)
    return found


def _file_checksum(file: Path, kind: str) -> str:
    """``"<kind>:<hex>"`` of the bytes of `file` (read in 4 MiB blocks); crc32 where ``xxhash`` is missing."""
    h, crc = (_xxh3_64() if _xxh3_64 is not None and kind != "crc32" else None), 0
    with open(file, "rb") as f:
        while block := f.read(4 << 20):
            if h is None:
                crc = zlib.crc32(block, crc)
            else:
                h.update(block)
    return f"{kind}:{h.hexdigest() if h is not None else f'{crc:08x}'}"


def checksums(folder: str | Path) -> dict[str, str]:
    """``{"__0_0.distcp": "xxh3_64:9f0c..."}`` of every file under `folder` but ``meta.json`` (crc32 without
    ``xxhash``): ``meta.json``'s ``checksums``, for `ResumeGuard.verify`."""
    return {name: _file_checksum(p, _CHECKSUM) for name, p in _files(folder).items()}


def checksum_problem(path: Path, sums: Mapping[str, Any]) -> str | None:
    """The first file of `sums` (``meta.json``'s ``checksums``) whose bytes under `path` differ, as words, or None."""
    for name, want in sorted(sums.items()):
        kind = str(want).split(":", 1)[0]
        try:
            have = _file_checksum(path / name, kind if kind in ("xxh3_64", "crc32") else "xxh3_64")
        except FileNotFoundError:
            return f"{name} is missing ({META_FILE} lists it)"
        except OSError as exc:
            return f"{name} is unreadable ({reason(exc)})"
        if have != want:
            return f"{name} does not match its checksum ({want} in {META_FILE}, {have} now)"
    return None


def _sizes_problem(path: Path, sizes: Mapping[str, Any], listed: bool) -> str | None:
    """What is wrong with the files `sizes` names (relative path -> bytes), or None. `listed`: ``meta.json``'s exact
    sizes (`file_sizes`); else DCP's index, the bytes each file must hold at least."""
    for name, size in sorted(sizes.items()):
        try:
            have = (path / name).stat().st_size
        except FileNotFoundError:
            return f"{name} is missing ({META_FILE} lists it)" if listed else f"{name} is missing (its index names it)"
        except OSError as exc:
            return f"{name} is unreadable ({reason(exc)})"
        if listed and have != size:
            return f"{name} is {have} bytes, {META_FILE} says {size}"
        if have < size:
            return f"{name} is {have} bytes, its index says {size} are needed"
    return None


def _dcp_problem(path: Path) -> str | None:
    """What is wrong with the DCP files of `path` (each must reach the end of its last indexed entry), or None."""
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
    except Exception as exc:  # noqa: BLE001 - a damaged pickle raises anything (EOFError, UnpicklingError, ...)
        return f"{_DCP_METADATA} is unreadable ({reason(exc)})"
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(storage, Mapping):
        return f"{_DCP_METADATA} holds no index of the files"
    needed: dict[str, int] = {}
    for info in storage.values():
        name = getattr(info, "relative_path", None)
        if name is not None:
            needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    return _sizes_problem(path, needed, listed=False)


def config_changes(old: Mapping[str, Any], new: Mapping[str, Any], may_change: tuple[str, ...] = ()) -> str:
    """``"key: old -> new, ..."`` (at most six) of two configs, ``""`` when equal; `may_change` keys are ignored
    (``section.*`` a whole section; ``"key=value"`` a key `old` lacks that `new` has at that default)."""
    old, new = flatten(old), flatten(new)
    added = dict(m.split("=", 1) for m in may_change if "=" in m)
    changed = [
        k
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
        and not any(k == m or (m.endswith(".*") and k.startswith(m[:-1])) for m in may_change)
        and not (k in added and k not in old and str(new.get(k)) == added[k])
    ]
    diff = ", ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in changed[:6])
    return diff + (", ..." if len(changed) > 6 else "")
