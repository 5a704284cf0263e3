"""The bookkeeping of a recipe built on the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``), with DeepSpeed or
without (DDP, FSDP2).

The Trainer runs the step loop; these pieces connect it to the rest of the cookbook, unchanged for any model:

- `MetricsCallback` feeds `cookbook.metrics.MetricsLogger`: one window per ``logging_steps`` (loss,
  learning rate, gradient norm, step time, rows and real tokens per second, MFU), paused while the
  Trainer evaluates or saves a checkpoint; each evaluation's ``eval_*`` values, plus a recipe's own
  (``evaluate_more``, e.g. generation scored against references), as one eval record.
- `WholeEpochs`, a Trainer mixin, makes an epoch read every row once, in full global batches (`epoch_line` logs
  what is dropped).
- `CountBatches`, a Trainer mixin, counts each micro-batch's rows, real tokens and data-loading wait into it.
- `PublishCheckpoints` turns the Trainer's ``checkpoint-<step>`` folders into published checkpoints: written
  in a staging folder (the Trainer's ``output_dir``), completed with ``meta.json`` (step, world size, config,
  the files and their sizes), renamed into the checkpoints folder once every rank is done (atomic), the
  newest ``keep_last`` kept. `resume_guard`, `check_resume` and `already_complete` find and check the
  checkpoint a run continues (``checkpoint.resume``: auto, none or a folder).
- `StopAtStep` ends training with a checkpoint after ``train.stop_at_step``; `SeedPerRank` seeds each rank's
  random streams ``seed + rank`` (its own dropout masks).
- What the torchrun recipes' `cookbook.loop.TrainLoop` does when things fail, with the same code:
  `Preemption` (SIGTERM / SIGUSR1: every rank finishes its step, they agree on it with
  `cookbook.loop.StopVote`, a checkpoint is published there and the run exits with 75), `NonFiniteSteps`
  (``train.on_nonfinite`` through `cookbook.loop.NonFinitePolicy`: DeepSpeed's own check of the gradient norm,
  or, without DeepSpeed, an all-reduced check of the gradients before ``optimizer.step()``; the skip count is
  kept in the checkpoints), `ReportSaveErrors` (a Trainer mixin: a save that fails with an OS error ends the run with
  `cookbook.checkpoint.CheckpointSaveError`'s one line, exit 2) and `StallReport` (``train.collective_timeout_s``
  on every process group, DeepSpeed's included, and the progress records that let the rank whose collective
  timed out name the one that stalled, exit 3). A damaged checkpoint (a truncated shard, bytes overwritten in place, no
  ``meta.json``) is found by the resume guard from the file sizes and checksums `PublishCheckpoints` lists in
  ``meta.json`` (a folder is published under ``checkpoints/`` only once its ``meta.json`` is written).
- `check_deepspeed_config` refuses, before any worker starts, a DeepSpeed JSON that disagrees with the
  recipe's config (or with the one an ``accelerate launch`` config names: `check_accelerate_deepspeed_file`); `init_deepspeed` starts DeepSpeed's communication over the cookbook's process group.
- `TrainerRun` runs ``trainer.train()`` and closes the run whatever happens (stop, preemption, failure, stall).
- `export_final` writes the consolidated model (and a LoRA adapter) in Hugging Face format.

Use::

    info = init_deepspeed(on_cpu, cfg.train.collective_timeout_s, debug_dir=out_dir / "debug")
    resume_from = check_resume(cfg, info.world_size, MAY_CHANGE, "DeepSpeed's ZeRO partitions cannot be remapped")
    callbacks = RunCallbacks(cfg, root, metrics, pad_id, resume_from, evaluate_more=generation_eval)
    class MyTrainer(ReportSaveErrors, CountBatches, SFTTrainer): ...
    trainer = MyTrainer(..., args=SFTConfig(output_dir=staging, ...), callbacks=callbacks.all)
    trainer.remove_callback(PrinterCallback)  # MetricsLogger prints the log lines
    with TrainerRun(callbacks.preemption, metrics) as run:  # closes everything; a timed-out collective names the rank
        if not run.train(trainer, resume_from, max_steps, callbacks.publisher):  # Preempted (exit 75) after a preemption
            return  # stopped at train.stop_at_step
        export_final(trainer, tokenizer, out_dir)
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from transformers import TrainerCallback

from cookbook import lm
from cookbook.checkpoint import (CHECKSUMS_KEY, FILES_KEY, ResumeGuard, RNGState, _from_rank0, _os_error_in, _reason,
                                 checksums, file_sizes, publish, read_meta, save_error, seed_per_rank)
from cookbook.config import ConfigError
from cookbook.dist import (DistInfo, apply_collective_timeout, barrier, destroy_distributed, get_dist_info, get_logger,
                           init_distributed, record_progress, stall_error)
from cookbook.loop import NonFinitePolicy, Preempted, StopRequest, StopVote
from cookbook.metrics import MetricsLogger

# DeepSpeed keys the Trainer fills from its TrainingArguments when they are "auto"; a number must agree.
DS_TRAINER_KEYS = {"train_micro_batch_size_per_gpu": "train.micro_batch_size",
                   "gradient_accumulation_steps": "train.grad_accum_steps",
                   "train_batch_size": "train.micro_batch_size x train.grad_accum_steps x world size",
                   "gradient_clipping": "optim.max_grad_norm"}
# Trainer.evaluate's timing keys: not model metrics, left out of the eval record.
_EVAL_TIMING = ("runtime", "samples_per_second", "steps_per_second")


# ----------------------------------------------------------------------------- DeepSpeed
def check_deepspeed_config(path: str | Path, *, micro_batch_size: int, grad_accum_steps: int, world_size: int,
                           max_grad_norm: float, export_16bit: bool) -> dict:
    """Read a DeepSpeed JSON (``deepspeed.config``) and check it against the recipe's config.

    Args:
        path: the JSON file.
        micro_batch_size, grad_accum_steps, max_grad_norm: ``train.micro_batch_size``, ``train.grad_accum_steps``
            and ``optim.max_grad_norm``, which the Trainer writes where the JSON says ``"auto"``.
        world_size: processes of the job (GPUs x nodes).
        export_16bit: the run writes the final model (``checkpoint.export_hf``), which under ZeRO-3 needs the
            16-bit weights gathered on save.

    Returns:
        The JSON as a dict.

    Raises:
        ConfigError: the file is missing or not JSON; no ZeRO stage 1-3; fp16 is on (recipes train in bf16 or
            fp32: ``train.mixed_precision``); a batch-size or clipping value is a number that disagrees with the
            config (names the key and the config value it must equal, or "auto"); ZeRO-3 without
            ``stage3_gather_16bit_weights_on_model_save`` while `export_16bit`; ``bf16.check_grad_overflow=false``
            or ``zero_optimization.compute_grad_norm=false``, with which DeepSpeed applies a step whose gradient
            norm is NaN or infinite (`NonFiniteSteps` relies on DeepSpeed discarding it); an ``accelerate launch``
            config naming another DeepSpeed JSON (`check_accelerate_deepspeed_file`).
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: file not found: {path}")
    check_accelerate_deepspeed_file(path)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"deepspeed.config {path}: not valid JSON: {exc}") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 1, 2 or 3, got {stage!r}")
    if ds.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        raise ConfigError(f"{path}: fp16.enabled is set; this recipe trains in bf16 or fp32 (train.mixed_precision): "
                          f"remove the fp16 section")
    expected = {"train_micro_batch_size_per_gpu": micro_batch_size, "gradient_accumulation_steps": grad_accum_steps,
                "train_batch_size": micro_batch_size * grad_accum_steps * world_size, "gradient_clipping": max_grad_norm}
    for key, want in expected.items():
        got = ds.get(key, "auto")
        if got != "auto" and float(got) != float(want):
            raise ConfigError(f"{path}: {key}={got} disagrees with {DS_TRAINER_KEYS[key]} = {want}: set it to \"auto\" "
                              f"(the trainer fills it in) or to {want}")
    if ds.get("bf16", {}).get("check_grad_overflow") is False:
        raise ConfigError(f"{path}: bf16.check_grad_overflow=false makes DeepSpeed apply a step whose gradient norm is "
                          f"NaN or infinite, which train.on_nonfinite (stop or skip) cannot undo: remove it")
    if ds["zero_optimization"].get("compute_grad_norm") is False:
        raise ConfigError(f"{path}: zero_optimization.compute_grad_norm=false leaves DeepSpeed without the gradient "
                          f"norm that it checks before each update (train.on_nonfinite) and that the metrics log: "
                          f"remove it")
    if stage == 3 and export_16bit and not ds["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save"):
        raise ConfigError(f"{path}: ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save=true to "
                          f"write the final model (checkpoint.export_hf=true)")
    return ds


