"""What stops a run, decided alike on every rank, written once for the step loop (`cookbook.loop.TrainLoop`), the
Ray workers and the Hugging Face Trainer callbacks: a preemption signal (`StopRequest`, `StopVote`, `Preempted`) and
a non-finite loss or gradient norm (`NonFinitePolicy`, `NonFiniteError`). `cookbook.loop` re-exports the names."""

from __future__ import annotations

import itertools
import math
import signal
import threading
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch
import torch.distributed as dist

from cookbook.dist import get_logger
from cookbook.errors import EXIT_DIVERGED, EXIT_PREEMPTED, ConfigError, OneLineError


_PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)  # a scheduler's or torchrun's stop; Slurm's --signal warning
_ON_NONFINITE = ("stop", "skip")  # what a step with a NaN / inf loss or gradient norm does (TrainLoop.skip_step)
_Value = torch.Tensor | float  # a loss or gradient norm: a tensor (a DTensor too) or a float
_NONE_BAD = 2**62  # "no non-finite step" in the all-reduce (min) of the first bad step of updates already applied


class Preempted(SystemExit):
    """The run stopped on a preemption signal after saving a checkpoint; its code is `EXIT_PREEMPTED` (75)."""

    __module__ = "cookbook.loop"  # its home before the split: tracebacks and WorkerError.exc_type name it so


class NonFiniteError(OneLineError):
    """A step's loss or gradient norm is NaN or infinite: the run stops, the step not applied (or not saved); exit 4."""

    __module__ = "cookbook.loop"  # its home before the split: tracebacks and WorkerError.exc_type name it so

    exit_status = EXIT_DIVERGED
    same_on_every_rank = True  # every rank decides on the same reduced value: rank 0 prints it


class StopVote:
    """The ranks' agreement on stopping at a step boundary, without a device wait: each call starts an async
    all-reduce (max) of this rank's flag and returns the previous boundary's result (collective)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._pending = None  # (work, flag) of the all-reduce started at the last boundary

    def __call__(self, requested: bool) -> bool:
        if not dist.is_initialized():
            return requested
        decided = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            decided = flag.item() > 0
        flag = torch.tensor([1.0 if requested else 0.0], device=self.device)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, async_op=True), flag)
        return decided

    def finish(self) -> None:
        """Wait for the last boundary's all-reduce, never read (call on every rank after the loop)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None


class StopRequest:
    """A request to stop at the next step boundary (preemption): after `listen`, `_PREEMPT_SIGNALS` call it (main
    thread only). It only sets `requested`; the ranks agree on the step with `StopVote`."""

    def __init__(self) -> None:
        self.requested, self.signum = False, None  # signum: the signal that asked; None: a call from code
        self._handlers: dict = {}

    def __call__(self, signum: int | None = None) -> None:
        self.requested, self.signum = True, signum

    def listen(self) -> None:
        """Install the handlers of `_PREEMPT_SIGNALS` (main thread only)."""
        on_main = threading.current_thread() is threading.main_thread()
        self._handlers = {s: signal.signal(s, lambda signum, frame: self(signum)) for s in _PREEMPT_SIGNALS if on_main}

    def restore(self) -> None:
        for sig, handler in self._handlers.items():
            signal.signal(sig, handler)
        self._handlers = {}

    def preempted(self, step: int, max_steps: int, checkpoint: Path | None) -> Preempted:
        """Log that the run stopped after `step` of `max_steps`, with `checkpoint`; returns the `Preempted` to raise."""
        what = signal.Signals(self.signum).name if self.signum else "a stop request"
        get_logger().info(
            f"preempted ({what}) after step {step} of {max_steps}: checkpoint {checkpoint}; run the "
            f"same command again to continue (exit status {EXIT_PREEMPTED})"
        )
        return Preempted(EXIT_PREEMPTED)


