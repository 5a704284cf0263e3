import json
import os
import time

import pytest
import torch

from cookbook.dist import DistInfo
from cookbook.metrics import MetricsLogger, ModelFlops, count_parameters, launch_time, mfu, peak_bf16_flops

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")


def test_mfu_of_a_known_config_matches_hand_computed_flops():
    model = torch.nn.Sequential(torch.nn.Embedding(100, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    n = count_parameters(model)
    assert n == (8 * 16 + 16) + (16 * 4 + 4) == 212  # the 800 embedding weights do not count
    assert count_parameters(model, exclude_embeddings=False) == 1012
    flops = ModelFlops(num_params=n, num_layers=2, attn_width=8)
    # 6 N + 12 L d T = 6 * 212 + 12 * 2 * 8 * 10
    assert flops.per_token(10) == 1272 + 1920 == 3192
    assert mfu(1000.0, flops.per_token(10), 1e6) == pytest.approx(3.192)


def test_mfu_of_a_llama_sized_model():
    # Llama-2-7B: 6.48e9 non-embedding params, 32 layers, width 4096, seq 4096;
    # 3,000 tokens/s per GPU on an H100 SXM.
    flops = ModelFlops(num_params=6_476_005_376, num_layers=32, attn_width=4096)
    per_token = 6 * 6_476_005_376 + 12 * 32 * 4096 * 4096
    assert flops.per_token(4096) == per_token
    assert mfu(3000, per_token, peak_bf16_flops("NVIDIA H100 80GB HBM3")) == pytest.approx(3000 * per_token / 989e12)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A10", 125e12),
        ("Tesla T4", None),
    ],
)
def test_peak_table(name, peak, monkeypatch):
    monkeypatch.delenv("COOKBOOK_PEAK_TFLOPS", raising=False)
    assert peak_bf16_flops(name) == peak


def _log_a_few_steps(tmp_path, **kw):
    logger = MetricsLogger(
        tmp_path, CPU, flops=ModelFlops(100, 2, 8), run_name="t", experiment="tests", params={"a": {"b": 1}}, **kw
    )
    logger.start(0)
    for step in (1, 2, 3):
        logger.add(samples=4, tokens=torch.tensor(40), data_wait_s=0.0)
        rec = logger.log_step(step, loss=torch.tensor(2.0 / step), lr=1e-3, grad_norm=torch.tensor(0.5))
    logger.log_eval(3, {"accuracy": 0.75})
    logger.close()
    return logger, rec


def test_jsonl_and_mlflow_records(tmp_path):
    logger, rec = _log_a_few_steps(tmp_path)
    assert rec["samples_per_s"] > 0 and rec["tokens_per_s_per_device"] == pytest.approx(rec["tokens_per_s"])
    assert rec["tokens_per_s"] / rec["samples_per_s"] == pytest.approx(10.0)
    assert "mfu" not in rec and "mem_allocated_gib" not in rec and rec["rss_gib"] > 0  # CPU: no MFU, RSS instead
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines if r["event"] == "train"] == [1, 2, 3]
    assert [r["loss"] for r in lines if r["event"] == "train"] == pytest.approx([2.0, 1.0, 2.0 / 3])
    assert lines[-1]["eval/accuracy"] == 0.75

    from mlflow.tracking import MlflowClient

    client = MlflowClient(logger.mlflow_uri)
    run = client.get_run(logger.mlflow_run_id)
    assert run.data.params["a.b"] == "1" and run.info.status == "FINISHED"
    assert [m.value for m in client.get_metric_history(run.info.run_id, "loss")] == pytest.approx([2.0, 1.0, 2.0 / 3])
    assert client.get_metric_history(run.info.run_id, "eval_accuracy")[0].value == 0.75


def test_a_resumed_run_continues_its_mlflow_run(tmp_path):
    first, _ = _log_a_few_steps(tmp_path)
    second, _ = _log_a_few_steps(tmp_path)
    assert second.mlflow_run_id == first.mlflow_run_id


def test_a_second_run_in_one_process_logs_to_its_own_store(tmp_path):
    """mlflow.set_tracking_uri exports the URI into os.environ; the next run of the process (a notebook cell, a
    forked worker) must not take it for the user's MLFLOW_TRACKING_URI."""
    first, _ = _log_a_few_steps(tmp_path / "a")
    assert "MLFLOW_TRACKING_URI" not in os.environ
    second, _ = _log_a_few_steps(tmp_path / "b")
    assert second.mlflow_uri == f"sqlite:///{(tmp_path / 'b').resolve()}/mlflow.db" != first.mlflow_uri
    assert second.mlflow_run_id != first.mlflow_run_id


def test_tracking_failure_never_stops_training(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "nosuchscheme://nowhere")
    logger, rec = _log_a_few_steps(tmp_path)
    assert logger.mlflow_uri is None  # switched off
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 4  # 3 train + 1 eval still written


def test_paused_time_is_not_counted_in_the_window(tmp_path):
    logger = MetricsLogger(tmp_path, CPU, run_name="t", experiment="tests", mlflow=False)
    logger.start(0)
    time.sleep(0.05)  # a training step
    with logger.paused():  # an evaluation or checkpoint
        time.sleep(0.5)
    logger.add(samples=4, tokens=40, data_wait_s=0.0)
    rec = logger.log_step(1, loss=1.0, lr=1e-3, grad_norm=None)
    logger.close()
    assert 0.05 <= rec["step_time_s"] < 0.3, rec["step_time_s"]


