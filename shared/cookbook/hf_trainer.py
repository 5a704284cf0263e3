"""The torchrun loop's bookkeeping for a recipe on the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``): atomic
publication with checksums, preemption (exit 75), non-finite steps (exit 4), stalls (exit 3), metrics.jsonl and the
trackers. Why each piece: docs/notes.md.

    class MyTrainer(hf_trainer.Bookkeeping, SFTTrainer): ...           # at module level
    run = hf_trainer.TrainerRun(cfg, metrics, pad_id, resume_from)
    trainer = MyTrainer(..., args=SFTConfig(..., **hf_trainer.trainer_args(cfg, max_steps)), callbacks=run.callbacks)
    with run:                                                          # if run.train(trainer, max_steps): export
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from torch.linalg import vector_norm
from transformers import PrinterCallback, TrainerCallback

from cookbook import lm
from cookbook.checkpoint import from_rank0, os_error_in, publish, publish_pretrained, save_error
from cookbook.config import to_dict
from cookbook.dist import all_reduce_sum, apply_collective_timeout, barrier, destroy_distributed, get_dist_info
from cookbook.dist import get_logger, record_progress, stall_error
from cookbook.metrics import MetricsLogger
from cookbook.policy import NonFinitePolicy, Preempted, StopRequest, StopVote
from cookbook.resume import CHECKSUMS_KEY, FILES_KEY, ResumeGuard, checksums, file_sizes, read_meta, reason
from cookbook.state import RNGState, seed_per_rank

_EVAL_TIMING = ("runtime", "samples_per_second", "steps_per_second")  # Trainer.evaluate's, not model metrics


def trainer_args(cfg: Any, max_steps: int) -> dict[str, Any]:
    """The bookkeeping's ``TrainingArguments``: a save every ``checkpoint.every_steps`` (0: at the end only; < 0:
    none) into ``output_dir/.staging``; MetricsLogger, not the Trainer, prints and reports (one run across restarts)."""
    every, t = cfg.checkpoint.every_steps, cfg.train
    return dict(
        output_dir=str(Path(cfg.output_dir) / ".staging"),
        seed=t.seed,
        max_steps=max_steps,
        per_device_train_batch_size=t.micro_batch_size,
        gradient_accumulation_steps=t.grad_accum_steps,
        logging_steps=t.log_every,
        save_strategy="steps" if every >= 0 else "no",  # saves the end too
        save_steps=every or max_steps,
        save_total_limit=cfg.checkpoint.keep_last or None,
        report_to="none",
        disable_tqdm=True,
        log_level="warning",
    )


def _global_batch(args) -> int:
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size


def _callback(trainer, cls):
    return next(c for c in trainer.callback_handler.callbacks if isinstance(c, cls))


class MetricsCallback(TrainerCallback):
    """Feeds a `MetricsLogger`: a train record per log with a ``loss`` (plus `log_extra()`), an eval record per
    evaluation (``eval_*`` without prefix and timing, kept in `last_eval`). Evaluations and saves are paused out of
    the step time; an evaluation leaves the random streams as it found them."""

    def __init__(self, metrics: MetricsLogger, pad_id: int, log_extra: Callable[[], Mapping[str, float]] = dict):
        self.metrics, self.pad_id, self.log_extra = metrics, pad_id, log_extra
        self.last_eval: dict[str, float] = {}
        self._pause = self._rng = None  # the open MetricsLogger.paused(); the random streams before an evaluation

    def count(self, batches: list[dict[str, torch.Tensor]], data_wait_s: float) -> None:
        """Count one optimizer step's micro-batches: rows, real tokens, and `data_wait_s` (seconds, shared out)."""
        wait = data_wait_s / len(batches)
        for b in batches:
            self.metrics.add(samples=b["input_ids"].shape[0], tokens=lm.count_tokens(b, self.pad_id), data_wait_s=wait)

    def _pause_if(self, control) -> None:
        if control.should_evaluate and self._rng is None:
            self._rng = RNGState().state_dict()
        if (control.should_evaluate or control.should_save) and self._pause is None:
            if self.metrics.info.device.type == "cuda":
                torch.cuda.synchronize(self.metrics.info.device)  # the step's queued kernels belong to the window
            self._pause = self.metrics.paused()
            self._pause.__enter__()

    def _resume(self, *args, **kwargs) -> None:
        if self._pause is not None:
            self._pause, pause = None, self._pause
            pause.__exit__(None, None, None)

    on_step_begin = on_save = on_train_end = _resume  # on_step_begin: normally closed already by on_evaluate / on_save

    def on_train_begin(self, args, state, control, **kwargs):
        barrier()
        self.metrics.start(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        self._pause_if(control)

    on_epoch_end = on_step_end

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self._resume()
            lr, grad_norm = logs.get("learning_rate", 0.0), logs.get("grad_norm")
            self.metrics.log_step(state.global_step, logs["loss"], lr, grad_norm, extra=self.log_extra())
            self._pause_if(control)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        scores = {k[5:]: v for k, v in (metrics or {}).items() if k.startswith("eval_") and isinstance(v, (int, float))}
        self.last_eval = {k: v for k, v in scores.items() if k not in _EVAL_TIMING}
        self.metrics.log_eval(state.global_step, self.last_eval)
        if self._rng is not None:
            RNGState().load_state_dict(self._rng)
            self._rng = None
        if not control.should_save:
            self._resume()


class Bookkeeping:
    """Trainer mixin, first in the bases, with `TrainerRun.callbacks`: counts each step's micro-batches, reads whole
    global batches (`FullBatchesSampler`); a save failing with an `OSError` deletes its staging folder and ends the run
    with `CheckpointSaveError`'s one line (exit 2)."""

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        t0 = time.perf_counter()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        _callback(self, MetricsCallback).count(batches, time.perf_counter() - t0)
        return batches, num_items

    def _get_train_sampler(self, train_dataset=None):
        rows = self.train_dataset if train_dataset is None else train_dataset
        return FullBatchesSampler(len(rows), _global_batch(self.args), self.args.seed, lambda: self.state.epoch)

    def _save_checkpoint(self, model, trial):
        original, step = torch.save, self.state.global_step
        torch.save = functools.partial(_save_through_file, original)
        try:
            return super()._save_checkpoint(model, trial)
        except Exception as exc:
            # never published: its bytes would keep a full disk full. Every rank whose save fails deletes it
            shutil.rmtree(Path(self.args.output_dir) / f"checkpoint-{step}", ignore_errors=True)
            code = re.search(r"\(os error (\d+)\)", str(exc))  # safetensors gives its OSError as text only
            os_error = os_error_in(exc) or (OSError(int(code[1]), os.strerror(int(code[1]))) if code else None)
            if os_error is None:
                raise
            info, root = get_dist_info(), _callback(self, PublishCheckpoints).root
            rank = info.rank if info.world_size > 1 else None
            error = save_error(step, root / f"checkpoint-{step}", _newest(root), rank, os_error)
            error.same_on_every_rank = False  # this rank alone met it, so this rank prints it
            raise error from exc
        finally:
            torch.save = original


def _save_through_file(torch_save, obj, f, *args, **kwargs):
    """`torch_save` to a path through a Python file: a failed write raises its `OSError` (errno, file), not torch's
    ``RuntimeError: ... unexpected pos``."""
    if not isinstance(f, (str, os.PathLike)):
        return torch_save(obj, f, *args, **kwargs)
    try:
        with open(f, "wb") as stream:
            return torch_save(obj, stream, *args, **kwargs)
    except Exception as exc:
        if (os_error := os_error_in(exc)) is None:
            raise
        raise OSError(os_error.errno, os_error.strerror, os.fspath(f)) from exc


class FullBatchesSampler(torch.utils.data.Sampler):
    """One epoch's rows: ``torch.randperm(num_rows)`` seeded ``seed + epoch_of()`` (the Trainer's epoch), cut to whole
    global batches (each rank as many micro-batches, no row twice). ValueError: fewer rows than one batch."""

    def __init__(self, num_rows: int, global_batch: int, seed: int, epoch_of: Callable[[], float | None]):
        if num_rows < global_batch:
            raise ValueError(f"{num_rows} rows are fewer than one global batch of {global_batch}")
        self.num_rows, self.global_batch, self.seed, self.epoch_of = num_rows, global_batch, seed, epoch_of

    def __len__(self) -> int:
        return self.num_rows // self.global_batch * self.global_batch

    def __iter__(self):
        seed = self.seed + int(self.epoch_of() or 0)
        return iter(torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(seed))[: len(self)].tolist())