def check_accelerate_deepspeed_file(path: str | Path, env: Mapping[str, str] | None = None) -> None:
    """Refuse an ``accelerate launch`` whose DeepSpeed JSON is not the recipe's ``deepspeed.config``.

    ``accelerate launch --config_file <yaml>`` with ``deepspeed_config.deepspeed_config_file`` exports it to the
    workers as ``ACCELERATE_DEEPSPEED_CONFIG_FILE``; the Trainer trains with its own ``deepspeed`` argument (the
    recipe's ``deepspeed.config``) and would silently ignore a different file. A relative path is looked up from the
    working directory (as accelerate does), then from the folder of `path`.

    Args:
        path: the recipe's DeepSpeed JSON (an existing file).
        env: the environment to read (default ``os.environ``).

    Raises:
        ConfigError: the variable names a file that does not exist, or another file than `path`.
    """
    given = (os.environ if env is None else env).get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not given:
        return
    candidates = [Path(given), Path(path).parent / given] if not Path(given).is_absolute() else [Path(given)]
    found = next((c for c in candidates if c.is_file()), None)
    if found is None:
        raise ConfigError(f"accelerate's deepspeed_config_file {given!r} (ACCELERATE_DEEPSPEED_CONFIG_FILE) is not a "
                          f"file; this recipe trains with deepspeed.config = {path}: name that file there, or leave "
                          f"deepspeed_config_file out")
    if not found.samefile(path):
        raise ConfigError(f"accelerate's deepspeed_config_file {str(found)!r} disagrees with deepspeed.config = {path}: "
                          f"the Trainer would train with {Path(path).name} and ignore it; name the same file in both "
                          f"(e.g. ./launch.sh deepspeed.config={found.name}), or leave deepspeed_config_file out")


