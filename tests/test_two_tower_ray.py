"""The two-tower Ray Train recipe on CPU: 2 Ray workers on generated interactions."""

import re
from datetime import datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import ROOT, read_jsonl
from ray_cluster import recipe_module, run_driver_forked, summary

RECIPE = ROOT / "recipes" / "two-tower-ray"


def reference_recall(model, data, ks: list[int]) -> dict[str, float]:
    """recall@k the plain way, one held-out user at a time: the held-out item's rank among the items
    the user did not have in training (the held-out item itself always competes)."""
    with torch.no_grad():
        user_emb = model.user_tower(torch.as_tensor(data.eval_users)).numpy()
        item_emb = model.item_tower(torch.arange(data.num_items)).numpy()
    hits = dict.fromkeys(ks, 0)
    for emb, user, target in zip(user_emb, data.eval_users, data.eval_items):
        scores = item_emb @ emb
        ranked = np.ones(data.num_items, dtype=bool)
        ranked[data.train_items[data.train_users == user]] = False
        ranked[target] = True
        above = int((scores[ranked] > scores[target]).sum())
        for k in ks:
            hits[k] += above < k
    return {f"recall_at_{k}": hits[k] / len(data.eval_users) for k in ks}


def evaluate_checkpoint(out: Path) -> tuple[dict, dict]:
    """The newest checkpoint of the run in ``out`` evaluated in this process (one process, no Ray), by
    the recipe's `recall_at_k` and by `reference_recall`: what the run's last eval record must equal."""
    train = recipe_module("two-tower-ray")
    cfg = train.load_config(train.Config, out / "config.yaml")  # the run's resolved config
    data = train.read_interactions(cfg.data)
    model = train.TwoTower(data.num_users, data.num_items, cfg.model)
    newest = sorted(out.glob("checkpoint_epoch_*"))[-1]
    model.load_state_dict(torch.load(newest / "state.pt", weights_only=True)["model"])
    ks = cfg.train.recall_k
    return train.recall_at_k(model, data, ks, 0, 1, torch.device("cpu")), reference_recall(model.eval(), data, ks)


def assert_same_recall(record: dict, alone: dict, reference: dict, users: int) -> None:
    assert record["eval/users"] == alone["users"] == users
    for name, value in alone.items():
        assert record[f"eval/{name}"] == pytest.approx(value, abs=1e-12), name
    for name, value in reference.items():
        assert alone[name] == pytest.approx(value, abs=1e-12), name


def test_stop_after_the_first_checkpoint_resume_and_beat_popularity(ray_env, tmp_path):
    out = tmp_path / "run"
    # Both runs: the driver forked from pytest (no interpreter start-up); launch.sh is the other Ray recipes' (tested
    # there, and test_ray_train checks that the scripts are the same).
    first = run_driver_forked(
        "two-tower-ray", ray_env, f"output_dir={out}", "train.stop_at_epoch=1", "mlflow=false"
    )  # MLflow in the Ray workers: the other Ray recipes' tests
    assert first.returncode == 0, first.stderr[-4000:]
    noise = ("\x1b[", "Failed to query Ray Train Controller", "Reporting training result", "successfully created")
    assert not [n for n in noise if n in first.stderr], first.stderr[-4000:]  # Ray's own lines that repeat ours
    assert "\nstopped at epoch 1 of 4 (train.stop_at_epoch): epoch 1 step 12 " in first.stderr
    assert "\ndone:" not in first.stderr and "run again without train.stop_at_epoch" in first.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "eval"] == [12]  # 3,300 pairs / (128 x 2) = 12 steps
    assert summary(records)["reports_per_worker"] == [1, 1]

    second = run_driver_forked("two-tower-ray", ray_env, f"output_dir={out}", "mlflow=false")  # Ray resumes the run
    assert second.returncode == 0, second.stderr[-4000:]
    assert "checkpoint_epoch_0001 (epoch 1, step 12, world_size 2)" in second.stderr
    assert re.search(r"\ndone: epoch 4 step 48 recall_at_10 0\.\d{4} .* users 300 \| checkpoint ", second.stderr)
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert min(r["step"] for r in train[len([r for r in train if r["step"] <= 12]) :]) > 12  # continued after step 12
    assert train[-1]["step"] == 48 and train[-1]["loss"] < train[0]["loss"] - 0.5, (train[0]["loss"], train[-1]["loss"])
    end = summary(records)
    assert end["reports_per_worker"] == [3, 3] and end["param_fingerprints"][0] == end["param_fingerprints"][1]
    final = [r for r in records if r["event"] == "eval"][-1]
    assert final["eval/users"] == 300  # every held-out user scored once across the two workers
    assert final["eval/recall_at_10"] > 2 * final["eval/popularity_recall_at_10"], final
    assert_same_recall(final, *evaluate_checkpoint(out), users=300)  # the same weights in one process

    n_records = len(records)
    third = run_driver_forked("two-tower-ray", ray_env, f"output_dir={out}", "mlflow=false", run_main=True)  # done
    assert third.returncode == 0, third.stderr[-4000:]
    assert "already complete: 4 of 4 epochs" in third.stderr and len(read_jsonl(out / "metrics.jsonl")) == n_records


