"""Every recipe refuses an out-of-range config value in its --check (launch.sh's first step), naming the
key, the rule and the value, before any data is read or any worker starts."""

import pytest

from conftest import check
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
