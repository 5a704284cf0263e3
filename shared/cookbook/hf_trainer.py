"""The bookkeeping of a recipe built on the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``), with or without
DeepSpeed: callbacks and mixins that connect it to the rest of the cookbook, for any model.

`MetricsCallback` feeds `cookbook.metrics.MetricsLogger`; `CountBatches` counts rows, tokens and data wait;
`WholeEpochs` makes an epoch full global batches; `SeedPerRank`, `StopAtStep`; the failure callbacks
`Preemption` (exit 75), `NonFiniteSteps` (``train.on_nonfinite``, exit 4) and `StallReport` (exit 3), with the
torchrun loop's policy (`cookbook.policy`); `RunCallbacks` wires them in order; `TrainerRun` runs
``trainer.train()`` and closes the run. The checkpoint pieces (`PublishCheckpoints`, `ReportSaveErrors`,
`check_resume`, `export_final`) live in `cookbook.hf_checkpoints` and the DeepSpeed ones (`check_deepspeed_config`,
`init_deepspeed`) in `cookbook.hf_deepspeed`; both re-exported here (docs/failures.md, docs/notes.md).

    callbacks = RunCallbacks(cfg, root, metrics, pad_id, resume_from, evaluate_more=generation_eval)
    trainer = MyTrainer(..., callbacks=callbacks.all)   # class MyTrainer(ReportSaveErrors, CountBatches, SFTTrainer)
    with TrainerRun(callbacks.preemption, metrics) as run:   # if run.train(...): export_final(...)
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from transformers import TrainerCallback

from cookbook import lm
from cookbook.config import to_dict
from cookbook.dist import (apply_collective_timeout, barrier, destroy_distributed, get_dist_info, get_logger, record_progress,
                           stall_error)
from cookbook.hf_checkpoints import (PublishCheckpoints, ReportSaveErrors, already_complete, check_resume,  # noqa: F401 (re-exported)
                                     export_final, published_checkpoints, resume_guard)
from cookbook.hf_deepspeed import (DS_TRAINER_KEYS, check_accelerate_deepspeed_file, check_deepspeed_config,  # noqa: F401 (re-exported)
                                   init_deepspeed)
from cookbook.metrics import MetricsLogger
from cookbook.policy import NonFinitePolicy, Preempted, StopRequest, StopVote
from cookbook.resume import read_meta
from cookbook.state import RNGState, seed_per_rank

# Trainer.evaluate's timing keys: not model metrics, left out of the eval record.
_EVAL_TIMING = ("runtime", "samples_per_second", "steps_per_second")


# ----------------------------------------------------------------------------- metrics
class MetricsCallback(TrainerCallback):
    """Feeds a `MetricsLogger` from the Trainer's events: a train record per ``on_log`` with a ``loss``, one eval
    record per ``on_evaluate`` (the ``eval_*`` values without prefix and timing keys, then ``evaluate_more(model)``'s,
    a collective; kept in `last_eval`). Evaluations and saves inside the step loop are paused out of the step time and
    leave the random streams as they were; put this callback after `StopAtStep` and `PublishCheckpoints`.
    `log_extra`: more numbers for each train record, the same on every rank.
    """

    def __init__(self, metrics: MetricsLogger, pad_id: int,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None,
                 log_extra: Callable[[], Mapping[str, float]] | None = None):
        self.metrics = metrics
        self.pad_id = pad_id
        self.evaluate_more = evaluate_more
        self.log_extra = log_extra
        self.last_eval: dict[str, float] = {}  # the last evaluation's values, as logged
        self._pause = None  # the open MetricsLogger.paused() context, between a step's end and its eval / save
        self._rng = None  # the random streams when a step ended with should_evaluate, restored after on_evaluate

    def count(self, batches: list[dict[str, torch.Tensor]], data_wait_s: float) -> None:
        """Count the micro-batches of one optimizer step: rows, real tokens, and `data_wait_s` (seconds spent
        fetching all of them, shared out equally)."""
        wait = data_wait_s / max(len(batches), 1)
        for b in batches:
            self.metrics.add(samples=b["input_ids"].shape[0], tokens=lm.count_tokens(b, self.pad_id), data_wait_s=wait)

    def _pause_if(self, control) -> None:
        if control.should_evaluate and self._rng is None:  # the evaluation must not change what training draws
            self._rng = RNGState().state_dict()
        if (control.should_evaluate or control.should_save) and self._pause is None:
            if self.metrics.info.device.type == "cuda":
                torch.cuda.synchronize(self.metrics.info.device)  # the step's queued kernels belong to the window
            self._pause = self.metrics.paused()
            self._pause.__enter__()

    def _resume(self) -> None:
        if self._pause is not None:
            self._pause.__exit__(None, None, None)
            self._pause = None

    def on_train_begin(self, args, state, control, **kwargs):
        barrier()
        self.metrics.start(state.global_step)

    def on_step_begin(self, args, state, control, **kwargs):
        self._resume()  # normally closed already by on_evaluate / on_save

    def on_step_end(self, args, state, control, **kwargs):
        self._pause_if(control)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._pause_if(control)

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

    def on_save(self, args, state, control, **kwargs):
        self._resume()

    def on_train_end(self, args, state, control, **kwargs):
        self._resume()


class CountBatches:
    """Trainer mixin, first in the bases: counts each optimizer step's micro-batches (rows, real tokens,
    data-loading wait) into the trainer's `MetricsCallback`.

    Raises:
        ValueError: the trainer has no `MetricsCallback` among its callbacks.
    """

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        t0 = time.perf_counter()
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        wait = time.perf_counter() - t0
        found = [c for c in self.callback_handler.callbacks if isinstance(c, MetricsCallback)]
        if not found:
            raise ValueError(f"{type(self).__name__} counts batches for a MetricsCallback: pass one in callbacks=[...]")
        found[0].count(batches, wait)
        return batches, num_items


class WholeEpochs:
    """Trainer mixin: an epoch reads every row at most once, in ``rows // global batch`` full global batches
    (`FullBatchesSampler`); the remainder is dropped and logged once (`epoch_line`). Why: docs/notes.md.
    """

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        a = self.args
        return FullBatchesSampler(len(dataset), a.per_device_train_batch_size * a.gradient_accumulation_steps
                                  * a.world_size, a.seed, epoch_of=lambda: int(self.state.epoch or 0))


class FullBatchesSampler(torch.utils.data.Sampler):
    """Row indices of one epoch: ``torch.randperm(num_rows)`` seeded ``seed + epoch_of()``, cut to
    ``num_rows // global_batch`` whole global batches, so every rank gets as many micro-batches and no row comes twice.
    `epoch_of` reads ``int(state.epoch)`` from the Trainer.

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
        seed = self.seed + int(self.epoch_of())
        order = torch.randperm(self.num_rows, generator=torch.Generator().manual_seed(seed))
        return iter(order[:len(self)].tolist())


