"""The bookkeeping around a recipe's own step body, written once (README.md#how-a-trainpy-is-built): `TrainLoop`
(steps, log windows, eval and save cadence, stop and preemption, the non-finite policy, the end of a run),
`EpochBatches` (batches epoch after epoch) and `Run`, what a recipe enters (adds the resume and the metrics run)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from cookbook.checkpoint import Checkpointer, RankLocalState, ResumeGuard, RNGState, TrainState, rng_kept, seed_per_rank
from cookbook.config import to_dict
from cookbook.dist import DistInfo, barrier, get_dist_info, get_logger, record_progress, stall_error
from cookbook.metrics import MetricsLogger, ModelFlops, StepProfiler
from cookbook.policy import NonFiniteError  # noqa: F401 (re-exported)
from cookbook.policy import NonFinitePolicy, Preempted, StopRequest, StopVote, models_in, optimizers_in
from cookbook.run_lock import mark_complete
from cookbook.sampler import DataPosition

Outputs = Mapping[str, "tuple[Path | None, str]"]  # summary key -> (folder or None, how to load it)
_Value = torch.Tensor | float  # a loss, norm or logged number: a 0-d tensor (no sync) or a float
# Evaluation results that count what was evaluated: not shown on `done:`.
_EVAL_COUNTS = ("tokens", "samples", "rows", "users")
_OUTPUT_NAMES = {"export_dir": "model"}  # summary key -> its name on the closing lines (others: the key less "_dir")
_END = object()  # what next() gives for an iterator that has ended


def _complete_line(out_dir: Path, step: int, max_steps: int, outputs: Mapping[str, str | Path]) -> str:
    """``already complete: ...`` of a run in `out_dir` (one wording for every recipe's message)."""
    return ResumeGuard(out_dir / "checkpoints", run_dir=out_dir).already_complete(step, max_steps, outputs=outputs)


def _already_complete(
    state: TrainState, max_steps: int, out_dir: str | Path, final: str | Path | None = None, what: str = "model"
) -> bool:
    """Whether a resumed run has nothing left to do (``state.step >= max_steps`` and its export `final`, when given,
    exists); if so rank 0 says so (`what`: what `final` holds, "model" or "adapter")."""
    if state.step < max_steps or (final is not None and not Path(final).is_dir()):
        return False
    out_dir = Path(out_dir)
    outputs = {**({what: final} if final is not None else {}), "metrics": out_dir / "metrics.jsonl"}
    get_logger().info(_complete_line(out_dir, state.step, max_steps, outputs))
    return True


class EpochBatches:
    """Endless batches from `loader`, epoch after epoch, timed, moved to `device` (None: left where they are).
    Each new pass increments ``state.epoch`` and calls ``set_epoch(state.epoch)``; `metrics` notes its first wait."""

    def __init__(
        self,
        loader,
        state: TrainState,
        set_epoch: Callable[[int], None] | None = None,
        device: torch.device | None = None,
        metrics: MetricsLogger | None = None,
    ):
        self.loader, self.state, self.set_epoch, self.device, self.metrics = loader, state, set_epoch, device, metrics
        self._it: Iterator | None = None

    def _new_pass(self) -> None:
        if self.set_epoch is not None:
            self.set_epoch(self.state.epoch)
        self._it = iter(self.loader)

    def next(self) -> tuple[Any, float]:
        """The next batch (on `device`) and the seconds waited for it; RuntimeError: a fresh pass yields none."""
        t0 = time.perf_counter()
        new_pass = self._it is None
        if new_pass:
            self._new_pass()
        if (batch := next(self._it, _END)) is _END:
            self.state.epoch += 1
            new_pass = True
            self._new_pass()
            if (batch := next(self._it, _END)) is _END:
                raise RuntimeError("the training data loader yields no batch: too few rows for one micro-batch")
        wait = time.perf_counter() - t0
        if new_pass and self.metrics is not None:
            self.metrics.note_pass_start(wait)
        if self.device is not None and isinstance(batch, Mapping):
            batch = {
                k: v.to(self.device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()
            }
        elif self.device is not None:
            batch = batch.to(self.device, non_blocking=True)
        return batch, wait

    def take(self, n: int) -> tuple[list[Any], list[float]]:
        """`n` batches (the micro-batches of one optimizer step) and their waits in seconds."""
        pairs = [self.next() for _ in range(n)]
        return [b for b, _ in pairs], [w for _, w in pairs]


class TrainLoop:
    """Step counting, metric windows, eval and checkpoint cadence around a recipe's own step body; collective.
    `stop_at_step` > 0: stop (and save) after it; `eval_every` 0: at the end only; `checkpoint_every` -1 never, 0 at
    `stop_at_step` and the end, N every N steps; `config`: into ``meta.json``; `on_nonfinite`: ``"stop"``/``"skip"``."""

    def __init__(
        self,
        *,
        state: TrainState,
        max_steps: int,
        stop_at_step: int = -1,
        metrics: MetricsLogger,
        log_every: int = 10,
        eval_every: int = 0,
        evaluate: Callable[[], Mapping[str, float]] | None = None,
        checkpointer: Checkpointer | None = None,
        checkpoint_every: int = -1,
        checkpoint_state: Mapping[str, Any] | None = None,
        config: Mapping[str, Any] | None = None,
        profiler: StepProfiler | None = None,
        log_extra: Callable[[], Mapping[str, _Value]] | None = None,
        on_nonfinite: str = "stop",
        max_consecutive_skips: int = 5,
    ):
        if log_every < 1:
            raise ValueError(f"log_every must be >= 1, got {log_every}")
        if checkpointer is not None and checkpoint_every >= 0 and checkpoint_state is None:
            raise ValueError("checkpoint_state is required to save checkpoints")
        self.state, self.max_steps, self.metrics = state, max_steps, metrics
        self.stop_at = min(stop_at_step, max_steps) if stop_at_step > 0 else max_steps
        self.log_every, self.eval_every, self.evaluate = log_every, eval_every, evaluate
        self.checkpointer, self.checkpoint_every = checkpointer, checkpoint_every
        self.checkpoint_state = checkpoint_state
        self.config, self.profiler, self.log_extra, self.device = config, profiler, log_extra, metrics.info.device
        self.stopped = False  # the run ended before max_steps (stop_at_step or a stop request)
        self._stop = StopRequest()  # preemption: SIGTERM / SIGUSR1 while the loop runs
        self._vote = StopVote(self.device)  # the ranks' agreement on a preemption stop
        self._saved_step = -1
        self.nonfinite = NonFinitePolicy(
            on_nonfinite,
            max_consecutive_skips,
            device=self.device,
            newest_checkpoint=lambda: checkpointer.verified_latest() if checkpointer is not None else None,
            models=models_in(checkpoint_state),
            optimizers=optimizers_in(checkpoint_state),
        )
        self._skipped_now = False  # the step being run was skipped
        self._reset_window()

    # ------------------------------------------------------------------ the loop
    def __enter__(self) -> TrainLoop:
        self._stop.listen()  # preemption: SIGTERM, Slurm's SIGUSR1 (main thread only)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Restore the signal handlers and end the metrics run; a collective timeout becomes a `CollectiveTimeout`."""
        self._stop.restore()
        if exc_type is None:
            self._vote.finish()
        preempted = isinstance(exc, Preempted)
        self.metrics.close(failed=exc_type is not None and not preempted, stopped=self.stopped or preempted)
        if exc is not None and (stalled := stall_error(exc)) is not None:
            raise stalled from exc

    def steps(self) -> Iterator[int]:
        """Yield each step's number (``state.step + 1``) until `max_steps`, ``stop_at_step`` or a stop."""
        barrier()
        self.metrics.start(self.state.step)
        while self.state.step < self.stop_at:
            record_progress(self.state.step)  # for the message of a rank whose collective times out
            if self._vote(self._stop.requested):  # the ranks agree to stop here (collective: `StopVote`)
                self._save(force=True)
                break
            yield from self._step()

    _UNENDED = "the step body must end with loop.end_step(...) or a skip (loop.skip_step)"

    def _step(self) -> Iterator[int]:
        """Yield the next step's number between the profiler's and the non-finite policy's marks; RuntimeError
        (`_UNENDED`) if its body neither ended nor skipped it."""
        done, self._skipped_now = self.state.step, False
        if self.profiler is not None:
            self.profiler.start(done + 1)
        self.nonfinite.begin_step()
        yield done + 1
        if self.profiler is not None:
            self.profiler.stop()
        if self.state.step == done and not self._skipped_now:
            raise RuntimeError(self._UNENDED)

    def skip_step(self, grad_norm: _Value | None = None, *, loss: _Value | None = None, applied: bool = False) -> bool:
        """Check a step for a non-finite loss or gradient norm before its update (`NonFinitePolicy.skip`); True: zero
        the gradients and ``continue``. Raises NonFiniteError: ``"stop"``, or too many skips in a row."""
        skipped = self.nonfinite.skip(self.state.step + 1, grad_norm, loss=loss, applied=applied)
        self._skipped_now = self._skipped_now or skipped
        return skipped

    def end_step(
        self, loss: _Value, *, lr: float, grad_norm: _Value | None = None, window: Mapping[str, _Value] | None = None
    ) -> None:
        """Count one optimizer step and do what is due. `loss`: this rank's (0-d device tensor: no sync); `grad_norm`:
        before clipping; `window`: more numbers averaged over the log window by name."""
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
        if self._log_due(step):
            self._log_window(lr, grad_norm)
        with self.metrics.paused():  # not counted in the step time and throughput
            eval_due = self.eval_every > 0 and step % self.eval_every == 0 and step < self.max_steps
            if self.evaluate is not None and eval_due:
                with rng_kept():  # the evaluation does not change what training draws next (dropout)
                    values = self.evaluate()
                self.metrics.log_eval(step, values)
            self._save()

    def _log_due(self, step: int) -> bool:
        return step % self.log_every == 0 or step == self.max_steps

    def _log_window(self, lr: float, grad_norm: _Value | None = None) -> None:
        """Log the window's averages (its loss, `window` numbers, `log_extra`, skipped steps) and start a new one."""
        self.nonfinite.check_applied()
        extra = {k: v / self._steps for k, v in self._window.items()}
        extra.update(self.log_extra() if self.log_extra is not None else {})
        extra.update(self.nonfinite.log_extra())
        self.metrics.log_step(self.state.step, self._loss / self._steps, lr, grad_norm, extra=extra or None)
        self._reset_window()

    def _reset_window(self) -> None:
        self._loss: torch.Tensor | float = torch.zeros((), device=self.device)
        self._window: dict[str, Any] = {}
        self._steps = 0

    def _save(self, force: bool = False) -> None:
        if self.checkpointer is None or self.checkpoint_every < 0:
            return
        step, every = self.state.step, self.checkpoint_every
        due = force or step in (self.stop_at, self.max_steps) or (every > 0 and step % every == 0)
        if due and self._saved_step != step:  # not saved at this step already
            self.nonfinite.check_applied()  # never save an update that diverged
            self.nonfinite.check_model(step, "its checkpoint is not saved")
            self._saved_step = step
            meta = {"epoch": self.state.epoch, **({"config": dict(self.config)} if self.config is not None else {})}
            self.checkpointer.save(step, self.checkpoint_state, meta)

    # ------------------------------------------------------------------ the end
    def finish(
        self, export: Callable[[], Outputs] | None = None, summary: Callable[[], Mapping[str, Any]] | None = None
    ) -> dict[str, float] | None:
        """After the loop: final evaluation, `export` (collective; ``{summary key: (folder or None, how to load)}``)
        and the summary; returns the final evaluation (None for a run that stopped early: how to continue is said).
        Raises HubPushError: the ``push_to_hub`` upload failed; NonFiniteError: the model holds NaN or inf."""
        self.nonfinite.check_applied()
        if self.state.step < self.max_steps:
            self.stopped = True
            latest = self.checkpointer.latest() if self.checkpointer is not None else None
            if get_dist_info().is_main:  # where this part of the run is: its metrics and tracker runs
                for name, text in [("metrics", f"{self.metrics.jsonl_path}"), *self.metrics.tracker_lines()]:
                    get_logger().info(f"{name + ':':<12} {text}")
            if self._stop.requested:  # preempted: a distinct exit status, so that a scheduler can requeue the job
                raise self._stop.preempted(self.state.step, self.max_steps, latest)
            get_logger().info(
                f"stopped at step {self.state.step} of {self.max_steps} (train.stop_at_step); to continue "
                f"from {latest}, run again without train.stop_at_step (or with a larger value)"
            )
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
        record = {
            "step": self.state.step,
            **{f"eval/{k}": v for k, v in final_eval.items()},
            **{k: str(path) if path else None for k, (path, _) in outputs.items()},
            "mlflow_uri": self.metrics.mlflow_uri,
            "mlflow_run_id": self.metrics.mlflow_run_id,
            **timings,
            **(dict(summary()) if summary is not None else {}),
        }
        self.metrics.log_summary(record)
        checkpoints = self.checkpointer.root if self.checkpointer is not None else None
        log_outputs(self.state.step, final_eval, self.metrics, checkpoints, outputs, timings=timings)
        if get_dist_info().is_main and self.config is not None:  # the same command again says so at once
            kept = {**{k: str(p) for k, (p, _) in outputs.items() if p}, "metrics": str(self.metrics.jsonl_path)}
            named = {k.removesuffix("_dir"): p for k, p in kept.items()}
            line = _complete_line(self.metrics.out_dir, self.state.step, self.max_steps, named)
            mark_complete(self.metrics.out_dir, self.config, line, kept)
        return final_eval


class Run(TrainLoop):
    """A torchrun recipe's run, entered with ``with``: seeds ``train.seed + rank``, resumes from ``checkpoint.resume``,
    writes ``config.yaml``, starts the metrics, then is the config's `TrainLoop`; `take` gives `loader`'s micro-batches,
    calling `set_epoch` (default: the loader's ``sampler.set_epoch``, where it has one) at each new pass.
    Already complete: said once; `steps` yields nothing, `say` and `finish` do nothing. Checkpoints hold ``app``,
    ``scheduler``, ``train``, ``data`` (with `resizable`) and ``rank_local``; or `checkpoint`, with its `state`.
    Raises CheckpointError: the checkpoint does not fit this run; ConfigError: bad ``train.on_nonfinite`` settings."""

    def __init__(
        self,
        cfg: Any,
        info: DistInfo,
        *,
        may_change: tuple[str, ...],
        max_steps: int,
        experiment: str,
        app: Any = None,
        scheduler: Any = None,
        loader: Any = None,
        set_epoch: Callable[[int], None] | None = None,
        resizable: bool = True,
        state: TrainState | None = None,
        checkpoint: Mapping[str, Any] | None = None,
        final: str | Path | None = None,
        what: str = "model",
        flops: ModelFlops | None = None,
        count_tokens: bool = True,
        cannot_remap: str | None = None,
        evaluate: Callable[[], Mapping[str, float]] | None = None,
        log_extra: Callable[[], Mapping[str, _Value]] | None = None,
    ):
        if checkpoint is None:
            state = TrainState()
            checkpoint = {"app": app, "scheduler": scheduler, "train": state}
            if resizable:
                checkpoint["data"] = DataPosition(loader)  # global: remapped when the world size changes
            checkpoint["rank_local"] = RankLocalState(dataloader=loader, rng=RNGState())  # same world size only
        out_dir = Path(cfg.output_dir)
        checkpointer = Checkpointer(
            out_dir / "checkpoints",
            keep_last=cfg.checkpoint.keep_last,
            cannot_remap=cannot_remap,
            resizable=any(isinstance(v, DataPosition) for v in checkpoint.values()),
        )
        resume_from = checkpointer.check_resume(
            cfg.checkpoint.resume, info.world_size, to_dict(cfg), may_change, cfg.train.stop_at_step
        )
        if getattr(cfg.train, "seed", None) is not None:  # each rank its own dropout masks; a resume restores them
            seed_per_rank(cfg.train.seed, info.rank)
        if resume_from is not None:
            checkpointer.load(resume_from, checkpoint)
        self.state, self.complete = state, _already_complete(state, max_steps, out_dir, final, what)
        if self.complete:
            return
        metrics = MetricsLogger.for_run(
            cfg, info, experiment=experiment, flops=flops, max_steps=max_steps, count_tokens=count_tokens
        )
        profile_step = getattr(cfg.train, "profile_step", 0)
        on_nonfinite, max_skips = NonFinitePolicy.settings(cfg.train)
        super().__init__(
            state=state,
            max_steps=max_steps,
            stop_at_step=cfg.train.stop_at_step,
            metrics=metrics,
            log_every=cfg.train.log_every,
            eval_every=getattr(cfg.train, "eval_every", 0),
            evaluate=evaluate,
            checkpointer=checkpointer,
            checkpoint_every=cfg.checkpoint.every_steps,
            checkpoint_state=checkpoint,
            config=to_dict(cfg),
            log_extra=log_extra,
            profiler=StepProfiler(profile_step, out_dir, info) if profile_step > 0 else None,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_skips,
        )
        set_epoch = set_epoch or getattr(getattr(loader, "sampler", None), "set_epoch", None)
        self.batches = EpochBatches(loader, state, set_epoch, info.device, metrics) if loader is not None else None

    def __enter__(self) -> Run:
        return self if self.complete else super().__enter__()

    def __exit__(self, *exc_info) -> None:
        if not self.complete:
            super().__exit__(*exc_info)

    def steps(self) -> Iterator[int]:
        return iter(()) if self.complete else super().steps()

    def take(self, n: int) -> tuple[list[Any], list[float]]:
        """The `n` micro-batches of one optimizer step (on the device) and their waits in seconds."""
        return self.batches.take(n)

    def say(self, line: str) -> None:
        """Log `line` (rank 0) when the run is not already complete."""
        if not self.complete:
            get_logger().info(line)

    def finish(self, *args: Any, **kwargs: Any) -> dict[str, float] | None:
        return None if self.complete else super().finish(*args, **kwargs)


def log_outputs(
    step: int,
    final_eval: Mapping[str, float],
    metrics: MetricsLogger,
    checkpoints: Path | None,
    outputs: Outputs,
    eval_text: str | None = None,
    timings: Mapping[str, float] | None = None,
) -> None:
    """The closing log lines of a finished run (rank 0): steps, final evaluation, `timings`, where the metrics,
    trackers, checkpoints and exports are, and how to load them."""
    if not get_dist_info().is_main:
        return
    log = get_logger()
    pairs = " ".join(f"{k} {v:.4f}" for k, v in final_eval.items() if k not in _EVAL_COUNTS)
    shown = eval_text if eval_text is not None else f"eval {pairs}" if pairs else ""
    log.info(f"done: {step} steps" + (f" | {shown}" if shown else ""))
    timings, times = timings or {}, []
    if "startup_s" in timings:
        first = f" (first step {timings['first_step_s']:.1f} s)" if "first_step_s" in timings else ""
        times.append(f"startup {timings['startup_s']:.1f} s{first}")
    if "final_eval_s" in timings:
        times.append(f"final eval {timings['final_eval_s']:.1f} s")
    if times:
        log.info(f"{'time:':<12} " + " | ".join(times))
    rows = [("metrics", f"{metrics.jsonl_path}"), *metrics.tracker_lines()]
    if checkpoints is not None:
        rows.append(("checkpoints", str(checkpoints)))
    rows += [
        (_OUTPUT_NAMES.get(key, key.removesuffix("_dir")), f"{path} ({how})" if how else str(path))
        for key, (path, how) in outputs.items()
        if path
    ]
    for name, text in rows:
        log.info(f"{name + ':':<12} {text}")