def _recall_on_two_workers(interactions: str) -> tuple[dict, dict | None]:
    """The recipe's evaluation (`recall_at_k` of this worker's share of the held-out users, summed over the
    workers) on each of 2 workers, with the same weights; returns the result and rank 0's weights."""
    import cookbook

    train = recipe_module("two-tower-ray")
    info = cookbook.get_dist_info()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", [f"data.interactions={interactions}"])
    data = train.read_interactions(cfg.data)
    torch.manual_seed(cfg.train.seed)
    model = train.TwoTower(data.num_users, data.num_items, cfg.model)
    result = train.recall_at_k(model, data, cfg.train.recall_k, info.rank, info.world_size, info.device)
    return result, model.state_dict() if info.is_main else None


def test_one_held_out_user_on_two_workers_finishes_and_counts_once(tmp_path):
    import cookbook

    rows = (RECIPE / "tiny" / "data" / "interactions.csv").read_text().splitlines()
    first_of_each = {}
    for line in rows[1:]:
        first_of_each.setdefault(line.split(",")[0], line)
    # u0000 keeps its 12 interactions (one held out); every other user has one, so nothing to hold out.
    kept = [line for line in rows[1:] if line.startswith("u0000,")] + [
        v for k, v in first_of_each.items() if k != "u0000"
    ]
    f = tmp_path / "one_user.csv"
    f.write_text("\n".join([rows[0], *kept]) + "\n")
    # Worker 1 scores no user and must still join the sum (a hang fails the collective after its timeout).
    run = cookbook.distributed(num_processes=2, start_method="fork", timeout_minutes=1)(_recall_on_two_workers)
    (final, state), (other, _) = run.distributed(str(f))
    assert final == other
    train = recipe_module("two-tower-ray")
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", [f"data.interactions={f}"])
    data = train.read_interactions(cfg.data)
    model = train.TwoTower(data.num_users, data.num_items, cfg.model)
    model.load_state_dict(state)  # the same weights in one process
    ks = cfg.train.recall_k
    assert_same_recall(
        {f"eval/{k}": v for k, v in final.items()},
        train.recall_at_k(model, data, ks, 0, 1, torch.device("cpu")),
        reference_recall(model.eval(), data, ks),
        users=1,
    )


def test_recall_at_k_sharded_and_with_repeats_equals_the_plain_computation():
    train = recipe_module("two-tower-ray")
    rng = np.random.default_rng(0)
    users = np.repeat(np.arange(40), 4)
    items = rng.integers(0, 8, len(users))
    eval_items = rng.integers(0, 8, 40)
    eval_items[::2] = items[::8]  # every other user's held-out item is one it also had in training
    data = train.Interactions(users, items, np.arange(40), eval_items, 40, 8, np.bincount(items, minlength=8))
    torch.manual_seed(0)
    model = train.TwoTower(40, 8, train.ModelConfig(embedding_dim=8, hidden_dim=16, output_dim=4)).eval()
    ks, cpu = [1, 2, 3, 8], torch.device("cpu")
    whole = train.recall_at_k(model, data, ks, 0, 1, cpu, chunk=7)
    assert whole["users"] == 40
    for name, value in reference_recall(model, data, ks).items():
        assert whole[name] == pytest.approx(value, abs=1e-12), name
    assert whole["recall_at_8"] == whole["popularity_recall_at_8"] == 1.0  # every item is in the top 8
    # Worker r of 3 scores users r, r + 3, ...: without a process group nothing is summed, so add the shards here.
    shards = [train.recall_at_k(model, data, ks, r, 3, cpu) for r in range(3)]
    assert [s["users"] for s in shards] == [14, 13, 13]
    for name in whole:
        if name != "users":
            assert sum(s[name] * s["users"] for s in shards) == pytest.approx(whole[name] * 40, abs=1e-9), name


