"""The worker side of a Ray recipe: `worker_entry` (what ``TorchTrainer`` runs: the recipe's ``train_loop``),
`config_from_dict`, `worker_info` and `WorkerRun`, the bookkeeping around the recipe's step body with the torchrun
loop's failure policy (`cookbook.policy`). ``state.pt`` holds the state dicts, every worker's random streams and the
skipped steps (tensors and plain values); ``meta.json`` ``epoch``, ``step``, ``world_size``, ``config``, checksums.
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping

import torch
import torch.distributed as dist

from cookbook.checkpoint import (CHECKSUMS_KEY, META_FILE, CheckpointError, CheckpointSaveError, RNGState, checksums,
                                 from_rank0, os_error_in, rng_kept, save_error, seed_per_rank)
from cookbook.config import save_config, to_dict, to_object
from cookbook.dist import (DistInfo, all_gather_object, all_reduce_mean, barrier, get_logger, param_fingerprint,
                           record_progress, set_collective_timeout, stall_error)
from cookbook.logs import configure_logging
from cookbook.loop import Outputs, log_outputs
from cookbook.policy import NonFiniteError, NonFinitePolicy, StopVote, models_in
from cookbook.metrics import MetricsLogger, ModelFlops, StepProfiler
from cookbook.resume import checksum_problem

STATE_FILE = "state.pt"
DIVERGED = "diverged"  # in rank 0's return value (Ray's ``Result.return_value``): the NonFiniteError's message
SAVE_FAILED = "save_failed"  # in rank 0's return value: the CheckpointSaveError's message and errno
_RNG_KEY = "rng_per_worker"  # in state.pt: the random streams of each worker, indexed by rank
_EPOCH_RNG_KEY = "epoch_rng_per_worker"  # mid-epoch checkpoints: each worker's streams when the epoch's batches began
_SKIPPED_KEY = "skipped_steps"  # in state.pt: the steps skipped for a non-finite value so far (WorkerRun.skip_step)
_STOP_POLL_S = 0.5  # rank 0 asks Ray whether a stop was requested at most this often
# Set in each worker by `worker_entry` from the driver's ``train_loop_config``: the checkpoint folder the driver
# announced ("resuming from ...", checked by `load_checkpoint`) and the key of its stop request in Ray's store.
_announced: str | None = None
_stop_key: str | None = None


class RecipeError(RuntimeError):
    """An exception of a class defined in the recipe's ``train.py``, raised in a worker and re-raised as this (the
    driver and Ray's controller cannot import the recipe module under the worker's name); the message starts with
    the original class name, the worker's traceback is in the run's log."""


def worker_entry(loop_config: dict) -> dict | None:
    """Import the recipe file ``loop_config["script"]`` by path (OmegaConf needs its dataclasses in a real module;
    its folder goes on ``sys.path``) and call its ``train_loop(loop_config["config"])``. A non-finite stop or a failed save is returned to the driver
    (``{DIVERGED: message}``, ``{SAVE_FAILED: (message, errno)}``), so that Ray does not restart the workers into
    it; a timed-out collective is raised as `cookbook.dist.CollectiveTimeout` (a restart, or one line)."""
    import importlib.util

    global _announced, _stop_key
    _announced, _stop_key = loop_config.get("announced"), loop_config.get("stop_key")
    script = loop_config["script"]
    name = f"cookbook_recipe_{abs(hash(script))}"
    if name not in sys.modules:
        if str(Path(script).parent) not in sys.path:  # its sibling modules import, as when train.py runs as a script
            sys.path.insert(0, str(Path(script).parent))
        spec = importlib.util.spec_from_file_location(name, script)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    try:
        sys.modules[name].train_loop(loop_config["config"])
    except NonFiniteError as exc:
        return {DIVERGED: str(exc)}
    except CheckpointSaveError as exc:
        return {SAVE_FAILED: (str(exc), exc.errno)}
    except Exception as exc:
        stalled = stall_error(exc)
        if stalled is not None:
            raise stalled from exc
        home = getattr(sys.modules.get(type(exc).__module__), "__file__", None)
        if type(exc).__module__ != name and (home is None or Path(home).parent != Path(script).parent):
            raise  # not a class of the recipe folder's: Ray's controller and the driver can import it
        raise RecipeError(f"{type(exc).__name__}: {exc}") from None
    return None


def config_from_dict(schema: type, data: Mapping[str, Any]) -> Any:
    """The recipe's config dataclass from the plain dict the driver sent (``${oc.env:...}`` values are read from
    this worker's environment)."""
    from omegaconf import OmegaConf

    return to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(data)))


