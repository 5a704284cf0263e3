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

from cookbook.checkpoint import from_rank0, os_error_in, publish, save_error
from cookbook.config import to_dict
from cookbook.dist import barrier, get_dist_info, get_logger
from cookbook.resume import CHECKSUMS_KEY, FILES_KEY, ResumeGuard, _reason, checksums, file_sizes, read_meta


def published_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoints ``checkpoint-<step>`` (with ``meta.json``) under `root`, oldest first: the resume
    guard's own discovery (`cookbook.checkpoint.ResumeGuard`), so that what is pruned is what a resume would find."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint the Trainer saves: once every rank wrote ``checkpoint-<step>`` into the staging
    folder, rank 0 adds ``meta.json`` (step, world size, `config`, file sizes, checksums, `more_meta`), renames it into
    `root` and keeps the newest `keep_last` (0: all). Set ``save_total_limit=None``.

    Raises (from ``on_save``, on every rank):
        CheckpointSaveError: rank 0 could not write ``meta.json`` or publish; the previous checkpoint is intact.
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
        failure = from_rank0(failure)
        if failure is not None:
            reason, code = failure
            raise save_error(state.global_step, self.root / src.name, self.latest(),
                             0 if args.world_size > 1 else None, OSError(code, reason), reason)
        barrier()


def resume_guard(output_dir: str | Path, cannot_remap: str) -> ResumeGuard:
    """The `ResumeGuard` of a Trainer recipe's published ``checkpoint-<step>`` folders under ``output_dir/checkpoints``;
    another number of ranks is refused, and its advice to start afresh deletes the whole `output_dir`.
    """
    return ResumeGuard(Path(output_dir) / "checkpoints", folder="checkpoint-<n>", files=(), run_dir=output_dir,
                       cannot_remap=cannot_remap, same_size="NGPU x NNODES = {n}", published=True)


def check_resume(cfg: Any, world_size: int, may_change: tuple[str, ...], cannot_remap: str) -> Path | None:
    """The checkpoint to resume from (``checkpoint.resume``: auto, none or a folder) checked against the run of `cfg`
    on `world_size` processes (`may_change`: keys that may differ).

    Raises:
        CheckpointError: see `cookbook.resume.ResumeGuard.check`.
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
    """Trainer mixin, before the Trainer in the bases: a save that fails with an `OSError` ends the run with
    `CheckpointSaveError`'s one line (exit 2, not restarted) from ``_save_checkpoint``, when a `PublishCheckpoints` is
    among the callbacks. The failed checkpoint is deleted from staging and never published; the other ranks stop
    as having lost a peer (exit 3). Other failures pass through.
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
    """While the Trainer saves, ``torch.save`` to a path writes through a Python file object, so a failed write
    raises the `OSError` (errno, file) instead of torch's ``RuntimeError: ... unexpected pos``; the bytes are the same.
    """
    original = torch.save

    def save(obj, f, *args, **kwargs):
        if not isinstance(f, (str, os.PathLike)):
            return original(obj, f, *args, **kwargs)
        try:
            with open(f, "wb") as stream:
                return original(obj, stream, *args, **kwargs)
        except Exception as exc:
            os_error = os_error_in(exc)
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
    found = os_error_in(exc)
    if found is not None:
        return found
    code = re.search(r"\(os error (\d+)\)", str(exc))
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else None


def export_final(trainer, tokenizer, out_dir: str | Path, merge: bool = True) -> Path | None:
    """Write the consolidated model and tokenizer to ``out_dir/final`` (Hugging Face format), atomically; collective.

    Under ZeRO-3 DeepSpeed gathers to rank 0 in the training dtype (the JSON needs
    ``stage3_gather_16bit_weights_on_model_save``). A PEFT model's adapter goes to ``out_dir/adapter`` and ``final``
    holds the merged model (``merge=False``: the adapter alone). ``config.json`` records the dtype and
    ``use_cache: true``. Returns ``out_dir/final`` (or ``adapter``) on rank 0, None elsewhere.
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
