"""The bookkeeping of a recipe built on the Hugging Face ``Trainer`` (or TRL's ``SFTTrainer``) with DeepSpeed.

The Trainer runs the step loop; these pieces connect it to the rest of the cookbook, unchanged for any model:

- `MetricsCallback` feeds `cookbook.metrics.MetricsLogger`: one window per ``logging_steps`` (loss,
  learning rate, gradient norm, step time, rows and real tokens per second, MFU), paused while the
  Trainer evaluates or saves a checkpoint; each evaluation's ``eval_*`` values, plus a recipe's own
  (``evaluate_more``, e.g. generation scored against references), as one eval record.
- `CountBatches`, a Trainer mixin, counts each micro-batch's rows, real tokens and data-loading wait into it.
- `PublishCheckpoints` turns the Trainer's ``checkpoint-<step>`` folders into published checkpoints: written
  in a staging folder (the Trainer's ``output_dir``), completed with ``meta.json`` (step, world size, config),
  renamed into the checkpoints folder once every rank is done (atomic), the newest ``keep_last`` kept.
- `StopAtStep` ends training with a checkpoint after ``train.stop_at_step``.
- `check_deepspeed_config` refuses, before any worker starts, a DeepSpeed JSON that disagrees with the
  recipe's config; `init_deepspeed` starts DeepSpeed's communication over the cookbook's process group.
- `export_final` writes the consolidated model (and a LoRA adapter) in Hugging Face format.

Use::

    metrics_cb = MetricsCallback(metrics, pad_id, evaluate_more=generation_eval)
    class MyTrainer(CountBatches, SFTTrainer): ...
    trainer = MyTrainer(..., args=SFTConfig(output_dir=staging, ...),
                        callbacks=[StopAtStep(cfg.train.stop_at_step),
                                   PublishCheckpoints(root, cfg.checkpoint.keep_last, to_dict(cfg)), metrics_cb])
    trainer.remove_callback(PrinterCallback)  # MetricsLogger prints the log lines
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any, Callable, Mapping

import torch
from transformers import TrainerCallback

from cookbook import lm
from cookbook.checkpoint import ResumeGuard, publish
from cookbook.config import ConfigError
from cookbook.dist import DistInfo, barrier, get_logger
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
            ``stage3_gather_16bit_weights_on_model_save`` while `export_16bit`.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: file not found: {path}")
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
    if stage == 3 and export_16bit and not ds["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save"):
        raise ConfigError(f"{path}: ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save=true to "
                          f"write the final model (checkpoint.export_hf=true)")
    return ds


def init_deepspeed(on_cpu: bool) -> DistInfo:
    """Start the cookbook's process group (`cookbook.init_distributed`) and DeepSpeed's communication over it.

    On a CPU run DeepSpeed would build a shared-memory all-reduce op with a C++ JIT compile (~40 s); gloo's
    collectives do the same job for a CPU test, so that build is skipped. Call before creating
    ``TrainingArguments`` (with ZeRO-3, they make ``from_pretrained`` partition the weights while loading).

    Returns:
        This process's `DistInfo`.
    """
    import importlib

    from cookbook.dist import init_distributed

    if on_cpu:
        importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    import deepspeed

    info = init_distributed()
    deepspeed.init_distributed(dist_backend=info.backend)  # DeepSpeed's comm layer over the existing group
    return info


# ----------------------------------------------------------------------------- metrics
class MetricsCallback(TrainerCallback):
    """Feeds a `MetricsLogger` from the Trainer's events.

    - ``on_train_begin``: starts the first window at the Trainer's step (after a resume, too).
    - ``on_log`` with a training ``loss``: one train record (``MetricsLogger.log_step``: the window's loss,
      ``learning_rate``, ``grad_norm``, and the rows and tokens counted by `CountBatches`).
    - ``on_evaluate``: the ``eval_*`` values (without the prefix and the Trainer's timing keys), then
      ``evaluate_more(model)``'s, as one eval record (``MetricsLogger.log_eval``); kept in `last_eval`.
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
    """

    def __init__(self, metrics: MetricsLogger, pad_id: int,
                 evaluate_more: Callable[[torch.nn.Module], Mapping[str, float]] | None = None):
        self.metrics = metrics
        self.pad_id = pad_id
        self.evaluate_more = evaluate_more
        self.last_eval: dict[str, float] = {}  # the last evaluation's values, as logged
        self._pause = None  # the open MetricsLogger.paused() context, between a step's end and its eval / save

    def count(self, batches: list[dict[str, torch.Tensor]], data_wait_s: float) -> None:
        """Count the micro-batches of one optimizer step: rows, real tokens, and `data_wait_s` (seconds spent
        fetching all of them, shared out equally)."""
        wait = data_wait_s / max(len(batches), 1)
        for b in batches:
            self.metrics.add(samples=b["input_ids"].shape[0], tokens=lm.count_tokens(b, self.pad_id), data_wait_s=wait)

    def _pause_if(self, control) -> None:
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
            self.metrics.log_step(state.global_step, logs["loss"], logs.get("learning_rate", 0.0), logs.get("grad_norm"))
            self._pause_if(control)

    def on_evaluate(self, args, state, control, metrics=None, model=None, **kwargs):
        values = {k.removeprefix("eval_"): v for k, v in (metrics or {}).items() if k.startswith("eval_")
                  and k.removeprefix("eval_") not in _EVAL_TIMING and isinstance(v, (int, float))}
        if self.evaluate_more is not None:
            values.update(self.evaluate_more(model))
        self.metrics.log_eval(state.global_step, values)
        self.last_eval = values
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


# ----------------------------------------------------------------------------- checkpoints
def published_checkpoints(root: str | Path) -> list[Path]:
    """Published checkpoints ``checkpoint-<step>`` (with ``meta.json``) under `root`, oldest first: the resume
    guard's own discovery (`cookbook.checkpoint.ResumeGuard`), so that what is pruned is what a resume would find."""
    return ResumeGuard(root, folder="checkpoint-<n>", files=()).complete_checkpoints()


class PublishCheckpoints(TrainerCallback):
    """Publishes each checkpoint the Trainer saves, atomically.

    The Trainer writes ``checkpoint-<step>`` into its ``output_dir`` (the staging folder: DeepSpeed's
    partitions of every rank, scheduler, RNG, data position). Once every rank is done, rank 0 adds
    ``meta.json`` (``step``, ``world_size``, ``time``, ``config``) and renames the folder to
    ``<root>/checkpoint-<step>`` (atomic on one file system; `published_checkpoints` lists only those), then
    deletes all but the newest `keep_last` (0: keeps all). Set ``save_total_limit=None`` in the arguments: the
    staging folder is emptied by the renames.

    Args:
        root: the published checkpoints' folder (``output_dir/checkpoints``), on the Trainer's file system.
        keep_last: published checkpoints to keep, >= 0.
        config: the run's config (a dict), stored in ``meta.json`` for the resume check.
    """

    def __init__(self, root: str | Path, keep_last: int, config: Mapping[str, Any]):
        self.root, self.keep_last, self.config = Path(root), keep_last, dict(config)

    def on_save(self, args, state, control, **kwargs):
        barrier()  # every rank has written its ZeRO partitions and RNG state
        if state.is_world_process_zero:
            self.root.mkdir(parents=True, exist_ok=True)
            src = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            meta = {"step": state.global_step, "world_size": args.world_size, "time": time.time(),
                    "config": self.config}
            (src / "meta.json").write_text(json.dumps(meta, indent=2))
            publish(src, self.root / src.name)
            for old in published_checkpoints(self.root)[: -self.keep_last] if self.keep_last else []:
                shutil.rmtree(old, ignore_errors=True)
            get_logger().info(f"checkpoint published: {self.root / src.name}")
        barrier()


class StopAtStep(TrainerCallback):
    """Ends training after step `stop_at_step` (``train.stop_at_step``; <= 0: never) with a checkpoint, when
    that step is before the last."""

    def __init__(self, stop_at_step: int):
        self.stop_at_step = stop_at_step

    def on_step_end(self, args, state, control, **kwargs):
        if 0 < self.stop_at_step <= state.global_step < state.max_steps:
            control.should_save = True
            control.should_training_stop = True


# ----------------------------------------------------------------------------- export
def export_final(trainer, tokenizer, out_dir: str | Path) -> Path | None:
    """Write the consolidated model and the tokenizer to ``out_dir/final`` (Hugging Face format), atomically.

    Collective. The full state dict comes from the Trainer's accelerator (under ZeRO-3 DeepSpeed gathers every
    partition to rank 0, in the training dtype: bf16 on GPU, fp32 on CPU; the JSON needs
    ``stage3_gather_16bit_weights_on_model_save``). For a PEFT (LoRA) model the adapter goes to
    ``out_dir/adapter`` and ``final`` holds the base model with the adapter merged in. ``config.json`` records
    the dtype (so ``from_pretrained(dtype="auto")`` keeps it) and ``use_cache: true``.

    Returns:
        ``out_dir/final`` on rank 0, ``None`` elsewhere.
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
            base = unwrapped.get_base_model()
            # The class's own constructor, not from_config: under ZeRO-3, from_config partitions the new model
            # across ranks (a collective that rank 0 alone would wait on forever).
            with torch.device("meta"):
                merged = get_peft_model(type(base)(base.config), unwrapped.peft_config["default"])
            merged.load_state_dict(state, assign=True)
            unwrapped = merged.merge_and_unload()
            state = {k: v.contiguous() for k, v in unwrapped.state_dict().items()}
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