def init_deepspeed(on_cpu: bool, timeout_s: float = 1800.0, debug_dir: str | Path | None = None) -> DistInfo:
    """Start the cookbook's process group (`cookbook.init_distributed`) and DeepSpeed's communication over it.

    On a CPU run DeepSpeed would build a shared-memory all-reduce op with a C++ JIT compile (~40 s); gloo's
    collectives do the same job for a CPU test, so that build is skipped. Call before creating
    ``TrainingArguments`` (with ZeRO-3, they make ``from_pretrained`` partition the weights while loading).

    Args:
        on_cpu: the run is on CPU (gloo).
        timeout_s: the collective timeout (``train.collective_timeout_s``), for the default group and DeepSpeed;
            the groups DeepSpeed creates itself get it from `StallReport` when training begins.
        debug_dir: where stack dumps and NCCL's flight recorder write on a timeout (``<output_dir>/debug``).

    Returns:
        This process's `DistInfo`.
    """
    import importlib

    if on_cpu:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    info = init_distributed(timeout_s, debug_dir=debug_dir)
    # DeepSpeed's comm layer over the existing group
    deepspeed.init_distributed(dist_backend=info.backend, timeout=datetime.timedelta(seconds=timeout_s))
    return info


# ----------------------------------------------------------------------------- metrics
class MetricsCallback(TrainerCallback):
    """Feeds a `MetricsLogger` from the Trainer's events.

    - ``on_train_begin``: starts the first window at the Trainer's step (after a resume, too).
    - ``on_log`` with a training ``loss``: one train record (``MetricsLogger.log_step``: the window's loss,
      ``learning_rate``, ``grad_norm``, and the rows and tokens counted by `CountBatches`).
    - ``on_evaluate``: the ``eval_*`` values (without the prefix and the Trainer's timing keys), then
      ``evaluate_more(model)``'s, as one eval record (``MetricsLogger.log_eval``); kept in `last_eval`.
    - An evaluation inside the step loop leaves the random streams as they were at the step's end (they are
      restored after ``on_evaluate``): with dropout on, ``train.eval_every`` does not change the training run.
    - Evaluations and checkpoint saves inside the step loop are left out of the step time, throughput and ETA
      (``MetricsLogger.paused``): when a step ends with ``should_evaluate`` or ``should_save`` set, the window
      pauses (after the step's own log record) until the last of them is done. Put this callback after
      those that set these flags in ``on_step_end`` (`StopAtStep`) and after those whose ``on_save`` or
      ``on_evaluate`` take time (`PublishCheckpoints`).

    Args:
        metrics: the run's `MetricsLogger`.
        pad_id: the padding token id, to count real tokens (`cookbook.lm.count_tokens`).
        evaluate_more: ``model -> {name: value}`` run with every evaluation on every rank (collective), its
            values reduced over ranks already; ``None``: the Trainer's values alone.
        log_extra: more numbers for each train record (``NonFiniteSteps.log_extra``: ``skipped_steps``), the same
            on every rank.
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
    """Trainer mixin, first in the bases (``class MyTrainer(CountBatches, SFTTrainer)``): counts each
    optimizer step's micro-batches (rows, real tokens, data-loading wait) into the trainer's `MetricsCallback`.

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
    """Trainer mixin (``class MyTrainer(WholeEpochs, CountBatches, SFTTrainer)``): an epoch reads every row at
    most once, in full global batches.

    The Trainer's own sampler gives each rank its share of micro-batches and accelerate pads the ranks to equal
    counts by repeating rows from the epoch's start; with ``gradient_accumulation_steps`` the epoch's last
    optimizer step takes fewer micro-batches. The recipes count ``epochs x (rows // global batch)`` steps, so a
    run of ``train.epochs`` passes ran a fraction of the passes, some rows twice. Here the sampler
    (`FullBatchesSampler`) yields, per epoch, ``rows // global batch`` full global batches from a fresh
    permutation (seeded ``args.seed + epoch``, so a resume continues the same order); the remainder (fewer than
    one global batch, other rows each epoch) is dropped and said once in the log (`epoch_line`).
    """

    def _get_train_sampler(self, train_dataset=None):
        dataset = self.train_dataset if train_dataset is None else train_dataset
        a = self.args
        return FullBatchesSampler(len(dataset), a.per_device_train_batch_size * a.gradient_accumulation_steps
                                  * a.world_size, a.seed, epoch_of=lambda: int(self.state.epoch or 0))


