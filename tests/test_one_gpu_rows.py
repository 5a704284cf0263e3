"""benchmarks/one_gpu_rows.py (the numbers kept from each part of benchmarks/one_gpu_rows.sh) on hand-written
metrics records, and scripts/make_tiny_interactions.py's options (the two-tower part's data)."""

import csv
import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


rows = load(ROOT / "benchmarks" / "one_gpu_rows.py", "one_gpu_rows")
interactions = load(ROOT / "scripts" / "make_tiny_interactions.py", "make_tiny_interactions")


def write(path: Path, records: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_modernbert_numbers(tmp_path):
    train = [
        {
            "event": "train",
            "step": s,
            "step_time_s": t,
            "data_wait_s": w,
            "data_wait_frac": w / t,
            "samples_per_s_per_device": 32 / t,
        }
        for s, t, w in [(10, 6.0, 0.5), (20, 0.05, 0.001), (30, 0.04, 0.001), (40, 0.06, 0.003), (50, 0.05, 0.002)]
    ]
    train[0]["epoch_start_wait_s"] = 0.4  # the first pass
    train[3]["epoch_start_wait_s"] = 0.02  # epoch 2 began in the window ending at step 40
    summary = {"event": "summary", "step": 50, "startup_s": 80.5, "first_step_s": 55.0, "final_eval_s": 2.5}
    ev = {"event": "eval", "step": 50, "eval/accuracy": 0.5, "eval/samples": 2000.0}
    out = rows.modernbert(write(tmp_path / "m.jsonl", train + [ev, summary]))
    assert (out["startup_s"], out["first_step_s"], out["final_eval_s"]) == (80.5, 55.0, 2.5)
    assert [(e["step"], e["epoch_start_wait_s"]) for e in out["epoch_starts"]] == [(10, 0.4), (40, 0.02)]
    # windows after step min(20, 50 // 2) = 20: steps 30, 40, 50
    assert out["median_step_time_s"] == 0.05 and out["median_data_wait_s"] == 0.002
    assert out["samples_per_s_per_device"] == pytest.approx(640.0)  # median of 800, 533.3, 640
    assert out["steps"] == 50 and out["final_eval"] == {"eval/accuracy": 0.5, "eval/samples": 2000.0}


def test_ray_numbers_and_missing_file(tmp_path):
    train = [
        {"event": "train", "step": 50 * (i + 1), "samples_per_s_per_device": v, "step_time_s": 4096 / v}
        for i, v in enumerate([1e5, 4e5, 5e5, 6e5, 5.5e5])
    ]
    ev = {
        "event": "eval",
        "step": 250,
        "eval/recall_at_10": 0.3,
        "eval/popularity_recall_at_10": 0.05,
        "eval/users": 100.0,
        "eval/loss": 1.0,
    }
    out = rows.ray(write(tmp_path / "r.jsonl", train + [ev]))
    assert out["samples_per_s_per_device"] == 5.25e5  # windows 2-5 (the first fifth left out): 4, 5, 5.5, 6 x 1e5
    assert out["steps"] == 250
    assert out["eval"] == {
        "step": 250,
        "eval/recall_at_10": 0.3,
        "eval/popularity_recall_at_10": 0.05,
        "eval/users": 100.0,
    }
    assert rows.ray(str(tmp_path / "none.jsonl")) == {} and rows.modernbert(str(tmp_path / "none.jsonl")) == {}


def test_record_and_zero(tmp_path):
    log = tmp_path / "run.log"
    log.write_text("loading\nTraceback (most recent call last):\nValueError: bad\nlast line\n")
    ok = rows.record("zero3", 0, str(log), '{"tokens_per_s_per_gpu": 1234.5}')
    assert ok == {"part": "zero3", "exit_status": 0, "tokens_per_s_per_gpu": 1234.5}
    failed = rows.record("zero2", 124, str(log))
    assert failed["error"] == "over its time limit; Traceback (most recent call last): | ValueError: bad"
    assert rows.record("ray", 1, str(tmp_path / "no.log"))["error"] == "no log"
    summary = tmp_path / "s.json"
    summary.write_text(json.dumps({"run": "zero3", "step_ms": 250.0, "losses": {"5": 10.0}}) + "\n")
    assert rows.zero(str(summary)) == {"run": "zero3", "step_ms": 250.0}
    assert rows.zero(str(tmp_path / "none.json")) == {}


def test_interactions_options(tmp_path):
    out = tmp_path / "i.csv"
    interactions.main(out=out)  # the defaults: the checked-in tiny set, byte for byte
    assert out.read_bytes() == (ROOT / "recipes" / "two-tower-ray" / "tiny" / "data" / "interactions.csv").read_bytes()
    interactions.main(users=50, items=60, groups=3, per_user=7, out=out)
    got = list(csv.DictReader(out.open()))
    assert len(got) == 350 and len({r["user_id"] for r in got}) == 50
    by_user = {}
    for r in got:
        by_user.setdefault(r["user_id"], []).append(r["item_id"])
    assert all(len(set(v)) == 7 for v in by_user.values())  # no user repeats an item
    with pytest.raises(ValueError, match="per_user=21 exceeds the 20 items of a group"):
        interactions.main(users=5, items=60, groups=3, per_user=21, out=out)
