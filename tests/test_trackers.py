"""cookbook.metrics' trackers (TensorBoard, W&B offline; MLflow is in test_metrics.py), each read back the way its
own reader would, the masking of tracking URIs in all of them, and rank 0's progress bar (cookbook.progress):
drawn on a terminal, absent from a file or pipe, where the log lines stay exactly as they were."""

import io
import json
import logging
import re
import struct
from pathlib import Path

import pytest
import torch

from cookbook.config import ConfigError, check_trackers
from cookbook.dist import DistInfo, _configure_logging
from cookbook.metrics import MetricsLogger

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
LOSSES = [2.0, 1.0, 2.0 / 3]


def _log_three_steps(out, **kw):
    logger = MetricsLogger(out, CPU, run_name="t", experiment="tests", params={"a": {"b": 1}}, max_steps=3, **kw)
    logger.start(0)
    for step, loss in enumerate(LOSSES, 1):
        logger.add(samples=4, tokens=torch.tensor(40), data_wait_s=0.0)
        logger.advance(step)
        logger.log_step(step, loss=torch.tensor(loss), lr=1e-3, grad_norm=torch.tensor(0.5))
    logger.log_eval(3, {"accuracy": 0.75})
    logger.close()
    return logger


def _records(path: Path, fmt: str) -> list[bytes]:
    """The records of a TFRecord file (``tfrecord``, TensorBoard's: 8-byte length, its crc, data, crc) or of a
    LevelDB-style log (``wandb``, W&B's .wandb: a 7-byte header, then 32 KiB blocks of records of crc, 2-byte
    length, type, data; a record may span blocks)."""
    data, out = path.read_bytes(), []
    pos = 0 if fmt == "tfrecord" else 7  # ":W&B", a magic number, a version
    if fmt == "tfrecord":
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            out.append(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
        return out
    part = b""
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if n == 0 and kind == 0:
            pos += left
            continue
        part += data[pos + 7 : pos + 7 + n]
        pos += 7 + n
        if kind in (1, 4):  # a full record, or the last piece of one
            out.append(part)
            part = b""
    return out


def test_tensorboard_event_file_holds_every_scalar_and_the_config(tmp_path):
    from tensorboardX.proto.event_pb2 import Event

    logger = _log_three_steps(tmp_path, trackers=["tensorboard"])
    (events,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    scalars, texts = {}, []
    for raw in _records(events, "tfrecord"):
        event = Event.FromString(raw)
        for value in event.summary.value:
            if value.HasField("simple_value"):
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
            elif value.HasField("tensor"):
                texts.append(b"".join(value.tensor.string_val).decode())
    assert scalars["loss"] == [(1, pytest.approx(2.0)), (2, pytest.approx(1.0)), (3, pytest.approx(2.0 / 3))]
    assert scalars["eval/accuracy"] == [(3, pytest.approx(0.75))]
    assert {"lr", "grad_norm", "tokens_per_s_per_device", "rss_gib"} <= set(scalars)
    assert any("| a.b | 1 |" in t for t in texts)
    assert logger.tracker_lines() == [
        (
            "TensorBoard",
            f"{tmp_path / 'tensorboard'}; browse with `tensorboard --logdir "
            f"{tmp_path / 'tensorboard'}`" + _install_note("tensorboard"),
        )
    ]


def _install_note(module):
    import importlib.util

    return (
        ""
        if importlib.util.find_spec(module)
        else (
            " (after `pip install tensorboard==2.21.0`, or `pip install -r "
            "requirements/trackers.txt` from the cookbook repository's root)"
        )
    )


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    for name in ("WANDB_API_KEY", "WANDB_MODE", "WANDB_RUN_ID", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):  # nothing written to the home folder
        monkeypatch.setenv(name, str(tmp_path / "wandb-home"))


def test_wandb_without_a_key_runs_offline_into_the_output_folder_and_a_resume_continues_the_run(
    tmp_path, wandb_offline
):
    from wandb.proto.wandb_internal_pb2 import Record

    first = _log_three_steps(tmp_path, trackers=["wandb"])
    (folder,) = (tmp_path / "wandb").glob("offline-run-*")
    run_id = (tmp_path / "wandb_run_id.txt").read_text()
    (run_file,) = folder.glob(f"run-{run_id}.wandb")
    history = []
    for raw in _records(run_file, "wandb"):
        record = Record.FromString(raw)
        if record.WhichOneof("record_type") == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
    assert [h["loss"] for h in history] == pytest.approx(LOSSES)
    assert [h["_step"] for h in history] == [1, 2, 3]
    assert history[-1]["eval/accuracy"] == 0.75
    assert first.tracker_lines() == [("W&B", f"{folder} (offline); upload with `wandb sync {folder}`")]
    second = _log_three_steps(tmp_path, trackers=["wandb"])  # resumed in the same output folder
    assert (tmp_path / "wandb_run_id.txt").read_text() == run_id
    # W&B's folder of the continued run: offline-run-<time>-<the same id>, with -1 added within the same second
    assert re.search(rf"/offline-run-\d+_\d+-{run_id}(-\d+)?`$", second.tracker_lines()[0][1])


def test_a_tracking_uri_secret_is_masked_in_every_tracker_file_and_line(tmp_path, monkeypatch, wandb_offline, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://user:PASSWORD1@127.0.0.1:9/?token=TOKEN2")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the server is not there: fail at once
    with caplog.at_level(logging.INFO, logger="cookbook"):
        logger = _log_three_steps(tmp_path, trackers=["mlflow", "tensorboard", "wandb"])
    warning = [r.getMessage() for r in caplog.records if "MLflow tracking switched off" in r.getMessage()]
    assert len(warning) == 1 and "http://user:***@127.0.0.1:9/?token=***" in warning[0], warning
    shown = caplog.text + json.dumps(logger.tracker_lines())
    assert "PASSWORD1" not in shown and "TOKEN2" not in shown
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(written) > 5  # metrics.jsonl, the event file, the W&B run's files
    assert not [p for p in written if b"PASSWORD1" in p.read_bytes() or b"TOKEN2" in p.read_bytes()]


def test_trackers_are_checked_by_name_and_by_package(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError,
        match=r"^trackers: unknown tracker 'neptune'; choose from mlflow, tensorboard, "
        r"wandb \(metrics.jsonl is always written\)$",
    ):
        check_trackers(["mlflow", "neptune"])
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(
        ConfigError,
        match=r"^trackers: wandb is selected but the wandb package is not installed: "
        r"`pip install wandb==0\.31\.0`, or `pip install -r requirements/trackers\.txt` "
        r"from the cookbook repository's root$",
    ):
        MetricsLogger(tmp_path, CPU, params={"trackers": ["wandb"]})
    assert MetricsLogger(tmp_path, CPU, mlflow=False, params={"trackers": ["mlflow"]}).trackers == []


def test_install_hints_name_the_packages_with_the_requirements_files_pins():
    """A recipe folder copied out of the repository has no requirements/: the hints give the pip packages themselves,
    pinned as the files the repository's hints name (so the two cannot drift apart)."""
    from cookbook import requirements

    root = Path(__file__).resolve().parents[1]

    def pins(path):
        lines = (line.split("#")[0].strip() for line in (root / path).read_text().splitlines())
        return {line.split("==")[0]: line for line in lines if line}

    for name, (module, packages, path) in requirements.TRACKERS.items():
        assert [pins(path).get(spec.split("==")[0]) for spec in packages.split()] == packages.split(), name
    assert [
        pins(requirements.TRACKER_UIS_FILE).get(spec.split("==")[0]) for spec in requirements.TRACKER_UIS.values()
    ] == ["mlflow==3.17.2", "tensorboard==2.21.0"]
    assert requirements.install_hint("wandb==0.31.0", "requirements/trackers.txt") == (
        "`pip install wandb==0.31.0`, or `pip install -r requirements/trackers.txt` from the cookbook repository's root"
    )


# ----------------------------------------------------------------------------- the progress bar
class Terminal(io.StringIO):
    def isatty(self):
        return True


LOG_LINE = re.compile(
    r"^\d\d:\d\d:\d\d step (\d)/3 \| loss [\d.]+ \| lr 1.00e-03 \| gnorm 0.50 \| \d+ ms/step \| "
    r"[\d.]+ samples/s/rank \| [\d,]+ tok/s/rank \| rss [\d.]+ GiB \| data 0%( \| eta \d+ s)?$"
)


def _console_of_a_run(tmp_path, monkeypatch, stream):
    monkeypatch.setattr("sys.stderr", stream)
    monkeypatch.delenv("TQDM_DISABLE", raising=False)
    monkeypatch.delenv("TERM", raising=False)
    log = logging.getLogger("cookbook")
    saved = list(log.handlers), log.propagate, log.level
    _configure_logging(0)  # as a recipe's process has it; put back after (later tests of this process read caplog)
    try:
        handlers = list(log.handlers)
        _log_three_steps(tmp_path, mlflow=False)
        assert log.handlers == handlers  # given back as they were
    finally:
        log.handlers[:], log.propagate = saved[0], saved[1]
        log.setLevel(saved[2])
    return stream.getvalue()


def test_off_a_terminal_there_is_no_bar_and_the_log_lines_are_unchanged(tmp_path, monkeypatch):
    text = _console_of_a_run(tmp_path, monkeypatch, io.StringIO())
    lines = text.splitlines()
    assert [LOG_LINE.match(line).group(1) for line in lines[:3]] == ["1", "2", "3"], text
    assert lines[3].endswith(" eval  step 3 | accuracy 0.7500") and len(lines) == 4
    assert "\r" not in text and "step/s" not in text


def test_on_a_terminal_the_bar_shows_steps_loss_throughput_and_time_left_below_the_log_lines(tmp_path, monkeypatch):
    text = _console_of_a_run(tmp_path, monkeypatch, Terminal())
    frames = re.split(r"[\r\n]", text)
    logged = [f for f in frames if LOG_LINE.match(f)]
    assert [LOG_LINE.match(f).group(1) for f in logged] == ["1", "2", "3"]  # each log line once, whole
    bars = [f for f in frames if f.startswith("train: ")]
    assert re.search(
        r"train: +67%\|[^|]*\| 2/3 \[\d\d:\d\d<\d\d:\d\d, [\d.]+step/s, loss=1.0000, tok/s/rank=[\d,]+\]",
        "\n".join(bars),
    ), bars
    assert re.search(r"\| 3/3 \[.*loss=0.6667, tok/s/rank=", bars[-1]), bars[-1]
