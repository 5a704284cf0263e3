"""cookbook.hub.model_folder: a local folder, or a hub id found in a Hugging Face cache laid out by hand,
offline (no hub is reachable from the tests); torchrec-dlrm's text files written once (text_files.py: write_lines,
file_to_text, dataset_to_text: the last is run with a stand-in for datasets.load_dataset)."""

import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import ROOT, recipe_modules

from cookbook.config import ConfigError
from cookbook.hub import model_folder
from cookbook.tabular import DataError

(text_files,) = recipe_modules("torchrec-dlrm", "text_files")
dataset_to_text, file_to_text, write_lines = text_files.dataset_to_text, text_files.file_to_text, text_files.write_lines

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


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "org/missing",
            "model.name_or_path: org/missing is not a folder and not in the Hugging Face cache {cache} "
            "(HF_HUB_OFFLINE=1): download it there first (`hf download org/missing`) or give a local folder",
        ),
        ("/no/such/model", "model.name_or_path: folder not found: /no/such/model"),
        (
            "not a hub id!",
            "model.name_or_path: 'not a hub id!' is not a folder and not a Hugging Face Hub id (org/name)",
        ),
        (str(ROOT / "recipes" / "qwen-fsdp2-sft" / "tiny" / "data"), "model.name_or_path: no *.safetensors files in"),
    ],
)
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


# ----------------------------------------------------------------------------- offline: fail fast
@pytest.fixture
def online_hub(monkeypatch):
    """huggingface_hub as without HF_HUB_OFFLINE, and this process not yet asked whether the hub answers;
    `endpoint(url)` points it at `url`. Everything is restored afterwards."""
    from huggingface_hub import constants

    import cookbook.hub

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(cookbook.hub, "_reachable", None)
    return lambda url: monkeypatch.setattr(constants, "ENDPOINT", url)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_unreachable_hub_switches_to_offline_at_once_and_a_missing_model_fails_in_one_line(
    online_hub, capsys, tmp_path, monkeypatch
):
    import time

    from huggingface_hub import constants
    from transformers import AutoConfig

    from cookbook.hub import offline_unless_reachable

    online_hub(f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    t0 = time.monotonic()
    assert offline_unless_reachable() is True
    assert constants.HF_HUB_OFFLINE is True
    with pytest.raises(OSError, match="couldn't connect|offline"):
        AutoConfig.from_pretrained("org/not-cached")  # without the switch: five retries, about 25 s
    assert time.monotonic() - t0 < 3.0
    err = capsys.readouterr().err
    assert err.startswith("warning: the Hugging Face Hub (http://127.0.0.1:") and "ConnectError" in err
    assert "working offline, from the cache" in err and err.count("\n") == 1
    with pytest.raises(
        ConfigError,
        match=r"^model.name_or_path: org/not-cached is not a folder and not in the Hugging "
        r"Face cache .* \(the Hugging Face Hub cannot be reached\): download it",
    ):
        model_folder("org/not-cached")


def test_a_hub_that_answers_stays_online_and_one_that_hangs_is_given_up_on_time(online_hub):
    import socket
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from huggingface_hub import constants

    import cookbook.hub
    from cookbook.hub import offline_unless_reachable

    class Head(BaseHTTPRequestHandler):
        def do_HEAD(self):
            self.send_response(401)  # any answer counts: the hub is there
            self.end_headers()

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Head)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        online_hub(f"http://127.0.0.1:{server.server_port}")
        assert offline_unless_reachable() is False and constants.HF_HUB_OFFLINE is False
    finally:
        server.shutdown()
    with socket.socket() as silent:  # accepts connections (the kernel's backlog) and never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        online_hub(f"http://127.0.0.1:{silent.getsockname()[1]}")
        cookbook.hub._reachable = None
        t0 = time.monotonic()
        assert offline_unless_reachable(timeout_s=0.5) is True
        assert 0.4 < time.monotonic() - t0 < 1.5


