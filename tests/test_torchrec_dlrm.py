"""The TorchRec DLRM recipe on CPU: 2 gloo ranks, 26 small tables, generated Criteo-format rows.

Each run calls the recipe's ``main`` in 2 forked workers (``@cookbook.distributed``) of this process, which
imported torch and TorchRec once (a launch through launch.sh costs ~20 s of start-up on 2 cores); only the
resumed run goes through launch.sh, the way users run the recipe, so its --check validates the resume.
"""

import re

import pytest
import torch
from conftest import (
    FP32_EPS,
    ROOT,
    check,
    fp32_sum_atol,
    fp32_sum_rtol,
    launch,
    launch_and_kill,
    load_recipe,
    main_in_workers,
    read_jsonl,
    train_losses,
)

import cookbook
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError

RECIPE = ROOT / "recipes" / "torchrec-dlrm"
KINDS = ("table_wise", "row_wise", "column_wise", "data_parallel")
STEPS = 40  # two passes over the tiny training split (21 global batches of 2 x 64 rows each)
# fp32 on CPU; the sharded and the single-process model differ only in the order of sums (all-to-all, DDP's
# all-reduce). Measured on this 2-core box: logits identical, weights after one SGD step within 1.5e-8 (absolute;
# values up to ~0.5). A gradient off by the world size, or a table its optimizer missed, is off by > 5e-5.
# Tolerances: fp32 rounding (conftest.fp32_sum_atol) of the over arch's widest sum (16 dense + 26 x 27 / 2 dot
# products) for the logits; for the weights, of the 128 rows' gradient sum, plus 2 eps for rounding p - lr * grad.
GLOBAL_ROWS, OVER_ARCH_IN = 128, 16 + 26 * 27 // 2
COMMON = (f"train.max_steps={STEPS}", "mlflow=false", "train.eval_every=0")


def recipe_module():
    return load_recipe("torchrec-dlrm")


def tiny_config(*overrides):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


@pytest.fixture(autouse=True)
def _cpu_env(monkeypatch):
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


def run_forked(out, *overrides):
    """The recipe's ``main`` on 2 forked workers, as launch.sh would run it after the --check."""
    import os

    os.environ["COOKBOOK_DEVICE"] = "cpu"
    main_in_workers("torchrec-dlrm", f"output_dir={out}", *overrides)
    return out


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory):
    """One uninterrupted run per sharding kind (every table of that kind)."""
    base = tmp_path_factory.mktemp("dlrm-plans")
    return {
        kind: run_forked(
            base / kind, *COMMON, f"sharding.plan={kind}", "sharding.tables={}", "checkpoint.every_steps=-1"
        )
        for kind in KINDS
    }


