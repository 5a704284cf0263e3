"""Checkpoints and the final export of a Hugging Face Trainer run: `PublishCheckpoints` publishes the Trainer's
``checkpoint-<step>`` folders (``meta.json`` with the files, their sizes and checksums; an atomic rename; the newest
``keep_last`` kept), `resume_guard` / `check_resume` / `already_complete` find and check the checkpoint a run
continues, `ReportSaveErrors` turns a failed save into one line (exit 2), `export_final` writes the model in
Hugging Face format. `cookbook.hf_trainer` re-exports them."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from transformers import TrainerCallback

from cookbook.checkpoint import _from_rank0, _os_error_in, publish, save_error
from cookbook.config import to_dict
from cookbook.dist import barrier, get_dist_info, get_logger
from cookbook.resume import CHECKSUMS_KEY, FILES_KEY, ResumeGuard, _reason, checksums, file_sizes, read_meta


def published_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoints ``checkpoint-<step>`` (with ``meta.json``) under `root`, oldest first: the resume
    guard's own discovery (`cookbook.checkpoint.ResumeGuard`), so that what is pruned is what a resume would find."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint the Trainer saves, atomically.

    The Trainer writes ``checkpoint-<step>`` into its ``output_dir`` (the staging folder: DeepSpeed's
    partitions of every rank, scheduler, RNG, data position). Once every rank is done, rank 0 adds
    ``meta.json`` (``step``, ``world_size``, ``time``, ``config``, ``files``: every file of the checkpoint
    with its size, `cookbook.resume.file_sizes`, so that the resume guard finds a truncated or missing shard, and
    ``checksums``, `cookbook.checkpoint.checksums`, for bytes overwritten in place)
    and renames the folder to ``<root>/checkpoint-<step>`` (atomic on one file system; `published_checkpoints`
    lists only those), then deletes all but the newest `keep_last` (0: keeps all). Set ``save_total_limit=None``
    in the arguments: the staging folder is emptied by the renames. When training begins, rank 0 deletes what an
    interrupted or failed save left in the staging folder.

    Args:
        root: the published checkpoints' folder (``output_dir/checkpoints``), on the Trainer's file system.
        keep_last: published checkpoints to keep, >= 0.
        config: the run's config (a dict), stored in ``meta.json`` for the resume check.
        more_meta: called on rank 0 at each save for more ``meta.json`` entries (JSON values), e.g.
            `NonFiniteSteps.meta` (the skip count a resume continues).

    Raises (from ``on_save``, on every rank):
        CheckpointSaveError: rank 0 could not write ``meta.json`` or publish (disk full, ...): one line naming
            the checkpoint, the OS error and the previous checkpoint, which is intact.
    """

    def __init__(self, root: str | Path, keep_last: int, config: Mapping[str, Any],
                 more_meta: Callable[[], Mapping[str, Any]] | None = None):
        self.root, self.keep_last, self.config = Path(root), keep_last, dict(config)
        self.more_meta = more_meta

    def latest(self) -> Path | None:
        """The newest published checkpoint, or ``None``."""
        found = published_checkpoints(self.root)
        return found[-1] if found else None

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # unpublished leftovers of an interrupted or failed save
            for old in Path(args.output_dir).glob("checkpoint-*"):
                shutil.rmtree(old, ignore_errors=True)
        barrier()

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its ZeRO partitions and RNG state
        src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        failure = None
        if state.is_world_process_zero:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                meta = {"step": state.global_step, "world_size": args.world_size, "time": time.time(),
                        "config": self.config, FILES_KEY: file_sizes(src), CHECKSUMS_KEY: checksums(src),
                        **(self.more_meta() if self.more_meta is not None else {})}
                (src / "meta.json").write_text(json.dumps(meta, indent=2))
                publish(src, self.root / src.name)
            except OSError as exc:  # every rank must hear of it, or they would wait at the next collective
                failure = (_reason(exc), exc.errno)
                shutil.rmtree(src, ignore_errors=True)  # never published: its space goes back to the full disk
            else:
                for old in published_checkpoints(self.root)[: -self.keep_last] if self.keep_last else []:
                    shutil.rmtree(old, ignore_errors=True)
                get_logger().info(f"checkpoint published: {self.root / src.name}")
        failure = _from_rank0(failure)
        if failure is not None:
            reason, code = failure
            raise save_error(state.global_step, self.root / src.name, self.latest(),
                             0 if args.world_size > 1 else None, OSError(code, reason), reason)
        barrier()


