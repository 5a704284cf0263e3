"""The inputs of benchmarks/moe_first_gpu_runs.sh: shrunken configs (benchmarks/tiny_config.py), image + text
rows (benchmarks/vl_rows.py) through the VL data path, and the Mamba kernel line (the recipe's moe_model)."""

import importlib
import importlib.util
import json
from pathlib import Path

import pytest
from transformers import AutoConfig

from conftest import recipe_modules

moe_model, image_text = recipe_modules("moe-lora-fsdp2-ep", "moe_model", "image_text")
load_vl_processors, vl_example = image_text.load_vl_processors, image_text.vl_example

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "recipes" / "moe-lora-fsdp2-ep"
VL = TEXT  # the image + text variant (tiny-vl.yaml, qwen3-vl-30b-a3b.yaml)


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tiny_configs_take_the_twins_sizes_and_keep_the_published_vocabulary(tmp_path):
    shrink = load("tiny_config").shrink
    read = lambda p: json.loads(p.read_text())  # noqa: E731
    nemotron = shrink(
        read(TEXT / "models/nemotron-3-nano-30b-a3b/config.json"), read(TEXT / "tiny/nemotron-h/config.json")
    )
    assert (nemotron["hybrid_override_pattern"], nemotron["hidden_size"], nemotron["n_routed_experts"]) == (
        "ME*E",
        64,
        4,
    )
    assert (nemotron["vocab_size"], nemotron["max_position_embeddings"], nemotron["bos_token_id"]) == (
        131072,
        262144,
        1,
    )
    vl = shrink(read(VL / "models/qwen3-vl-30b-a3b/config.json"), read(VL / "tiny/qwen3-vl-moe/config.json"))
    text, vision = vl["text_config"], vl["vision_config"]
    assert (
        text["hidden_size"],
        text["num_hidden_layers"],
        text["num_experts"],
        text["rope_scaling"]["mrope_section"],
    ) == (64, 2, 4, [4, 2, 2])
    assert (text["vocab_size"], text["eos_token_id"], "pad_token_id" in text) == (151936, 151645, False)
    assert (vl["image_token_id"], vl["vision_start_token_id"]) == (151655, 151652)
    assert (
        vision["depth"],
        vision["patch_size"],
        vision["spatial_merge_size"],
        vision["deepstack_visual_indexes"],
    ) == (2, 16, 2, [0])
    for name, cfg in (("nemotron", nemotron), ("vl", vl)):  # transformers reads them as their model types
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
    assert AutoConfig.from_pretrained(tmp_path / "nemotron").layers_block_type == [
        "linear_attention",
        "moe",
        "full_attention",
        "moe",
    ]
    assert AutoConfig.from_pretrained(tmp_path / "vl").get_text_config().vocab_size == 151936


ALPACA = [
    {"instruction": "Name a colour.", "input": "", "output": "Blue."},
    {"instruction": "Skip me.", "input": "", "output": " "},
    {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
]


def test_vl_rows_pair_two_photos_with_a_question_and_an_alpaca_turn():
    vl_rows = load("vl_rows").vl_rows
    rows = vl_rows(["a0.jpg", "a1.jpg"], ["b0.jpg", "b1.jpg", "b2.jpg"], ALPACA, 2)
    assert [r["images"] for r in rows] == [["a0.jpg", "b0.jpg"], ["b1.jpg", "a1.jpg"]]  # ant i % 2, bee (7i + 3) % 3
    assert [m["content"] for m in rows[1]["messages"][1:]] == [
        "The first picture shows a bee, the second an ant.",
        "Add the numbers.\n\n2 and 3",
        "5",
    ]  # empty answer skipped
    assert rows[0]["messages"][0]["content"][:2] == [{"type": "image"}, {"type": "image"}]
    with pytest.raises(ValueError, match="3 rows need 3 answered Alpaca rows"):
        vl_rows(["a0.jpg"], ["b0.jpg"], ALPACA, 3)


def test_vl_rows_label_both_assistant_turns_and_expand_the_images():
    row = load("vl_rows").vl_rows(["ant0.jpg"], ["bee0.jpg"], ALPACA, 1)[0]
    tokenizer, processor = load_vl_processors(str(VL / "tiny/qwen3-vl-moe"))
    image_token = AutoConfig.from_pretrained(VL / "tiny/qwen3-vl-moe").image_token_id
    ex = vl_example(row, "row 1", VL / "tiny/data/insects", tokenizer, processor, image_token, max_length=512)
    labelled = tokenizer.decode([t for t, label in zip(ex["input_ids"], ex["labels"]) if label != -100])
    assert labelled == "The first picture shows an ant, the second a bee.<|im_end|>Blue.<|im_end|>"
    assert ex["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 4]]  # 64 x 64 photos, patch 16
    assert ex["input_ids"].count(image_token) == 8  # 16 patches / merge 2 x 2, per image


def test_mamba_kernels_names_the_missing_packages(monkeypatch):
    nemotron = AutoConfig.from_pretrained(TEXT / "tiny/nemotron-h")
    real = importlib.import_module

    def only(*names):  # import_module with only `names` of the kernel packages installed (json stands in for them)
        def fake(name, *args):
            if name not in moe_model.MAMBA_KERNEL_PACKAGES["nemotron_h"]:
                return real(name, *args)
            if name not in names:
                raise ImportError(f"No module named '{name}'")
            return json

        return fake

    monkeypatch.setattr(importlib, "import_module", only())
    assert moe_model.mamba_kernels(nemotron) == (
        "Mamba-2 layers (nemotron_h): not importable: mamba_ssm (ImportError: No module named 'mamba_ssm'), causal_conv1d "
        "(ImportError: No module named 'causal_conv1d'): transformers runs its PyTorch path for those parts (correct, slower)"
    )
    monkeypatch.setattr(importlib, "import_module", only("causal_conv1d"))
    assert moe_model.mamba_kernels(nemotron).startswith(
        "Mamba-2 layers (nemotron_h): kernels of causal_conv1d; not importable: mamba_ssm"
    )
    monkeypatch.setattr(importlib, "import_module", only("mamba_ssm", "causal_conv1d"))
    assert moe_model.mamba_kernels(nemotron) == "Mamba-2 layers (nemotron_h): kernels of mamba_ssm, causal_conv1d"
    assert moe_model.mamba_kernels(AutoConfig.from_pretrained(TEXT / "tiny/qwen3-moe")) is None