def epoch_line(num_rows: int, global_batch: int) -> str:
    """The log's line on what one epoch reads (`FullBatchesSampler`)."""
    steps, rest = divmod(num_rows, global_batch)
    head = f"epoch: {num_rows} rows = {steps} steps of {global_batch} rows, every row read once"
    if rest:
        return f"{head}; the last partial global batch ({rest} rows, others each epoch) is dropped"
    return f"{head}; no partial global batch"


class RunControl(TrainerCallback):
    """As training begins: listens for SIGTERM and SIGUSR1 (`StopRequest`), seeds ``args.seed + args.process_index``
    and gives every process group (DeepSpeed's too) the collective timeout. Per step: records this rank's progress
    (the stall line, exit 3); stops with a checkpoint where the ranks agree on a signal (`StopVote`, then
    `raise_if_stopped`: exit 75) or after `stop_at_step` (<= 0: never), never at the last step."""

    def __init__(self, stop_at_step: int):
        self.stop_at_step, self.request, self._vote = stop_at_step, StopRequest(), None

    def on_train_begin(self, args, state, control, **kwargs):
        self._vote = StopVote(get_dist_info().device)
        self.request.listen()
        seed_per_rank(args.seed, args.process_index)
        apply_collective_timeout()
        record_progress(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        if self._vote(self.request.requested) and state.global_step < state.max_steps:
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no" or control.should_save
        record_progress(state.global_step)
        if 0 < self.stop_at_step <= state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._vote is not None:
            self._vote.finish()
        self.close()

    def close(self) -> None:  # a failed train() skips on_train_end; safe to call twice
        self.request.restore()

    def raise_if_stopped(self, state, checkpoint: Path | None) -> None:
        """After ``trainer.train()``: `Preempted` (75), logged with `checkpoint`, if a preemption stopped it early."""
        if self.request.requested and state.global_step < state.max_steps:
            raise self.request.preempted(state.global_step, state.max_steps, checkpoint)


class NonFiniteSteps(TrainerCallback):
    """``train.on_nonfinite`` (`NonFinitePolicy`) on DeepSpeed's skip of a non-finite step, or without DeepSpeed on
    the clipped gradients before ``optimizer.step()`` (one all-reduce; a bad step's are dropped). The skip count
    continues from `resume_from` and goes into each ``meta.json`` (`meta`)."""

    def __init__(self, policy: NonFinitePolicy, root: str | Path, resume_from: str | Path | None = None):
        self.policy, self._deepspeed = policy, False
        policy.newest_checkpoint = lambda: _newest(root)  # for the stop message
        if resume_from is not None:
            policy.skipped_steps = int(read_meta(resume_from).get("skipped_steps", 0))

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # by name: accelerate exports the class only where DeepSpeed is installed
        self._deepspeed = type(optimizer).__name__ == "DeepSpeedOptimizerWrapper"

    def _apply(self, state, bad: bool, what: str, short: str) -> None:
        if not bad:
            return self.policy.stepped()
        step = state.global_step + 1
        self.policy.nonfinite(step, what.format(step=step), short)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._deepspeed:  # DeepSpeed applies or discards the update itself (on_optimizer_step)
            return
        device = get_dist_info().device  # a DTensor's norm: its local shard's; one count all-reduced over the ranks
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None and p.grad.numel()]
        norms = [vector_norm(g.to_local() if hasattr(g, "to_local") else g, dtype=torch.float32) for g in grads]
        local = (~torch.isfinite(torch.stack([torch.zeros((), device=device), *(n.to(device) for n in norms)]))).sum()
        bad = all_reduce_sum({"bad": local}, device)["bad"] > 0
        if bad:
            for p in model.parameters():
                p.grad = None
        what = "the gradients of step {step} are not finite on every rank (the optimizer step was left out)"
        self._apply(state, bad, what, "non-finite gradients, optimizer step left out")

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if self._deepspeed:  # else decided in on_pre_optimizer_step
            what = "the gradient norm of step {step} is not finite (DeepSpeed discarded the update)"
            self._apply(state, optimizer.step_was_skipped, what, "non-finite gradient norm, update discarded")

    def meta(self) -> dict[str, int]:
        """``{"skipped_steps": n}``, this run's and the ones it resumed: `PublishCheckpoints`'s ``more_meta``."""
        return {"skipped_steps": self.policy.skipped_steps}


