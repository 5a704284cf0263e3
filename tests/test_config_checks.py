"""Every recipe refuses an out-of-range config value in its --check (launch.sh's first step), naming the
key, the rule and the value, before any data is read or any worker starts."""

import pytest

from conftest import ROOT, check
from cookbook.config import ConfigError


@pytest.mark.parametrize(
    "recipe, override, message",
    [
        ("modernbert-ddp", "train.micro_batch_size=0", "train.micro_batch_size must be >= 1, got 0"),
        ("modernbert-ddp", "data.eval_fraction=1.0", "data.eval_fraction must be in (0, 1), got 1.0"),
        (
            "qwen-fsdp2-sft",
            "train.mixed_precision=fp8",
            "train.mixed_precision must be one of 'bf16', 'fp32', got 'fp8'",
        ),
        ("qwen-fsdp2-sft", "checkpoint.every_steps=-2", "checkpoint.every_steps must be >= -1, got -2 (-1: never)"),
        ("qwen-zero3-receipts", "lora.r=0", "lora.r must be >= 1, got 0"),
        ("moe-lora-fsdp2-ep", "lora.dropout=1.0", "lora.dropout must be in [0, 1), got 1.0"),
        (
            "moe-lora-fsdp2-ep:tiny-vl.yaml",
            "train.mixed_precision=fp16",
            "train.mixed_precision must be one of 'bf16', 'fp32', got 'fp16'",
        ),
        ("torchrec-dlrm", "optim.sparse=adam", "optim.sparse must be one of 'rowwise_adagrad', 'sgd', got 'adam'"),
        (
            "resnet50-ray-ddp",
            "model.backend=keras",
            "model.backend must be one of 'auto', 'torchvision', 'transformers', got 'keras'",
        ),
        ("qwen-ray-sft", "optim.scheduler=step", "optim.scheduler must be one of 'linear', "),
        # values torch or the scheduler would take, or refuse only in the workers (a traceback, then restarts)
        ("modernbert-ddp", "data.num_workers=-1", "data.num_workers must be >= 0, got -1 (0: load in the training"),
        ("modernbert-ddp", "optim.lr=-1e-3", "optim.lr must be in (0, inf), got -0.001"),
        ("modernbert-ddp", "optim.betas=[0.9,1.5]", "optim.betas must be two numbers in [0, 1), got [0.9, 1.5]"),
        ("qwen-fsdp2-sft", "optim.warmup_ratio=1.5", "optim.warmup_ratio must be in [0, 1], got 1.5"),
        ("qwen-fsdp2-sft", "optim.warmup_ratio=-0.1", "optim.warmup_ratio must be in [0, 1], got -0.1"),
        ("modernbert-ddp", "train.profile_step=-2", "train.profile_step must be >= 0, got -2 (0: none)"),
        ("torchrec-dlrm", "train.max_steps=-5", "train.max_steps must be >= -1, got -5 (-1: train.epochs decides)"),
        ("qwen-zero3-receipts", "optim.eps=-1e-8", "optim.eps must be >= 0, got -1e-08"),
        ("torchrec-dlrm", "optim.dense_lr=0", "optim.dense_lr must be in (0, inf), got 0.0"),
        ("resnet50-ray-ddp", "optim.lr=-0.1", "optim.lr must be in (0, inf), got -0.1"),
        ("two-tower-ray", "optim.lr=0", "optim.lr must be in (0, inf), got 0.0"),
        (
            "two-tower-ray",
            "train.micro_batch_size=1",
            "train.micro_batch_size must be >= 2, got 1 (the other items of the batch are the negatives)",
        ),
    ],
)
def test_out_of_range_values_are_refused_by_the_check(tmp_path, recipe, override, message):
    recipe, _, config = recipe.partition(":")  # recipe[:config file], default tiny.yaml
    with pytest.raises(ConfigError) as err:
        check(recipe, f"output_dir={tmp_path / 'out'}", override, config=config or "tiny.yaml")
    assert str(err.value).startswith(message)
    assert not (tmp_path / "out").exists()


def test_the_checks_scheduler_names_are_transformers_schedulers():
    from transformers.trainer_utils import SchedulerType

    from cookbook.config import SCHEDULERS

    assert list(SCHEDULERS) == [t.value for t in SchedulerType]


def test_no_shipped_config_reads_a_file_outside_its_recipe_folder():
    """A recipe folder copied elsewhere runs its configs: no value points up and out of the folder (``../``)."""
    import yaml

    def strings(node):
        if isinstance(node, dict):
            return [s for v in node.values() for s in strings(v)]
        if isinstance(node, list):
            return [s for v in node for s in strings(v)]
        return [node] if isinstance(node, str) else []

    outside = [
        f"{path.relative_to(ROOT)}: {value}"
        for path in sorted((ROOT / "recipes").glob("*/*.yaml"))
        for value in strings(yaml.safe_load(path.read_text()))
        if value.startswith("../") or "/../" in value
    ]
    assert len(list((ROOT / "recipes").glob("*/tiny.yaml"))) >= 10 and outside == []