class NonFinitePolicy:
    """What a step with a NaN or infinite loss or gradient norm does, decided alike on every rank before its update:
    ``"stop"`` raises `NonFiniteError`; ``"skip"`` has the caller drop the step, puts the running statistics of
    `models` back, logs and counts it, up to `max_consecutive_skips` in a row. `check_model` refuses a non-finite model.
    Raises ValueError: an unknown `on_nonfinite`, or `max_consecutive_skips` < 0."""

    def __init__(
        self,
        on_nonfinite: str = "stop",
        max_consecutive_skips: int = 5,
        *,
        device: torch.device | None = None,
        newest_checkpoint: Callable[[], Path | str | None] | None = None,
        skipped_steps: int = 0,
        models: Iterable[torch.nn.Module] = (),
        optimizers: Iterable[torch.optim.Optimizer] = (),
    ):
        if on_nonfinite not in _ON_NONFINITE:
            raise ValueError(f"on_nonfinite must be one of {', '.join(_ON_NONFINITE)}, got {on_nonfinite!r}")
        if max_consecutive_skips < 0:
            raise ValueError(f"max_consecutive_skips must be >= 0, got {max_consecutive_skips}")
        self.on_nonfinite, self.max_consecutive_skips = on_nonfinite, max_consecutive_skips
        self.device = device if device is not None else torch.device("cpu")
        self.newest_checkpoint = newest_checkpoint if newest_checkpoint is not None else (lambda: None)
        self.skipped_steps = skipped_steps  # steps skipped for a non-finite loss or gradient norm
        self._consecutive = 0  # of them, in a row up to now
        self._applied_bad: torch.Tensor | None = None  # first step whose applied update was non-finite (0: none)
        self.models = list(models)
        # fused optimizers skip a step on the device (found_inf): a "stop" check of the gradient norm waits (_defer)
        self.optimizers = [o for o in optimizers if all(g.get("fused") for g in o.param_groups)]
        self._deferred: tuple[torch.Tensor, torch.Tensor] | None = None  # first step with a non-finite norm, its norm
        self._stats: list[torch.Tensor] = []  # the models' running statistics (_running_stats), as of begin_step
        self._saved: list[torch.Tensor] = []  # ... and their values then

    @staticmethod
    def settings(train: Any) -> tuple[str, int]:
        """``(train.on_nonfinite, train.max_consecutive_skips)`` (default ``"stop"``, 5), or ConfigError."""
        on_nonfinite, max_skips = getattr(train, "on_nonfinite", "stop"), getattr(train, "max_consecutive_skips", 5)
        if on_nonfinite not in _ON_NONFINITE:
            raise ConfigError(f"train.on_nonfinite must be one of {', '.join(_ON_NONFINITE)}, got {on_nonfinite!r}")
        if max_skips < 0:
            raise ConfigError(f"train.max_consecutive_skips must be >= 0, got {max_skips}")
        return on_nonfinite, max_skips

    @classmethod
    def from_config(cls, train: Any, **kwargs: Any) -> NonFinitePolicy:
        return cls(*cls.settings(train), **kwargs)

    def skip(
        self, step: int, grad_norm: _Value | None = None, *, loss: _Value | None = None, applied: bool = False
    ) -> bool:
        """Check step `step` (1-based) before its update; True: the caller drops it. `grad_norm`: the total norm, the
        same on every rank; None: check `loss` (one all-reduce). `applied`: the update already ran (checked later)."""
        if grad_norm is not None:
            if self._defer(step, grad_norm):
                return False
            value = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)
            if math.isfinite(value):
                return False
            what, short = f"the gradient norm of step {step} is {value}", f"non-finite gradient norm ({value})"
        elif loss is None:
            return False
        elif applied:
            self._note_applied(loss, step)
            return False
        elif self._finite_on_every_rank(loss):
            return False
        else:
            what, short = f"the loss of step {step} is not finite on every rank", "non-finite loss"
        self.nonfinite(step, what, short)
        return True

    def nonfinite(self, step: int, what: str, short: str) -> None:
        """Step `step` was not finite on some rank: stop (NonFiniteError), or count and log a skip; every rank alike.
        `what` words the stop message (``"the gradient norm of step 5 is nan"``), `short` the skip line."""
        self._consecutive += 1
        if self.on_nonfinite == "stop":
            raise self._stops(
                f"{what}: the step was not applied and the run stops (train.on_nonfinite=stop)",
                "check the data of this step, or set train.on_nonfinite=skip to drop such steps",
            )
        if self._consecutive > self.max_consecutive_skips:
            raise self._stops(
                f"{what}: the step was not applied, and that makes {self._consecutive} non-finite steps in a row "
                f"(train.max_consecutive_skips={self.max_consecutive_skips}), so the run stops"
            )
        if self._stats:
            with torch.no_grad():  # the dropped batch's forward updated them
                torch._foreach_copy_(self._stats, self._saved)
        self.skipped_steps += 1
        get_logger().info(f"step {step}: {short}, step skipped ({self.skipped_steps} skipped so far)")

    def begin_step(self) -> None:
        """Before a step's forward, with ``"skip"``: keep the models' running statistics for a skip to put back."""
        if self.on_nonfinite != "skip" or not self.models:
            return
        stats = _running_stats(self.models)
        with torch.no_grad():
            if len(stats) != len(self._stats) or any(a is not b for a, b in zip(stats, self._stats)):
                self._stats, self._saved = stats, [t.detach().clone() for t in stats]
            elif stats:
                torch._foreach_copy_(self._saved, stats)

    def check_model(self, step: int, outcome: str) -> None:
        """Raise NonFiniteError when a parameter or buffer of the models is NaN or inf on some rank (one all-reduce);
        `step` and `outcome` (``"its checkpoint is not saved"``) word the message."""
        if not self.models:
            return
        tensors = _local_tensors(self.models)
        counts = [(~torch.isfinite(t)).sum().to(self.device) for _, t in tensors]
        counts = torch.stack(counts) if counts else torch.zeros(1, dtype=torch.int64, device=self.device)
        total = counts.sum().reshape(1)
        if dist.is_initialized():
            dist.all_reduce(total)
        if (n := int(total.item())) == 0:
            return
        bad = [name for (name, _), count in zip(tensors, counts.tolist()) if count]
        where = f" ({bad[0]}{f' and {len(bad) - 1} more' if len(bad) > 1 else ''})" if bad else ""
        raise self._stops(
            f"after step {step}, {n} values of the model's parameters and buffers are NaN or infinite{where}: "
            f"{outcome} and the run stops, whatever train.on_nonfinite says"
        )

    def stepped(self) -> None:
        self._consecutive = 0  # a step was applied: the count of non-finite steps in a row starts again

    def log_extra(self) -> dict[str, float]:
        """``{"skipped_steps": n}`` for a log line with ``"skip"``; ``{}`` with ``"stop"``."""
        return {"skipped_steps": float(self.skipped_steps)} if self.on_nonfinite == "skip" else {}

    def _stops(self, why: str, todo: str = "or check the data") -> NonFiniteError:
        """``NonFiniteError("<why>; <the newest checkpoint>. Lower optim.lr or raise the warm-up, <todo>")``"""
        latest = self.newest_checkpoint()
        kept = f"the newest checkpoint, from before it, is {latest}" if latest else "no checkpoint was saved before it"
        return NonFiniteError(f"{why}; {kept}. Lower optim.lr or raise the warm-up, {todo}")

    def _finite_on_every_rank(self, loss: _Value) -> bool:
        if isinstance(loss, torch.Tensor):
            flag = (~torch.isfinite(loss.detach())).any().to(torch.float32).reshape(1)
        else:
            flag = torch.tensor([0.0 if math.isfinite(loss) else 1.0], device=self.device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return flag.item() == 0

    def _note_applied(self, loss: _Value, step: int) -> None:
        """Keep the first step whose (applied) loss was not finite, on the device: no sync."""
        loss = torch.as_tensor(loss, device=self.device)
        if self._applied_bad is None:
            self._applied_bad = torch.zeros((), dtype=torch.int64, device=loss.device)
        bad = (~torch.isfinite(loss.detach())).any() & (self._applied_bad == 0)
        self._applied_bad = torch.where(bad, torch.full_like(self._applied_bad, step), self._applied_bad)

    def _defer(self, step: int, grad_norm: _Value) -> bool:
        """With ``"stop"`` and fused optimizers, check `grad_norm` without a sync, which would keep the host from
        running ahead: they skip a non-finite step on the device (``found_inf``, as `torch.amp.GradScaler` uses it),
        and `check_applied`, before the next log line, save or the end, stops the run for it."""
        if self.on_nonfinite != "stop" or not self.optimizers or not isinstance(grad_norm, torch.Tensor):
            return False
        norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).detach().float()
        bad = ~torch.isfinite(norm)
        for optimizer in self.optimizers:
            optimizer.found_inf = bad.float()
        if self._deferred is None:
            self._deferred = (torch.zeros((), dtype=torch.int64, device=norm.device), torch.zeros_like(norm))
        first, value = self._deferred
        new = bad & (first == 0)
        self._deferred = (torch.where(new, torch.full_like(first, step), first), torch.where(new, norm, value))
        return True

    def check_applied(self) -> None:
        """Stop for a non-finite step found without a sync (`_defer`), or if an update already applied was
        non-finite on any rank (collective once `applied` was used)."""
        if self._deferred is not None:
            first, value = self._deferred
            step, self._deferred = int(first.item()), None
            if step:
                self.nonfinite(step, f"the gradient norm of step {step} is {float(value)}", "")
        if self._applied_bad is None:
            return
        first = torch.where(self._applied_bad == 0, torch.full_like(self._applied_bad, _NONE_BAD), self._applied_bad)
        if dist.is_initialized():
            dist.all_reduce(first, op=dist.ReduceOp.MIN)
        step = int(first.item())
        if step != _NONE_BAD:
            raise self._stops(
                f"the loss of step {step} is not finite on every rank and its update was already applied (this "
                f"recipe checks after its step), so the run stops before saving it, whatever train.on_nonfinite says"
            )