def worker_info() -> DistInfo:
    """This Ray Train worker's rank, local rank, world size and device; the ``cookbook`` logger at INFO on rank 0
    only (warnings from every rank)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    device = ray.train.torch.get_device()
    backend = dist.get_backend() if dist.is_initialized() else ("nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_world_size(), device, backend)
    configure_logging(info.rank)
    return info


def load_checkpoint(map_location: torch.device | str = "cpu") -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(state, meta)`` of the checkpoint Ray hands the worker, or ``None`` on a fresh start; ``state.pt`` read with
    ``weights_only=True``, memory-mapped on the CPU. Raises RuntimeError for an older checkpoint than the driver
    announced (a bug), CheckpointError for a file that does not match its checksum in ``meta.json``."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    _check_announced(Path(ckpt.path).name if ckpt is not None else None)
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        meta = json.loads((Path(d) / META_FILE).read_text())
        problem = checksum_problem(Path(d), meta.get(CHECKSUMS_KEY) or {})  # as ResumeGuard.verify words it
        if problem:
            raise CheckpointError(f"{ckpt.path}: {problem}, damaged since it was saved: restore it, or run again (the "
                                  f"driver then resumes from the checkpoint before it)")
        state = torch.load(Path(d) / STATE_FILE, map_location=map_location, weights_only=True,
                           mmap=torch.device(map_location).type == "cpu")
    get_logger().info(f"resumed from {ckpt.path} ({_facts(meta)})")
    return state, meta


def _check_announced(handed: str | None) -> None:
    """Refuse a checkpoint folder `handed` (or ``None``) older than `_announced`; a newer one is a restart."""
    if _announced is None:
        return

    def position(name: str) -> tuple[int, ...]:  # (step,), (epoch,) or, mid-epoch, (epoch, step)
        return tuple(int(n) for n in re.findall(r"\d+", name))

    if handed is None or position(handed) < position(_announced):
        raise RuntimeError(f"Ray Train handed the workers {handed or 'no checkpoint'}, but the driver announced a "
                           f"resume from {_announced}: the workers would not continue the run it named. This is a "
                           f"bug; start afresh with a new output_dir")


def rng_state() -> dict[str, Any]:
    """This process's random streams (`cookbook.checkpoint.RNGState`) in a form ``weights_only`` loading reads
    (NumPy's key as an int64 tensor); restore with `set_rng_state`."""
    state = RNGState().state_dict()
    if "numpy" in state:
        name, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = (str(name), torch.from_numpy(key.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the random streams `rng_state` returned (in this or another process)."""
    state = dict(state)
    if "numpy" in state:
        import numpy as np

        name, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = (name, key.numpy().astype(np.uint32), pos, has_gauss, gauss)
    RNGState().load_state_dict(state)


def _facts(meta: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in meta.items() if k not in ("config", CHECKSUMS_KEY))


class WorkerRun:
    """Resume, metrics, log window, checkpoints for ``ray.train.report`` and the summary of one Ray Train worker;
    every method that logs, evaluates or checkpoints is collective. A recipe enters ``with run:``, loops over
    ``run.epochs()`` or ``run.steps()`` and ``run.timed(loader)``, calls ``run.end_step`` / ``run.end_epoch``, reports
    ``with run.checkpoint() as saved: ray.train.report(**saved)`` and ends with ``run.finish``.

    Constructed after the model's initialisation, it resumes `state` (name -> object with ``state_dict``, or a plain
    value), the random streams, `step` and `epoch`. `stop_at`: ``("train.stop_at_epoch", n)`` (a checkpoint per
    epoch) or ``("train.stop_at_step", n)`` (by ``checkpoint.every_steps``: -1 never, 0 at the stop, N every N
    steps). A stop request from the driver (preemption) is agreed by `cookbook.policy.StopVote` and checkpointed
    (mid-epoch: ``checkpoint_epoch_<n>_step_<s>``, whose resume reads the epoch's first batches again and drops them).
    """

    def __init__(self, cfg: Any, info: DistInfo, experiment: str, state: Mapping[str, Any], *, max_steps: int,
                 steps_per_epoch: int, stop_at: tuple[str, int], evaluate: Callable[[], Mapping[str, float]] | None = None,
                 flops: ModelFlops | None = None, count_tokens: bool = True, about: str = ""):
        if {_RNG_KEY, _EPOCH_RNG_KEY, _SKIPPED_KEY} & set(state):
            raise ValueError(f"state: {_RNG_KEY!r}, {_EPOCH_RNG_KEY!r} and {_SKIPPED_KEY!r} name the workers' random "
                             f"streams and skipped steps in a checkpoint; use other names")
        on_nonfinite, max_skips = NonFinitePolicy.settings(cfg.train)
        if getattr(cfg.train, "collective_timeout_s", None) is not None:  # a stalled worker: see `worker_entry`
            set_collective_timeout(cfg.train.collective_timeout_s, store_rank=0)  # Ray's env:// store: rank 0's
        self.cfg, self.info, self.state = cfg, info, dict(state)
        self.max_steps, self.steps_per_epoch = max_steps, steps_per_epoch
        self.stop_key, self.unit = stop_at[0], stop_at[0].rsplit("_", 1)[-1]
        self.total = max_steps // steps_per_epoch if self.unit == "epoch" else max_steps
        self.stop = min(self.total, stop_at[1]) if stop_at[1] > 0 else self.total
        self.checkpoint_every = getattr(cfg.checkpoint, "every_steps", 0) if self.unit == "step" else 0
        self.evaluate, self.eval_every = evaluate, getattr(cfg.train, "eval_every", 0)
        self.step = self.epoch = self.reports = 0
        self.stopped = False  # the run ended at its stop point (or on a stop request), before the end
        self.preempted = False  # the run stopped on the driver's stop request (SIGTERM / SIGUSR1), after a checkpoint
        self._last_eval: dict[str, float] = {}
        self._stop_seen, self._next_poll, self._vote = False, 0.0, StopVote(self.info.device)
        self._rng: Mapping[str, Any] | None = None  # the resumed random streams, restored again after a skip
        self._epoch_rng: Mapping[str, Any] | None = None  # the streams when this epoch's batches began
        self._newest: Path | None = None  # the newest checkpoint folder (resumed or saved)
        self._skipped_now = False  # the step being run was skipped (skip_step)
        self._values: dict[str, Any] = {}  # the metrics of the next checkpoint's report (end_epoch, end_step)
        self._stop_reported = False  # a report after the stop request was made (`checkpoint`)
        skipped = 0
        if getattr(cfg.train, "seed", None) is not None:
            seed_per_rank(cfg.train.seed, info.rank)  # each worker its own dropout masks; a resume restores its own
        resumed = load_checkpoint()  # memory-mapped on the CPU, copied into the model and optimizer
        if resumed is not None:
            saved, meta = resumed
            for name, obj in self.state.items():
                if hasattr(obj, "load_state_dict"):
                    obj.load_state_dict(saved[name])
            if _RNG_KEY in saved:
                self._rng = saved[_RNG_KEY][info.rank]
                set_rng_state(self._rng)
            else:
                get_logger().warning("the checkpoint holds no random streams (an older version wrote it): data "
                                     "augmentation and dropout continue from this run's seeds")
            if _EPOCH_RNG_KEY in saved:  # mid-epoch: replayed from these in `timed`
                self._epoch_rng = saved[_EPOCH_RNG_KEY][info.rank]
            self.step, self.epoch = meta["step"], meta.get("epoch", 0)
            skipped = int(saved.get(_SKIPPED_KEY, 0))
            del saved
        record_progress(self.step)  # each step's, for the line of a worker whose collective times out
        self.nonfinite = NonFinitePolicy(on_nonfinite, max_skips, device=info.device, models=models_in(self.state),
                                         newest_checkpoint=lambda: self._newest, skipped_steps=skipped)
        if resumed is not None:  # its name (`_label`) counts the skipped steps
            self._newest = Path(cfg.output_dir).expanduser().resolve() / f"checkpoint_{self._label()}"
            del resumed
        self._saved_at = self.batches  # the newest checkpoint's data position
        self._lr = 0.0  # the learning rate of the newest applied step (an epoch's last log line after a skip)
        # An epoch run resumed mid-epoch (a preemption checkpoint): batches of this epoch already taken.
        self._skip = self.batches - self.epoch * steps_per_epoch if self.unit == "epoch" else 0
        out = Path(cfg.output_dir)
        if info.is_main:
            out.mkdir(parents=True, exist_ok=True)
            save_config(cfg, out / "config.yaml")
        self.metrics = MetricsLogger(out, info, flops=flops, run_name=cfg.run_name, experiment=experiment,
                                     params=to_dict(cfg), mlflow=cfg.mlflow, max_steps=max_steps, count_tokens=count_tokens)
        self.profiler = StepProfiler(getattr(cfg.train, "profile_step", 0), out, info)
        self._reset_window()
        get_logger().info(f"world size {info.world_size} ({info.backend}, {info.device.type}) | "
                          f"{about + ' | ' if about else ''}{max_steps} steps ({steps_per_epoch}/epoch) | "
                          f"starting at {self.unit} {self.done}")

    @property
    def done(self) -> int:
        """Epochs or steps (the unit of ``stop_at``) done."""
        return self.epoch if self.unit == "epoch" else self.step

    @property
    def batches(self) -> int:
        """Steps' worth of batches taken over the run, applied or skipped (an epoch is ``steps_per_epoch`` of them)."""
        return self.step + self.nonfinite.skipped_steps

    @property
    def skipped_steps(self) -> int:
        """Steps dropped by `skip_step` over the whole run (restored on resume)."""
        return self.nonfinite.skipped_steps

    # ------------------------------------------------------------------ the loop
    def __enter__(self) -> WorkerRun:
        try:
            barrier()  # every worker starts the clock together
            self.metrics.start(self.step)
            self.profiler.start(self.step + 1)
        except BaseException:
            self.metrics.close(failed=True)
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self._vote.finish()
        self.metrics.close(failed=exc_type is not None, stopped=self.stopped)

    def steps(self) -> Iterator[int]:
        """Each optimizer step's number (1-based) up to the stop point or a stop request; each ends in `end_step`."""
        while self.step < self.stop and not self.preempted:
            started, self._skipped_now = self.step, False
            self.nonfinite.begin_step()
            yield started + 1
            if self.step == started and not self._skipped_now:
                raise RuntimeError("each step must end with run.end_step(...) or a skip (run.skip_step)")

    def skip_step(self, grad_norm: torch.Tensor | float | None = None, *,
                  loss: torch.Tensor | float | None = None) -> bool:
        """`cookbook.policy.NonFinitePolicy.skip` of the step being run, before its update (`grad_norm`: the same
        on every worker; else `loss`). ``True`` (``train.on_nonfinite=skip``): zero the gradients and ``continue``;
        the step number comes again with the next batches. Raises NonFiniteError (``stop``, too many skips)."""
        skipped = self.nonfinite.skip(self.step + 1, grad_norm, loss=loss)
        self._skipped_now = self._skipped_now or skipped
        return skipped

    def epochs(self) -> Iterator[int]:
        """Each epoch's number (0-based) up to the stop point or a stop request; each ends in `end_epoch`."""
        while self.epoch < self.stop and not self.preempted:
            started = self.epoch
            yield started
            if self.epoch == started and not self.preempted:
                raise RuntimeError("each epoch must end with run.end_epoch(...)")

    def timed(self, batches: Iterable) -> Iterator[tuple[Any, float]]:
        """``(batch, seconds waited for it)``; in an epoch run, up to a stop request, past those a mid-epoch resume
        already took."""
        if self._skip and self._epoch_rng is not None:
            set_rng_state(self._epoch_rng)  # the epoch's batches are read again as they were first
        if self.unit == "epoch":
            self._epoch_rng = rng_state()
        it = iter(batches)
        if self._skip:
            for _ in range(self._skip):
                next(it)
            if self._rng is not None:
                set_rng_state(self._rng)  # as at the checkpoint
            self._skip = 0
        while True:
            if self.unit == "epoch" and self._agree_stop():
                self.preempted = True
                return
            t0 = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            if self.unit == "epoch":  # a batch is a step (runs counted in steps: `steps`)
                self.nonfinite.begin_step()
            yield batch, time.perf_counter() - t0

    def end_step(self, loss: torch.Tensor | float, *, lr: float, grad_norm: torch.Tensor | float | None = None,
                 window: Mapping[str, torch.Tensor | float] | None = None) -> bool:
        """Count one optimizer step (`loss`: this worker's 0-d tensor; `window`: more numbers averaged by name) and log
        by ``train.log_every``; returns whether a checkpoint is due (step runs; collective), ``False`` in epoch runs."""
        self.profiler.stop()
        self.step += 1
        record_progress(self.step)
        self.nonfinite.stepped()
        step = self.step
        self._loss = self._loss + (loss.detach() if isinstance(loss, torch.Tensor) else loss)
        for k, v in (window or {}).items():
            self._window[k] = self._window.get(k, 0.0) + (v.detach() if isinstance(v, torch.Tensor) else v)
        self._steps += 1
        self._lr = lr
        epoch_end = (self.batches if self.unit == "epoch" else step) % self.steps_per_epoch == 0
        if step % self.cfg.train.log_every == 0 or epoch_end or step == self.max_steps:
            extra = {k: v / self._steps for k, v in self._window.items()}
            extra.update(self.nonfinite.log_extra())
            self.metrics.log_step(step, self._loss / self._steps, lr, grad_norm, extra=extra or None)
            self._reset_window()
        with self.metrics.paused():  # not counted in the step time and throughput
            if self.evaluate is not None and self.eval_every > 0 and step % self.eval_every == 0 and step < self.max_steps:
                with rng_kept():  # the evaluation does not change what training draws next (dropout)
                    values = self.evaluate()
                self.metrics.log_eval(step, values)
        self.profiler.start(step + 1)
        if self.unit != "step":
            return False
        every = self.checkpoint_every
        due = every >= 0 and (step == self.stop or (every > 0 and step % every == 0))
        if step < self.stop and self._agree_stop():
            self.preempted = due = True
        if due:
            self._values = {"loss": all_reduce_mean({"loss": loss}, self.info.device)["loss"]}  # of the global batch
        return due

    def end_epoch(self, evaluate: Callable[[], Mapping[str, float]]) -> dict[str, float]:
        """Count one epoch and run `evaluate` (collective) before its `checkpoint`; returns its metrics (``{}`` when
        a stop request cut the epoch short)."""
        if self.preempted:
            self._values = {}
            return {}
        self.epoch += 1
        if self._steps:  # the epoch's last batch was skipped (skip_step): its last log line comes here
            self.metrics.log_step(self.step, self._loss / self._steps, self._lr, None,
                                  extra={**{k: v / self._steps for k, v in self._window.items()},
                                         **self.nonfinite.log_extra()})
            self._reset_window()
        with self.metrics.paused():
            with rng_kept():  # the evaluation does not change what the next epoch draws
                values = self._last_eval = dict(evaluate())
            self.metrics.log_eval(self.step, values)
        self._values = values
        return values

    def _label(self) -> str:
        """The name of a checkpoint at this point, less ``checkpoint_``."""
        if self.unit == "step":
            return f"step_{self.step:08d}"
        # mid-epoch (a preemption): epochs done and steps done
        return f"epoch_{self.epoch:04d}" + (f"_step_{self.step:08d}" if self.batches % self.steps_per_epoch else "")

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[dict[str, Any]]:
        """``with run.checkpoint() as saved: ray.train.report(**saved)`` (collective, after `end_epoch` or an `end_step`
        that returned ``True``): rank 0 writes ``state.pt`` and ``meta.json`` to a temporary folder that Ray copies to
        ``<output_dir>/checkpoint_<label>``. Raises NonFiniteError for a non-finite model (nothing saved), and
        CheckpointSaveError on every worker when rank 0's write or Ray's copy failed (the partial folder removed)."""
        counts = {"epoch": self.epoch} if self.unit == "epoch" else {}
        metrics = {**counts, "step": self.step, **self._values, **({"preempted": 1.0} if self.preempted else {})}
        with self.metrics.paused():
            if self.preempted and self._saved_at == self.batches:  # the newest checkpoint is at this step
                yield {"metrics": metrics}
                self.reports, self._stop_reported = self.reports + 1, True
                return
            label = self._label()
            self.nonfinite.check_model(self.step, f"checkpoint_{label} is not saved")
            run = {_RNG_KEY: all_gather_object(rng_state()), _SKIPPED_KEY: self.nonfinite.skipped_steps}  # every worker's
            if self.unit == "epoch" and self.batches % self.steps_per_epoch:
                run[_EPOCH_RNG_KEY] = all_gather_object(self._epoch_rng)
            meta = {**counts, "step": self.step, "world_size": self.info.world_size, "config": to_dict(self.cfg)}
            final = Path(self.cfg.output_dir).expanduser().resolve() / f"checkpoint_{label}"
            with tempfile.TemporaryDirectory() as tmp:
                saved: dict[str, Any] = {"metrics": metrics}
                failure = None
                if self.info.is_main:  # DDP replicas are identical: rank 0's state
                    from ray.train import Checkpoint

                    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self.state.items()}
                    try:
                        with open(Path(tmp) / STATE_FILE, "wb") as f:  # a Python file: a failed write keeps its errno
                            torch.save({**state, **run}, f)
                        meta[CHECKSUMS_KEY] = checksums(tmp)  # a resume finds a damaged state.pt (ResumeGuard.verify)
                        (Path(tmp) / META_FILE).write_text(json.dumps(meta, indent=2))
                    except Exception as exc:
                        failure = self._save_failure(exc, final)
                    saved.update(checkpoint=Checkpoint.from_directory(tmp), checkpoint_dir_name=f"checkpoint_{label}")
                raise_save_error(from_rank0(failure))  # before the report: no worker waits in it
                try:
                    yield saved
                except Exception as exc:  # Ray's copy to output_dir (pyarrow) failed on rank 0
                    failure = self._save_failure(exc, final)
                    shutil.rmtree(final, ignore_errors=True)  # not registered: its space goes back to the disk
                raise_save_error(from_rank0(failure))
            get_logger().info(f"checkpoint saved: {label} ({_facts(meta)})")
            self.reports, self._stop_reported = self.reports + 1, self.preempted
            self._saved_at = self.batches
            self._newest = final

    def _save_failure(self, exc: Exception, final: Path) -> tuple[str, int | None]:
        """``(message, errno)`` of `cookbook.checkpoint.save_error` for the OS error behind `exc` (else `exc`)."""
        os_error = os_error_in(exc)
        if os_error is None:
            raise exc
        error = save_error(self.step, final, self._newest, 0 if self.info.world_size > 1 else None, os_error)
        return str(error), error.errno

    def _agree_stop(self) -> bool:
        """Whether the workers agreed to stop here (collective): rank 0 reads the driver's request from Ray's store."""
        if _stop_key is None:
            return False
        if self.info.is_main and not self._stop_seen and time.monotonic() >= self._next_poll:
            from ray.experimental.internal_kv import _internal_kv_get

            self._stop_seen = _internal_kv_get(_stop_key) is not None
            self._next_poll = time.monotonic() + _STOP_POLL_S
        return self._vote(self._stop_seen)

    def _reset_window(self) -> None:
        self._loss: torch.Tensor | float = torch.zeros((), device=self.info.device)
        self._window: dict[str, Any] = {}
        self._steps = 0

    # ------------------------------------------------------------------ the end
    def finish(self, model: torch.nn.Module, export: Callable[[], Outputs] | None = None) -> dict[str, float]:
        """After the loop: the final evaluation (returned), each worker's report count and parameter fingerprint, the
        summary record, and for a finished run `export` (``{summary key: (folder or None, how to load it)}``) and the
        closing lines; for a stopped one, how to continue. Raises NonFiniteError for a finished non-finite model."""
        if self.preempted and not self._stop_reported:
            raise RuntimeError("the run stopped on the driver's stop request: report run.checkpoint() before run.finish()")
        if not self.preempted and self.done >= self.total:
            self.nonfinite.check_model(self.step, "the run is not done (no final evaluation, export or summary)")
        final_eval = dict(self.evaluate()) if self.evaluate is not None and not self.preempted else {}
        if final_eval:
            self.metrics.log_eval(self.step, final_eval)
        else:
            final_eval = self._last_eval
        workers = {"reports_per_worker": all_gather_object(self.reports),
                   "param_fingerprints": all_gather_object(param_fingerprint(model))}
        outputs: dict[str, tuple[Path | None, str]] = {}
        if self.preempted:
            self.stopped = True
            get_logger().info(f"stopped after step {self.step} ({self.unit} {self.done} of {self.total}) on the "
                              f"driver's stop request, with a checkpoint at it; run the same command again to continue")
        elif self.done < self.total:
            self.stopped = True
            get_logger().info(f"stopped {'after' if self.unit == 'epoch' else 'at'} {self.unit} {self.done} of "
                              f"{self.total} ({self.stop_key}); run again without it to continue")
        elif export is not None:
            outputs = dict(export())
        self.metrics.log_summary({"step": self.step, **({"epoch": self.epoch} if self.unit == "epoch" else {}),
                                  **workers, **{f"eval/{k}": v for k, v in final_eval.items()},
                                  **{k: str(path) if path else None for k, (path, _) in outputs.items()},
                                  "mlflow_uri": self.metrics.mlflow_uri, "mlflow_run_id": self.metrics.mlflow_run_id})
        if not self.stopped:
            log_outputs(self.step, final_eval, self.metrics, Path(self.cfg.output_dir), outputs)
        return final_eval


def raise_save_error(failure: tuple[str, int | None] | None) -> None:
    """Raise the `CheckpointSaveError` of a failed save's ``(message, errno)`` (`SAVE_FAILED`), if any."""
    if failure is not None:
        error = CheckpointSaveError(failure[0])
        error.errno = failure[1]
        raise error