def published_checkpoints(root: str | Path) -> list[Path]:
    """Published ``checkpoint-<step>`` folders under `root`, oldest first, as the resume guard finds them."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


def _newest(root: str | Path) -> Path | None:
    return (published_checkpoints(root) or [None])[-1]


class PublishCheckpoints(TrainerCallback):
    """Once every rank wrote ``checkpoint-<step>`` into ``args.output_dir`` (staging), rank 0 adds ``meta.json`` (step,
    world size, `config`, file sizes, checksums, `more_meta()`), renames it into `root` and keeps the newest
    ``args.save_total_limit`` there. ``on_save`` raises `CheckpointSaveError` on every rank if that fails."""

    def __init__(self, root: str | Path, config: Mapping[str, Any], more_meta: Callable[[], Mapping[str, Any]] = dict):
        self.root, self.config, self.more_meta = Path(root), dict(config), more_meta

    def on_train_begin(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # unpublished leftovers of an interrupted or failed save
            for old in Path(args.output_dir).glob("checkpoint-*"):
                shutil.rmtree(old, ignore_errors=True)
        barrier()

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its ZeRO partitions and RNG state
        src, failure = Path(args.output_dir) / f"checkpoint-{state.global_step}", None
        if state.is_world_process_zero:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
                meta = dict(step=state.global_step, world_size=args.world_size, time=time.time(), config=self.config)
                meta.update({FILES_KEY: file_sizes(src), CHECKSUMS_KEY: checksums(src), **self.more_meta()})
                (src / "meta.json").write_text(json.dumps(meta, indent=2))
                publish(src, self.root / src.name)
            except OSError as exc:  # every rank must hear of it, or they would wait at the next collective
                failure = (reason(exc), exc.errno)
                shutil.rmtree(src, ignore_errors=True)  # never published: its space goes back to the full disk
            else:  # the Trainer rotated its output_dir (.staging: nothing there) before on_save; this, the published
                keep = args.save_total_limit or 0
                for old in published_checkpoints(self.root)[:-keep] if keep > 0 else []:
                    shutil.rmtree(old, ignore_errors=True)
                get_logger().info(f"checkpoint published: {self.root / src.name}")
        if (failure := from_rank0(failure)) is not None:
            rank = 0 if args.world_size > 1 else None
            error = OSError(failure[1], failure[0])
            raise save_error(state.global_step, self.root / src.name, _newest(self.root), rank, error, failure[0])
        barrier()


def _guard(output_dir: str | Path, cannot_remap: str) -> ResumeGuard:
    root, same_size = Path(output_dir) / "checkpoints", "NGPU x NNODES = {n}"
    kwargs = dict(run_dir=output_dir, cannot_remap=cannot_remap, same_size=same_size, published=True)
    return ResumeGuard(root, folder="checkpoint-<n>", files=(), **kwargs)


def check_resume(cfg: Any, world_size: int, may_change: tuple[str, ...], cannot_remap: str) -> Path | None:
    """The published checkpoint to resume from (`ResumeGuard.check`); another world size refused, `cannot_remap`
    saying why."""
    return _guard(cfg.output_dir, cannot_remap).check(
        cfg.checkpoint.resume, world_size, to_dict(cfg), may_change, ("train.stop_at_step", cfg.train.stop_at_step)
    )


def already_complete(
    output_dir: str | Path, resume_from: Path | None, max_steps: int, model: str = "final"
) -> str | None:
    """The message when checkpoint `resume_from` is at `max_steps` and ``output_dir/<model>`` is there; else None."""
    final = Path(output_dir) / model
    step = read_meta(resume_from)["step"] if resume_from is not None and final.is_dir() else -1
    if step < max_steps:
        return None
    return _guard(output_dir, "").already_complete(step, max_steps, "step", {"model": final})


def finished(output_dir: str | Path, resume_from: Path | None, max_steps: int, model: str = "final") -> bool:
    """Whether nothing is left to do (`already_complete`); if so, its message is logged and the process group ended."""
    if (done := already_complete(output_dir, resume_from, max_steps, model)) is not None:
        get_logger().info(done)
        destroy_distributed()
    return done is not None


def export_final(trainer, tokenizer, out_dir: str | Path, merge: bool = True) -> Path | None:
    """The model and tokenizer in Hugging Face format published as ``out_dir/final`` by rank 0 (collective); a PEFT
    model's adapter in ``out_dir/adapter``, ``final`` the merged model (``merge=False``: none). Returns ``final`` (or
    ``adapter``) on rank 0, else None."""
    out_dir, result = Path(out_dir), None
    state = trainer.accelerator.get_state_dict(trainer.model_wrapped)  # every rank takes part; rank 0 gets tensors
    if trainer.is_world_process_zero():
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        state = {k: v.detach().cpu() for k, v in state.items()}
        dtype = str(next(v.dtype for v in state.values() if v.is_floating_point())).removeprefix("torch.")
        if "peft" in sys.modules and isinstance(model, sys.modules["peft"].PeftModel):
            result = publish_pretrained(model, out_dir / "adapter", tokenizer, state_dict=state)
        if result is not None and merge:
            base = model.get_base_model()
            # The class's own constructor, not from_config: under ZeRO-3, from_config partitions the new model
            # across ranks (a collective that rank 0 alone would wait on forever).
            with torch.device("meta"):
                merged = sys.modules["peft"].get_peft_model(type(base)(base.config), model.peft_config["default"])
            merged.load_state_dict(state, assign=True)
            model = merged.merge_and_unload()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if result is None or merge:  # the (merged) model
            config = {"dtype": dtype, "use_cache": True}
            result = publish_pretrained(model, out_dir / "final", tokenizer, config, state_dict=state)
    barrier()
    return result


class TrainerRun(contextlib.AbstractContextManager):
    """A Trainer recipe's `callbacks`, in order; checkpoints published in ``output_dir/checkpoints`` (`root`). Leaving
    the block stops listening for signals, closes `metrics` and the process group, and turns a timed-out collective
    into the line naming the rank behind."""

    def __init__(self, cfg: Any, metrics: MetricsLogger, pad_id: int, resume_from: Path | None = None):
        self.metrics, self.resume_from, self.stopped = metrics, resume_from, False
        self.root = Path(cfg.output_dir) / "checkpoints"
        self.run_control = RunControl(cfg.train.stop_at_step)
        nonfinite = NonFiniteSteps(NonFinitePolicy.from_config(cfg.train), self.root, resume_from)
        self.metrics_callback = MetricsCallback(metrics, pad_id, log_extra=nonfinite.policy.log_extra)
        publisher = PublishCheckpoints(self.root, to_dict(cfg), more_meta=nonfinite.meta)
        self.callbacks = [self.run_control, nonfinite, publisher, self.metrics_callback]

    def train(self, trainer, max_steps: int) -> bool:
        """``trainer.train()`` from `resume_from`: True at `max_steps`, False at ``train.stop_at_step``, `Preempted` on
        a preemption signal (both with a checkpoint there)."""
        log = get_logger()
        trainer.remove_callback(PrinterCallback)  # MetricsLogger prints the log lines
        log.info(epoch_line(len(trainer.train_dataset), _global_batch(trainer.args)))  # Bookkeeping's epochs
        if self.resume_from is not None:  # before the steps, so that the log reads in order
            log.info(f"resumed from {self.resume_from} (the Trainer restores it as training starts)")
        trainer.train(resume_from_checkpoint=str(self.resume_from) if self.resume_from else None)
        if trainer.state.global_step >= max_steps:
            return True
        self.stopped, newest = True, _newest(self.root)
        self.run_control.raise_if_stopped(trainer.state, newest)  # exit status 75
        log.info(
            f"stopped at step {trainer.state.global_step} of {max_steps} (train.stop_at_step); run again "
            f"without train.stop_at_step (or with a larger value) to continue from {newest}"
        )
        return False

    def __exit__(self, exc_type, exc, tb) -> None:
        failed = exc is not None and not isinstance(exc, Preempted)
        stalled = stall_error(exc) if failed else None  # name the rank behind while the group exists
        try:
            self.run_control.close()
            self.metrics.close(failed=failed, stopped=self.stopped)
            destroy_distributed()
        finally:
            if stalled is not None:
                raise stalled from exc