def epoch_line(num_rows: int, global_batch: int) -> str:
    """The log's line on what one epoch reads: ``num_rows`` rows in full global batches of ``global_batch`` rows,
    and the remainder that is dropped (`WholeEpochs`)."""
    steps, rest = divmod(num_rows, global_batch)
    tail = f"the last partial global batch ({rest} rows, others each epoch) is dropped" if rest else \
        "no partial global batch"
    return f"epoch: {num_rows} rows = {steps} steps of {global_batch} rows, every row read once; {tail}"


# ----------------------------------------------------------------------------- seeds, stops and failures
class SeedPerRank(TrainerCallback):
    """Seeds the random streams ``args.seed + args.process_index`` when training begins (each rank its own dropout
    masks); a resumed run then restores each rank's saved streams.
    """

    def on_train_begin(self, args, state, control, **kwargs):
        seed_per_rank(args.seed, args.process_index)


class StopAtStep(TrainerCallback):
    """Ends training after step `stop_at_step` (``train.stop_at_step``; <= 0: never) with a checkpoint, when
    that step is before the last."""

    def __init__(self, stop_at_step: int):
        self.stop_at_step = stop_at_step

    def on_step_end(self, args, state, control, **kwargs):
        if 0 < self.stop_at_step <= state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True


class Preemption(TrainerCallback):
    """SIGTERM or SIGUSR1 asks to stop (`cookbook.policy.StopRequest`); the ranks agree on the step (`StopVote`), the
    Trainer saves a checkpoint there and stops, and `raise_if_stopped` raises `Preempted` (exit 75). A request at the
    last step is too late. Put it before `MetricsCallback`.
    """

    def __init__(self) -> None:
        self.request = StopRequest()
        self._vote: StopVote | None = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._vote = StopVote(get_dist_info().device)
        self.request.listen()

    def on_step_end(self, args, state, control, **kwargs):
        if self._vote(self.request.requested) and state.global_step < state.max_steps:
            control.should_training_stop = True
            if args.save_strategy != "no":
                control.should_save = True

    def on_train_end(self, args, state, control, **kwargs):
        if self._vote is not None:
            self._vote.finish()
        self.request.restore()

    def close(self) -> None:
        """Stop listening (after a failed ``train()``, which skips ``on_train_end``); safe to call twice."""
        self.request.restore()

    def raise_if_stopped(self, state, checkpoint: Path | None) -> None:
        """After ``trainer.train()``: if a preemption stopped it before ``state.max_steps``, log the stop
        with `checkpoint` (published at that step) and raise `cookbook.policy.Preempted` (75).
        """
        if self.request.requested and state.global_step < state.max_steps:
            raise self.request.preempted(state.global_step, state.max_steps, checkpoint)