# ----------------------------------------------------------------------------- input formats (before Ray starts)
def _read(tmp_path, name: str, content: str | bytes, *overrides: str):
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    train = recipe_module("two-tower-ray")
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", [f"data.interactions={f}", *overrides])
    return train.read_interactions(cfg.data)


PLAIN = "user_id,item_id,timestamp\n1,10,1\n1,11,2\n2,10,3\n2,12,4\n2,11,5\n"


def _parquet(**columns) -> bytes:
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    out = io.BytesIO()
    pq.write_table(pa.table(columns), out)
    return out.getvalue()


@pytest.mark.parametrize(
    "name, content",
    [
        ("excel.csv", b"\xef\xbb\xbf" + PLAIN.replace("\n", "\r\n").encode()),  # byte-order mark, CRLF
        ("blank_lines.csv", PLAIN.replace("1,11,2\n", "1,11,2\n\n \n") + "\n\n"),
        (
            "floats.csv",
            PLAIN.replace("\n1,10,", "\n1.0,10,").replace("2,12,", "2,12.00,").replace("2,11,5", " 2.0 ,11,5.0"),
        ),
        ("rows.tsv", PLAIN.replace(",", "\t").replace("\n2\t10", "\n \n2\t10")),  # a whitespace-only line
        (
            "rows.json",
            '[{"user_id": 1, "item_id": 10, "timestamp": 1}, {"user_id": 1, "item_id": 11, "timestamp": 2}, '
            '{"user_id": 2, "item_id": 10, "timestamp": 3}, {"user_id": 2, "item_id": 12, "timestamp": 4}, '
            '{"user_id": 2, "item_id": 11, "timestamp": 5}]',
        ),
        (
            "rows.parquet",
            _parquet(
                user_id=[1, 1, 2, 2, 2],
                item_id=[10.0, 11.0, 10.0, 12.0, 11.0],  # ids as floats
                timestamp=[datetime(2024, 1, 1, 0, 0, s) for s in range(1, 6)],
            ),
        ),  # a timestamp column
        (
            "rows.jsonl",
            "\ufeff"
            + "".join(
                f'{{"user_id": {u}, "item_id": "{i}", "timestamp": {t}}}\n\n'
                for u, i, t in (("1.0", 10, 1), (1, 11, 2), (2, "10.0", 3), (2, 12, 4), (2, 11, 5))
            ),
        ),
    ],
)
def test_native_interaction_files_read_as_the_plain_csv(tmp_path, name, content):
    plain, other = _read(tmp_path, "plain.csv", PLAIN), _read(tmp_path, name, content)
    for field in ("train_users", "train_items", "eval_users", "eval_items", "item_counts"):
        assert getattr(other, field).tolist() == getattr(plain, field).tolist(), field
    assert (other.num_users, other.num_items) == (plain.num_users, plain.num_items) == (2, 3)