def resume_guard(output_dir: str | Path, cannot_remap: str) -> ResumeGuard:
    """The resume guard of a Trainer recipe: the Trainer's ``checkpoint-<step>`` folders, published with
    ``meta.json`` under ``output_dir/checkpoints`` (`PublishCheckpoints`). Another number of ranks is refused
    (`cannot_remap` says why: ``"the Trainer's data order and per-rank RNG states depend on it"``); its advice to
    start afresh deletes the whole `output_dir` (metrics.jsonl included: deleting the checkpoints alone would append
    a new run to the old run's records)."""
    return ResumeGuard(Path(output_dir) / "checkpoints", folder="checkpoint-<n>", files=(), run_dir=output_dir,
                       cannot_remap=cannot_remap, same_size="NGPU x NNODES = {n}", published=True)


def check_resume(cfg: Any, world_size: int, may_change: tuple[str, ...], cannot_remap: str) -> Path | None:
    """The checkpoint to resume from (``cfg.checkpoint.resume``: auto, none or a folder), checked against the run
    of `cfg` (a recipe's config with ``output_dir``, ``checkpoint.resume`` and ``train.stop_at_step``) on
    `world_size` processes; `may_change` lists the config keys that may differ from the checkpoint's.

    Raises:
        CheckpointError: see `cookbook.checkpoint.ResumeGuard.check`: not a complete checkpoint; "none" over an
            earlier run's checkpoints; written by another number of ranks or with other settings;
            ``train.stop_at_step`` not after it.
    """
    return resume_guard(cfg.output_dir, cannot_remap).check(cfg.checkpoint.resume, world_size, to_dict(cfg), may_change,
                                                            ("train.stop_at_step", cfg.train.stop_at_step))


def already_complete(output_dir: str | Path, resume_from: Path | None, max_steps: int,
                     model: str = "final") -> str | None:
    """The message for a run whose checkpoint `resume_from` is at or past `max_steps` and whose final model
    (``output_dir/<model>``, a folder `export_final` writes) is there, so nothing is left to do; else ``None``."""
    final = Path(output_dir) / model
    step = read_meta(resume_from)["step"] if resume_from is not None and final.is_dir() else -1
    if step < max_steps:
        return None
    return resume_guard(output_dir, "").already_complete(step, max_steps, "step", {"model": final})


class ReportSaveErrors:
    """Trainer mixin, before the Trainer in the bases (``class MyTrainer(ReportSaveErrors, CountBatches,
    SFTTrainer)``): a checkpoint save that fails with an OS error (disk full, file too large, I/O error, a
    read-only file system) ends the run with `CheckpointSaveError` (exit status 2, which the launcher does not
    restart: the disk would still be full) instead of a traceback.

    The message names the checkpoint (its published folder), the OS error and the rank that met it, the previous
    checkpoint (intact: the failed one is never published, and the rank that met the error deletes it from the
    staging folder, as does every other rank whose save then fails, so that a full disk gets its space back) and
    what to do. Only the rank that met the error knows of it: it prints the line; the other ranks,
    waiting for it in a collective, stop with "another rank is gone" (exit 3) or are stopped by the launcher.
    Failures of `PublishCheckpoints` (rank 0's ``meta.json`` and rename) are raised by it on every rank.

    Raises:
        CheckpointSaveError: from ``_save_checkpoint``, the Trainer's save (model, DeepSpeed's partitions,
            scheduler, RNG, trainer state), when an `OSError` is behind its failure and a `PublishCheckpoints`
            is among the callbacks; other failures pass through unchanged.
    """

    def _save_checkpoint(self, model, trial):
        try:
            with _torch_saves_raise_os_errors():
                return super()._save_checkpoint(model, trial)
        except Exception as exc:
            os_error = _os_error_behind(exc)
            publisher = next((c for c in self.callback_handler.callbacks if isinstance(c, PublishCheckpoints)), None)
            step = self.state.global_step
            if publisher is not None:  # never published: its bytes would keep a full disk full. Every rank whose
                # save fails deletes it (the others' fails when this rank is gone), after its own last write
                shutil.rmtree(Path(self.args.output_dir) / f"checkpoint-{step}", ignore_errors=True)
            if os_error is None or publisher is None:
                raise
            info = get_dist_info()
            error = save_error(step, publisher.root / f"checkpoint-{step}", publisher.latest(),
                               info.rank if info.world_size > 1 else None, os_error)
            error.same_on_every_rank = False  # this rank alone met it, so this rank prints it
            raise error from exc


