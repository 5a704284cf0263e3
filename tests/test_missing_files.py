"""A data file that is not a file, in every recipe's --check: a folder is named as one, and a relative path found
neither beside the config nor in the current folder says from which folder it was looked for
(`cookbook.errors.not_a_file`)."""

import pytest
import torchvision_cpu

from conftest import check

torchvision_cpu.apply()  # retinanet-ddp's check imports torchvision (tests/torchvision_cpu.py)

CASES = [  # recipe, override with {} for the path, what the message calls it
    ("modernbert-ddp", "data.train_files=[{}]", "file"),
    ("retinanet-ddp", "data.train_annotations={}", "file"),
    ("torchrec-dlrm", "data.train_files=[{}]", "data file"),
    ("two-tower-ray", "data.interactions={}", "file"),
    ("qwen-zero3-receipts", "deepspeed.config={}", "file"),
    ("qwen-fsdp2-sft", "data.train_files=[{}]", "data file"),
]


@pytest.mark.parametrize("recipe, override, what", CASES, ids=[c[0] for c in CASES])
def test_a_relative_path_not_found_says_from_where(tmp_path, monkeypatch, recipe, override, what):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as err:
        check(recipe, f"output_dir={tmp_path / 'out'}", override.format("nope/data.json"))
    assert str(err.value).endswith(f"{what} not found: nope/data.json (from {tmp_path})")


@pytest.mark.parametrize("recipe, override, what", CASES[:5], ids=[c[0] for c in CASES[:5]])
def test_a_folder_is_named_as_one(tmp_path, recipe, override, what):
    folder = tmp_path / "data"
    folder.mkdir()
    with pytest.raises(Exception) as err:
        check(recipe, f"output_dir={tmp_path / 'out'}", override.format(folder))
    assert str(err.value).endswith(f"{folder} is a folder, not a {what}")


@pytest.mark.parametrize("recipe", ["qwen-fsdp2-sft", "gpt-oss-lora-trl", "qwen-zero3-receipts", "unsloth-lora-ddp"])
def test_an_sft_data_file_not_found_is_named_with_its_key(tmp_path, monkeypatch, recipe):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(Exception) as err:
        check(recipe, f"output_dir={tmp_path / 'out'}", "data.train_files=[nope/data.json]")
    assert str(err.value).endswith(f"data.train_files: data file not found: nope/data.json (from {tmp_path})")


MODEL_CASES = ["modernbert-ddp", "qwen-fsdp2-sft"]  # a preflight that loads a model folder's tokenizer and config


@pytest.mark.parametrize("recipe", MODEL_CASES)
def test_a_model_folder_that_is_missing_empty_or_without_a_tokenizer_is_named(tmp_path, recipe):
    """Not a hub error, nor transformers' traceback (an empty folder was exit 1 with a ValueError)."""
    out, empty, config_only = f"output_dir={tmp_path / 'out'}", tmp_path / "empty", tmp_path / "config-only"
    empty.mkdir()
    config_only.mkdir()
    (config_only / "config.json").write_text("{}")
    missing = tmp_path / "models" / "ModernBERT-base"
    for override, expected in [
        (f"model.name_or_path={missing}", f"model.name_or_path: folder not found: {missing}"),
        (
            f"model.name_or_path={empty}",
            f"model.name_or_path: {empty} is not a Hugging Face model folder (none of config.json in it)",
        ),
    ]:
        with pytest.raises(Exception) as err:
            check(recipe, out, override)
        assert str(err.value).endswith(expected)
    with pytest.raises(Exception) as err:
        check(recipe, out, f"model.tokenizer={config_only}")
    assert str(err.value).endswith(
        f"model.tokenizer: {config_only} is not a Hugging Face tokenizer folder (none of tokenizer.json, "
        "tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt in it)"
    )