@pytest.mark.parametrize(
    "name, content, overrides, expected",
    [
        (
            "interactions.csv",
            "user,item\nu1,i1\n",
            [],
            r"missing column\(s\) \['user_id', 'item_id'\]; found \['user', 'item'\] \(the first line must be a header",
        ),
        (
            "interactions.csv",
            "u1,i1\nu1,i2\n",
            [],
            r"found \['u1', 'i1'\] \(the first line must be a header naming the columns",
        ),
        (
            "interactions.csv",
            "user_id;item_id\nu1;i1\nu1;i2\n",
            [],
            r"the header looks semicolon-separated; .csv files are split on",
        ),
        (
            "interactions.csv",
            "user_id,item_id\nu1,i1\n\nu1\n",
            [],
            r"interactions.csv line 4: missing field 'item_id' \(1 of 2 fields: user_id, item_id\)",
        ),
        (
            "interactions.csv",
            "user_id,item_id\nu1,i1,x\nu1,i2\n",
            [],
            r"interactions.csv line 2: 3 fields, expected 2 \(user_id, item_id\)",
        ),
        (
            "interactions.csv",
            "user_id,item_id\nu1,i1\nu1,i2,x\n",
            [],
            r"interactions.csv line 3: 3 fields, expected 2 \(user_id, item_id\)",
        ),
        (
            "interactions.csv",
            "user_id,item_id\nu1,i1\n".encode("utf-16"),
            [],
            r"interactions.csv line 1: not UTF-8 text",
        ),
        (
            "interactions.csv",
            "user_id,item_id,timestamp\nu1,i1,5\n\nu1,i2,later\n",
            [],
            r"line 4: timestamp 'later' is not a number",
        ),
        (
            "interactions.csv",
            "user_id,item_id,timestamp\nu1,i1,5\nu1,i2,1e999\n",
            [],
            r"line 3: timestamp '1e999' is not a finite number",
        ),
        (
            "interactions.csv",
            "user_id,item_id,timestamp\nu1,i1,5\nu1,i2,inf\n",
            [],
            r"line 3: timestamp 'inf' is not a finite number",
        ),
        (
            "interactions.csv",
            "user_id,item_id,timestamp\nu1,i1,5\nu1,i2,nan\n",
            [],
            r"line 3: timestamp 'nan' is not a number",
        ),
        ("interactions.csv", "user_id,item_id\nu1,i1\nu2,i2\n", [], r"no user has 2 or more interactions"),
        ("interactions.csv", "", [], r"interactions.csv: empty file"),
        (
            "rows.jsonl",
            '{"user_id": "u1", "item_id": "i1"}\n\n{"user_id": "u1", "item_id": \n',
            [],
            r"rows.jsonl line 3: not valid JSON",
        ),
        (
            "rows.jsonl",
            '{"user_id": "u1", "item_id": "i1"}\n\n{"user_id": "u1"}\n',
            [],
            r"rows.jsonl line 3: missing field 'item_id' \(found user_id\)",
        ),
        (
            "rows.jsonl",
            '{"user_id": null, "item_id": "i1"}\n{"user_id": "u1", "item_id": "i2"}\n',
            [],
            r"rows.jsonl line 1: missing or empty user_id",
        ),
        (
            "rows.jsonl",
            '{"user_id": "u1", "item_id": "i1"}\n["u1", "i2"]\n',
            [],
            r"rows.jsonl line 2: expected a JSON object, got list",
        ),
        (
            "rows.csv",
            "user_id,item_id,ts\nu1,i1,1\nu1,i2,2\n",
            ["data.time_column=tstamp"],
            r"data.time_column='tstamp' is not a column; found \['user_id', 'item_id', 'ts'\]",
        ),
        ("rows.txt", "user_id,item_id\nu1,i1\n", [], r"rows.txt: unsupported file type '.txt'"),
        (
            "rows.tsv",
            "user_id\titem_id\nu1\ti1\nu1\ti2\tx\n",
            [],
            r"rows.tsv line 3: 3 fields, expected 2 \(user_id, item_id\)",
        ),
        (
            "rows.jsonl",
            '{"user_id": "u1", "item_id": "i1"}\n{"user_id": "u1", "item_id": "i2", "timestamp": 2}\n',
            [],
            r"rows.jsonl line 2: a timestamp, but the first row has none",
        ),
        (
            "rows.jsonl",
            '{"user_id": "u1", "item_id": "i1", "timestamp": 1}\n{"user_id": "u1", "item_id": "i2"}\n',
            [],
            r"rows.jsonl line 2: timestamp None is not a number",
        ),
        (
            "rows.parquet",
            _parquet(user_id=["u1", None], item_id=["i1", "i2"]),
            [],
            r"rows.parquet row 2: missing or empty user_id",
        ),
    ],
)
def test_bad_interaction_files_are_named_before_ray_starts(tmp_path, name, content, overrides, expected):
    f = tmp_path / name
    f.write_bytes(content if isinstance(content, bytes) else content.encode())
    train = recipe_module("two-tower-ray")
    with pytest.raises(ValueError, match=expected):
        train.main(
            [
                "--config",
                str(RECIPE / "tiny.yaml"),
                "--check",
                f"output_dir={tmp_path / 'out'}",
                f"data.interactions={f}",
                *overrides,
            ]
        )
