"""The bookkeeping of a recipe on the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``), with or without DeepSpeed
(its JSON check: `cookbook.hf_deepspeed`). The Trainer saves, resumes (``resume_from_checkpoint``: the resume guard's
pick), logs and keeps ``save_total_limit`` checkpoints; this adds, as the torchrun loop does: atomic publication with
checksums, preemption (exit 75), non-finite steps (exit 4), stalls (exit 3) through `cookbook.policy`, and
metrics.jsonl and the trackers through `cookbook.metrics`. Why each piece: docs/failures.md, docs/notes.md.

    class MyTrainer(hf_trainer.Bookkeeping, SFTTrainer): ...           # at module level
    run = hf_trainer.TrainerRun(cfg, metrics, pad_id, resume_from)
    trainer = MyTrainer(..., args=SFTConfig(..., **hf_trainer.trainer_args(cfg, max_steps)), callbacks=run.callbacks)
    with run:                                                          # if run.train(trainer, max_steps): export
"""

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
from transformers import PrinterCallback, TrainerCallback

from cookbook import lm
from cookbook.checkpoint import from_rank0, os_error_in, publish, save_error
from cookbook.config import to_dict
from cookbook.dist import (apply_collective_timeout, barrier, destroy_distributed, get_dist_info, get_logger,
                           record_progress, stall_error)
from cookbook.metrics import MetricsLogger
from cookbook.policy import NonFinitePolicy, Preempted, StopRequest, StopVote
from cookbook.resume import CHECKSUMS_KEY, FILES_KEY, ResumeGuard, _reason, checksums, file_sizes, read_meta
from cookbook.state import RNGState, seed_per_rank

_EVAL_TIMING = ("runtime", "samples_per_second", "steps_per_second")  # Trainer.evaluate's, not model metrics


def trainer_args(cfg: Any, max_steps: int) -> dict[str, Any]:
    """The ``TrainingArguments`` of the bookkeeping: a log every ``train.log_every`` steps, ``train.seed``, a save
    every ``checkpoint.every_steps`` (0: at the end only; < 0: none) into ``output_dir/.staging`` (`PublishCheckpoints`
    publishes it from there) and the newest ``checkpoint.keep_last`` (0: all) kept."""
    every = cfg.checkpoint.every_steps
    return dict(output_dir=str(Path(cfg.output_dir) / ".staging"), seed=cfg.train.seed,
                logging_steps=cfg.train.log_every, save_strategy="steps" if every >= 0 else "no",  # saves the end too
                save_steps=every or max_steps, save_total_limit=cfg.checkpoint.keep_last or None,
                # not the Trainer's trackers: MetricsLogger's continue one run across restarts, with throughput and MFU
                report_to="none", disable_tqdm=True, log_level="warning")  # MetricsLogger prints the log lines


# ----------------------------------------------------------------------------- metrics
class MetricsCallback(TrainerCallback):
    """Feeds a `MetricsLogger`: a train record per ``on_log`` with a ``loss`` (`log_extra`: more numbers, the same on
    every rank), an eval record per ``on_evaluate`` (the ``eval_*`` values without prefix and timing, then
    ``evaluate_more(model)``'s, a collective; kept in `last_eval`). Evaluations and saves are paused out of the step
    time, and an evaluation leaves the random streams as it found them. Put it after `StopAtStep` and the publisher.
    """

    def __init__(self, metrics: MetricsLogger, pad_id: int,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None,
                 log_extra: Callable[[], Mapping[str, float]] | None = None):
        self.metrics, self.pad_id, self.evaluate_more, self.log_extra = metrics, pad_id, evaluate_more, log_extra
        self.last_eval: dict[str, float] = {}
        self._pause = None  # the open MetricsLogger.paused() context, between a step's end and its eval / save
        self._rng = None  # the random streams when a step ended with should_evaluate, restored after on_evaluate

    def count(self, batches: list[dict[str, torch.Tensor]], data_wait_s: float) -> None:
        """Count one optimizer step's micro-batches: rows, real tokens, and `data_wait_s` (seconds, shared out)."""
        wait = data_wait_s / max(len(batches), 1)
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
            self._pause.__exit__(None, None, None)
            self._pause = None

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
            self.metrics.log_step(state.global_step, logs["loss"], logs.get("learning_rate", 0.0), logs.get("grad_norm"),
                                  extra=dict(self.log_extra()) if self.log_extra is not None else None)
            self._pause_if(control)

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        values = {k.removeprefix("eval_"): v for k, v in (metrics or {}).items() if k.startswith("eval_")
                  and k.removeprefix("eval_") not in _EVAL_TIMING and isinstance(v, (int, float))}
        if self.evaluate_more is not None:
            values.update(self.evaluate_more(model))
        self.metrics.log_eval(state.global_step, values)
        self.last_eval = values
        if self._rng is not None:
            RNGState().load_state_dict(self._rng)
            self._rng = None
        if not control.should_save:
            self._resume()