class NonFiniteSteps(TrainerCallback):
    """``train.on_nonfinite`` for the Trainer, with the torchrun recipes' `NonFinitePolicy`: under DeepSpeed it reads
    DeepSpeed's own skip of a non-finite step (``on_optimizer_step``); without it, it checks the clipped gradients
    before ``optimizer.step()`` (one all-reduce) and drops a bad step's gradients. ``stop`` raises `NonFiniteError`
    (exit 4); ``skip`` logs and counts the step (the Trainer keeps its number). The count goes into each checkpoint's
    ``meta.json`` (`meta`) and continues from `resume_from`. How: docs/failures.md, docs/notes.md.
    """

    META_KEY = "skipped_steps"  # in meta.json

    def __init__(self, policy: NonFinitePolicy, root: str | Path, resume_from: str | Path | None = None):
        self.policy, self.root = policy, Path(root)
        policy.newest_checkpoint = self._newest  # for the stop message: the newest published checkpoint
        if resume_from is not None:
            policy.skipped_steps = int(read_meta(resume_from).get(self.META_KEY, 0))
        self._deepspeed = False  # set in on_train_begin

    def _newest(self) -> Path | None:
        found = published_checkpoints(self.root)
        return found[-1] if found else None

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        try:  # accelerate exports the wrapper only where DeepSpeed is installed
            from accelerate.utils import DeepSpeedOptimizerWrapper
        except ImportError:
            self._deepspeed = False
            return
        self._deepspeed = isinstance(optimizer, DeepSpeedOptimizerWrapper)

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        if self._deepspeed:  # DeepSpeed has already applied or discarded the update (on_optimizer_step)
            return
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        if _nonfinite_on_some_rank(grads, get_dist_info().device):
            for p in model.parameters():
                p.grad = None
            step = state.global_step + 1
            self.policy.nonfinite(step, f"the gradients of step {step} are not finite on every rank (the optimizer "
                                        f"step was left out)", "non-finite gradients, optimizer step left out")
        else:
            self.policy.stepped()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        if not self._deepspeed:  # decided in on_pre_optimizer_step
            return
        if not optimizer.step_was_skipped:
            self.policy.stepped()
            return
        step = state.global_step + 1
        self.policy.nonfinite(step, f"the gradient norm of step {step} is not finite (DeepSpeed discarded the update)",
                              "non-finite gradient norm, update discarded")

    def log_extra(self) -> dict[str, float]:
        """``{"skipped_steps": n}`` with ``skip``, else ``{}``: for `MetricsCallback`'s ``log_extra``."""
        return self.policy.log_extra()

    def meta(self) -> dict[str, int]:
        """``{"skipped_steps": n}``, steps skipped up to now (this run and the ones it resumed): for
        `PublishCheckpoints`'s ``more_meta``."""
        return {self.META_KEY: self.policy.skipped_steps}


