"""The worker side of a Ray recipe: `worker_entry` (what ``TorchTrainer`` runs) and `WorkerRun`. ``state.pt``: state
dicts, each worker's random streams, the skipped steps; ``meta.json``: epoch, step, world_size, config, checksums."""

from __future__ import annotations

import contextlib
import importlib.util
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
from omegaconf import OmegaConf

from cookbook.checkpoint import CHECKSUMS_KEY, META_FILE, CheckpointError, CheckpointSaveError, RNGState, checksums
from cookbook.checkpoint import TrainState, from_rank0, os_error_in, rng_kept, save_error, seed_per_rank
from cookbook.config import to_dict, to_object
from cookbook.dist import DistInfo, all_gather_object, all_reduce_mean, barrier, get_logger, param_fingerprint
from cookbook.dist import record_progress, set_collective_timeout, stall_error
from cookbook.logs import configure_logging
from cookbook.loop import Outputs, TrainLoop, log_outputs
from cookbook.policy import NonFiniteError, NonFinitePolicy
from cookbook.metrics import MetricsLogger, ModelFlops, StepProfiler
from cookbook.resume import checksum_problem

STATE_FILE = "state.pt"
DIVERGED = "diverged"  # in rank 0's return value (Ray's ``Result.return_value``): the NonFiniteError's message
SAVE_FAILED = "save_failed"  # in rank 0's return value: the CheckpointSaveError's message and errno
_RNG_KEY = "rng_per_worker"  # in state.pt: the random streams of each worker, indexed by rank
_EPOCH_RNG_KEY = "epoch_rng_per_worker"  # mid-epoch checkpoints: each worker's streams when the epoch's batches began
_SKIPPED_KEY = "skipped_steps"  # in state.pt: the steps skipped for a non-finite value so far (WorkerRun.skip_step)
# Set by `worker_entry`: the checkpoint the driver announced (`load_checkpoint` checks it), its stop request's key.
_announced: str | None = None
_stop_key: str | None = None


class RecipeError(RuntimeError):
    """A worker's exception of a recipe folder's class (which the driver cannot import), as ``"<class>: <message>"``."""


def worker_entry(loop_config: dict) -> dict | None:
    """Import the recipe file ``loop_config["script"]`` (its folder on ``sys.path``), call its ``train_loop(config)``.
    A non-finite stop or a failed save is returned (``{DIVERGED: message}``, ``{SAVE_FAILED: (message, errno)}``: Ray
    does not restart into it); a timed-out collective is raised as `CollectiveTimeout`."""
    global _announced, _stop_key
    _announced, _stop_key = loop_config.get("announced"), loop_config.get("stop_key")
    script = loop_config["script"]
    name = f"cookbook_recipe_{abs(hash(script))}"
    if name not in sys.modules:
        if str(Path(script).parent) not in sys.path:  # its sibling modules import, as when train.py runs as a script
            sys.path.insert(0, str(Path(script).parent))
        spec = importlib.util.spec_from_file_location(name, script)
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    try:
        sys.modules[name].train_loop(loop_config["config"])
    except NonFiniteError as exc:
        return {DIVERGED: str(exc)}
    except CheckpointSaveError as exc:
        return {SAVE_FAILED: (str(exc), exc.errno)}
    except Exception as exc:
        if (stalled := stall_error(exc)) is not None:
            raise stalled from exc
        home = getattr(sys.modules.get(type(exc).__module__), "__file__", None)
        if type(exc).__module__ != name and (home is None or Path(home).parent != Path(script).parent):
            raise  # not a class of the recipe folder's: Ray's controller and the driver can import it
        raise RecipeError(f"{type(exc).__name__}: {exc}") from None


def config_from_dict(schema: type, data: Mapping[str, Any]) -> Any:
    """The recipe's config dataclass from the driver's dict (``${oc.env:...}`` read from this worker's environment)."""
    return to_object(OmegaConf.merge(OmegaConf.structured(schema), dict(data)))


def worker_info() -> DistInfo:
    """This Ray Train worker's rank, local rank, world size and device; logging at INFO on rank 0 only."""
    import ray.train.torch

    ctx, device = ray.train.get_context(), ray.train.torch.get_device()
    backend = dist.get_backend() if dist.is_initialized() else ("nccl" if device.type == "cuda" else "gloo")
    info = DistInfo(ctx.get_world_rank(), ctx.get_local_rank(), ctx.get_world_size(), device, backend)
    configure_logging(info.rank)
    return info


