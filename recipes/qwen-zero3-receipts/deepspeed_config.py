"""The DeepSpeed JSON of this recipe, checked before any worker starts against the recipe's config and an
``accelerate launch`` config (the Trainer would fail on it, or ignore it, once the workers run)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Mapping

from cookbook.config import ConfigError
from cookbook.errors import not_a_file


def check_deepspeed_config(
    path: str | Path,
    *,
    micro_batch_size: int,
    grad_accum_steps: int,
    world_size: int,
    max_grad_norm: float,
    export_16bit: bool,
) -> dict:
    """The DeepSpeed JSON at `path` as a dict. ConfigError (naming the key): missing or not JSON, no ZeRO stage 1-3,
    fp16, a number other than the Trainer's for ``"auto"``, norm checks off, ZeRO-3 export without 16-bit gathering."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"deepspeed.config: {not_a_file(path)}")
    check_accelerate_deepspeed_file(path)
    try:
        ds = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ConfigError(f"deepspeed.config {path}: not valid JSON: {exc}") from None
    stage = ds.get("zero_optimization", {}).get("stage")
    if stage not in (1, 2, 3):
        raise ConfigError(f"{path}: zero_optimization.stage must be 1, 2 or 3, got {stage!r}")
    if ds.get("fp16", {}).get("enabled") not in (None, False, "auto"):
        raise ConfigError(
            f"{path}: fp16.enabled is set; this recipe trains in bf16 or fp32 (train.mixed_precision): "
            f"remove the fp16 section"
        )
    expected = {
        "train_micro_batch_size_per_gpu": (micro_batch_size, "train.micro_batch_size"),  # what the Trainer
        "gradient_accumulation_steps": (grad_accum_steps, "train.grad_accum_steps"),  # fills in for "auto"
        "train_batch_size": (
            micro_batch_size * grad_accum_steps * world_size,
            "train.micro_batch_size x train.grad_accum_steps x world size",
        ),
        "gradient_clipping": (max_grad_norm, "optim.max_grad_norm"),
    }
    for key, (want, name) in expected.items():
        got = ds.get(key, "auto")
        if got != "auto" and float(got) != float(want):
            raise ConfigError(
                f'{path}: {key}={got} disagrees with {name} = {want}: set it to "auto" '
                f"(the trainer fills it in) or to {want}"
            )
    if ds.get("bf16", {}).get("check_grad_overflow") is False:
        raise ConfigError(
            f"{path}: bf16.check_grad_overflow=false makes DeepSpeed apply a step whose gradient norm is "
            f"NaN or infinite, which train.on_nonfinite (stop or skip) cannot undo: remove it"
        )
    if ds["zero_optimization"].get("compute_grad_norm") is False:
        raise ConfigError(
            f"{path}: zero_optimization.compute_grad_norm=false leaves DeepSpeed without the gradient "
            f"norm that it checks before each update (train.on_nonfinite) and that the metrics log: "
            f"remove it"
        )
    if stage == 3 and export_16bit and not ds["zero_optimization"].get("stage3_gather_16bit_weights_on_model_save"):
        raise ConfigError(
            f"{path}: ZeRO-3 needs zero_optimization.stage3_gather_16bit_weights_on_model_save=true to "
            f"write the final model (checkpoint.export_hf=true)"
        )
    return ds


def check_accelerate_deepspeed_file(path: str | Path, env: Mapping[str, str] | None = None) -> None:
    """ConfigError when ``ACCELERATE_DEEPSPEED_CONFIG_FILE`` (in `env`; relative to the working directory or to
    `path`'s folder) names no file or another file than `path` (the Trainer would ignore it)."""
    given = (os.environ if env is None else env).get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not given:
        return
    found = next((c for c in (Path(given), Path(path).parent / given) if c.is_file()), None)  # absolute: both alike
    if found is None:
        raise ConfigError(
            f"accelerate's deepspeed_config_file {given!r} (ACCELERATE_DEEPSPEED_CONFIG_FILE) is not a "
            f"file; this recipe trains with deepspeed.config = {path}: name that file there, or leave "
            f"deepspeed_config_file out"
        )
    if not found.samefile(path):
        raise ConfigError(
            f"accelerate's deepspeed_config_file {str(found)!r} disagrees with deepspeed.config = {path}: "
            f"the Trainer would train with {Path(path).name} and ignore it; name the same file in both "
            f"(e.g. ./launch.sh deepspeed.config={found.name}), or leave deepspeed_config_file out"
        )