def models_in(state: Mapping[str, Any] | None) -> list[torch.nn.Module]:
    """The models among a checkpoint's objects: its `torch.nn.Module` values and the others' ``model``."""
    found = [obj if isinstance(obj, torch.nn.Module) else getattr(obj, "model", None) for obj in (state or {}).values()]
    return list({id(m): m for m in found if isinstance(m, torch.nn.Module)}.values())  # each model once, in order


def optimizers_in(state: Mapping[str, Any] | None) -> list[torch.optim.Optimizer]:
    """The optimizers among a checkpoint's objects: the ``optimizer`` of each."""
    found = [getattr(obj, "optimizer", None) for obj in (state or {}).values()]
    return [o for o in found if isinstance(o, torch.optim.Optimizer)]


def _running_stats(models: Iterable[torch.nn.Module]) -> list[torch.Tensor]:
    """The buffers a training forward updates in place: the running statistics of `models`' norm layers."""
    from torch.nn.modules.batchnorm import _NormBase

    norms = (m for model in models for m in model.modules() if isinstance(m, _NormBase))
    return [b for m in norms for b in m.buffers(recurse=False)]


def _local_tensors(models: Iterable[torch.nn.Module]) -> list[tuple[str, torch.Tensor]]:
    """``(name, values)`` of the floating-point parameters and buffers of `models` held on this rank (local shards)."""
    found, seen = [], set()
    for model in models:
        for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
            if id(t) in seen:
                continue
            seen.add(id(t))
            local = t.to_local() if hasattr(t, "to_local") else t
            parts = [s.tensor for s in t.local_shards()] if hasattr(t, "local_shards") else [local]
            found += [(name, p.detach()) for p in parts if p.is_floating_point() and p.numel() and not p.is_meta]
    return found