class Bookkeeping:
    """Trainer mixin, first in the bases: counts each optimizer step's micro-batches (rows, real tokens, data wait)
    into the `MetricsCallback`; an epoch reads full global batches (`FullBatchesSampler`); a save that fails with an
    `OSError` deletes its staging folder and ends the run with `CheckpointSaveError`'s one line (exit 2; the other ranks
    stop as having lost a peer) when a `PublishCheckpoints` is among the callbacks; no `PrinterCallback`.

    Raises:
        ValueError: no `MetricsCallback` among the callbacks.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.remove_callback(PrinterCallback)  # MetricsLogger prints the log lines

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        t0 = time.perf_counter()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        found = [c for c in self.callback_handler.callbacks if isinstance(c, MetricsCallback)]
        if not found:
            raise ValueError(f"{type(self).__name__} counts batches for a MetricsCallback: pass one in callbacks=[...]")
        found[0].count(batches, time.perf_counter() - t0)
        return batches, num_items

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        a = self.args
        return FullBatchesSampler(len(dataset), a.per_device_train_batch_size * a.gradient_accumulation_steps
                                  * a.world_size, a.seed, epoch_of=lambda: int(self.state.epoch or 0))

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
            error = save_error(step, publisher.root / f"checkpoint-{step}", _newest(publisher.root),
                               info.rank if info.world_size > 1 else None, os_error)
            error.same_on_every_rank = False  # this rank alone met it, so this rank prints it
            raise error from exc


class FullBatchesSampler(torch.utils.data.Sampler):
    """Row indices of one epoch: ``torch.randperm(num_rows)`` seeded ``seed + epoch_of()`` (the Trainer's
    ``int(state.epoch)``), cut to ``num_rows // global_batch`` whole global batches: every rank gets as many
    micro-batches and no row comes twice (why: docs/notes.md).

    Raises:
        ValueError: fewer rows than one global batch.
    """

    def __init__(self, num_rows: int, global_batch: int, seed: int, epoch_of: Callable[[], int]):
        if num_rows < global_batch:
            raise ValueError(f"{num_rows} rows are fewer than one global batch of {global_batch}")
        self.num_rows, self.global_batch, self.seed, self.epoch_of = num_rows, global_batch, seed, epoch_of

    def __len__(self) -> int:
        return self.num_rows // self.global_batch * self.global_batch

    def __iter__(self):
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(self.seed + int(self.epoch_of())))
        return iter(order[:len(self)].tolist())


def epoch_line(num_rows: int, global_batch: int) -> str:
    """The log's line on what one epoch reads (`FullBatchesSampler`) and the remainder that is dropped."""
    steps, rest = divmod(num_rows, global_batch)
    tail = f"the last partial global batch ({rest} rows, others each epoch) is dropped" if rest else \
        "no partial global batch"
    return f"epoch: {num_rows} rows = {steps} steps of {global_batch} rows, every row read once; {tail}"


# ----------------------------------------------------------------------------- seeds, stops and failures
class SeedPerRank(TrainerCallback):
    """Seeds ``args.seed + args.process_index`` as training begins (each rank its own dropout masks); a resume then
    restores each rank's saved streams."""

    def on_train_begin(self, args, state, control, **kwargs):
        seed_per_rank(args.seed, args.process_index)


class StopAtStep(TrainerCallback):
    """Ends training with a checkpoint after step `stop_at_step` (``train.stop_at_step``; <= 0: never) before the last."""

    def __init__(self, stop_at_step: int):
        self.stop_at_step = stop_at_step

    def on_step_end(self, args, state, control, **kwargs):
        if 0 < self.stop_at_step <= state.global_step < state.max_steps:
            control.should_save = control.should_training_stop = True