@contextlib.contextmanager
def _torch_saves_raise_os_errors() -> Iterator[None]:
    """While the Trainer saves a checkpoint, ``torch.save`` to a path writes through a Python file object, so that
    a failed write raises the `OSError` (its errno and the file) instead of torch's ``RuntimeError: ... unexpected
    pos 704 vs 598``, whose C++ file writer keeps no errno. DeepSpeed writes its ZeRO partitions with
    ``torch.save(state, path)``, as the Trainer does its scheduler, RNG states and arguments; the bytes written are
    the same."""
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return original(obj, f, *args, **kwargs)
        try:
            with open(f, "wb") as stream:
                return original(obj, stream, *args, **kwargs)
        except Exception as exc:
            os_error = _os_error_in(exc)
            if os_error is None:
                raise
            raise OSError(os_error.errno, os_error.strerror, os.fspath(f)) from exc

    torch.save = save
    try:
        yield
    finally:
        torch.save = original


def _os_error_behind(exc: BaseException) -> OSError | None:
    """The OS error behind a failed write: an `OSError` in `exc`'s chain, or the one that safetensors (Rust) gives
    as text only (``SafetensorError: Error while serializing: I/O error: File too large (os error 27)``)."""
    found = _os_error_in(exc)
    if found is not None:
        return found
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else None


def export_final(trainer, tokenizer, out_dir: str | Path, merge: bool = True) -> Path | None:
    """Write the consolidated model and the tokenizer to ``out_dir/final`` (Hugging Face format), atomically.

    Collective. The full state dict comes from the Trainer's accelerator (under ZeRO-3 DeepSpeed gathers every
    partition to rank 0, in the training dtype: bf16 on GPU, fp32 on CPU; the JSON needs
    ``stage3_gather_16bit_weights_on_model_save``). For a PEFT (LoRA) model the adapter goes to
    ``out_dir/adapter`` and ``final`` holds the base model with the adapter merged in. ``config.json`` records
    the dtype (so ``from_pretrained(dtype="auto")`` keeps it) and ``use_cache: true``. ``merge=False`` writes the
    adapter alone (a base whose weights cannot take a merge, e.g. 4-bit quantized).

    Returns:
        ``out_dir/final`` on rank 0 (``out_dir/adapter`` without `merge`), ``None`` elsewhere.
    """
    out_dir = Path(out_dir)
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # every rank takes part; rank 0 gets tensors
    result = None
    if trainer.is_world_process_zero():
        unwrapped = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        state = {k: v.detach().cpu() for k, v in state.items()}
        dtype = next(v.dtype for v in state.values() if v.is_floating_point())
        if _is_peft(unwrapped):
            from peft import get_peft_model

            tmp = out_dir / ".tmp-adapter"
            shutil.rmtree(tmp, ignore_errors=True)
            unwrapped.save_pretrained(tmp, state_dict=state)
            tokenizer.save_pretrained(tmp)
            publish(tmp, out_dir / "adapter")
            result = out_dir / "adapter"
        if result is not None and merge:
            base = unwrapped.get_base_model()
            # The class's own constructor, not from_config: under ZeRO-3, from_config partitions the new model
            # across ranks (a collective that rank 0 alone would wait on forever).
            with torch.device("meta"):
                merged = get_peft_model(type(base)(base.config), unwrapped.peft_config["default"])
            merged.load_state_dict(state, assign=True)
            unwrapped = merged.merge_and_unload()
            state = {k: v.contiguous() for k, v in unwrapped.state_dict().items()}
    if trainer.is_world_process_zero() and (result is None or merge):  # the (merged) model
        tmp = out_dir / ".tmp-final"
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state, safe_serialization=True)
        config_file = tmp / "config.json"
        saved = json.loads(config_file.read_text())
        saved["dtype"] = str(dtype).removeprefix("torch.")
        saved["use_cache"] = True
        config_file.write_text(json.dumps(saved, indent=2))
        tokenizer.save_pretrained(tmp)
        publish(tmp, out_dir / "final")
        result = out_dir / "final"
    barrier()
    return result


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)