def test_download_bars_come_back_on_a_terminal_only(monkeypatch):
    import importlib
    import io
    import sys

    import transformers.utils.logging
    from huggingface_hub.utils import are_progress_bars_disabled
    from transformers import logging as hf_logging

    from cookbook.hub import show_download_bars

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    hub_tqdm = importlib.import_module(
        "huggingface_hub.utils.tqdm"
    )  # the module (its package exports a class so named)
    monkeypatch.setattr(hub_tqdm, "progress_bar_states", dict(hub_tqdm.progress_bar_states))  # restored after
    monkeypatch.setattr(transformers.utils.logging, "_tqdm_active", transformers.utils.logging._tqdm_active)
    monkeypatch.delenv("HF_HUB_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    monkeypatch.setenv("LOCAL_RANK", "0")
    hf_logging.disable_progress_bar()  # what the recipes do at import
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    assert show_download_bars() is False
    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert show_download_bars() is False
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert show_download_bars() is True
    assert not are_progress_bars_disabled("huggingface_hub.snapshot_download")
    assert are_progress_bars_disabled()  # other bars stay off


def test_resolve_path_asks_the_hub_only_for_a_hub_id(tmp_path, monkeypatch):
    import cookbook.hub
    from cookbook.hub import resolve_path

    asked = []
    monkeypatch.setattr(cookbook.hub, "prepare_access", lambda: asked.append(True))
    (tmp_path / "tiny").mkdir()
    assert resolve_path("tiny", tmp_path) == str(tmp_path / "tiny")
    assert resolve_path("data/a/b.csv", tmp_path) == "data/a/b.csv"
    assert asked == []
    assert resolve_path("answerdotai/ModernBERT-base", tmp_path) == "answerdotai/ModernBERT-base"
    assert asked == [True]


# ----------------------------------------------------------------------------- push to the hub
def _train_and_push(out, monkeypatch, fail=False):
    """Two steps of a tiny Qwen2 with cookbook.loop, exported with export_hf and pushed to org/tiny-run; the hub
    calls are stand-ins that record what would be uploaded (a copy of the folder)."""
    from huggingface_hub import HfApi
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from cookbook.checkpoint import TrainState, export_hf
    from cookbook.dist import DistInfo
    from cookbook.loop import TrainLoop
    from cookbook.metrics import MetricsLogger

    uploads = []

    def upload_folder(self, *, repo_id, folder_path, repo_type, commit_message):
        if fail:
            raise OSError("Connection reset by peer")
        uploads.append((repo_id, repo_type, commit_message))
        shutil.copytree(folder_path, out / "uploaded")
        return SimpleNamespace(commit_url=f"https://huggingface.co/{repo_id}/commit/abc")

    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: uploads.append(("create", repo_id)))
    monkeypatch.setattr(HfApi, "upload_folder", upload_folder)
    tiny = ROOT / "recipes" / "qwen-ray-sft" / "tiny" / "qwen2"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny))
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {
        "run_name": "tiny-run",
        "model": {"name_or_path": str(tiny), "pretrained": False},
        "optim": {"lr": 0.01},
        "checkpoint": {"push_to_hub": "org/tiny-run", "export_hf": True},
    }
    info = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
    metrics = MetricsLogger(out, info, mlflow=False, max_steps=2, params=config)  # as start_run: the config
    loop = TrainLoop(
        state=TrainState(),
        max_steps=2,
        metrics=metrics,
        log_every=1,
        evaluate=lambda: {"loss": 1.5, "accuracy": 0.25},
        config=config,
    )
    ids = torch.randint(0, 100, (2, 8))
    with loop:
        for _ in loop.steps():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            loop.end_step(loss, lr=0.01)
        loop.finish(
            export=lambda: {
                "export_dir": (export_hf(model, out / "final", tokenizer), "AutoModelForCausalLM.from_pretrained")
            }
        )
    return uploads, model, metrics


def test_push_to_hub_uploads_the_export_with_a_model_card_and_it_loads(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    uploads, model, metrics = _train_and_push(tmp_path, monkeypatch)
    assert uploads == [("create", "org/tiny-run"), ("org/tiny-run", "model", "tiny-run: final export")]
    folder = tmp_path / "uploaded"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md"} <= {
        p.name for p in folder.iterdir()
    }
    card = (folder / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: transformers\ntags:\n- distributed-training-cookbook\n- tiny-run\n---")
    assert "base_model" not in card  # trained from random init (model.pretrained: false)
    assert f"| train/loss | {metrics.last_train['loss']:.6g} |" in card and "| eval/accuracy | 0.25 |" in card
    assert "| steps | 2 |" in card and "push_to_hub: org/tiny-run" in card and "lr: 0.01" in card
    loaded = AutoModelForCausalLM.from_pretrained(folder)
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), model.state_dict().values()))
    assert AutoTokenizer.from_pretrained(folder)("hello")["input_ids"]


def test_a_failed_push_is_one_line_with_the_command_that_retries_it(tmp_path, monkeypatch):
    from cookbook.push import HubPushError

    with pytest.raises(HubPushError) as err:
        _train_and_push(tmp_path, monkeypatch, fail=True)
    assert str(err.value) == (
        f"checkpoint.push_to_hub=org/tiny-run: the upload of {tmp_path / 'final'} failed "
        f"(OSError: Connection reset by peer); the export is complete on disk: retry with "
        f"`hf upload org/tiny-run {tmp_path / 'final'} .`"
    )
    assert err.value.exit_status == 2 and (tmp_path / "final" / "README.md").is_file()


@pytest.mark.parametrize(
    "section, env, message",
    [
        (
            dict(push_to_hub="tiny-run"),
            {"HF_TOKEN": "x"},
            "checkpoint.push_to_hub='tiny-run' is not a Hugging Face Hub repo id (org/name): it has no owner",
        ),
        (
            dict(push_to_hub="org/a", export_hf=False),
            {"HF_TOKEN": "x"},
            "checkpoint.push_to_hub=org/a: nothing to push",
        ),
        (
            dict(push_to_hub="org/a"),
            {"HF_TOKEN": "x", "HF_HUB_OFFLINE": "1"},
            "checkpoint.push_to_hub=org/a: HF_HUB_OFFLINE is set",
        ),
        (
            dict(push_to_hub="org/a"),
            {},
            "checkpoint.push_to_hub=org/a: no Hugging Face token; log in (`hf auth login`)",
        ),
    ],
)
def test_a_push_that_cannot_work_is_refused_before_training(section, env, message, monkeypatch, tmp_path):
    from huggingface_hub import constants

    from cookbook.config import HFCheckpointConfig, RunConfig, check_run

    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no stored token
    monkeypatch.setattr(constants, "HF_TOKEN_PATH", str(tmp_path / "token"))
    monkeypatch.setattr(constants, "HF_STORED_TOKENS_PATH", str(tmp_path / "stored_tokens"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", env.get("HF_HUB_OFFLINE") == "1")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    cfg = RunConfig(output_dir=str(tmp_path / "out"), checkpoint=HFCheckpointConfig(**section))
    with pytest.raises(ConfigError) as err:
        check_run(cfg)
    assert str(err.value).startswith(message), str(err.value)
