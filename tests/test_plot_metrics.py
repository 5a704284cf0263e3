"""scripts/plot_metrics.py on the committed FSDP2 and ZeRO-3 results (benchmarks/results): one PNG, five panels, one
line per run with the records' own numbers."""

import json
import subprocess
import sys

import pytest
from conftest import ROOT

sys.path.insert(0, str(ROOT / "scripts"))
import plot_metrics  # noqa: E402

RUNS = [
    ROOT / "benchmarks" / "results" / "sft-h200x2-fsdp2-sdpa-seq2048.jsonl",
    ROOT / "benchmarks" / "results" / "sft-h200x2-trl-zero3-seq2048.jsonl",
]


def test_two_runs_side_by_side_on_five_panels():
    axes = plot_metrics.figure(RUNS, labels=["fsdp2", "zero3"]).axes
    assert [ax.get_title() for ax in axes] == [
        "loss",
        "learning rate",
        "tokens/s per device",
        "MFU (%)",
        "memory (GiB)",
    ]
    records = [[json.loads(line) for line in path.read_text().splitlines()] for path in RUNS]
    train = [[r for r in recs if r["event"] == "train"] for recs in records]
    for ax, key, scale in [
        (axes[0], "loss", 1),
        (axes[1], "lr", 1),
        (axes[2], "tokens_per_s_per_gpu", 1),
        (axes[3], "mfu", 100),
    ]:
        assert [line.get_label() for line in ax.lines] == ["fsdp2", "zero3"]
        for line, recs in zip(ax.lines, train):
            assert list(line.get_xdata()) == [r["step"] for r in recs]
            assert list(line.get_ydata()) == pytest.approx([r[key] * scale for r in recs])
    assert [line.get_label() for line in axes[4].lines] == [
        "fsdp2 allocated",
        "fsdp2 reserved",
        "zero3 allocated",
        "zero3 reserved",
    ]
    assert list(axes[4].lines[2].get_ydata()) == pytest.approx([r["mem_allocated_gib"] for r in train[1]])


def test_the_command_writes_a_png_and_the_function_returns_its_panels(tmp_path):
    assert plot_metrics.plot(RUNS[:1], tmp_path / "one.png") == [
        "loss",
        "learning rate",
        "tokens/s per device",
        "MFU (%)",
        "memory (GiB)",
    ]
    assert (tmp_path / "one.png").read_bytes()[:4] == b"\x89PNG"
    out = tmp_path / "runs.png"
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "plot_metrics.py"), *map(str, RUNS), "-o", str(out)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"event": "train", "step": 1}\nnot json\n{"event": "train", "step": 2}\n')
    with pytest.raises(SystemExit, match=rf"^error: {bad} line 2: not JSON"):
        plot_metrics.read_run(bad)


def test_a_last_record_cut_short_is_left_out_with_a_warning(tmp_path, capsys):
    cut = tmp_path / "metrics.jsonl"  # a run killed while it wrote its last record
    cut.write_text(
        '{"event": "train", "step": 1, "loss": 2.0}\n{"event": "train", "step": 2, "loss": 1.5}\n{"event": "tr'
    )
    train, evals = plot_metrics.read_run(tmp_path)
    assert list(train) == [1, 2] and train[2]["loss"] == 1.5 and evals == {}
    assert (
        capsys.readouterr().err
        == f"warning: {cut} line 3: not JSON (Unterminated string starting at), the last line, cut short: left out\n"
    )
