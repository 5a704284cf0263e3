"""The bookkeeping around a training step, written once: a small helper that a recipe's plain loop calls.

A recipe's ``train.py`` writes its step body out (forward, backward, ``no_sync``, gradient clipping,
the optimizer step, the FSDP2 / expert-parallel / TorchRec specifics) and leaves the rest to `TrainLoop`:

.. code-block:: python

    batches = EpochBatches(train_loader, state, sampler.set_epoch, info.device, metrics=metrics)
    loop = TrainLoop(state=state, max_steps=max_steps, stop_at_step=cfg.train.stop_at_step, metrics=metrics,
                     log_every=cfg.train.log_every, eval_every=cfg.train.eval_every, evaluate=run_eval,
                     checkpointer=checkpointer, checkpoint_every=cfg.checkpoint.every_steps,
                     checkpoint_state=ckpt_state, config=to_dict(cfg))
    with loop:                                  # ends the metrics run: FINISHED, KILLED (stopped early) or FAILED
        for step in loop.steps():               # 1, 2, ... up to max_steps or train.stop_at_step
            micro_batches, waits = batches.take(cfg.train.grad_accum_steps)
            ...                                 # forward and backward of each micro-batch; metrics.add(...)
            grad_norm = clip_grad_norm_(...)    # reduced over ranks: the same number on every rank
            if loop.skip_step(grad_norm):       # NaN / inf: stops the run, or (train.on_nonfinite=skip) drops the step
                optimizer.zero_grad(set_to_none=True)
                continue
            optimizer.step(); scheduler.step(); optimizer.zero_grad()
            loop.end_step(loss, lr=lr, grad_norm=grad_norm)   # log window, eval and checkpoint cadence
        loop.finish(export=lambda: {"export_dir": (export_hf(...), "AutoModelForCausalLM.from_pretrained")})

What it does, so that every recipe does it the same way:

- counts optimizer steps in the checkpointed `TrainState` (``step``, ``epoch``);
- keeps the metric window: the mean loss of the steps since the last log line, logged every
  ``log_every`` steps and at the last step (`cookbook.metrics.MetricsLogger.log_step`);
- runs evaluation every ``eval_every`` steps and saves a checkpoint every ``checkpoint_every`` steps,
  at ``stop_at_step`` and at the last step, both inside ``metrics.paused()`` so that step time,
  throughput and ETA measure training alone;
- stops at ``stop_at_step`` (a planned interruption, to be resumed) or when `request_stop` was called
  (a hook for preemption: the flag is read at step boundaries only);
- checks each step for a non-finite loss or gradient norm before its update (`skip_step`), on every rank alike:
  ``train.on_nonfinite=stop`` ends the run with `NonFiniteError` (exit 4), ``skip`` drops the step; a checkpoint
  and the end of a run are refused while a parameter or buffer is NaN or infinite (`cookbook.policy.NonFinitePolicy`,
  which the Ray workers and the Trainer callbacks use too);
- records each rank's progress in the process group's store at every step boundary
  (`cookbook.dist.record_progress`), so that a collective that times out ends the run with one line naming
  the rank that is behind (`cookbook.dist.CollectiveTimeout`, exit status 3);
- times the start-up (``startup_s``: from the launch to the end of this process's first optimizer step, and
  ``first_step_s``, that step alone: `MetricsLogger.first_step_done`) and the final evaluation (``final_eval_s``);
- at the end runs the final evaluation and the recipe's export, writes the summary record (with those times; it
  uploads the export to ``checkpoint.push_to_hub`` when set: `MetricsLogger.log_summary`) and the closing log lines
  (`log_outputs`), or says how to continue a run that stopped early.

The shape follows torchtitan's ``Trainer.train`` / ``train_step`` split and torchtune recipes'
``train()``: a loop the reader can see, with the bookkeeping in named calls.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from cookbook.checkpoint import Checkpointer, RankLocalState, ResumeGuard, RNGState, TrainState, rng_kept, seed_per_rank
from cookbook.config import save_config, to_dict
from cookbook.dist import DistInfo, barrier, get_dist_info, get_logger, record_progress, stall_error
from cookbook.metrics import MetricsLogger, ModelFlops, StepProfiler
from cookbook.policy import (PREEMPT_SIGNALS, NonFiniteError, NonFinitePolicy, Preempted,  # noqa: F401 (re-exported)
                             StopRequest, StopVote, models_in)
from cookbook.run_lock import mark_complete
from cookbook.sampler import DataPosition

Outputs = Mapping[str, "tuple[Path | None, str]"]  # summary key -> (folder or None, how to load it)
_EVAL_COUNTS = ("tokens", "samples", "rows")  # evaluation results that count what was evaluated: not shown on `done:`
_OUTPUT_NAMES = {"export_dir": "model"}  # summary key -> its name on the closing lines (others: the key less "_dir")


def already_complete(state: TrainState, max_steps: int, out_dir: str | Path, final: str | Path | None = None,
                     what: str = "model") -> bool:
    """Whether a resumed run has nothing left to do, and if so say so (rank 0's log).

    Args:
        state: the train state after resuming (``state.step`` optimizer steps done).
        max_steps: the run's total optimizer steps.
        out_dir: the run's output folder.
        final: the folder the finished run exported (``<out_dir>/final``); when given, the run counts as
            complete only once it exists (a run killed between its last checkpoint and its export
            resumes and exports). ``None``: the step count alone decides.
        what: what `final` holds, for the message ("model", "adapter").

    Returns:
        ``True`` when ``state.step >= max_steps`` (and `final` exists): the caller cleans up and returns.
    """
    if state.step < max_steps or (final is not None and not Path(final).is_dir()):
        return False
    out_dir = Path(out_dir)
    outputs = {**({what: final} if final is not None else {}), "metrics": out_dir / "metrics.jsonl"}
    guard = ResumeGuard(out_dir / "checkpoints", run_dir=out_dir)  # one wording for every recipe's message
    get_logger().info(guard.already_complete(state.step, max_steps, outputs=outputs))
    return True


class EpochBatches:
    """Endless batches from a data loader, epoch after epoch, timed.

    Each new pass over `loader` increments ``state.epoch`` and calls ``set_epoch(state.epoch)`` (a
    ``DistributedSampler`` reshuffles), so the epoch is checkpointed with the step. The first pass
    starts from wherever the loader's own state says (a ``StatefulDataLoader`` restored by resume
    continues mid-epoch), or, after a resume on another world size, at the global position of a
    `cookbook.sampler.ResizableSampler` (``set_epoch`` of the same epoch keeps it).

    Args:
        loader: an iterable of batches (dicts of tensors, or anything with ``.to(device)``).
        state: the run's `TrainState`.
        set_epoch: called with the epoch number before each pass (``sampler.set_epoch``); ``None`` if
            the loader needs no reshuffle call.
        device: batches are moved here (``non_blocking``); ``None`` leaves them where they are.
        metrics: when given, the wait for the first batch of each pass is noted there
            (`MetricsLogger.note_pass_start`: ``epoch_start_wait_s`` in that window's train record), so that a
            loader that restarts its worker processes each epoch shows as a spike there.
    """

    def __init__(self, loader, state: TrainState, set_epoch: Callable[[int], None] | None = None,
                 device: torch.device | None = None, metrics: MetricsLogger | None = None):
        self.loader, self.state, self.set_epoch, self.device, self.metrics = loader, state, set_epoch, device, metrics
        self._it: Iterator | None = None

    def _new_pass(self) -> None:
        if self.set_epoch is not None:
            self.set_epoch(self.state.epoch)
        self._it = iter(self.loader)

    def next(self) -> tuple[Any, float]:
        """The next batch (on `device`) and the seconds spent waiting for it.

        Raises:
            RuntimeError: the loader yields no batch at all in a fresh pass.
        """
        t0 = time.perf_counter()
        new_pass = self._it is None
        if new_pass:
            self._new_pass()
        try:
            batch = next(self._it)
        except StopIteration:
            self.state.epoch += 1
            new_pass = True
            self._new_pass()
            try:
                batch = next(self._it)
            except StopIteration:
                raise RuntimeError("the training data loader yields no batch: too few rows for one micro-batch") from None
        wait = time.perf_counter() - t0
        if new_pass and self.metrics is not None:
            self.metrics.note_pass_start(wait)
        if self.device is not None:
            if isinstance(batch, Mapping):
                batch = {k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            else:
                batch = batch.to(self.device, non_blocking=True)
        return batch, wait

    def take(self, n: int) -> tuple[list[Any], list[float]]:
        """`n` batches (the micro-batches of one optimizer step) and their waits in seconds."""
        pairs = [self.next() for _ in range(n)]
        return [b for b, _ in pairs], [w for _, w in pairs]


class TrainLoop:
    """Step counting, metric windows, eval and checkpoint cadence around a recipe's own step body.

    Args:
        state: the checkpointed `TrainState`; ``state.step`` is the number of optimizer steps done.
        max_steps: total optimizer steps of the run.
        stop_at_step: ``> 0``: stop after this step (a checkpoint is saved there), to resume later.
        metrics: the run's `MetricsLogger`.
        log_every: log the window's mean loss every this many steps (and at the last step).
        eval_every: evaluate every this many steps (``0``: only at the end); needs `evaluate`. The random
            streams are put back after each such evaluation (`cookbook.checkpoint.rng_kept`).
        evaluate: runs evaluation on every rank (collective) and returns metrics reduced over ranks,
            e.g. ``{"loss": 1.9}``; ``None``: no evaluation.
        checkpointer: saves checkpoints; ``None``: none.
        checkpoint_every: ``-1``: never save; ``0``: only at `stop_at_step` and the last step;
            ``N``: also every N steps.
        checkpoint_state: what `Checkpointer.save` saves (stateful objects by name).
        config: the run's config (a nested dict), stored in each checkpoint's ``meta.json`` so that a
            resume can refuse other settings.
        profiler: a `StepProfiler` started before and stopped after each step body, or ``None``.
        log_extra: called at each log line for more numbers of that window (collective if it reduces).
        on_nonfinite: a step whose loss or gradient norm is NaN or infinite: ``"stop"`` the run
            (`NonFiniteError`) or ``"skip"`` the step (see `skip_step`).
        max_consecutive_skips: with ``"skip"``: the most steps skipped in a row; the next non-finite one stops.

    Every method that logs, evaluates or saves is collective: call it on every rank in the same order.
    """

    def __init__(self, *, state: TrainState, max_steps: int, stop_at_step: int = -1, metrics: MetricsLogger,
                 log_every: int = 10, eval_every: int = 0, evaluate: Callable[[], Mapping[str, float]] | None = None,
                 checkpointer: Checkpointer | None = None, checkpoint_every: int = -1,
                 checkpoint_state: Mapping[str, Any] | None = None, config: Mapping[str, Any] | None = None,
                 profiler: StepProfiler | None = None,
                 log_extra: Callable[[], Mapping[str, float | torch.Tensor]] | None = None,
                 on_nonfinite: str = "stop", max_consecutive_skips: int = 5):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if checkpointer is not None and checkpoint_every >= 0 and checkpoint_state is None:
            raise ValueError("checkpoint_state is required to save checkpoints")
        self.state, self.max_steps, self.metrics = state, max_steps, metrics
        self.stop_at = min(stop_at_step, max_steps) if stop_at_step > 0 else max_steps
        self.log_every, self.eval_every, self.evaluate = log_every, eval_every, evaluate
        self.checkpointer, self.checkpoint_every = checkpointer, checkpoint_every
        self.checkpoint_state, self.config = checkpoint_state, config
        self.profiler, self.log_extra = profiler, log_extra
        self.device = metrics.info.device
        self.stopped = False  # the run ended before max_steps (stop_at_step or a stop request)
        self._stop = StopRequest()  # preemption: SIGTERM / SIGUSR1 while the loop runs
        self._vote = StopVote(self.device)  # the ranks' agreement on a preemption stop
        self._saved_step = -1
        self.nonfinite = NonFinitePolicy(on_nonfinite, max_consecutive_skips, device=self.device,
                                         newest_checkpoint=lambda: checkpointer.verified_latest() if checkpointer is not None else None,
                                         models=models_in(checkpoint_state), log=lambda line: get_logger().info(line))
        self._skipped_now = False  # the step being run was skipped
        self._reset_window()

    @classmethod
    def from_config(cls, cfg: Any, *, state: TrainState, max_steps: int, metrics: MetricsLogger,
                    checkpointer: Checkpointer | None, checkpoint_state: Mapping[str, Any] | None,
                    evaluate: Callable[[], Mapping[str, float]] | None = None,
                    log_extra: Callable[[], Mapping[str, float | torch.Tensor]] | None = None) -> TrainLoop:
        """A loop whose cadence comes from a recipe config with `cookbook.config`'s shared sections:
        ``train.stop_at_step``, ``train.log_every``, ``train.eval_every``, ``train.profile_step`` (a
        `StepProfiler` writing to ``<output_dir>/profile``), ``train.on_nonfinite``,
        ``train.max_consecutive_skips`` and ``checkpoint.every_steps``; the config is stored in each
        checkpoint. The other arguments are `TrainLoop`'s.

        Raises:
            ConfigError: ``train.on_nonfinite`` is not stop or skip, or ``train.max_consecutive_skips`` < 0."""
        train = cfg.train
        profile_step = getattr(train, "profile_step", 0)
        on_nonfinite, max_skips = NonFinitePolicy.settings(train)
        return cls(state=state, max_steps=max_steps, stop_at_step=train.stop_at_step, metrics=metrics,
                   log_every=train.log_every, eval_every=getattr(train, "eval_every", 0), evaluate=evaluate,
                   checkpointer=checkpointer, checkpoint_every=cfg.checkpoint.every_steps,
                   checkpoint_state=checkpoint_state, config=to_dict(cfg),
                   profiler=StepProfiler(profile_step, metrics.out_dir, metrics.info) if profile_step > 0 else None,
                   log_extra=log_extra, on_nonfinite=on_nonfinite, max_consecutive_skips=max_skips)

    @property
    def on_nonfinite(self) -> str:
        """``"stop"`` or ``"skip"``: what a non-finite step does (`skip_step`)."""
        return self.nonfinite.on_nonfinite

    @property
    def max_consecutive_skips(self) -> int:
        return self.nonfinite.max_consecutive_skips

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient norm since this process started."""
        return self.nonfinite.skipped_steps

    # ------------------------------------------------------------------ the loop
    def __enter__(self) -> TrainLoop:
        """Start listening for preemption: SIGTERM (a scheduler's or torchrun's stop) and SIGUSR1 (Slurm's
        ``--signal`` warning before the end of a job) call `request_stop` (main thread only)."""
        self._stop.listen()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Restore the signal handlers and end the metrics run.

        Raises:
            CollectiveTimeout: the body raised a collective timeout (a rank stalled); its one line names the rank
                that is behind (`cookbook.dist.describe_stall`)."""
        self._stop.restore()
        if exc_type is None:
            self._vote.finish()
        preempted = isinstance(exc, Preempted)
        self.metrics.close(failed=exc_type is not None and not preempted, stopped=self.stopped or preempted)
        stalled = stall_error(exc) if exc is not None else None
        if stalled is not None:
            raise stalled from exc

    def request_stop(self, signum: int | None = None) -> None:
        """Ask the loop to stop at the next step boundary, after saving a checkpoint there (preemption).

        Safe to call from a signal handler. The ranks agree on the step: the flag is reduced over all
        ranks (max) at the step boundaries, so a request on any rank stops every rank after the same step.

        Args:
            signum: the signal that asked, for the message (``None``: a call from code).
        """
        self._stop(signum)

    def _agree_stop(self) -> bool:
        """Whether the ranks have agreed to stop here (collective when a process group exists; `StopVote`)."""
        return self._vote(self._stop.requested)

    def steps(self) -> Iterator[int]:
        """Yield the number of each step to run (``state.step + 1``) until `max_steps`, ``stop_at_step``
        or a stop request. Starts the metrics clock on every rank together (a barrier)."""
        barrier()
        self.metrics.start(self.state.step)
        while self.state.step < self.stop_at:
            record_progress(self.state.step)  # for the message of a rank whose collective times out
            if self._agree_stop():
                self._save(force=True)
                break
            done = self.state.step
            self._skipped_now = False
            if self.profiler is not None:
                self.profiler.start(done + 1)
            self.nonfinite.begin_step()
            yield done + 1
            if self.profiler is not None:
                self.profiler.stop()
            if self.state.step == done and not self._skipped_now:
                raise RuntimeError("the step body must end with loop.end_step(...) or a skip (loop.skip_step)")

    def skip_step(self, grad_norm: torch.Tensor | float | None = None, *, loss: torch.Tensor | float | None = None,
                  applied: bool = False) -> bool:
        """Check a step for a NaN or infinite loss or gradient norm before its update; every rank decides alike.

        Args:
            grad_norm: the step's total gradient norm, the same number on every rank (reduced over ranks: what
                ``clip_grad_norm_`` returns for DDP gradients, the ``full_tensor()`` of FSDP2's DTensor norm); a
                NaN loss on any rank makes it NaN. No collective. ``None``: check `loss` instead.
            loss: this rank's loss of the step, for a recipe without such a norm (TorchRec: the sharded tables
                update inside backward, so it checks before backward): a non-finite flag is reduced over ranks
                (one all-reduce and a device sync). Used only when `grad_norm` is ``None``.
            applied: the update of this step has already run (TorchRec's pipeline updates inside its step): the
                `loss` is noted on the device only (no collective, no sync) and checked before the next log line
                or checkpoint, where a non-finite one stops the run (`NonFiniteError`) before anything is saved,
                whatever ``on_nonfinite`` says.

        Returns:
            ``False``: finite, go on with the update. ``True`` (``on_nonfinite="skip"``): drop the step: zero the
            gradients and ``continue``; neither the optimizer nor the scheduler steps, the model's BatchNorm
            statistics are put back as they were when the step began, the loop counts it in `skipped_steps` and
            logs it, and the same step number comes again with the next batch.

        Raises:
            NonFiniteError: a non-finite value with ``on_nonfinite="stop"``, or one more than
                ``max_consecutive_skips`` in a row. The update has not run, so the weights and the newest checkpoint
                are the last good ones; the message names the step and that checkpoint.
        """
        skipped = self.nonfinite.skip(self.state.step + 1, grad_norm, loss=loss, applied=applied)
        self._skipped_now = self._skipped_now or skipped
        return skipped

    def end_step(self, loss: torch.Tensor | float, *, lr: float, grad_norm: torch.Tensor | float | None = None,
                 window: Mapping[str, torch.Tensor | float] | None = None) -> None:
        """Count one optimizer step and do what is due after it.

        Args:
            loss: this rank's loss of the step (a 0-d tensor on the device is best: no sync).
            lr: the learning rate the step used.
            grad_norm: total gradient norm before clipping, or ``None``.
            window: more per-step numbers averaged over the log window under their own names
                (e.g. ``{"moe/aux_loss": aux}``).
        """
        self.state.step += 1
        self.nonfinite.stepped()
        step = self.state.step
        if not self.metrics.timings:
            self.metrics.first_step_done()  # startup_s, first_step_s: this process's first optimizer step
        self._loss = self._loss + (loss.detach() if isinstance(loss, torch.Tensor) else loss)
        for k, v in (window or {}).items():
            self._window[k] = self._window.get(k, 0.0) + (v.detach() if isinstance(v, torch.Tensor) else v)
        self._steps += 1
        self.metrics.advance(step)  # rank 0's progress bar, on a terminal
        if step % self.log_every == 0 or step == self.max_steps:
            self.nonfinite.check_applied()
            extra = {k: v / self._steps for k, v in self._window.items()}
            extra.update(self.log_extra() if self.log_extra is not None else {})
            extra.update(self.nonfinite.log_extra())
            self.metrics.log_step(step, self._loss / self._steps, lr, grad_norm, extra=extra or None)
            self._reset_window()
        with self.metrics.paused():  # not counted in the step time and throughput
            if (self.evaluate is not None and self.eval_every > 0 and step % self.eval_every == 0
                    and step < self.max_steps):
                with rng_kept():  # the evaluation does not change what training draws next (dropout)
                    values = self.evaluate()
                self.metrics.log_eval(step, values)
            self._save()

    def _reset_window(self) -> None:
        self._loss: torch.Tensor | float = torch.zeros((), device=self.device)
        self._window: dict[str, Any] = {}
        self._steps = 0

    def _save(self, force: bool = False) -> None:
        if self.checkpointer is None or self.checkpoint_every < 0:
            return
        step = self.state.step
        every = self.checkpoint_every
        if force or step in (self.stop_at, self.max_steps) or (every > 0 and step % every == 0):
            if self._saved_step == step:
                return  # saved at this step already
            self.nonfinite.check_applied()  # never save an update that diverged
            self.nonfinite.check_model(step, "its checkpoint is not saved")
            self._saved_step = step
            meta = {"epoch": self.state.epoch, **({"config": dict(self.config)} if self.config is not None else {})}
            self.checkpointer.save(step, self.checkpoint_state, meta)

    # ------------------------------------------------------------------ the end
    def finish(self, export: Callable[[], Outputs] | None = None,
               summary: Callable[[], Mapping[str, Any]] | None = None) -> dict[str, float] | None:
        """After the loop: the final evaluation, the export and the summary; or, for a run that stopped
        before `max_steps`, how to continue it.

        Args:
            export: writes the final artefacts and returns ``{summary key: (folder or None, how to load it)}``,
                e.g. ``{"export_dir": (path, "AutoModelForCausalLM.from_pretrained")}``; collective.
            summary: more entries for the summary record, computed after the export (collective).

        Returns:
            The final evaluation metrics (``{}`` without `evaluate`), or ``None`` when the run stopped early.

        Raises:
            cookbook.hub.HubPushError: ``checkpoint.push_to_hub`` is set and the upload of the export failed
                (`MetricsLogger.log_summary`; exit status 2).
            NonFiniteError: a parameter or buffer of the model is NaN or infinite (`NonFinitePolicy.check_model`).
        """
        self.nonfinite.check_applied()
        if self.state.step < self.max_steps:
            self.stopped = True
            latest = self.checkpointer.latest() if self.checkpointer is not None else None
            if get_dist_info().is_main:  # where this part of the run is: its metrics and tracker runs
                for name, text in [("metrics", f"{self.metrics.jsonl_path}"), *self.metrics.tracker_lines()]:
                    get_logger().info(f"{name + ':':<12} {text}")
            if self._stop.requested:  # preempted: a distinct exit status, so that a scheduler can requeue the job
                raise self._stop.preempted(self.state.step, self.max_steps, latest)
            get_logger().info(f"stopped at step {self.state.step} of {self.max_steps} (train.stop_at_step); to continue "
                              f"from {latest}, run again without train.stop_at_step (or with a larger value)")
            return None
        self.nonfinite.check_model(self.state.step, "the run is not done (no final evaluation, export or summary)")
        timings = dict(self.metrics.timings)  # startup_s, first_step_s
        final_eval = {}
        if self.evaluate is not None:
            t0 = time.perf_counter()
            final_eval = dict(self.evaluate())
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # results left on the device count too
            timings["final_eval_s"] = time.perf_counter() - t0
        if final_eval:
            self.metrics.log_eval(self.state.step, final_eval)
        outputs = dict(export()) if export is not None else {}
        record = {"step": self.state.step, **{f"eval/{k}": v for k, v in final_eval.items()},
                  **{k: str(path) if path else None for k, (path, _) in outputs.items()},
                  "mlflow_uri": self.metrics.mlflow_uri, "mlflow_run_id": self.metrics.mlflow_run_id, **timings,
                  **(dict(summary()) if summary is not None else {})}
        self.metrics.log_summary(record)
        log_outputs(self.state.step, final_eval, self.metrics,
                    self.checkpointer.root if self.checkpointer is not None else None, outputs, timings=timings)
        if get_dist_info().is_main and self.config is not None:  # the same command again says so at once
            out_dir = self.metrics.out_dir
            kept = {**{k: str(p) for k, (p, _) in outputs.items() if p}, "metrics": str(self.metrics.jsonl_path)}
            guard = ResumeGuard(out_dir / "checkpoints", run_dir=out_dir)
            mark_complete(out_dir, self.config, guard.already_complete(self.state.step, self.max_steps, outputs={
                k.removesuffix("_dir"): p for k, p in kept.items()}), kept)
        return final_eval


def checkpoint_state(app: Any, scheduler: Any, train_loader: Any, *,
                     resizable: bool = True) -> tuple[TrainState, dict[str, Any]]:
    """What a `TrainLoop` recipe's checkpoints hold, by name, and the `TrainState` among them.

    Args:
        app: the model and optimizer as one stateful object (`cookbook.checkpoint.ModelOptimizerState`, or the
            recipe's own, e.g. the MoE recipe's `AdapterState`), saved as ``app``.
        scheduler: the learning-rate scheduler, saved as ``scheduler``.
        train_loader: the training ``StatefulDataLoader``; its workers' state and the RNG states are saved per rank
            as ``rank_local`` (restored at the same world size only).
        resizable: also save ``data``, the loader's global position (`cookbook.sampler.DataPosition`, its sampler a
            `ResizableSampler`), so that `start_run` can resume on another world size.

    Returns:
        ``(state, checkpoint_state)``: a new `TrainState` (saved as ``train``) and the mapping for `start_run`.
    """
    state = TrainState()
    entries = {"app": app, "scheduler": scheduler, "train": state}
    if resizable:
        entries["data"] = DataPosition(train_loader)  # global: remapped when the world size changes
    entries["rank_local"] = RankLocalState(dataloader=train_loader, rng=RNGState())  # same world size only
    return state, entries


def start_run(cfg: Any, info: DistInfo, *, state: TrainState, checkpoint_state: Mapping[str, Any],
              may_change: tuple[str, ...], max_steps: int, experiment: str, final: str | Path | None = None,
              what: str = "model", flops: ModelFlops | None = None,
              count_tokens: bool = True, cannot_remap: str | None = None) -> tuple[Checkpointer, MetricsLogger] | None:
    """The start of a run, after its model, optimizer and data exist: resume, then write the config and start metrics.

    Resumes from the checkpoint ``checkpoint.resume`` names (``auto``: the newest complete one under
    ``<output_dir>/checkpoints``), after `Checkpointer.check_resume` has checked that it was written with the same
    settings (`may_change` lists the keys allowed to differ) and world size; a `checkpoint_state` that holds a
    `cookbook.sampler.DataPosition` (a global data position) resumes on another world size too, when the global
    batch is the checkpoint's (``Checkpointer(resizable=True)``). Before that, the random streams are seeded
    ``train.seed + rank`` (`cookbook.checkpoint.seed_per_rank`: each rank its own dropout masks). A run with nothing left to do
    (`already_complete`) says so and returns ``None``; else rank 0 writes ``<output_dir>/config.yaml`` and the
    `MetricsLogger` starts (its MLflow run too).

    Args:
        cfg: the recipe config (`cookbook.config.RunConfig` with ``train`` and ``checkpoint`` sections).
        info: this rank's `DistInfo`.
        state: the `TrainState` inside `checkpoint_state`, restored by the resume.
        checkpoint_state: what the checkpoints hold (stateful objects by name).
        may_change, max_steps: as in `Checkpointer.check_resume` and `TrainLoop`.
        experiment: the MLflow experiment name.
        final, what: as in `already_complete`.
        flops, count_tokens: as in `MetricsLogger`.
        cannot_remap: as in `Checkpointer`: why another world size is refused.

    Returns:
        ``(checkpointer, metrics)``, or ``None`` when the run is already complete (the caller cleans up and returns).

    Raises:
        CheckpointError: the checkpoint to resume from does not fit this run (`Checkpointer.check_resume`).
    """
    out_dir = Path(cfg.output_dir)
    resizable = any(isinstance(v, DataPosition) for v in checkpoint_state.values())
    checkpointer = Checkpointer(out_dir / "checkpoints", keep_last=cfg.checkpoint.keep_last, resizable=resizable,
                                cannot_remap=cannot_remap)
    resume_from = checkpointer.check_resume(cfg.checkpoint.resume, info.world_size, to_dict(cfg), may_change,
                                            cfg.train.stop_at_step)
    if getattr(cfg.train, "seed", None) is not None:
        seed_per_rank(cfg.train.seed, info.rank)  # each rank its own dropout masks; a resume restores the saved ones
    if resume_from is not None:
        checkpointer.load(resume_from, checkpoint_state)
    if already_complete(state, max_steps, out_dir, final, what):
        return None
    if info.is_main:
        out_dir.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out_dir / "config.yaml")
    metrics = MetricsLogger(out_dir, info, flops=flops, run_name=cfg.run_name, experiment=experiment,
                            params=to_dict(cfg), mlflow=cfg.mlflow, max_steps=max_steps, count_tokens=count_tokens)
    return checkpointer, metrics


def log_outputs(step: int, final_eval: Mapping[str, float], metrics: MetricsLogger, checkpoints: Path | None,
                outputs: Outputs, eval_text: str | None = None, timings: Mapping[str, float] | None = None) -> None:
    """The closing log lines of a finished run (rank 0 only): steps and final evaluation (its metrics, not
    the counts in `_EVAL_COUNTS`), the start-up and final-evaluation times when given, then where the metrics, each
    tracker's run (and the command that shows it: `MetricsLogger.tracker_lines`), the checkpoints and each exported
    artefact are (``model:`` for ``export_dir``, see `_OUTPUT_NAMES`), and how to load it.

    Args:
        eval_text: the final evaluation as the recipe words it; default: ``eval`` and the ``name value`` pairs
            of `final_eval`.
        timings: seconds under the summary's names (``startup_s``, ``first_step_s``, ``final_eval_s``), shown
            on a ``time:`` line: ``time:        startup 25.1 s (first step 12.0 s) | final eval 1.9 s``.
    """
    if not get_dist_info().is_main:
        return
    log = get_logger()
    pairs = " ".join(f"{k} {v:.4f}" for k, v in final_eval.items() if k not in _EVAL_COUNTS)
    shown = eval_text if eval_text is not None else f"eval {pairs}" if pairs else ""
    log.info(f"done: {step} steps" + (f" | {shown}" if shown else ""))
    timings = timings or {}
    times = ([f"startup {timings['startup_s']:.1f} s"
              + (f" (first step {timings['first_step_s']:.1f} s)" if "first_step_s" in timings else "")]
             if "startup_s" in timings else [])
    times += [f"final eval {timings['final_eval_s']:.1f} s"] if "final_eval_s" in timings else []
    if times:
        log.info(f"{'time:':<12} " + " | ".join(times))
    rows = [("metrics", f"{metrics.jsonl_path}"), *metrics.tracker_lines()]
    if checkpoints is not None:
        rows.append(("checkpoints", str(checkpoints)))
    rows += [(_OUTPUT_NAMES.get(key, key.removesuffix("_dir")), f"{path} ({how})" if how else str(path))
             for key, (path, how) in outputs.items() if path]
    for name, text in rows:
        log.info(f"{name + ':':<12} {text}")