def load_checkpoint() -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(state, meta)`` of the checkpoint Ray hands the worker (memory-mapped on the CPU), or ``None``."""
    import ray.train

    ckpt = ray.train.get_checkpoint()
    _check_announced(Path(ckpt.path).name if ckpt is not None else None)
    if ckpt is None:
        return None
    with ckpt.as_directory() as d:
        meta = json.loads((Path(d) / META_FILE).read_text())
        if problem := checksum_problem(Path(d), meta.get(CHECKSUMS_KEY) or {}):  # as ResumeGuard.verify words it
            raise CheckpointError(
                f"{ckpt.path}: {problem}, damaged since it was saved: restore it, or run again (the "
                f"driver then resumes from the checkpoint before it)"
            )
        state = torch.load(Path(d) / STATE_FILE, map_location="cpu", weights_only=True, mmap=True)
    get_logger().info(f"resumed from {ckpt.path} ({_facts(meta)})")
    return state, meta


def _check_announced(handed: str | None) -> None:
    """Refuse a checkpoint folder `handed` (or ``None``) older than `_announced`; a newer one is a restart."""
    # (step,), (epoch,) or, mid-epoch, (epoch, step); no checkpoint: ()
    handed_at, announced_at = (tuple(int(n) for n in re.findall(r"\d+", name or "")) for name in (handed, _announced))
    if _announced is not None and handed_at < announced_at:
        raise RuntimeError(
            f"Ray Train handed the workers {handed or 'no checkpoint'}, but the driver announced a "
            f"resume from {_announced}: the workers would not continue the run it named. This is a "
            f"bug; start afresh with a new output_dir"
        )


def rng_state() -> dict[str, Any]:
    """This process's random streams (`RNGState`) as ``weights_only`` loading reads them (NumPy's key in int64)."""
    state = RNGState().state_dict()
    if "numpy" in state:
        name, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = (str(name), torch.from_numpy(key.astype("int64")), int(pos), int(has_gauss), float(gauss))
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore the random streams `rng_state` returned (in this or another process)."""
    state = dict(state)
    if "numpy" in state:
        name, key, pos, has_gauss, gauss = state["numpy"]
        state["numpy"] = (name, key.numpy().astype("uint32"), pos, has_gauss, gauss)
    RNGState().load_state_dict(state)