def _nonfinite_on_some_rank(grads: list[torch.Tensor], device: torch.device) -> bool:
    """Whether any of `grads` (this rank's gradients, any shapes; DTensors are checked by their local shard) has a
    NaN or infinite norm on any rank. Collective (one all-reduce of a scalar, MAX, over the default group) when a
    process group exists: call it on every rank, with or without gradients."""
    local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
    norms = [torch.linalg.vector_norm(g.detach(), dtype=torch.float32).to(device) for g in local if g.numel()]
    flag = (~torch.isfinite(torch.stack(norms))).any().to(torch.float32).reshape(1) if norms else \
        torch.zeros(1, device=device)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())


class StallReport(TrainerCallback):
    """Gives every process group (DeepSpeed's copy of the world group included) ``train.collective_timeout_s`` when
    training begins, and records this rank's progress at each step end, so that a timed-out collective names the rank
    that is behind (exit status 3).
    """

    def on_train_begin(self, args, state, control, **kwargs):
        apply_collective_timeout()
        record_progress(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        record_progress(state.global_step)


# ----------------------------------------------------------------------------- the run
class RunCallbacks:
    """A Trainer recipe's callbacks wired to each other (`Preemption`, `NonFiniteSteps`, `MetricsCallback`, the
    publisher); `all` lists them in the order the Trainer must call them. `cfg` goes into ``meta.json`` for the resume
    check; `root`: the published checkpoints' folder.
    """

    def __init__(self, cfg: Any, root: str | Path, metrics: MetricsLogger, pad_id: int,
                 resume_from: str | Path | None = None,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None):
        self.preemption = Preemption()
        self.nonfinite = NonFiniteSteps(NonFinitePolicy.from_config(cfg.train), root, resume_from)
        self.publisher = PublishCheckpoints(root, cfg.checkpoint.keep_last, to_dict(cfg), more_meta=self.nonfinite.meta)
        self.metrics = MetricsCallback(metrics, pad_id, evaluate_more=evaluate_more, log_extra=self.nonfinite.log_extra)
        self.all = [SeedPerRank(), StopAtStep(cfg.train.stop_at_step), self.preemption, self.nonfinite, StallReport(), self.publisher,
                    self.metrics]


class TrainerRun:
    """Runs ``trainer.train()`` and ends the run whatever happens: leaving the block stops listening for signals,
    closes `metrics` and the process group; a timed-out collective becomes the one line naming the rank behind.
    """

    def __init__(self, preemption: Preemption, metrics: MetricsLogger):
        self.preemption, self.metrics = preemption, metrics
        self.stopped = False

    def train(self, trainer, resume_from: Path | None, max_steps: int, publisher: PublishCheckpoints) -> bool:
        """``trainer.train()`` from `resume_from`; True when it reached `max_steps`, False when ``train.stop_at_step``
        stopped it.

        Raises:
            Preempted: a preemption signal stopped it (a checkpoint is published at that step).
        """
        log = get_logger()
        if resume_from is not None:  # before the steps, so that the log reads in order
            log.info(f"resumed from {resume_from} (the Trainer restores it as training starts)")
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        if trainer.state.global_step >= max_steps:
            return True
        self.stopped = True
        self.preemption.raise_if_stopped(trainer.state, publisher.latest())  # exit status 75
        log.info(f"stopped at step {trainer.state.global_step} of {max_steps} (train.stop_at_step); run again "
                 f"without train.stop_at_step (or with a larger value) to continue from {publisher.latest()}")
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