@pytest.mark.parametrize("kind", KINDS)
def test_every_sharding_kind_trains_and_the_loss_falls(plan_runs, kind):
    records = read_jsonl(plan_runs[kind] / "metrics.jsonl")
    losses = train_losses(plan_runs[kind] / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in range(1, 11)) / 10, sum(losses[s] for s in range(STEPS - 9, STEPS + 1)) / 10
    assert last < first - 0.05, (first, last)
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert summary["eval/auc"] > 0.7 and summary["eval/rows"] == 384  # every 8th of 3,072 rows
    train = [r for r in records if r["event"] == "train"]
    assert all(r["samples_per_s_per_device"] > 0 for r in train) and "tokens_per_s" not in train[0]


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    """The tiny config as shipped (table-wise with a row-wise, a column-wise and a data-parallel table):
    uninterrupted (forked), and through launch.sh with rank 1 SIGKILLed right after the checkpoint of step 15
    is published: the launcher restarts the group, which resumes from that checkpoint by itself."""
    base = tmp_path_factory.mktemp("dlrm-resume")
    full = run_forked(base / "full", *COMMON, "checkpoint.every_steps=15")
    out = base / "resumed"
    proc = launch_and_kill(
        "torchrec-dlrm",
        f"output_dir={out}",
        *COMMON,
        "checkpoint.every_steps=15",
        once=out / "checkpoints" / "step_00000015",
        rank="1",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "restart 1 of 3: rank 1 was killed by SIGKILL" in proc.stderr, proc.stderr[-3000:]
    return full, out, proc


def test_resume_gives_the_uninterrupted_losses(resumed):
    full, out, proc = resumed
    assert "resumed from" in proc.stderr and "(step 15)" in proc.stderr
    assert "row_wise: 1 tables" in proc.stderr and "data_parallel: 1 tables" in proc.stderr
    expected, got = train_losses(full / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, STEPS + 1))
    # The closing lines: the final AUC and log-loss (not the row count), then where the outputs are.
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    done = re.search(rf"done: {STEPS} steps \| eval auc ([\d.]+) logloss ([\d.]+)\n", proc.stderr)
    assert done and [float(v) for v in done.groups()] == pytest.approx(
        [summary["eval/auc"], summary["eval/logloss"]], abs=5e-5
    ), proc.stderr[-3000:]
    assert f"checkpoints: {out / 'checkpoints'}" in proc.stderr and "metrics:" in proc.stderr
    # Same data position, table shards, fused row-wise Adagrad state and dense Adagrad sums: the same math.
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        torch.tensor([expected[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        rtol=1e-6,
        atol=0,
    )


def test_resume_on_another_world_size_is_refused_before_start(resumed):
    with pytest.raises(
        CheckpointError,
        match=r"written by 2 ranks but this job has 1: its data position counts global "
        r"batches of world_size x train.batch_size rows, .*\(resuming on another "
        r"number of processes is supported by modernbert-ddp, qwen-fsdp2-sft and "
        r"retinanet-ddp only\)",
    ):
        check("torchrec-dlrm", f"output_dir={resumed[1]}", *COMMON, "checkpoint.every_steps=15", world_size=1)


def test_a_checkpoint_damaged_in_place_is_passed_over_with_one_warning(resumed, tmp_path, caplog):
    """On a copy of the resumed run's checkpoints: 4 KiB of a table shard of the newest one overwritten in place (its
    size kept) makes the --check take the previous one, with one warning naming the folder and the file. The recipe
    imported as a fresh process imports it (its module code runs again), since it must not silence the warning."""
    import importlib.util
    import shutil

    spec = importlib.util.spec_from_file_location(
        "torchrec_dlrm_train", ROOT / "recipes" / "torchrec-dlrm" / "train.py"
    )
    spec.loader.exec_module(load_recipe("torchrec-dlrm"))  # what a new --check process runs at its start
    out = tmp_path / "run"
    shutil.copytree(resumed[1] / "checkpoints", out / "checkpoints")
    newest, previous = (
        sorted((out / "checkpoints").glob("step_*"))[-1],
        sorted((out / "checkpoints").glob("step_*"))[-2],
    )
    shard = max(newest.glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as f:
        f.seek(shard.stat().st_size // 2)
        f.write(b"\xff" * 4096)
    caplog.clear()
    check("torchrec-dlrm", f"output_dir={out}", *COMMON, "checkpoint.every_steps=15")
    warnings = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(warnings) == 1 and re.fullmatch(
        re.escape(f"warning: checkpoint {newest} is damaged ({shard.name} does not match its checksum (xxh3_64:")
        + r"\w+ in meta\.json, xxh3_64:\w+ now\)\); resuming from "
        + re.escape(f"{previous} instead"),
        warnings[0],
    ), warnings


# ----------------------------------------------------------------------------- correctness
@cookbook.distributed(num_processes=2, start_method="fork")
def _one_sharded_step(base: str):
    """Per kind: save the initial sharded model (DCP), forward and one SGD step on this rank's slice of the
    first global batch, save again. Returns every rank's logits and loss."""
    import torch.distributed.checkpoint as dcp

    train = recipe_module()
    info = cookbook.get_dist_info()
    out = {}
    for kind in KINDS:
        cfg = tiny_config(
            f"sharding.plan={kind}",
            "sharding.tables={}",
            "optim.sparse=sgd",
            "optim.dense=sgd",
            "optim.sparse_lr=0.5",
            "optim.dense_lr=0.5",
        )
        model, optimizer = train.shard_model(cfg, info)
        state = {"app": train.DLRMState(model, optimizer)}
        dcp.save(state, checkpoint_id=f"{base}/{kind}/init")
        batch, _ = next(iter(train.CriteoStream(cfg, info.rank, info.world_size)))
        loss, (_, logits, _) = model(batch)
        loss.backward()
        optimizer.step()
        dcp.save(state, checkpoint_id=f"{base}/{kind}/after")
        out[kind] = cookbook.all_gather_object((logits.detach(), loss.item()))
    return out


def _full_state(path, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(path, tmp_path / "full.pt")
    return torch.load(tmp_path / "full.pt", weights_only=False)["app"]["model"]


def test_sharded_forward_and_step_equal_a_single_process_model(tmp_path):
    """For every kind, the sharded model's logits on the 2 x 64-row global batch and its weights after one SGD
    step (plain SGD, so a wrong gradient scale shows) equal those of one unsharded model (plain
    EmbeddingBagCollection) with the same initial weights, trained on the whole global batch: sharded tables,
    data-parallel tables and the DDP-averaged MLPs all take the gradient of the global-batch mean loss."""
    from torchrec import EmbeddingBagCollection

    train = recipe_module()
    results = _one_sharded_step.distributed(str(tmp_path))[0]
    cfg = tiny_config()
    rows = [
        train.parse_row(line, train.table_sizes(cfg.model), where)
        for where, line in list(train.split_lines(cfg.data.train_files, cfg.data.holdout_every, "train"))[:128]
    ]
    batch = train.to_batch(rows)
    for kind, per_rank in results.items():
        reference = train.build_model(cfg, torch.device("cpu"))
        reference.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
            tables=reference.model.sparse_arch.embedding_bag_collection.embedding_bag_configs(),
            device=torch.device("cpu"),
        )
        reference.load_state_dict(_full_state(tmp_path / kind / "init", tmp_path))
        loss, (_, logits, _) = reference(batch)
        torch.testing.assert_close(
            torch.cat([lg for lg, _ in per_rank]),
            logits.detach(),
            rtol=0,
            atol=fp32_sum_atol(OVER_ARCH_IN, logits.abs().max()),
        )
        assert sum(lo for _, lo in per_rank) / 2 == pytest.approx(loss.item(), rel=fp32_sum_rtol(GLOBAL_ROWS))
        loss.backward()
        expected = {name: p.detach() - 0.5 * p.grad for name, p in reference.named_parameters()}
        update = {name: 0.5 * p.grad.abs().max() for name, p in reference.named_parameters()}
        after = _full_state(tmp_path / kind / "after", tmp_path)
        moved = 0
        for name, value in expected.items():
            torch.testing.assert_close(
                after[name],
                value,
                rtol=2 * FP32_EPS,
                atol=fp32_sum_atol(GLOBAL_ROWS, update[name]),
                msg=f"{kind}: {name}",
            )
            moved += int(not torch.equal(after[name], dict(reference.named_parameters())[name].detach()))
        assert moved == len(expected), f"{kind}: only {moved} of {len(expected)} tensors changed"


# ----------------------------------------------------------------------------- bad input
def _rows_file(tmp_path, edit):
    lines = (RECIPE / "tiny" / "data" / "train.txt").read_text().splitlines()[:200]
    lines = edit(lines)
    path = tmp_path / "rows.txt"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_row_with_a_missing_field_names_its_line(tmp_path):
    path = _rows_file(tmp_path, lambda ls: ls[:6] + ["\t".join(ls[6].split("\t")[:-1])] + ls[7:])
    with pytest.raises(recipe_module().DataError, match=r"rows.txt line 7: 39 tab-separated fields, expected 40"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{path}]", "train.batch_size=8")


def test_a_non_numeric_count_names_its_line_and_column(tmp_path):
    def edit(ls):
        fields = ls[11].split("\t")
        fields[4] = "12x"
        return ls[:11] + ["\t".join(fields)] + ls[12:]

    path = _rows_file(tmp_path, edit)
    with pytest.raises(recipe_module().DataError, match=r"rows.txt line 12, column 5 \(I4\): '12x' is not an integer"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{path}]", "train.batch_size=8")


@pytest.mark.parametrize(
    "value, message",
    [
        ("9" * 400, r"'9+\.\.\.9+' is outside the 64-bit integer range"),
        ("-9223372036854775809", r"'-9223372036854775809' is outside the 64-bit integer range"),
        ("1e999", r"'1e999' is not an integer"),
        ("inf", r"'inf' is not an integer"),
    ],
    ids=["400 digits", "below int64", "1e999", "inf"],
)
@pytest.mark.parametrize("suffix", [".txt", ".csv"])
def test_a_count_too_large_or_infinite_is_one_line_naming_its_line_and_column(tmp_path, value, message, suffix):
    """Criteo text and CSV alike (a 400-digit count once ended in a bare OverflowError), before any worker."""
    train = recipe_module()
    lines = _tiny_rows()[:20]
    fields = lines[6].split("\t")
    fields[4] = value
    lines[6] = "\t".join(fields)
    if suffix == ".csv":
        text = ",".join(train.COLUMNS) + "\n" + "".join(line.replace("\t", ",") + "\n" for line in lines)
        line = 8  # after the header
    else:
        text, line = "".join(line + "\n" for line in lines), 7
    path = tmp_path / f"rows{suffix}"
    path.write_text(text)
    with pytest.raises(train.DataError, match=rf"rows{suffix} line {line}, column 5 \(I4\): {message}"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{path}]", "train.batch_size=8")


def test_a_table_of_size_zero_is_refused(tmp_path):
    sizes = [10] * 26
    sizes[2] = 0
    with pytest.raises(ConfigError, match="table C3 has 0 rows"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"model.table_sizes=[{','.join(map(str, sizes))}]")


def test_row_wise_with_the_planner_on_cpu_says_what_to_do(tmp_path):
    with pytest.raises(ConfigError, match="planner offers no row_wise"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", "sharding.plan=auto", "sharding.tables={C3: row_wise}")


def test_hub_rows_are_written_as_criteo_text_before_workers(tmp_path, monkeypatch):
    """data.hub_id: --check streams the data set's rows into output_dir as Criteo text, which training then
    reads like a local file. The hub is unreachable here, so load_dataset yields the tiny file's rows."""
    import datasets

    train = recipe_module()
    lines = (RECIPE / "tiny" / "data" / "train.txt").read_text().splitlines()
    names = ["label", *train.DENSE, *train.CATEGORICAL]
    rows = [{c: (v if v else None) for c, v in zip(names, line.split("\t"))} for line in lines]
    calls = []

    def fake_load_dataset(hub_id, split, streaming):
        calls.append((hub_id, split, streaming))
        return iter(rows)

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    out = tmp_path / "out"
    printed = check(
        "torchrec-dlrm",
        f"output_dir={out}",
        "data.train_files=[]",
        "data.hub_id=someone/criteo",
        "data.hub_max_rows=300",
    )
    written = out / "hub_data" / "someone__criteo-train.txt"
    assert calls == [("someone/criteo", "train", True)]
    assert f"300 rows written to {written}" in printed and "config OK" in printed
    assert written.read_text().splitlines() == lines[:300]  # None -> empty field, the Criteo text layout

    rows = [{k: v for k, v in r.items() if k not in ("I4", "C7")} for r in rows]
    with pytest.raises(train.DataError, match=r"no column\(s\) I4, C7"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out2'}", "data.train_files=[]", "data.hub_id=someone/criteo")
    assert not (tmp_path / "out2" / "hub_data" / "someone__criteo-train.txt").exists()


# ----------------------------------------------------------------------------- small eval sets
def test_an_eval_set_smaller_than_the_world_size_counts_its_row_once(tmp_path):
    """One validation row on 2 ranks: evaluation finishes, and its log-loss and AUC are those of a single-process
    computation over that one row with the trained weights (the padding row of the empty rank is not counted)."""
    from torchmetrics.classification import BinaryAUROC
    from torchrec import EmbeddingBagCollection

    train = recipe_module()
    row = (RECIPE / "tiny" / "data" / "train.txt").read_text().splitlines()[5]
    one = tmp_path / "one.txt"
    one.write_text(row + "\n")
    out = run_forked(
        tmp_path / "run",
        "train.max_steps=2",
        "mlflow=false",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        f"data.eval_files=[{one}]",
    )
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    assert summary["eval/rows"] == 1
    cfg = tiny_config()
    reference = train.build_model(cfg, torch.device("cpu"))
    reference.model.sparse_arch.embedding_bag_collection = EmbeddingBagCollection(
        tables=reference.model.sparse_arch.embedding_bag_collection.embedding_bag_configs(), device=torch.device("cpu")
    )
    reference.load_state_dict(_full_state(out / "checkpoints" / "step_00000002", tmp_path))
    batch = train.to_batch([train.parse_row(row, train.table_sizes(cfg.model), "one.txt line 1")])
    with torch.no_grad():
        _, (_, logits, labels) = reference.eval()(batch)
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits.float(), labels.float())
    assert summary["eval/logloss"] == pytest.approx(loss.item(), rel=1e-5)
    assert summary["eval/auc"] == pytest.approx(BinaryAUROC()(torch.sigmoid(logits.float()), labels.long()).item())


# ----------------------------------------------------------------------------- input formats
def _tiny_rows(n=200):
    return (RECIPE / "tiny" / "data" / "train.txt").read_text().splitlines()[:n]


def _as_floats(line, sep="\t"):
    """A Criteo row with every non-empty count written as a float (``15`` -> ``15.0``), as pandas writes them."""
    fields = line.split("\t")
    return sep.join(f"{float(v)}" if v and 1 <= i <= 13 else v for i, v in enumerate(fields))


def test_criteo_text_with_bom_crlf_header_and_float_counts_reads_as_the_plain_file(tmp_path):
    train = recipe_module()
    lines = _tiny_rows()
    text = tmp_path / "day_0.txt"
    text.write_bytes(
        (
            "\ufeff"
            + "\t".join(train.COLUMNS)
            + "\r\n"
            + "".join(_as_floats(line).replace("\t0.0", "\t0", 1) + "\r\n" for line in lines)
        ).encode()
    )
    sizes = train.table_sizes(tiny_config().model)
    got = [train.parse_row(line, sizes, w) for w, line in train.split_lines([str(text)], 0, "all")]
    assert got == [train.parse_row(line, sizes, "x") for line in lines]
    assert "(200 rows checked)" in check(
        "torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{text}]", "train.batch_size=8"
    )
    fields = lines[3].split("\t")
    fields[2] = "2.5"
    (tmp_path / "half.txt").write_text("\n".join([*lines[:3], "\t".join(fields)]) + "\n")
    with pytest.raises(train.DataError, match=r"half.txt line 4, column 3 \(I2\): '2.5' is not an integer"):
        check(
            "torchrec-dlrm",
            f"output_dir={tmp_path / 'out'}",
            f"data.train_files=[{tmp_path / 'half.txt'}]",
            "train.batch_size=8",
        )


def test_criteo_csv_and_parquet_are_converted_once_per_content(tmp_path, capsys):
    """A CSV with a header and counts written as floats (and a parquet file of the same rows) becomes the
    Criteo text it came from, under output_dir/converted/ keyed by the source's hash: a second check reuses
    it, a changed source is converted again, and a non-integer count is refused naming line and column."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = recipe_module()
    lines = _tiny_rows()
    src = tmp_path / "criteo.csv"
    src.write_text("\ufeff" + ",".join(train.COLUMNS) + "\r\n" + "".join(_as_floats(l, ",") + "\r\n" for l in lines))
    args = (f"output_dir={tmp_path / 'out'}", f"data.train_files=[{src}]", "train.batch_size=8")
    assert "200 rows converted" in check("torchrec-dlrm", *args)
    converted = sorted((tmp_path / "out" / "converted").glob("criteo-*.txt"))
    assert len(converted) == 1 and converted[0].read_text().splitlines() == lines
    assert "converted" not in check("torchrec-dlrm", *args)  # same content: the converted file is reused

    src.write_text(",".join(train.COLUMNS) + "\n" + "".join(_as_floats(l, ",") + "\n" for l in lines[:100]))
    assert "100 rows converted" in check("torchrec-dlrm", *args)
    new = sorted(set((tmp_path / "out" / "converted").glob("criteo-*.txt")) - set(converted))
    assert len(new) == 1 and new[0].read_text().splitlines() == lines[:100]

    columns = list(zip(*[line.split("\t") for line in lines]))
    table = pa.table(
        {
            name: [int(v) if v else None for v in col]
            if name in train.DENSE or name == "label"
            else [v or None for v in col]
            for name, col in zip(train.COLUMNS, columns)
        }
    )
    table = table.cast(
        pa.schema([(n, pa.float64() if n in train.DENSE else table.schema.field(n).type) for n in train.COLUMNS])
    )  # counts as float64 with nulls, as pandas stores them
    pq.write_table(table, tmp_path / "criteo.parquet")
    assert "200 rows converted" in check(
        "torchrec-dlrm",
        f"output_dir={tmp_path / 'out'}",
        f"data.train_files=[{tmp_path / 'criteo.parquet'}]",
        "train.batch_size=8",
    )
    parquet_text = [p for p in (tmp_path / "out" / "converted").glob("criteo-*.txt") if p not in (*converted, *new)]
    assert len(parquet_text) == 1 and parquet_text[0].read_text().splitlines() == lines

    bad = [_as_floats(line, ",").split(",") for line in lines[:20]]
    bad[4][2] = "7.25"
    bad = [",".join(fields) for fields in bad]
    (tmp_path / "bad.csv").write_text(",".join(train.COLUMNS) + "\n" + "\n".join(bad) + "\n")
    with pytest.raises(train.DataError, match=r"bad.csv line 6, column 3 \(I2\): '7.25' is not an integer"):
        check("torchrec-dlrm", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{tmp_path / 'bad.csv'}]")
    assert not list((tmp_path / "out" / "converted").glob("bad-*"))  # nothing half-written is left


def test_a_json_value_is_named_as_the_file_wrote_it():
    """A JSON row's bad value reads as JSON (``true``, ``7.25``), quoted, not as Python's ``True``."""
    train = recipe_module()
    row = {name: 0 for name in train.COLUMNS} | {name: "a1" for name in train.CATEGORICAL}
    with pytest.raises(train.DataError, match=r"^r\.jsonl line 2, column label: 'true' is not 0 or 1$"):
        train.criteo_line(row | {"label": True}, "r.jsonl line 2")
    with pytest.raises(train.DataError, match=r"^r\.jsonl line 2, column I2: '7\.25' is not an integer$"):
        train.criteo_line(row | {"I2": 7.25}, "r.jsonl line 2")


def test_hub_counts_written_as_floats_become_integers_and_a_stale_file_is_rewritten(tmp_path, monkeypatch):
    """Hub data sets often store counts as float64 (``260.0``, None for missing): the text written has integers.
    A file left by an earlier converter, or written for another data.hub_max_rows, is written again."""
    import datasets

    train = recipe_module()
    lines = _tiny_rows(50)
    rows = [
        {
            c: (float(v) if v and c in train.DENSE else int(v) if c == "label" else v or None)
            for c, v in zip(train.COLUMNS, line.split("\t"))
        }
        for line in lines
    ]
    monkeypatch.setattr(datasets, "load_dataset", lambda hub_id, split, streaming: iter(rows))
    out = tmp_path / "out"
    written = out / "hub_data" / "someone__criteo-train.txt"
    written.parent.mkdir(parents=True)
    written.write_text("stale\n")  # left by an earlier version, which wrote no record beside it
    args = (f"output_dir={out}", "data.train_files=[]", "data.hub_id=someone/criteo", "train.batch_size=8")
    assert "50 rows written" in check("torchrec-dlrm", *args)
    assert written.read_text().splitlines() == lines
    assert "rows written" not in check("torchrec-dlrm", *args)  # same settings: reused
    assert "20 rows written" in check("torchrec-dlrm", *args, "data.hub_max_rows=20")
    assert written.read_text().splitlines() == lines[:20]


def test_a_bad_row_found_by_rank_1_reaches_the_user_as_one_line(tmp_path):
    """A bad row beyond ``data.check_rows`` in rank 1's slice of a global batch (rows 9-16 of the first batch of
    2 x 8 rows) is found by rank 1 alone, after the workers started: its one line comes first, no traceback."""

    def edit(ls):
        fields = ls[12].split("\t")
        fields[4] = "12x"
        return ls[:12] + ["\t".join(fields)] + ls[13:]

    path = _rows_file(tmp_path, edit)
    proc = launch(
        "torchrec-dlrm",
        f"output_dir={tmp_path / 'out'}",
        f"data.train_files=[{path}]",
        "data.check_rows=5",
        "data.holdout_every=0",
        "train.batch_size=8",
        "train.max_steps=4",
        "checkpoint.every_steps=0",
        "mlflow=false",
    )
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert errors[0] == f"error: [rank 1] {path} line 13, column 5 (I4): '12x' is not an integer", proc.stderr
    assert errors[-1] == (  # the launcher's last line repeats the cause
        f"error: rank 1 failed first (exit status 2: bad configuration, data or checkpoint): {path} line 13, column 5 "
        "(I4): '12x' is not an integer; the other ranks were stopped"
    ), proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr


def test_a_criteo_text_file_that_is_not_utf8_or_empty_is_named(tmp_path):
    train = recipe_module()
    lines = (RECIPE / "tiny" / "data" / "train.txt").read_text().splitlines()[:50]
    utf16 = tmp_path / "utf16.txt"
    utf16.write_text("\n".join(lines) + "\n", encoding="utf-16")
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes(
        ("\n".join(lines[:30]) + "\n").encode() + b"0\t1\tcaf\xe9\n" + ("\n".join(lines[30:]) + "\n").encode()
    )
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    common = (f"output_dir={tmp_path / 'out'}", "train.batch_size=8")
    with pytest.raises(train.DataError, match=rf"{utf16} line 1: not UTF-8 text \(.*\); save it as UTF-8"):
        check("torchrec-dlrm", *common, f"data.train_files=[{utf16}]")
    with pytest.raises(train.DataError, match=rf"{latin1} line 31: not UTF-8 text"):
        check("torchrec-dlrm", *common, f"data.train_files=[{latin1}]")
    with pytest.raises(train.DataError, match=rf"{empty}: no rows \(an empty file, or a header line alone\)"):
        check("torchrec-dlrm", *common, f"data.train_files=[{empty}]")