def _facts(meta: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {v}" for k, v in meta.items() if k not in ("config", CHECKSUMS_KEY))


class WorkerRun(TrainLoop):
    """One Ray Train worker's `TrainLoop` (its step counting, log windows, eval cadence and non-finite policy) with
    Ray's resume, stop request and checkpoints (collective): ``with run:``, ``run.epochs()`` or ``run.steps()``,
    ``run.timed(loader)``, ``run.end_step`` / ``run.end_epoch``, ``with run.checkpoint() as saved:
    ray.train.report(**saved)``, ``run.finish``. It resumes `state` (name -> object with ``state_dict``, or a value),
    the random streams, `step`, `epoch`. `stop_at`: ``("train.stop_at_epoch", n)`` (a checkpoint per epoch) or
    ``("train.stop_at_step", n)`` (by ``checkpoint.every_steps``). A stop request from the driver is checkpointed
    (mid-epoch: ``checkpoint_epoch_<n>_step_<s>``; its resume replays the epoch's batches)."""

    def __init__(
        self,
        cfg: Any,
        info: DistInfo,
        experiment: str,
        state: Mapping[str, Any],
        *,
        max_steps: int,
        steps_per_epoch: int,
        stop_at: tuple[str, int],
        evaluate: Callable[[], Mapping[str, float]] | None = None,
        flops: ModelFlops | None = None,
        count_tokens: bool = True,
        about: str = "",
    ):
        if {_RNG_KEY, _EPOCH_RNG_KEY, _SKIPPED_KEY} & set(state):
            raise ValueError(
                f"state: {_RNG_KEY!r}, {_EPOCH_RNG_KEY!r} and {_SKIPPED_KEY!r} name the workers' random "
                f"streams and skipped steps in a checkpoint; use other names"
            )
        on_nonfinite, max_skips = NonFinitePolicy.settings(cfg.train)
        if getattr(cfg.train, "collective_timeout_s", None) is not None:  # a stalled worker: see `worker_entry`
            set_collective_timeout(cfg.train.collective_timeout_s, store_rank=0)  # Ray's env:// store: rank 0's
        self.cfg, self.info, self.objects, self.steps_per_epoch = cfg, info, dict(state), steps_per_epoch
        self._stop_key, self._unit = stop_at[0], stop_at[0].rsplit("_", 1)[-1]
        self._total = max_steps // steps_per_epoch if self._unit == "epoch" else max_steps
        self._end = min(self._total, stop_at[1]) if stop_at[1] > 0 else self._total
        self._every = getattr(cfg.checkpoint, "every_steps", 0) if self._unit == "step" else 0
        self._reports, self._preempted = 0, False  # checkpoints reported; stopped on the driver's request
        self._stop_seen, self._next_poll = False, 0.0
        self._last_eval, self._values = {}, {}  # the last epoch's evaluation; the next checkpoint's report metrics
        self._rng = self._epoch_rng = None  # the resumed streams (again after a skip); those when this epoch began
        self._newest: Path | None = None  # the newest checkpoint folder (resumed or saved)
        self._stop_reported = False  # a report after a stop request
        self._lr = 0.0  # the learning rate of the newest applied step (an epoch's last log line after a skip)
        if getattr(cfg.train, "seed", None) is not None:
            seed_per_rank(cfg.train.seed, info.rank)  # each worker its own dropout masks; a resume restores its own
        train, skipped, meta = TrainState(), 0, None
        if (resumed := load_checkpoint()) is not None:  # memory-mapped on the CPU, copied into the model and optimizer
            saved, meta = resumed
            for name, obj in self.objects.items():
                if hasattr(obj, "load_state_dict"):
                    obj.load_state_dict(saved[name])
            if _RNG_KEY in saved:
                self._rng = saved[_RNG_KEY][info.rank]
                set_rng_state(self._rng)
            else:
                get_logger().warning(
                    "the checkpoint holds no random streams (an older version wrote it): data "
                    "augmentation and dropout continue from this run's seeds"
                )
            self._epoch_rng = saved[_EPOCH_RNG_KEY][info.rank] if _EPOCH_RNG_KEY in saved else None  # mid-epoch
            train.step, train.epoch, skipped = meta["step"], meta.get("epoch", 0), int(saved.get(_SKIPPED_KEY, 0))
            del saved, resumed
        record_progress(train.step)  # each step's, for the line of a worker whose collective times out
        profile_step = getattr(cfg.train, "profile_step", 0)
        super().__init__(
            state=train,
            max_steps=max_steps,
            metrics=MetricsLogger.for_run(
                cfg, info, experiment=experiment, flops=flops, max_steps=max_steps, count_tokens=count_tokens
            ),
            log_every=cfg.train.log_every,
            eval_every=getattr(cfg.train, "eval_every", 0),
            evaluate=evaluate,
            checkpoint_state=self.objects,  # its models and fused optimizers for the non-finite policy
            profiler=StepProfiler(profile_step, Path(cfg.output_dir), info) if profile_step > 0 else None,
            on_nonfinite=on_nonfinite,
            max_consecutive_skips=max_skips,
        )
        self.nonfinite.skipped_steps, self.nonfinite.newest_checkpoint = skipped, lambda: self._newest
        self._newest = self._folder() if meta is not None else None  # its name (`_label`) counts skipped steps
        self._saved_at = self.batches  # the newest checkpoint's data position
        # An epoch run resumed mid-epoch (a preemption checkpoint): batches of this epoch already taken.
        self._skip = self.batches - self.state.epoch * steps_per_epoch if self._unit == "epoch" else 0
        get_logger().info(
            f"world size {info.world_size} ({info.backend}, {info.device.type}) | "
            f"{about + ' | ' if about else ''}{max_steps} steps ({steps_per_epoch}/epoch) | "
            f"starting at {self._unit} {self._done}"
        )

    @property
    def _done(self) -> int:
        return self.state.epoch if self._unit == "epoch" else self.state.step

    @property
    def batches(self) -> int:  # steps' worth of batches taken over the run, applied or skipped
        return self.state.step + self.nonfinite.skipped_steps

    def __enter__(self) -> WorkerRun:
        try:
            barrier()  # every worker starts the clock together
            self.metrics.start(self.state.step)
        except BaseException:
            self.metrics.close(failed=True)
            raise
        return self

    _UNENDED = "each step must end with run.end_step(...) or a skip (run.skip_step)"

    def steps(self) -> Iterator[int]:
        """Each step's number (1-based) up to the stop point or a stop request; each ends in `end_step`."""
        while self.state.step < self._end and not self._preempted:
            yield from self._step()

    def epochs(self) -> Iterator[int]:
        """Each epoch's number (0-based) up to the stop point or a stop request; each ends in `end_epoch`."""
        while self.state.epoch < self._end and not self._preempted:
            yield (started := self.state.epoch)
            if self.state.epoch == started and not self._preempted:
                raise RuntimeError("each epoch must end with run.end_epoch(...)")

    def timed(self, batches: Iterable) -> Iterator[tuple[Any, float]]:
        """``(batch, seconds waited)``; in an epoch run up to a stop request, past those a mid-epoch resume took."""
        epoch_run = self._unit == "epoch"
        if self._skip and self._epoch_rng is not None:
            set_rng_state(self._epoch_rng)  # the epoch's batches are read again as they were first
        if epoch_run:
            self._epoch_rng = rng_state()
        it = iter(batches)
        if self._skip:
            for _ in range(self._skip):
                next(it)
            if self._rng is not None:
                set_rng_state(self._rng)  # as at the checkpoint
            self._skip = 0
        while not (epoch_run and self._agree_stop()):
            t0, end = time.perf_counter(), object()
            if (batch := next(it, end)) is end:
                return
            if epoch_run:  # a batch is a step (runs counted in steps: `steps`)
                self.nonfinite.begin_step()
            yield batch, time.perf_counter() - t0
        self._preempted = True

    def end_step(
        self,
        loss: torch.Tensor | float,
        *,
        lr: float,
        grad_norm: torch.Tensor | float | None = None,
        window: Mapping[str, torch.Tensor | float] | None = None,
    ) -> bool:
        """`TrainLoop.end_step` (logs also at each epoch's end); returns whether a checkpoint is due (step runs;
        collective)."""
        self._lr = lr
        record_progress(self.state.step + 1)
        super().end_step(loss, lr=lr, grad_norm=grad_norm, window=window)
        if self._unit != "step":
            return False
        step = self.state.step
        due = self._every >= 0 and (step == self._end or (self._every > 0 and step % self._every == 0))
        if step < self._end and self._agree_stop():
            self._preempted = due = True
        if due:
            self._values = {"loss": all_reduce_mean({"loss": loss}, self.info.device)["loss"]}  # of the global batch
        return due

    def _log_due(self, step: int) -> bool:
        epoch_end = (self.batches if self._unit == "epoch" else step) % self.steps_per_epoch == 0
        return epoch_end or super()._log_due(step)

    def end_epoch(self, evaluate: Callable[[], Mapping[str, float]]) -> None:
        """Count one epoch, run `evaluate` (collective), its metrics the checkpoint's (none after a stop request)."""
        if self._preempted:
            self._values = {}
            return
        self.state.epoch += 1
        if self._steps:  # the epoch's last batch was skipped (skip_step): its last log line comes here
            self._log_window(self._lr)
        with self.metrics.paused(), rng_kept():  # the evaluation does not change what the next epoch draws
            self.metrics.log_eval(self.state.step, values := dict(evaluate()))
        self._last_eval = self._values = values

    def _label(self) -> str:
        if self._unit == "step":
            return f"step_{self.state.step:08d}"
        return f"epoch_{self.state.epoch:04d}" + (
            f"_step_{self.state.step:08d}" if self.batches % self.steps_per_epoch else ""
        )

    def _folder(self) -> Path:  # where Ray stores the checkpoint of this point
        return Path(self.cfg.output_dir).expanduser().resolve() / f"checkpoint_{self._label()}"

    @contextlib.contextmanager
    def checkpoint(self) -> Iterator[dict[str, Any]]:
        """``with run.checkpoint() as saved: ray.train.report(**saved)`` (collective): rank 0 writes ``state.pt`` and
        ``meta.json`` to a temporary folder that Ray copies to ``<output_dir>/checkpoint_<label>``. NonFiniteError: a
        non-finite model; CheckpointSaveError on every worker: a failed write or copy (the partial folder removed)."""
        counts = {"epoch": self.state.epoch} if self._unit == "epoch" else {}
        metrics = {**counts, "step": self.state.step, **self._values, **({"preempted": 1.0} if self._preempted else {})}
        with self.metrics.paused():
            if self._preempted and self._saved_at == self.batches:  # the newest checkpoint is at this step
                yield {"metrics": metrics}
                self._reports, self._stop_reported = self._reports + 1, True
                return
            label, final = self._label(), self._folder()
            self.nonfinite.check_applied()  # never save an update that diverged
            self.nonfinite.check_model(self.state.step, f"checkpoint_{label} is not saved")
            # every worker's streams, and the steps skipped so far
            run = {_RNG_KEY: all_gather_object(rng_state()), _SKIPPED_KEY: self.nonfinite.skipped_steps}
            if self._unit == "epoch" and self.batches % self.steps_per_epoch:
                run[_EPOCH_RNG_KEY] = all_gather_object(self._epoch_rng)
            meta = {**counts, "step": self.state.step, "world_size": self.info.world_size, "config": to_dict(self.cfg)}
            with tempfile.TemporaryDirectory() as tmp:
                saved, failure = {"metrics": metrics}, None
                if self.info.is_main:  # DDP replicas are identical: rank 0's state
                    from ray.train import Checkpoint

                    state = {k: v.state_dict() if hasattr(v, "state_dict") else v for k, v in self.objects.items()}
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
            self._reports, self._stop_reported = self._reports + 1, self._preempted
            self._saved_at, self._newest = self.batches, final

    def _save_failure(self, exc: Exception, final: Path) -> tuple[str, int | None]:
        """``(message, errno)`` of `save_error` for the OS error behind `exc` (else raise `exc`)."""
        if (os_error := os_error_in(exc)) is None:
            raise exc
        error = save_error(self.state.step, final, self._newest, 0 if self.info.world_size > 1 else None, os_error)
        return str(error), error.errno

    def _agree_stop(self) -> bool:
        """Whether the workers agreed to stop here (collective): rank 0 reads the driver's request from Ray's store."""
        if _stop_key is None:
            return False
        if self.info.is_main and not self._stop_seen and time.monotonic() >= self._next_poll:
            from ray.experimental.internal_kv import _internal_kv_get

            self._stop_seen = _internal_kv_get(_stop_key) is not None
            self._next_poll = time.monotonic() + 0.5  # Ray is asked at most every 0.5 s
        return self._vote(self._stop_seen)

    def finish(self, model: torch.nn.Module, export: Callable[[], Outputs] | None = None) -> None:
        """After the loop: the final evaluation, the summary record, and for a finished run `export`
        (``{summary key: (folder or None, how to load it)}``) and the closing lines; else how to continue."""
        if self._preempted and not self._stop_reported:
            raise RuntimeError(
                "the run stopped on the driver's stop request: report run.checkpoint() before run.finish()"
            )
        self.nonfinite.check_applied()
        if not self._preempted and self._done >= self._total:
            self.nonfinite.check_model(self.state.step, "the run is not done (no final evaluation, export or summary)")
        if final_eval := dict(self.evaluate()) if self.evaluate is not None and not self._preempted else {}:
            self.metrics.log_eval(self.state.step, final_eval)
        final_eval = final_eval or self._last_eval
        reports, fingerprints = all_gather_object(self._reports), all_gather_object(param_fingerprint(model))
        outputs: dict[str, tuple[Path | None, str]] = {}
        self.stopped = self._preempted or self._done < self._total
        if self._preempted:
            get_logger().info(
                f"stopped after step {self.state.step} ({self._unit} {self._done} of {self._total}) on the "
                f"driver's stop request, with a checkpoint at it; run the same command again to continue"
            )
        elif self.stopped:
            get_logger().info(
                f"stopped {'after' if self._unit == 'epoch' else 'at'} {self._unit} {self._done} of "
                f"{self._total} ({self._stop_key}); run again without it to continue"
            )
        elif export is not None:
            outputs = dict(export())
        self.metrics.log_summary(
            {
                "step": self.state.step,
                **({"epoch": self.state.epoch} if self._unit == "epoch" else {}),
                "reports_per_worker": reports,
                "param_fingerprints": fingerprints,
                **{f"eval/{k}": v for k, v in final_eval.items()},
                **{k: str(path) if path else None for k, (path, _) in outputs.items()},
                "mlflow_uri": self.metrics.mlflow_uri,
                "mlflow_run_id": self.metrics.mlflow_run_id,
            }
        )
        if not self.stopped:
            log_outputs(self.state.step, final_eval, self.metrics, Path(self.cfg.output_dir), outputs)


def raise_save_error(failure: tuple[str, int | None] | None) -> None:
    """Raise the `CheckpointSaveError` of a failed save's ``(message, errno)`` (`SAVE_FAILED`), if any."""
    if failure is not None:
        error = CheckpointSaveError(failure[0])
        error.errno = failure[1]
        raise error