@pytest.mark.parametrize(
    "uri, shown",
    [
        ("https://alice:s3cret@mlflow.example.com:5000/x", "https://alice:***@mlflow.example.com:5000/x"),
        ("https://t0ken@mlflow.example.com", "https://***@mlflow.example.com"),
        ("http://mlflow.example.com/?token=abc&workspace=7", "http://mlflow.example.com/?token=***&workspace=7"),
        ("sqlite:////tmp/run/mlflow.db", "sqlite:////tmp/run/mlflow.db"),
        ("databricks", "databricks"),
    ],
)
def test_tracking_uri_credentials_are_masked(uri, shown):
    from cookbook.metrics import redact_uri

    assert redact_uri(uri) == shown


def test_launch_time_is_the_launchers_else_this_processs_start(monkeypatch):
    import psutil

    monkeypatch.setenv("COOKBOOK_LAUNCH_TIME", "1234.5")
    assert launch_time() == 1234.5
    for value in ("", "soon"):  # unset or not a number: this process's start
        monkeypatch.setenv("COOKBOOK_LAUNCH_TIME", value)
        assert launch_time() == psutil.Process().create_time() < time.time()
    monkeypatch.delenv("COOKBOOK_LAUNCH_TIME")
    assert launch_time() == psutil.Process().create_time()


def test_a_full_disk_switches_mlflow_off_in_one_line(tmp_path, capfd, caplog):
    """The SQLite store cannot grow (a file-size limit just above its size: SQLite reports "disk I/O error", as
    on a full disk): one warning line, training goes on. Before: MLflow's own ~40-line traceback came first."""
    import resource
    import signal

    logger = MetricsLogger(tmp_path, CPU, run_name="t", experiment="tests", params={"a": 1}, count_tokens=False)
    logger.start(0)
    capfd.readouterr()
    largest = max(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN), resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (largest + 10, previous[1][1]))
    try:
        for step in range(1, 30):  # until the journal or the WAL outgrows the limit
            logger.add(samples=1, tokens=0, data_wait_s=0.0)
            logger.log_step(step, loss=1.0, lr=1e-3, grad_norm=None)
            if logger.mlflow_uri is None:
                break
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, previous[1])
        signal.signal(signal.SIGXFSZ, previous[0])
    logger.close()
    assert logger.mlflow_uri is None
    assert [line for line in capfd.readouterr().err.splitlines() if "step " not in line] == []  # MLflow's own
    assert [r.getMessage() for r in caplog.records if "MLflow" in r.getMessage()] == [
        "MLflow tracking switched off after an error: MlflowException: (sqlite3.OperationalError) disk I/O error"
    ]


def _metrics_on_a_full_disk(out: str) -> dict:
    """On 2 gloo ranks: 2 steps logged, then rank 0's metrics.jsonl meets a file-size limit 10 bytes above its
    size (SIGXFSZ ignored: EFBIG, as a full disk's ENOSPC) at step 3. Returns what rank 0 saw."""
    import resource
    import signal

    import torch.distributed as dist

    from cookbook.metrics import MetricsWriteError

    rank = dist.get_rank()
    info = DistInfo(rank=rank, local_rank=rank, world_size=2, device=torch.device("cpu"), backend="gloo")
    logger = MetricsLogger(out, info, mlflow=False, count_tokens=False, progress=False)
    logger.start(0)
    seen = {}
    for step in (1, 2, 3):
        if step == 3 and rank == 0:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            size = os.path.getsize(logger.jsonl_path)
            seen["size"] = size
            resource.setrlimit(resource.RLIMIT_FSIZE, (size + 10, resource.RLIM_INFINITY))
        logger.add(samples=1, tokens=0, data_wait_s=0.0)
        try:
            logger.log_step(step, loss=1.0, lr=1e-3, grad_norm=None)
        except MetricsWriteError as exc:
            seen.update(error=str(exc), status=exc.exit_status, errno=exc.errno)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return seen


def test_a_full_disk_on_metrics_jsonl_is_one_line_exit_2_and_no_torn_line(tmp_path, caplog):
    """2 ranks for real; rank 0's write of step 3 fails: one line naming the file and the cause, exit status 2 (the
    launcher does not restart it), the file cut back to its 2 whole records. Before: a traceback (exit 1, restarted)
    and a torn 10-byte last line. A run that reopens a file whose last line is torn cuts it with one warning."""
    import errno

    import cookbook
    from cookbook.torchrun import should_restart

    seen = cookbook.distributed(num_processes=2, start_method="fork")(_metrics_on_a_full_disk).distributed(
        str(tmp_path)
    )[0]
    path = tmp_path / "metrics.jsonl"
    assert seen["error"] == (
        f"cannot write {path}: File too large (the disk is full or a file-size limit is "
        f"reached); free space, then run the same command again to resume"
    )
    assert (seen["status"], seen["errno"], should_restart(seen["status"], [seen["status"], 3])) == (
        2,
        errno.EFBIG,
        False,
    )
    assert path.stat().st_size == seen["size"]
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == [1, 2]

    with open(path, "a") as f:  # a crash mid-write
        f.write('{"event": "train", "st')
    MetricsLogger(tmp_path, CPU, mlflow=False, count_tokens=False, progress=False)
    assert path.stat().st_size == seen["size"]
    assert [r.getMessage() for r in caplog.records if "torn" in r.getMessage()] == [
        f"{path}: cut its torn last line (22 bytes, a crash mid-write)"
    ]
