"""The MoE recipe's lazy_load.py (shard-by-shard safetensors loading into a meta-device model) and image_text.py
(image + text rows) in one process, on the tiny models of the MoE recipes."""

import json

import pytest
import torch
from conftest import ROOT, recipe_modules

from cookbook.config import ConfigError
from cookbook.sft import SFTDataError

lazy_load, image_text = recipe_modules("moe-lora-fsdp2-ep", "lazy_load", "image_text")
load_base_lazily = lazy_load.load_base_lazily
collate_vl, to_vl_messages = image_text.collate_vl, image_text.to_vl_messages

QWEN3_MOE = ROOT / "recipes" / "moe-lora-fsdp2-ep" / "tiny" / "qwen3-moe"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A tiny Qwen3-MoE (4 experts) with random weights, saved in several safetensors files (per-expert tensors)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QWEN3_MOE))
    path = tmp_path_factory.mktemp("qwen3-moe")
    model.save_pretrained(path, max_shard_size="100KB")
    return model, path


def meta_model():
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(QWEN3_MOE))


def test_lazy_load_reads_the_dense_weights_and_a_slice_of_the_experts(saved):
    full, path = saved
    assert len(list(path.glob("*.safetensors"))) > 3
    model = meta_model()
    experts = model.model.layers[0].mlp.experts
    experts.checkpoint_offset = 2  # this rank keeps experts 2 and 3 of 4
    for name in ("gate_up_proj", "down_proj"):
        p = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(torch.empty(2, *p.shape[1:], device="meta")))
    elements = load_base_lazily(model, str(path))
    want = dict(full.named_parameters())
    for name, p in model.named_parameters():
        assert not p.is_meta, name
        expected = want[name].detach()
        if name.startswith("model.layers.0.mlp.experts."):
            expected = expected[2:4]
        torch.testing.assert_close(p.detach(), expected, rtol=0, atol=0, msg=name)
    assert elements == sum(p.numel() for p in model.parameters())


def test_lazy_load_names_a_missing_tensor_and_the_way_out(saved, tmp_path):
    from safetensors.torch import load_file, save_file

    _, path = saved
    for f in path.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    target = next(f for f in tmp_path.glob("*.safetensors") if "model.norm.weight" in load_file(f))
    save_file(
        {k: v for k, v in load_file(target).items() if k != "model.norm.weight"}, target, metadata={"format": "pt"}
    )
    with pytest.raises(
        ConfigError, match=r"model\.lazy_load: no tensor for model\.norm\.weight in .*; set model\.lazy_load=false"
    ):
        load_base_lazily(meta_model(), str(tmp_path))


def test_vl_rows_become_messages_with_image_parts():
    row = {
        "image": "a.jpg",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What insect?"},
            {"role": "assistant", "content": "An ant."},
        ],
    }
    messages, images = to_vl_messages(row, "t.jsonl row 1")
    assert images == ["a.jpg"]
    assert messages[1] == {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What insect?"}]}
    assert messages[2] == {"role": "assistant", "content": "An ant."}
    with pytest.raises(SFTDataError, match=r"t\.jsonl row 1: messages\[1\]\.content\[0\] must be"):
        to_vl_messages(
            {
                "image": "a.jpg",
                "messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": [{"type": "image"}]}],
            },
            "t.jsonl row 1",
        )
    # text parts under "value" are read; reasoning is refused in one line, never dropped in silence
    row["messages"][2] = {"role": "assistant", "content": [{"type": "text", "value": "An ant."}]}
    assert to_vl_messages(row, "t.jsonl row 1")[0][2] == {"role": "assistant", "content": "An ant."}
    row["messages"][2]["reasoning_content"] = "Six legs."
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: messages\[2\]\.reasoning_content is set, but image \+ text "
        r"rows train no reasoning",
    ):
        to_vl_messages(row, "t.jsonl row 1")


def test_collate_vl_pads_rows_and_concatenates_the_patches_of_all_images():
    rows = [
        {
            "input_ids": [5, 9, 9, 6],
            "labels": [-100, -100, -100, 6],
            "pixel_values": torch.ones(8, 3),
            "image_grid_thw": torch.tensor([[1, 2, 4]]),
        },
        {
            "input_ids": [5, 9, 6],
            "labels": [-100, -100, 6],
            "pixel_values": torch.zeros(4, 3),
            "image_grid_thw": torch.tensor([[1, 2, 2]]),
        },
    ]
    batch = collate_vl(rows, pad_id=0, image_token_id=9)
    assert batch["input_ids"].shape == (2, 8) and batch["attention_mask"].sum().item() == 7
    assert batch["mm_token_type_ids"].tolist() == [[0, 1, 1, 0, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["pixel_values"].shape == (12, 3) and batch["image_grid_thw"].tolist() == [[1, 2, 4], [1, 2, 2]]
    assert json.dumps(batch["labels"][1].tolist()) == json.dumps([-100, -100, 6] + [-100] * 5)
