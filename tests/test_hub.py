"""cookbook.hub.model_folder: a local folder, or a hub id found in a Hugging Face cache laid out by hand,
offline (no hub is reachable from the tests); the data files written once (write_lines, file_to_text,
dataset_to_text: the last is run with a stand-in for datasets.load_dataset)."""

import shutil
from pathlib import Path

import pytest
from conftest import ROOT

from cookbook.config import ConfigError
from cookbook.hub import dataset_to_text, file_to_text, model_folder, write_lines
from cookbook.tabular import DataError

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


# ----------------------------------------------------------------------------- data files written once
def _line(row, where, positions=None):
    if row["n"] in ("x", None):
        raise DataError(f"{where}, column {positions['n'] if positions else 'n'}: not a number")
    return f"{row['n']}|{row['s']}\n"


def test_write_lines_is_all_or_nothing(tmp_path):
    dst = tmp_path / "sub" / "out.txt"
    assert write_lines(dst, (f"{i}\n" for i in range(10)), max_lines=4) == 4
    assert dst.read_text() == "0\n1\n2\n3\n"

    def failing():
        yield "new\n"
        raise DataError("row 2: bad")

    with pytest.raises(DataError, match="row 2: bad"):
        write_lines(dst, failing())
    assert dst.read_text() == "0\n1\n2\n3\n" and sorted(p.name for p in dst.parent.iterdir()) == ["out.txt"]


def test_file_to_text_reads_csv_with_or_without_header_once_per_content(tmp_path):
    with_header = tmp_path / "a.csv"
    with_header.write_text("\ufeffS,extra,N\r\nb,0,1\r\nc,0,2\r\n")  # any case and order, other columns ignored
    dst, n = file_to_text(with_header, tmp_path / "conv", _line, ["n", "s"])
    assert n == 2 and dst.read_text() == "1|b\n2|c\n" and dst.parent == tmp_path / "conv"
    assert file_to_text(with_header, tmp_path / "conv", _line, ["n", "s"]) == (dst, None)  # same content: reused
    headerless = tmp_path / "b.csv"
    headerless.write_text("1,b\n2,c\n")
    other, n = file_to_text(headerless, tmp_path / "conv", _line, ["n", "s"])
    assert n == 2 and other != dst and other.read_text() == "1|b\n2|c\n"
    headerless.write_text("1,b\nx,c\n")  # changed content, a bad row on line 2 (column 1)
    with pytest.raises(DataError, match=r"b.csv line 2, column 1: not a number"):
        file_to_text(headerless, tmp_path / "conv", _line, ["n", "s"])
    assert len(list((tmp_path / "conv").iterdir())) == 2  # nothing half-written
    (tmp_path / "c.jsonl").write_text('{"n": 5, "s": "z"}\n')
    assert file_to_text(tmp_path / "c.jsonl", tmp_path / "conv", _line, ["n", "s"])[0].read_text() == "5|z\n"
    with pytest.raises(ConfigError, match="data file not found"):
        file_to_text(tmp_path / "none.csv", tmp_path / "conv", _line, ["n", "s"])


def test_dataset_to_text_writes_once_per_settings(tmp_path, monkeypatch):
    import datasets

    calls = []

    def load_dataset(hub_id, split, streaming):
        calls.append((hub_id, split, streaming))
        return iter([{"n": i, "s": "abc"[i % 3], "more": 0} for i in range(5)])

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    dst = tmp_path / "hub" / "org__d-train.txt"
    assert dataset_to_text("org/d", "train", dst, _line, ["n", "s"], max_rows=3) == 3
    assert dst.read_text() == "0|a\n1|b\n2|c\n" and calls == [("org/d", "train", True)]
    assert dataset_to_text("org/d", "train", dst, _line, ["n", "s"], max_rows=3) is None and len(calls) == 1
    assert dataset_to_text("org/d", "train", dst, _line, ["n", "s"], max_rows=3, version=2) == 3  # a new line format
    assert dataset_to_text("org/d", "train", dst, _line, ["n", "s"]) == 5 and len(calls) == 3
    with pytest.raises(DataError, match=r"data.hub_id=org/d: the data set has no column\(s\) q \(found more, n, s\)"):
        dataset_to_text("org/d", "train", tmp_path / "other.txt", _line, ["n", "q"])
    assert not (tmp_path / "other.txt").exists()
