"""The two-tower Ray Train recipe on CPU: 2 Ray workers on generated interactions."""

import pytest
from conftest import ROOT, read_jsonl
from ray_cluster import recipe_module, run_driver_forked, run_launch, summary

RECIPE = ROOT / "recipes" / "two-tower-ray"


def test_stop_after_the_first_checkpoint_resume_and_beat_popularity(ray_env, tmp_path):
    out = tmp_path / "run"
    # The stopped run: the driver forked from pytest (no interpreter start-up); the resume goes through launch.sh.
    first = run_driver_forked("two-tower-ray", ray_env, f"output_dir={out}", "train.stop_at_epoch=1")
    assert first.returncode == 0, first.stderr[-4000:]
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "eval"] == [12]  # 3,300 pairs / (128 x 2) = 12 steps
    assert summary(records)["reports_per_worker"] == [1, 1]

    second = run_launch("two-tower-ray", ray_env, f"output_dir={out}")
    assert second.returncode == 0, second.stderr[-4000:]
    assert "checkpoint_epoch_0001 (epoch 1, step 12, world_size 2)" in second.stderr
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert min(r["step"] for r in train[len([r for r in train if r["step"] <= 12]):]) > 12  # continued after step 12
    assert train[-1]["step"] == 48 and train[-1]["loss"] < train[0]["loss"] - 0.5, (train[0]["loss"], train[-1]["loss"])
    end = summary(records)
    assert end["reports_per_worker"] == [3, 3] and end["param_fingerprints"][0] == end["param_fingerprints"][1]
    final = [r for r in records if r["event"] == "eval"][-1]
    assert final["eval/users"] == 300  # every held-out user scored once across the two workers
    assert final["eval/recall_at_10"] > 2 * final["eval/popularity_recall_at_10"], final


@pytest.mark.parametrize("content, expected", [
    ("user,item\nu1,i1\n", r"missing column\(s\) \['user_id', 'item_id'\]; found \['user', 'item'\]"),
    ("user_id,item_id\nu1,i1\nu1,\n", r"interactions.csv line 3: empty item_id"),
    ("user_id,item_id,timestamp\nu1,i1,5\nu1,i2,later\n", r"line 3: timestamp 'later' is not a number"),
    ("user_id,item_id\nu1,i1\nu2,i2\n", r"no user has 2 or more interactions"),
])
def test_bad_interaction_files(tmp_path, content, expected):
    f = tmp_path / "interactions.csv"
    f.write_text(content)
    train = recipe_module("two-tower-ray")
    with pytest.raises(ValueError, match=expected):
        train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}", f"data.interactions={f}"])


@pytest.mark.parametrize("name, content, overrides, expected", [
    ("rows.jsonl", '{"user_id": "u1", "item_id": "i1"}\n\n{"user_id": "u1", "item_id": \n',
     [], r"rows.jsonl line 3: not valid JSON"),
    ("rows.jsonl", '{"user_id": "u1", "item_id": "i1"}\n["u1", "i2"]\n', [], r"rows.jsonl row 2: expected a JSON object, got list"),
    ("rows.csv", "user_id,item_id,ts\nu1,i1,1\nu1,i2,2\n", ["data.time_column=tstamp"],
     r"data.time_column='tstamp' is not a column; found \['user_id', 'item_id', 'ts'\]"),
])
def test_bad_rows_and_columns_are_named(tmp_path, name, content, overrides, expected):
    f = tmp_path / name
    f.write_text(content)
    train = recipe_module("two-tower-ray")
    with pytest.raises(ValueError, match=expected):
        train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}", f"data.interactions={f}",
                    *overrides])
