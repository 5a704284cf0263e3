"""``train.py --show-examples N`` in every SFT recipe, in this process (one process, no worker): N rendered rows with
the labelled tokens between [[ and ]], and per source the counts of what was kept, truncated and dropped, per field."""

import contextlib
import io
import json
import os

import pytest
from conftest import ROOT, load_recipe

ROWS = [  # a reasoning turn (dropped with data.reasoning=drop, counted), a key no recipe uses, an answer cut by max_length
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 2?"},
            {"role": "assistant", "content": "It is 4.", "reasoning_content": "2 + 2 = 4.", "weight": 1},
        ]
    },
    {"messages": [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "Hi there."}]},
    {"messages": [{"role": "user", "content": "Count."}, {"role": "assistant", "content": " ".join(["one"] * 400)}]},
]


def show(recipe: str, *overrides: str, config: str = "tiny.yaml") -> str:
    out = io.StringIO()
    env = {"COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with contextlib.redirect_stdout(out):
            load_recipe(recipe).main(
                ["--config", str(ROOT / "recipes" / recipe / config), "--show-examples", "2", *overrides]
            )
    finally:
        for k, v in saved.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
    return out.getvalue()


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("show") / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


@pytest.mark.parametrize(
    "recipe, end",
    [
        ("qwen-fsdp2-sft", "<|im_end|>"),
        ("qwen-ray-sft", "<|im_end|>"),
        ("moe-lora-fsdp2-ep", "<|im_end|>"),
        ("unsloth-lora-ddp", "<|im_end|>\n"),
    ],
)
def test_chat_recipes_show_rows_with_the_labels_marked_and_count_every_field(recipe, end, rows_file):
    out = show(recipe, f"data.train_files=[{rows_file}]", "data.max_length=100", "data.reasoning=drop")
    assert out.startswith("labelled tokens (in the loss) are between [[ and ]]\n")
    assert "--- rows.jsonl example 1 of 3 (line 1, " in out and "--- rows.jsonl example 2 of 3 (line 2, " in out
    assert "example 3 of 3" not in out  # N=2
    assert f"[[It is 4.{end}]]" in out and f"[[Hi there.{end}]]" in out
    assert "  examples        3 kept, 1 truncated to max_length=100, 0 dropped" in out
    assert "2 + 2 = 4." not in out
    assert "  reasoning       0 turns dropped, 0 left out by the chat template, 1 dropped (data.reasoning=drop)" in out
    assert "  keys not used   messages[].weight: 1" in out
    if recipe != "unsloth-lora-ddp":  # 1 of the 3 rows is held out for evaluation, after the rows shown
        assert out.rstrip().endswith(
            "data.eval_fraction=0.05: a seeded share of each file's examples is held out for "
            "evaluation; the examples above are before that split"
        )


def test_gpt_oss_receipts_and_vision_recipes_show_their_rows():
    out = show("gpt-oss-lora-trl")
    assert "--- chat.jsonl example 2 of 28 (line 2, " in out
    assert "<|start|>assistant<|channel|>final<|message|>[[" in out and "<|return|>]]" in out
    assert "  reasoning       22 turns in context (no loss), 6 left out by the chat template\n" in out
    out = show("qwen-zero3-receipts")
    assert "--- receipts.jsonl example 1 of 40 (line 1, 184 tokens, 61 labelled)" in out
    assert "  examples        40 kept, 0 dropped" in out
    assert out.rstrip().endswith(
        "data.eval_fraction=0.2: a seeded share of each file's examples is held out for "
        "evaluation; the examples above are before that split"
    )
    out = show("moe-lora-fsdp2-ep", config="tiny-vl.yaml")
    assert "<|vision_start|><|image_pad|> x 4<|vision_end|>What insect is in the picture?" in out
    assert (
        "[[An ant.<|im_end|>]]" in out and "  examples        20 kept, 4 truncated to max_length=64, 0 dropped" in out
    )