class StallReport(TrainerCallback):
    """Gives every process group (DeepSpeed's copy of the world group included) ``train.collective_timeout_s`` and
    records this rank's progress at each step, so that a timed-out collective names the rank behind (exit 3)."""

    def on_train_begin(self, args, state, control, **kwargs):
        apply_collective_timeout()
        record_progress(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        record_progress(state.global_step)


class Preemption(TrainerCallback):
    """SIGTERM or SIGUSR1 asks to stop (`StopRequest`); the ranks agree on the step (`StopVote`), the Trainer saves
    there and stops, and `raise_if_stopped` raises `Preempted` (exit 75). Too late at the last step. Put it before
    `MetricsCallback`."""

    def __init__(self) -> None:
        self.request = StopRequest()
        self._vote: StopVote | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._vote = StopVote(get_dist_info().device)
        self.request.listen()

    def on_step_end(self, args, state, control, **kwargs):
        if self._vote(self.request.requested) and state.global_step < state.max_steps:
            control.should_training_stop = True
            control.should_save = args.save_strategy != "no" or control.should_save

    def on_train_end(self, args, state, control, **kwargs):
        if self._vote is not None:
            self._vote.finish()
        self.request.restore()

    def close(self) -> None:
        """Stop listening (a failed ``train()`` skips ``on_train_end``); safe to call twice."""
        self.request.restore()

    def raise_if_stopped(self, state, checkpoint: Path | None) -> None:
        """After ``trainer.train()``: `Preempted` (75), logged with `checkpoint`, if a preemption stopped it early."""
        if self.request.requested and state.global_step < state.max_steps:
            raise self.request.preempted(state.global_step, state.max_steps, checkpoint)


class NonFiniteSteps(TrainerCallback):
    """``train.on_nonfinite`` with the torchrun recipes' `NonFinitePolicy`: under DeepSpeed it reads DeepSpeed's own
    skip of a non-finite step (``on_optimizer_step``); without it, it checks the clipped gradients before
    ``optimizer.step()`` (one all-reduce) and drops a bad step's gradients. ``stop`` raises `NonFiniteError` (exit 4);
    ``skip`` counts the step, in each checkpoint's ``meta.json`` (`meta`), continued from `resume_from`.
    """

    META_KEY = "skipped_steps"  # in meta.json

    def __init__(self, policy: NonFinitePolicy, root: str | Path, resume_from: str | Path | None = None):
        self.policy, self._deepspeed = policy, False
        policy.newest_checkpoint = lambda: _newest(root)  # for the stop message
        if resume_from is not None:
            policy.skipped_steps = int(read_meta(resume_from).get(self.META_KEY, 0))

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        # by name: accelerate exports the class only where DeepSpeed is installed
        self._deepspeed = type(optimizer).__name__ == "DeepSpeedOptimizerWrapper"

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._deepspeed:  # DeepSpeed has already applied or discarded the update (on_optimizer_step)
            return
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if not _nonfinite_on_some_rank(grads, get_dist_info().device):
            return self.policy.stepped()
        for p in model.parameters():
            p.grad = None
        step = state.global_step + 1
        self.policy.nonfinite(step, f"the gradients of step {step} are not finite on every rank (the optimizer "
                                    f"step was left out)", "non-finite gradients, optimizer step left out")

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if not self._deepspeed:  # decided in on_pre_optimizer_step
            return
        if not optimizer.step_was_skipped:
            return self.policy.stepped()
        step = state.global_step + 1
        self.policy.nonfinite(step, f"the gradient norm of step {step} is not finite (DeepSpeed discarded the update)",
                              "non-finite gradient norm, update discarded")

    def log_extra(self) -> dict[str, float]:
        """``{"skipped_steps": n}`` with ``skip``, else ``{}``: `MetricsCallback`'s ``log_extra``."""
        return self.policy.log_extra()

    def meta(self) -> dict[str, int]:
        """``{"skipped_steps": n}``, this run's and the ones it resumed: `PublishCheckpoints`'s ``more_meta``."""
        return {self.META_KEY: self.policy.skipped_steps}


def _nonfinite_on_some_rank(grads: list[torch.Tensor], device: torch.device) -> bool:
    """Whether any of `grads` (DTensors by their local shard) has a NaN or infinite norm on any rank. Collective
    (an all-reduce of one scalar) when a process group exists: call it on every rank."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32).to(device) for g in local if g.numel()]
    flag = (~torch.isfinite(torch.stack(norms))).any().to(torch.float32).reshape(1) if norms else \
        torch.zeros(1, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


# ----------------------------------------------------------------------------- checkpoints
def published_checkpoints(root: str | Path) -> list[Path]:
    """Published ``checkpoint-<step>`` folders under `root`, oldest first, as the resume guard finds them."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


def _newest(root: str | Path) -> Path | None:
    found = published_checkpoints(root)
    return found[-1] if found else None


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint the Trainer saves: once every rank wrote ``checkpoint-<step>`` into the staging
    folder (``args.output_dir``), rank 0 adds ``meta.json`` (step, world size, `config`, file sizes, checksums,
    `more_meta`), renames it into `root` and keeps the newest ``args.save_total_limit`` there.

    Raises (from ``on_save``, on every rank):
        CheckpointSaveError: rank 0 could not write ``meta.json`` or publish; the previous checkpoint is intact.
    """

    def __init__(self, root: str | Path, config: Mapping[str, Any], more_meta: Callable[[], Mapping[str, Any]] | None = None):
        self.root, self.config, self.more_meta = Path(root), dict(config), more_meta

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
                # The Trainer rotates its output_dir before on_save (.staging here, a no-op): the published ones here
                keep = args.save_total_limit or 0
                for old in published_checkpoints(self.root)[:-keep] if keep > 0 else []:
                    shutil.rmtree(old, ignore_errors=True)
                get_logger().info(f"checkpoint published: {self.root / src.name}")
        failure = from_rank0(failure)
        if failure is not None:
            reason, code = failure
            raise save_error(state.global_step, self.root / src.name, _newest(self.root),
                             0 if args.world_size > 1 else None, OSError(code, reason), reason)
        barrier()


def _guard(output_dir: str | Path, cannot_remap: str) -> ResumeGuard:
    """The `ResumeGuard` of the published ``output_dir/checkpoints/checkpoint-<step>``; another number of ranks is
    refused (`cannot_remap`: why), and its advice to start afresh deletes the whole `output_dir`."""
    return ResumeGuard(Path(output_dir) / "checkpoints", folder="checkpoint-<n>", files=(), run_dir=output_dir,
                       cannot_remap=cannot_remap, same_size="NGPU x NNODES = {n}", published=True)


def check_resume(cfg: Any, world_size: int, may_change: tuple[str, ...], cannot_remap: str) -> Path | None:
    """The checkpoint to resume from (``checkpoint.resume``: auto, none or a folder; auto: the newest that verifies,
    falling back with one warning), checked against `cfg` on `world_size` ranks (`may_change`: keys that may differ).

    Raises:
        CheckpointError: see `cookbook.resume.ResumeGuard.check`.
    """
    return _guard(cfg.output_dir, cannot_remap).check(cfg.checkpoint.resume, world_size, to_dict(cfg), may_change,
                                                            ("train.stop_at_step", cfg.train.stop_at_step))


def already_complete(output_dir: str | Path, resume_from: Path | None, max_steps: int,
                     model: str = "final") -> str | None:
    """The message for a run whose checkpoint `resume_from` is at or past `max_steps` and whose final model
    (``output_dir/<model>``, `export_final`'s) is there: nothing left to do; else ``None``."""
    final = Path(output_dir) / model
    step = read_meta(resume_from)["step"] if resume_from is not None and final.is_dir() else -1
    if step < max_steps:
        return None
    return _guard(output_dir, "").already_complete(step, max_steps, "step", {"model": final})


def finished(output_dir: str | Path, resume_from: Path | None, max_steps: int, model: str = "final") -> bool:
    """Whether nothing is left to do (`already_complete`); if so, its message is logged and the process group ended."""
    done = already_complete(output_dir, resume_from, max_steps, model)
    if done is not None:
        get_logger().info(done)
        destroy_distributed()
    return done is not None


@contextlib.contextmanager
def _torch_saves_raise_os_errors() -> Iterator[None]:
    """While the Trainer saves, ``torch.save`` to a path writes through a Python file, so that a failed write raises
    the `OSError` (errno, file) instead of torch's ``RuntimeError: ... unexpected pos``; the bytes are the same."""
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
    """The `OSError` in `exc`'s chain, or the one safetensors gives as text only (``... (os error 27)``)."""
    found = os_error_in(exc)
    code = re.search(r"\(os error (\d+)\)", str(exc)) if found is None else None
    return OSError(int(code[1]), os.strerror(int(code[1]))) if code else found


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
        model = trainer.accelerator.unwrap_model(trainer.model_wrapped)
        state = {k: v.detach().cpu() for k, v in state.items()}
        dtype = str(next(v.dtype for v in state.values() if v.is_floating_point())).removeprefix("torch.")
        if _is_peft(model):
            result = _publish_pretrained(model, tokenizer, out_dir / "adapter", state_dict=state)
        if result is not None and merge:
            from peft import get_peft_model

            base = model.get_base_model()
            # The class's own constructor, not from_config: under ZeRO-3, from_config partitions the new model
            # across ranks (a collective that rank 0 alone would wait on forever).
            with torch.device("meta"):
                merged = get_peft_model(type(base)(base.config), model.peft_config["default"])
            merged.load_state_dict(state, assign=True)
            model = merged.merge_and_unload()
            state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if result is None or merge:  # the (merged) model
            result = _publish_pretrained(model, tokenizer, out_dir / "final", {"dtype": dtype, "use_cache": True},
                                         state_dict=state, safe_serialization=True)
    barrier()
    return result


def _publish_pretrained(model, tokenizer, folder: Path, config: Mapping[str, Any] = {}, **kwargs) -> Path:
    """`model` (``save_pretrained(**kwargs)``, `config` set in its config.json) and `tokenizer` published as `folder`."""
    tmp = folder.parent / f".tmp-{folder.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, **kwargs)
    if config:
        (tmp / "config.json").write_text(json.dumps({**json.loads((tmp / "config.json").read_text()), **config}, indent=2))
    tokenizer.save_pretrained(tmp)
    publish(tmp, folder)
    return folder


def _is_peft(model: torch.nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


# ----------------------------------------------------------------------------- the run
class TrainerRun:
    """A Trainer recipe's callbacks, wired to each other, in the order the Trainer must call them (`callbacks`), and
    the end of its ``trainer.train()``: leaving the block stops listening for signals, closes `metrics` and the process
    group, and turns a timed-out collective into the one line naming the rank behind. `cfg` goes into each
    ``meta.json`` for the resume check; the checkpoints are published in ``output_dir/checkpoints``.
    """

    def __init__(self, cfg: Any, metrics: MetricsLogger, pad_id: int, resume_from: Path | None = None,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None):
        self.metrics, self.resume_from, self.stopped = metrics, resume_from, False
        self.root = Path(cfg.output_dir) / "checkpoints"
        self.preemption = Preemption()
        nonfinite = NonFiniteSteps(NonFinitePolicy.from_config(cfg.train), self.root, resume_from)
        self.metrics_callback = MetricsCallback(metrics, pad_id, evaluate_more, log_extra=nonfinite.log_extra)
        self.callbacks = [SeedPerRank(), StopAtStep(cfg.train.stop_at_step), self.preemption, nonfinite, StallReport(),
                          PublishCheckpoints(self.root, to_dict(cfg), more_meta=nonfinite.meta), self.metrics_callback]

    def train(self, trainer, max_steps: int) -> bool:
        """``trainer.train()`` from `resume_from`; True when it reached `max_steps`, False when ``train.stop_at_step``
        stopped it (a checkpoint is published there).

        Raises:
            Preempted: a preemption signal stopped it (a checkpoint is published at that step).
        """
        log = get_logger()
        if self.resume_from is not None:  # before the steps, so that the log reads in order
            log.info(f"resumed from {self.resume_from} (the Trainer restores it as training starts)")
        trainer.train(resume_from_checkpoint=str(self.resume_from) if self.resume_from else None)
        if trainer.state.global_step >= max_steps:
            return True
        self.stopped = True
        self.preemption.raise_if_stopped(trainer.state, _newest(self.root))  # exit status 75
        log.info(f"stopped at step {trainer.state.global_step} of {max_steps} (train.stop_at_step); run again "
                 f"without train.stop_at_step (or with a larger value) to continue from {_newest(self.root)}")
        return False

    def __enter__(self) -> "TrainerRun":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        failed = exc is not None and not isinstance(exc, Preempted)
        stalled = stall_error(exc) if failed else None  # name the rank behind while the group exists
        try:
            self.preemption.close()
            self.metrics.close(failed=failed, stopped=self.stopped)
            destroy_distributed()
        finally:
            if stalled is not None:
                raise stalled from exc
        return False
