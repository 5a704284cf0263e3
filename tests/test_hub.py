"""cookbook.hub.model_folder: a local folder, or a hub id found in a Hugging Face cache laid out by hand,
offline (no hub is reachable from the tests)."""

import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from cookbook.config import ConfigError
from cookbook.hub import model_folder

REVISION = "0123456789abcdef0123456789abcdef01234567"


def make_hub_cache(cache: Path, repo_id: str, source: Path) -> Path:
    """Lay out `source`'s files as huggingface_hub caches a downloaded model repository:
    ``models--<org>--<name>/snapshots/<revision>/<files>`` and ``refs/main`` holding the revision.
    Returns the snapshot folder."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / REVISION
    shutil.copytree(source, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    return snapshot


def use_offline_cache(monkeypatch, cache: Path) -> None:
    """``HF_HUB_OFFLINE=1`` and ``HF_HUB_CACHE=<cache>`` for this process and the workers it forks. huggingface_hub
    reads both variables when it is imported (already done here), so its constants are set too."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from safetensors.torch import save_file
    import torch

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": torch.ones(2)}, model / "model.safetensors")
    make_hub_cache(tmp_path / "hub", "org/tiny", model)
    use_offline_cache(monkeypatch, tmp_path / "hub")
    return tmp_path / "hub"


def test_a_cached_hub_id_is_its_snapshot_folder_offline(cache):
    assert model_folder("org/tiny") == cache / "models--org--tiny" / "snapshots" / REVISION


def test_a_local_folder_is_itself(cache):
    folder = cache / "models--org--tiny" / "snapshots" / REVISION
    assert model_folder(str(folder)) == folder


@pytest.mark.parametrize("value, message", [
    ("org/missing", "model.name_or_path: org/missing is not a folder and not in the Hugging Face cache {cache} "
                    "(HF_HUB_OFFLINE=1): download it there first (`hf download org/missing`) or give a local folder"),
    ("/no/such/model", "model.name_or_path: folder not found: /no/such/model"),
    ("not a hub id!", "model.name_or_path: 'not a hub id!' is not a folder and not a Hugging Face Hub id (org/name)"),
    (str(ROOT / "recipes" / "qwen-fsdp2-sft" / "tiny" / "data"), "model.name_or_path: no *.safetensors files in"),
])
def test_what_cannot_be_a_model_folder_is_one_line_naming_the_key(cache, value, message):
    with pytest.raises(ConfigError) as err:
        model_folder(value)
    assert str(err.value).startswith(message.replace("{cache}", str(cache))), str(err.value)
    assert "\n" not in str(err.value)