class FullBatchesSampler(torch.utils.data.Sampler):
    """Row indices of one epoch: ``torch.randperm(num_rows)`` seeded ``seed + epoch_of()``, cut to
    ``num_rows // global_batch`` whole global batches. Split round-robin into micro-batches across ranks
    (accelerate's ``BatchSamplerShard``), every rank gets the same number of micro-batches, a multiple of the
    accumulation steps, and no row comes twice in an epoch.

    `epoch_of` reads the epoch from the Trainer's state (``int(state.epoch)``: after a resume too, where the
    loader that skips the epoch's first batches does not pass ``set_epoch`` down to its sampler).

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


# ----------------------------------------------------------------------------- checkpoints
def published_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoints ``checkpoint-<step>`` (with ``meta.json``) under `root`, oldest first: the resume
    guard's own discovery (`cookbook.checkpoint.ResumeGuard`), so that what is pruned is what a resume would find."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint the Trainer saves, atomically.

    The Trainer writes ``checkpoint-<step>`` into its ``output_dir`` (the staging folder: DeepSpeed's
    partitions of every rank, scheduler, RNG, data position). Once every rank is done, rank 0 adds
    ``meta.json`` (``step``, ``world_size``, ``time``, ``config``, ``files``: every file of the checkpoint
    with its size, `cookbook.checkpoint.file_sizes`, so that the resume guard finds a truncated or missing shard, and
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
    from cookbook.config import to_dict

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


class SeedPerRank(TrainerCallback):
    """Each rank its own dropout masks: when training begins (after the model and its LoRA layers are built),
    the random streams are seeded ``args.seed + args.process_index`` (`cookbook.checkpoint.seed_per_rank`). The
    Trainer seeds every rank with ``args.seed`` alone, so all ranks drew the same masks. A resumed run then
    restores each rank's saved streams from the checkpoint, as before."""

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
    """Preemption of a Trainer run, as `cookbook.loop.TrainLoop` does it: SIGTERM (a scheduler's, or torchrun's
    passing on the launcher's) or SIGUSR1 (Slurm's warning before a job's end) asks to stop
    (`cookbook.loop.StopRequest`, listening from ``on_train_begin`` to ``on_train_end`` or `close`); at each step
    end the ranks vote on it (`cookbook.loop.StopVote`: an asynchronous all-reduce, decided one step later), so
    every rank finishes the same step, the Trainer saves a checkpoint there (unless ``save_strategy="no"``:
    ``checkpoint.every_steps=-1``) and training stops. After ``trainer.train()`` returns, `raise_if_stopped` logs
    the stop and raises `cookbook.loop.Preempted` (exit status 75); the same command resumes with no step lost.
    A request at the last step is too late: the run finishes as planned.

    Put it before `MetricsCallback` in the callbacks (the save it asks for is left out of the step time).
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
        """After ``trainer.train()``: if a preemption stopped it before ``state.max_steps``, log the stop with
        `checkpoint` (the one published at that step) and raise `cookbook.loop.Preempted` (75).

        Raises:
            Preempted: the run stopped on a preemption signal."""
        if self.request.requested and state.global_step < state.max_steps:
            raise self.request.preempted(state.global_step, state.max_steps, checkpoint)


class NonFiniteSteps(TrainerCallback):
    """``train.on_nonfinite`` for the Trainer, with the torchrun recipes' policy (`cookbook.loop.NonFinitePolicy`:
    stop, or skip at most ``train.max_consecutive_skips`` in a row), under DeepSpeed or a plain Trainer (DDP, FSDP2).

    Under DeepSpeed, its ZeRO optimizers (stages 1-3, bf16 or fp32; DeepSpeed 0.19.8, as ``requirements/base.txt``
    pins) reduce the gradient norm over the ranks before each update and discard a step whose norm is NaN or
    infinite: the gradients are zeroed, no weight or optimizer state changes, the Trainer's LR scheduler does not
    step (``optimizer.step_was_skipped``), and the Trainer logs the norm as ``inf``. That update happens inside the
    backward of the step's last micro-batch, before any callback runs, so this callback reads DeepSpeed's decision
    in ``on_optimizer_step``, on every rank alike. `check_deepspeed_config` refuses the DeepSpeed settings under
    which DeepSpeed would apply such a step (``bf16.check_grad_overflow=false``, ``compute_grad_norm=false``).

    Without DeepSpeed the decision is made here, in ``on_pre_optimizer_step``: the Trainer (transformers 5.24,
    ``_inner_training_loop``) calls it after the gradients are reduced (DDP) and clipped, right before
    ``optimizer.step()``. Clipping by a NaN or infinite total norm leaves NaN in the gradients (a non-finite loss
    gives such gradients), so the check looks at the clipped gradients: one flag, "some trainable gradient of this
    rank has a NaN or infinite norm", is
    all-reduced (MAX) so that every rank decides alike (under FSDP2 each rank checks its own shards). A step found
    non-finite has every trainable gradient set to ``None``, so ``optimizer.step()`` leaves those parameters and
    their optimizer state as they were (torch's optimizers pass over a parameter without a gradient). The Trainer
    still steps its LR scheduler (it follows the step number). Not caught: finite gradients whose total norm alone
    overflows float32, which clipping turns into zeros (as plain ``clip_grad_norm_`` does). The check costs one
    scalar all-reduce and one host sync per optimizer step.

    Either way:

    - ``stop``: `cookbook.loop.NonFiniteError` (exit status 4) naming the step and the newest published
      checkpoint, which is from before it;
    - ``skip``: the step is logged and counted (``skipped_steps`` in the train records, through
      `MetricsCallback`'s ``log_extra``). The Trainer counts batches, so a skipped step keeps its number: the run
      ends after ``max_steps`` batches, ``skipped_steps`` of them not applied (the torchrun recipes give the
      number to the next batch instead).

    No checkpoint holds a discarded step's values. The count is kept in each published checkpoint's ``meta.json``
    (``skipped_steps``: pass `meta` to `PublishCheckpoints`'s ``more_meta``) and a resumed run continues it
    (`resume_from`).

    Args:
        policy: ``NonFinitePolicy.from_config(cfg.train)``.
        root: the published checkpoints' folder, for the stop message.
        resume_from: the checkpoint this run resumes from (its ``meta.json``'s ``skipped_steps``, 0 if absent),
            or ``None`` for a fresh start.

    Raises:
        NonFiniteError: see above.
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
        if nonfinite_on_some_rank(grads, get_dist_info().device):
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


def nonfinite_on_some_rank(grads: list[torch.Tensor], device: torch.device) -> bool:
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
    """A stalled rank, named: when training begins, every process group (DeepSpeed's copy of the world group, on
    which ZeRO-1/2 reduce gradients and their norm, included) gets the collective timeout of
    ``train.collective_timeout_s`` (`cookbook.dist.apply_collective_timeout`;
    the default group has it from `init_deepspeed`), and at each step end this rank's progress is recorded in the
    group's store (`cookbook.dist.record_progress`). A collective that then waits past the timeout raises on the
    rank that waited (gloo), and `cookbook.run_main` prints one line naming the rank that is behind (exit status 3).
    """

    def on_train_begin(self, args, state, control, **kwargs):
        apply_collective_timeout()
        record_progress(state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        record_progress(state.global_step)


# ----------------------------------------------------------------------------- the run
class RunCallbacks:
    """The callbacks of a Trainer recipe's run, wired to each other: `Preemption`, `NonFiniteSteps` (its skip count
    written into each checkpoint's ``meta.json`` by `PublishCheckpoints` and continued from `resume_from`),
    `MetricsCallback` (the skip count in its records). `all` lists them in the order the Trainer must call them:
    `StopAtStep` and `Preemption` set ``should_save`` before `MetricsCallback` sees the step end, and
    `MetricsCallback`, last, pauses its window over the evaluation and the save (publishing included).

    Args:
        cfg: the recipe config (``train.stop_at_step``, ``train.on_nonfinite``, ``train.max_consecutive_skips``,
            ``checkpoint.keep_last``; all of it goes into ``meta.json`` for the resume check).
        root: the published checkpoints' folder (``output_dir/checkpoints``).
        metrics, pad_id, evaluate_more: as in `MetricsCallback`.
        resume_from: the checkpoint this run resumes from, or None.
    """

    def __init__(self, cfg: Any, root: str | Path, metrics: MetricsLogger, pad_id: int,
                 resume_from: str | Path | None = None,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None):
        from cookbook.config import to_dict

        self.preemption = Preemption()
        self.nonfinite = NonFiniteSteps(NonFinitePolicy.from_config(cfg.train), root, resume_from)
        self.publisher = PublishCheckpoints(root, cfg.checkpoint.keep_last, to_dict(cfg), more_meta=self.nonfinite.meta)
        self.metrics = MetricsCallback(metrics, pad_id, evaluate_more=evaluate_more, log_extra=self.nonfinite.log_extra)
        self.all = [SeedPerRank(), StopAtStep(cfg.train.stop_at_step), self.preemption, self.nonfinite, StallReport(), self.publisher,
                    self.metrics]


class TrainerRun:
    """How a Trainer recipe runs ``trainer.train()`` and ends, whatever happens (the ``try`` of `TrainLoop.run`):

        with TrainerRun(preemption, metrics) as run:
            if not run.train(trainer, resume_from, max_steps, publisher):
                return  # stopped at train.stop_at_step, with a checkpoint
            ...evaluate, export, log the outputs...

    `train` resumes from `resume_from`, raises `cookbook.loop.Preempted` (exit status 75) after a preemption and
    logs where to continue after ``train.stop_at_step``. Leaving the block stops listening for signals
    (`Preemption.close`), closes `metrics` (failed, stopped early or finished) and the process group; a collective
    that timed out is raised as the one line naming the rank that is behind (`cookbook.dist.stall_error`).
    """

    def __init__(self, preemption: Preemption, metrics: MetricsLogger):
        self.preemption, self.metrics = preemption, metrics
        self.stopped = False

    def train(self, trainer, resume_from: Path | None, max_steps: int, publisher: PublishCheckpoints) -> bool:
        """``trainer.train()``; True when it reached `max_steps`, False when ``train.stop_at_step`` stopped it.

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


# ----------------------------------------------------------------------------- export
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
