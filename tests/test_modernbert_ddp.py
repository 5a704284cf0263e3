"""The ModernBERT DDP recipe, run as a user runs it: launch.sh, tiny config, 2 CPU ranks (gloo).

The uninterrupted run (``full_run``, from a copy of the recipe folder), the bad-input refusal and the two real
faults (SIGTERM to the launcher; SIGKILL to a worker, which the launcher restarts) go through launch.sh; the runs that check what ``main`` does on a later call (stop and resume, re-run of a finished run)
call it on 2 workers forked from this process (``main_in_workers``), which saves launch.sh's --check and
torchrun start-up (~20 s on 2 cores per run).
"""

import contextlib
import json
import logging
import os
import re
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import (
    ROOT,
    check,
    kill_worker,
    launch,
    load_recipe,
    main_in_workers,
    read_jsonl,
    start_launch,
    train_losses,
    wait_for,
)

import cookbook
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError

RECIPE = ROOT / "recipes" / "modernbert-ddp"
DataError = load_recipe("modernbert-ddp").DataError


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """An uninterrupted 40-step run of tiny.yaml (checkpoints at 20 and 40), launched as a user who copied the
    recipe folder would: its own launch.sh, from inside the copy, with a relative output_dir. Later runs on
    that output_dir use the copy's tiny.yaml (`copied_config`): a config's relative paths resolve to absolute
    ones beside it, and a resume refuses other paths."""
    copy = tmp_path_factory.mktemp("full") / "my-recipe"
    shutil.copytree(RECIPE, copy)
    t0 = time.time()
    proc = launch("modernbert-ddp", "output_dir=out", cwd=copy)
    proc.wall_s = time.time() - t0  # the whole command, as a user times it
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return copy / "out", proc


def copied_config(out) -> str:
    """tiny.yaml of the copy that `full_run` ran from (its output_dir is ``<copy>/out``)."""
    return str(out.parent / "tiny.yaml")


def run_in_workers(monkeypatch, capfd, *overrides, config: str = "tiny.yaml", ranks: int = 2) -> str:
    """``main`` of tiny.yaml on `ranks` forked workers (what launch.sh runs after its --check); returns their stderr."""
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    log = logging.getLogger("cookbook")
    inherited = [h for h in log.handlers if getattr(h, "_cookbook", False)]
    for h in inherited:  # each worker then logs to this test's stderr (capfd), not to a stream set up earlier
        log.removeHandler(h)
    try:
        capfd.readouterr()
        if ranks == 2:
            main_in_workers("modernbert-ddp", *overrides, config=config)
        else:
            cookbook.distributed(num_processes=ranks, start_method="fork")(_main).distributed(
                ["--config", str(RECIPE / config), *overrides]
            )
        return capfd.readouterr().err
    finally:
        for h in inherited:
            log.addHandler(h)


def _main(argv: list[str]) -> None:
    load_recipe("modernbert-ddp").main(argv)


def test_loss_falls_and_eval_is_logged(full_run):
    out, proc = full_run
    losses = train_losses(out / "metrics.jsonl")
    assert sorted(losses) == list(range(1, 41))
    first, last = sum(losses[s] for s in range(1, 6)) / 5, sum(losses[s] for s in range(36, 41)) / 5
    assert last < 0.5 * first, (first, last)
    evals = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [20, 40]
    assert evals[-1]["eval/accuracy"] > 0.5 and 0.0 < evals[-1]["eval/macro_f1"] <= 1.0
    assert evals[-1]["eval/samples"] == 400  # every validation row once, none duplicated across ranks
    # The final lines give the final evaluation (not the row count) and tell the user where everything is.
    done = re.search(r"done: 40 steps \| eval loss ([\d.]+) accuracy ([\d.]+) macro_f1 ([\d.]+)\n", proc.stderr)
    assert done, proc.stderr[-3000:]
    assert [float(v) for v in done.groups()] == pytest.approx(
        [evals[-1][f"eval/{k}"] for k in ("loss", "accuracy", "macro_f1")], abs=5e-5
    )
    for what in ("metrics:", "MLflow:", "checkpoints:", "model:"):
        assert what in proc.stderr


def test_throughput_metrics_are_per_device_on_cpu(full_run):
    out, _ = full_run
    rec = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"][-1]
    assert rec["samples_per_s_per_device"] == pytest.approx(rec["samples_per_s"] / 2)
    assert rec["tokens_per_s"] > rec["samples_per_s"] > 0 and rec["step_time_s"] > 0
    assert 0 <= rec["data_wait_frac"] <= 1 and rec["rss_gib"] > 0 and rec["grad_norm"] > 0


def test_the_summary_times_the_start_up_and_the_final_evaluation(full_run):
    """``startup_s`` counts from the launcher's start (the check included) to the end of step 1, ``final_eval_s`` is
    the final evaluation alone: both positive, both within the command's wall time, together with the 40 steps."""
    out, proc = full_run
    records = read_jsonl(out / "metrics.jsonl")
    summary = [r for r in records if r["event"] == "summary"][-1]
    steps_s = sum(r["step_time_s"] for r in records if r["event"] == "train")  # steps 2-40 at least
    assert 0 < summary["first_step_s"] < summary["startup_s"]
    assert 0 < summary["final_eval_s"] and summary["startup_s"] + summary["final_eval_s"] + 0.9 * steps_s < proc.wall_s
    shown = re.search(r"time: +startup ([\d.]+) s \(first step ([\d.]+) s\) \| final eval ([\d.]+) s\n", proc.stderr)
    assert shown, proc.stderr[-3000:]
    assert [float(v) for v in shown.groups()] == pytest.approx(
        [summary[k] for k in ("startup_s", "first_step_s", "final_eval_s")], abs=0.051
    )
    # the check tokenized the splits once; the workers memory-mapped them (issue 37): the same rows as tokenize()
    phases = summary["startup_phases"]
    assert summary["tokenized_cache"] is True
    assert list(phases) == ["worker_start", "module_start", "imports", "distributed", "data", "model"]
    assert (
        0
        <= phases["worker_start"]
        <= phases["module_start"]
        <= phases["imports"]
        <= phases["distributed"]
        <= phases["data"]
        <= phases["model"]
        < summary["startup_s"]
    )
    mod = load_recipe("modernbert-ddp")
    cfg = mod.load_config(mod.Config, copied_config(out), [f"output_dir={out}"])
    mod.check_config(cfg, out.parent)
    from transformers import AutoTokenizer

    cached = mod.tokenized_splits(cfg, None, write=False)
    assert cached[4] is True and (out / ".cache").is_dir()
    train_raw, eval_raw = mod.load_splits(cfg.data, cfg.train.seed)
    fresh = mod.tokenize(eval_raw, AutoTokenizer.from_pretrained(cfg.model.tokenizer), cfg.data)[0]
    assert cached[1]["input_ids"] == fresh["input_ids"] and cached[1]["labels"] == fresh["labels"]
    assert len(cached[0]) == len(train_raw)


def test_the_tokenized_cache_gives_the_rows_tokenize_gives_and_a_stale_one_is_not_read(tmp_path):
    """What --check writes (`tokenized_splits` with ``write``) and the workers memory-map: the same input_ids,
    attention_mask and labels as tokenizing the files, and the same truncation counts. A data file whose content
    changed (same size, same mtime) or another data.max_length has another key: tokenized afresh."""
    from transformers import AutoTokenizer

    train = load_recipe("modernbert-ddp")
    data = tmp_path / "data"
    shutil.copytree(RECIPE / "tiny" / "data", data)
    overrides = [
        f"output_dir={tmp_path / 'out'}",
        f"data.train_files=[{data / 'train.csv'}]",
        f"data.eval_files=[{data / 'val.csv'}]",
    ]
    cfg = train.load(str(RECIPE / "tiny.yaml"), overrides)
    tok = AutoTokenizer.from_pretrained(cfg.model.tokenizer)

    def rows(split):
        return {k: split[k] for k in ("input_ids", "attention_mask", "labels")}

    fresh = train.tokenized_splits(cfg, tok, write=False)
    assert fresh[4] is False and not (tmp_path / "out").exists()  # a worker without a cache writes none
    assert train.tokenized_splits(cfg, tok, write=True)[4] is False  # the check: tokenized, then written
    cached = train.tokenized_splits(cfg, None, write=False)  # a worker: read, no tokenizer needed
    assert cached[4] is True and cached[2:4] == fresh[2:4]
    assert rows(cached[0]) == rows(fresh[0]) and rows(cached[1]) == rows(fresh[1])
    assert "arrow" in str(cached[0].cache_files)  # memory-mapped from the cache folder, not read into memory

    csv = data / "train.csv"
    stat, text = csv.stat(), csv.read_text()
    assert text.startswith('"2",')
    csv.write_text('"3",' + text[4:])  # one label changed: same size; mtime put back
    os.utime(csv, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    changed = train.tokenized_splits(cfg, tok, write=False)
    assert changed[4] is False and changed[0]["labels"][0] == 2 != cached[0]["labels"][0]
    csv.write_text(text)
    shorter = train.load(str(RECIPE / "tiny.yaml"), [*overrides, "data.max_length=32"])
    assert train.tokenized_splits(shorter, tok, write=False)[4] is False
    assert train.tokenized_splits(cfg, None, write=False)[4] is True  # the first cache is still there and valid


def test_evaluation_is_eager_unless_model_compile_eval():
    """With model.compile, ``run_eval`` evaluates without compiling anything (torch.compiler's force_eager stance)
    unless ``compiled``; either way the metrics are the same. A counting backend stands in for inductor."""
    train = load_recipe("modernbert-ddp")
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    class Classifier(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(3, 4)

        def forward(self, x, labels):
            logits = self.linear(x)
            return SimpleNamespace(logits=logits, loss=torch.nn.functional.cross_entropy(logits, labels))

    torch.manual_seed(0)
    model = Classifier()
    model.compile(backend=backend)
    loader = [{"x": torch.randn(n, 3), "labels": torch.randint(0, 4, (n,))} for n in (8, 8, 3)]
    autocast = lambda: contextlib.nullcontext()  # noqa: E731
    eager = train.run_eval(model, loader, torch.device("cpu"), autocast, compiled=False)
    assert graphs == [] and eager["samples"] == 19
    compiled = train.run_eval(model, loader, torch.device("cpu"), autocast, compiled=True)
    assert len(graphs) >= 1
    assert compiled == pytest.approx(eager, rel=1e-6)


def test_the_compiled_model_is_not_compiled_again_at_the_second_step():
    """build_model fixes ``config.problem_type``: the model's forward sets it on its first call with labels, which
    failed torch.compile's guard on it and compiled the whole model a second time at step 2 (seen with
    TORCH_LOGS=recompiles). A counting backend stands in for inductor: the second step adds no graph."""
    train = load_recipe("modernbert-ddp")
    cfg = cookbook.config.load_config(train.Config, str(ROOT / "recipes" / "modernbert-ddp" / "tiny.yaml"), [])
    cfg.model.name_or_path = str(ROOT / "recipes" / "modernbert-ddp" / "tiny" / "model")
    from transformers import AutoTokenizer

    model = train.build_model(cfg.model, AutoTokenizer.from_pretrained(cfg.model.name_or_path), torch.device("cpu"))
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model.compile(backend=backend)
    torch.manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, 100, (4, 16)),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
        "labels": torch.randint(0, 4, (4,)),
    }
    counts = []
    for _ in range(2):
        model(**batch).loss.backward()
        counts.append(len(graphs))
    torch._dynamo.reset()
    assert counts[0] >= 1 and counts[1] == counts[0]


@pytest.mark.parametrize("scope", ["model", "layers"])
def test_compile_model_keeps_the_losses_and_compiles_nothing_at_the_second_step(scope, tmp_path):
    """``compile_model`` (whole model, or each encoder layer: regional compilation) gives the eager model's losses
    and parameter names. With ``layers`` the 5 layers of the tiny model made deeper (global attention every 2nd)
    share 2 graphs in the forward (layer 0, which has no attention norm, and the rest: the global and local layers
    differ only in their mask tensors), not one each; neither scope adds a graph at the second step. A counting
    backend stands in for inductor."""
    train = load_recipe("modernbert-ddp")
    cfg = cookbook.config.load_config(train.Config, str(ROOT / "recipes" / "modernbert-ddp" / "tiny.yaml"), [])
    shutil.copytree(ROOT / "recipes" / "modernbert-ddp" / "tiny" / "model", tmp_path / "model")
    model_config = json.loads((tmp_path / "model" / "config.json").read_text())
    model_config.update(num_hidden_layers=5)
    model_config.pop("layer_types", None)  # drawn again from global_attn_every_n_layers
    (tmp_path / "model" / "config.json").write_text(json.dumps(model_config))
    cfg.model.name_or_path = str(tmp_path / "model")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.model.name_or_path)
    torch.manual_seed(0)
    batch = {
        "input_ids": torch.randint(5, 100, (4, 16)),
        "attention_mask": torch.ones(4, 16, dtype=torch.long),
        "labels": torch.randint(0, 4, (4,)),
    }
    batch["attention_mask"][1, 10:] = 0  # a padded row: the masks are tensors, as in training
    losses, names, graphs = {}, {}, []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    for mode in ("eager", scope):
        torch.manual_seed(0)
        model = train.build_model(cfg.model, tokenizer, torch.device("cpu"))
        torch._dynamo.reset()
        if mode != "eager":
            train.compile_model(model, scope, backend=backend)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        losses[mode], counts = [], []
        for _ in range(2):
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[mode].append(loss.item())
            counts.append(len(graphs))
        names[mode] = list(model.state_dict())
    torch._dynamo.reset()
    assert [layer.attention_type for layer in model.model.layers] == ["full_attention", "sliding_attention"] * 2 + [
        "full_attention"
    ]
    assert counts[0] == (2 if scope == "layers" else 1) and counts[1] == counts[0]
    assert losses[scope] == pytest.approx(losses["eager"], rel=1e-5) and losses["eager"][1] != losses["eager"][0]
    assert names[scope] == names["eager"]


def test_ranks_hold_identical_parameters_and_the_export_matches(full_run):
    out, _ = full_run
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    fingerprints = summary["param_fingerprints"]
    assert len(fingerprints) == 2 and fingerprints[0] == fingerprints[1]

    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    exported = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    assert exported.config.id2label[3] == "Sci/Tech"
    assert cookbook.param_fingerprint(exported) == pytest.approx(fingerprints[0], rel=1e-12)

    # The trained model, rebuilt from the last DCP checkpoint, gives the same logits as the export.
    config = AutoConfig.from_pretrained(RECIPE / "tiny" / "model", num_labels=4)
    trained = AutoModelForSequenceClassification.from_config(config).eval()
    state = {"app": {"model": trained.state_dict()}}
    dcp.load(state, checkpoint_id=str(out / "checkpoints" / "step_00000040"))
    trained.load_state_dict(state["app"]["model"])
    tok = AutoTokenizer.from_pretrained(out / "final")
    batch = tok(
        ["striker scores twice in the cup final", "central bank raises interest rates"],
        padding=True,
        return_tensors="pt",
    )
    with torch.no_grad():
        torch.testing.assert_close(exported(**batch).logits, trained(**batch).logits, rtol=0, atol=0)


def test_mlflow_run_holds_the_metrics(full_run):
    out, _ = full_run
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summary["mlflow_uri"])
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.params["train.max_steps"] == "40"
    history = client.get_metric_history(run.info.run_id, "loss")
    assert len(history) == 40
    assert client.get_metric_history(run.info.run_id, "eval_accuracy")[-1].value == pytest.approx(
        summary["eval/accuracy"]
    )


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(full_run, tmp_path, monkeypatch, capfd):
    """A run stopped at step 20 resumes (past a damaged newer checkpoint) and finishes with the uninterrupted run's
    losses. Both parts load data in a worker process per rank (data.num_workers=1, persistent workers; the
    uninterrupted run has none): after the resume every training batch of a rank comes from one worker, the same
    before and after epoch 1 starts at step 26 (a loader that restarts its workers each epoch gives two)."""
    train = load_recipe("modernbert-ddp")
    collated = tmp_path / "collated"

    class Recording(train.DataCollatorWithPadding):  # runs in the loader's worker: which process, which batch size
        def __call__(self, features):
            with open(collated, "a") as f:
                f.write(f"{os.getppid()} {os.getpid()} {len(features)}\n")
            return super().__call__(features)

    monkeypatch.setattr(train, "DataCollatorWithPadding", Recording)
    out_full, _ = full_run
    out = tmp_path / "run"
    run_in_workers(monkeypatch, capfd, f"output_dir={out}", "data.num_workers=1", "train.stop_at_step=20")
    assert sorted(train_losses(out / "metrics.jsonl")) == list(range(1, 21))
    assert not (out / "final").exists()
    collated.unlink()
    # A newer checkpoint whose shard is truncated (a disk that failed after the publish): resume=auto skips it.
    ckpts = out / "checkpoints"
    damaged = shutil.copytree(ckpts / "step_00000020", ckpts / "step_00000030")
    (damaged / "meta.json").write_text((damaged / "meta.json").read_text().replace('"step": 20', '"step": 30'))
    with open(damaged / "__0_0.distcp", "r+b") as f:
        f.truncate(1000)
    # And a newer one with 4 KiB of a shard overwritten in place (same size): only its checksum tells.
    overwritten = shutil.copytree(ckpts / "step_00000020", ckpts / "step_00000035")
    (overwritten / "meta.json").write_text((overwritten / "meta.json").read_text().replace('"step": 20', '"step": 35'))
    with open(overwritten / "__1_0.distcp", "r+b") as f:
        f.seek(4096)
        f.write(b"\xff" * 4096)
    second = run_in_workers(monkeypatch, capfd, f"output_dir={out}", "data.num_workers=1")  # checkpoint.resume=auto
    assert "(step 20)" in second and "resumed from" in second, second[-3000:]
    warnings = [line for line in second.splitlines() if "damaged" in line]
    assert len(warnings) == 1 and re.search(
        rf"warning: checkpoints {re.escape(str(damaged))} \(__0_0.distcp is 1000 bytes, its index says \d+ "
        rf"are needed\); {re.escape(str(overwritten))} \(__1_0.distcp does not match its checksum \(xxh3_64:\w+ in "
        rf"meta.json, xxh3_64:\w+ now\)\) are damaged; resuming from {re.escape(str(ckpts / 'step_00000020'))} "
        rf"instead$",
        warnings[0],
    ), warnings
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_00000020", "step_00000040"]  # the damaged one is gone
    resumed_steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"][20:]
    assert resumed_steps == list(range(21, 41))
    expected, got = train_losses(out_full / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(got) == sorted(expected)
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, 41)], dtype=torch.float64),
        torch.tensor([expected[s] for s in range(1, 41)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    workers = {}  # rank process -> the worker processes that collated its training batches (16 rows)
    for line in collated.read_text().splitlines():
        parent, pid, size = map(int, line.split())
        assert pid != parent  # collated in a worker, not in the rank
        if size == 16:
            workers.setdefault(parent, []).append(pid)
    assert len(workers) == 2
    for pids in workers.values():  # the first batches may come from the iterator that DCP's load made and dropped
        assert (
            len(pids) >= 2 * 20 and len(set(pids[-2 * 20 :])) == 1
        )  # 20 steps of 2 micro-batches, epoch start included
    records = read_jsonl(out / "metrics.jsonl")
    epoch_start = [r["step"] for r in records if r["event"] == "train" and "epoch_start_wait_s" in r]
    assert epoch_start == [1, 21, 26]  # each process's first pass, and epoch 1's (log_every 1)


def test_ddp_speed_settings_leave_the_losses_unchanged(full_run, tmp_path, monkeypatch, capfd):
    """ddp.bucket_cap_mb, ddp.gradient_as_bucket_view and ddp.static_graph change how DDP all-reduces the gradients
    (here: buckets of 10 KiB, so many all-reduces a step), not their values: the first 10 steps equal the
    uninterrupted run's. That run accumulates 2 micro-batches of 16, which static_graph refuses (PyTorch's
    static-graph reducer fails under no_sync), so this one takes the same 32 rows per rank in one micro-batch."""
    out = tmp_path / "run"
    run_in_workers(
        monkeypatch,
        capfd,
        f"output_dir={out}",
        "ddp.bucket_cap_mb=0.01",
        "ddp.gradient_as_bucket_view=true",
        "ddp.static_graph=true",
        "train.micro_batch_size=32",
        "train.grad_accum_steps=1",
        "train.stop_at_step=10",
    )
    expected, got = train_losses(full_run[0] / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, 11))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, 11)], dtype=torch.float64),
        torch.tensor([expected[s] for s in range(1, 11)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    assert load_recipe("modernbert-ddp").Config().ddp.kwargs() == {
        "bucket_cap_mb": 25.0,
        "gradient_as_bucket_view": False,
        "static_graph": False,
    }  # PyTorch's defaults


def test_a_run_resized_from_2_ranks_to_1_and_back_to_2_consumes_each_sample_once_and_keeps_its_losses(
    full_run, tmp_path, monkeypatch, capfd
):
    """The uninterrupted run's checkpoint of step 20 (2 ranks) resumes on 1 rank (accumulation 4: the same global
    batch of 64), which stops at step 30; 2 ranks resume from there and finish the 40 steps. Epoch 0 ends at step 25.

    Every sample index the data loader drew after a resize (recorded by a sampler subclass in each rank), together
    with what 2 ranks of torch's DistributedSampler drew in the first 20 steps, is each index of epoch 0 once; epoch
    1's are that epoch's first ones, once each, in order of the parts. The losses after each resize are the
    uninterrupted run's within float tolerance (the same samples per step, summed in another order), so the model,
    the optimizer moments and the schedule were restored. Each resize says so in one line."""
    from torch.utils.data import DistributedSampler

    train = load_recipe("modernbert-ddp")
    records = tmp_path / "drawn"
    records.mkdir()

    class Recording(train.ResizableSampler):  # what each rank's loader draws, one line per index
        def __iter__(self):
            for index in super().__iter__():
                with open(records / f"{os.getpid()}-{self.num_replicas}-ranks-{self.rank}", "a") as f:
                    f.write(f"{self.epoch} {index}\n")
                yield index

    monkeypatch.setattr(train, "ResizableSampler", Recording)
    full, out = full_run[0], tmp_path / "run"
    shutil.copytree(full, out, ignore=shutil.ignore_patterns("step_00000040", "final", "mlflow*"))
    ckpts, config, common = out / "checkpoints", copied_config(full), ("mlflow=false", "train.eval_every=0")
    with pytest.raises(
        CheckpointError,
        match=r"global batch of 64 samples \(16 micro-batch x 2 accumulation x 2 ranks\) "
        r"but this job's is 32 .* set train.grad_accum_steps=4 \(16 x 4 x 1 = 64\)",
    ):
        check("modernbert-ddp", f"output_dir={out}", *common, config=config, world_size=1)  # launch.sh's check
    one = run_in_workers(
        monkeypatch,
        capfd,
        f"output_dir={out}",
        *common,
        "train.grad_accum_steps=4",
        "train.stop_at_step=30",
        config=config,
        ranks=1,
    )
    two = run_in_workers(monkeypatch, capfd, f"output_dir={out}", *common, config=config)
    for text, ckpt, n, m, at in (
        (one, "step_00000020", 2, 1, "epoch 0 at sample 1280"),
        (two, "step_00000030", 1, 2, "epoch 1 at sample 320"),
    ):
        lines = [line.split(" ", 1)[1] for line in text.splitlines() if " resized: " in line]
        assert lines == [
            f"resized: {ckpts / ckpt} was written by {n} rank{'s' * (n > 1)}, this job has {m}. Resharded "
            f"by DCP: the model and optimizer state. Remapped: the data position, {at} of 1600 in the same "
            f"order (global batch 64 samples, as before). Not restored, as in a fresh run (seeded at "
            f"start-up): the per-rank state (rank_local: dataloader, rng)"
        ], text[-3000:]
    assert "done: 40 steps" in two

    drawn = {(ranks, epoch): [] for ranks in (1, 2) for epoch in (0, 1)}
    for path in records.iterdir():
        for line in path.read_text().splitlines():
            epoch, index = map(int, line.split())
            drawn[int(path.name.split("-")[1]), epoch].append(index)
    before = []  # what the first 20 steps drew: 2 ranks x 20 steps x 2 micro-batches x 16 of torch's sampler
    for rank in range(2):
        sampler = DistributedSampler(range(1600), num_replicas=2, rank=rank, shuffle=True, seed=42, drop_last=True)
        before += list(sampler)[: 20 * 2 * 16]
    assert drawn[2, 0] == []  # the 2-rank resume starts in epoch 1
    assert sorted(before + drawn[1, 0]) == list(range(1600))  # every sample of epoch 0 once, over both world sizes
    epoch1 = torch.randperm(1600, generator=torch.Generator().manual_seed(42 + 1)).tolist()  # DistributedSampler's
    assert sorted(drawn[1, 1]) == sorted(epoch1[: 5 * 64])  # steps 26-30 on 1 rank
    assert sorted(drawn[2, 1]) == sorted(epoch1[5 * 64 : 15 * 64])  # steps 31-40 on 2 ranks

    expected, got = train_losses(full / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"][40:] == list(range(21, 41))
    want = torch.tensor([expected[s] for s in range(21, 41)], dtype=torch.float64)
    have = torch.tensor([got[s] for s in range(21, 41)], dtype=torch.float64)
    torch.testing.assert_close(have, want, rtol=1e-5, atol=0)  # measured: 6e-7 at most


def test_a_killed_worker_and_then_a_preemption_lose_no_step(full_run, tmp_path, monkeypatch, capfd):
    """Two faults of one job, for real, and an end equal to an uninterrupted run's.

    1. A worker lost mid-run: SIGKILL to rank 1 (a child of the launcher, which runs torchrun's agent) right after
       the checkpoint of step 20 is published. The launcher restarts the whole group once, and the workers resume
       from that checkpoint by themselves.
    2. A scheduler's preemption: SIGTERM to the launcher (torchrun passes it on) a few steps later. Every rank
       stops after the same step, a checkpoint is saved there and the launcher exits with 75.
    3. The same command then resumes and finishes: the per-step losses (a replayed step's later record wins),
       the exported weights and the MLflow run equal those of the uninterrupted run.
    """
    from safetensors.torch import load_file

    out = tmp_path / "run"
    proc = start_launch("modernbert-ddp", f"output_dir={out}")
    try:
        wait_for(proc, lambda: (out / "checkpoints" / "step_00000020").is_dir())
        kill_worker(proc, rank="1")
        after_restart = lambda: (
            (out / "metrics.jsonl").is_file()
            and sum(  # noqa: E731
                r["event"] == "train" and r["step"] > 20 for r in read_jsonl(out / "metrics.jsonl")
            )
            >= 3
        )
        wait_for(proc, after_restart)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 75, err[-4000:]
    restarts = [line for line in err.splitlines() if line.startswith("restart ")]
    assert restarts == [
        "restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint"
    ], err[-4000:]
    assert "(step 20)" in err and "resumed from" in err, err[-4000:]
    stopped = re.search(
        r"preempted \(SIGTERM\) after step (\d+) of 40: checkpoint (\S+); run the same command again", err
    )
    assert stopped and "preempted: the workers were asked to save a checkpoint" in err, err[-3000:]
    step = int(stopped[1])
    assert 23 <= step < 40 and stopped[2].endswith(f"step_{step:08d}")
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert steps[:20] == list(range(1, 21)) and steps[-(step - 20) :] == list(range(21, step + 1))

    second = run_in_workers(monkeypatch, capfd, f"output_dir={out}")  # the same command resumes
    assert f"(step {step})" in second and "resumed from" in second and "done: 40 steps" in second, second[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    expected, got = train_losses(full_run[0] / "metrics.jsonl"), train_losses(out / "metrics.jsonl")
    assert sorted(got) == list(range(1, 41))
    torch.testing.assert_close(
        torch.tensor([got[s] for s in range(1, 41)], dtype=torch.float64),
        torch.tensor([expected[s] for s in range(1, 41)], dtype=torch.float64),
        rtol=1e-5,
        atol=0,
    )
    trained, reference = (
        load_file(out / "final" / "model.safetensors"),
        load_file(full_run[0] / "final" / "model.safetensors"),
    )
    assert sorted(trained) == sorted(reference)
    for name in reference:
        torch.testing.assert_close(trained[name], reference[name], rtol=0, atol=0, msg=name)
    summaries = [r for r in records if r["event"] == "summary"]
    assert len(summaries) == 1 and summaries[0]["step"] == 40

    from mlflow.tracking import MlflowClient

    run = MlflowClient(summaries[0]["mlflow_uri"]).get_run(summaries[0]["mlflow_run_id"])  # one run, continued
    assert run.info.status == "FINISHED"
    assert {
        m.step for m in MlflowClient(summaries[0]["mlflow_uri"]).get_metric_history(run.info.run_id, "loss")
    } == set(range(1, 41))


def test_recipe_folder_works_from_a_copy(full_run):
    """The run launched from the copy (its own launch.sh, output_dir=out) read the copy's model and data, and wrote
    into the copy: the config it wrote, with paths resolved beside the copy's tiny.yaml, and its summary say so."""
    from omegaconf import OmegaConf

    out, _ = full_run
    copy, written = out.parent, OmegaConf.load(out / "config.yaml")
    assert (written.model.name_or_path, written.model.tokenizer) == (str(copy / "tiny" / "model"),) * 2
    assert (list(written.data.train_files), list(written.data.eval_files)) == (
        [str(copy / "tiny" / "data" / "train.csv")],
        [str(copy / "tiny" / "data" / "val.csv")],
    )
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    assert (
        summary["step"] == 40 and (copy / summary["export_dir"] / "model.safetensors").is_file()
    )  # relative to the copy
    assert summary["mlflow_uri"] == f"sqlite:///{out / 'mlflow.db'}"
    assert not (RECIPE / "out").exists()


# ----------------------------------------------------------------------------- bad input
def _write(path, text):
    path.write_text(text)
    return path


ROW = '{"text": "striker scores twice", "label": 1}'
ROW_BAD_JSON = '{"text": oops}'
ROW_NO_LABEL = '{"text": "a"}'
UNCLOSED_QUOTE = '1,t,d\n2,"t,d\n3,t,d\n'


BAD_INPUTS = [
    (lambda d: ["data.train_files=[/no/such/train.csv]"], "data.train_files: file not found: /no/such/train.csv"),
    (lambda d: [f"data.train_files=[{d}]"], "is a folder, not a file"),
    (
        lambda d: [f"data.train_files=[{_write(d / 'bad.csv', 'a,b,c,d' + chr(10) + '1,2,3,4' + chr(10))}]"],
        "bad.csv: unrecognised columns ['a', 'b', 'c', 'd']",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'lab.csv', chr(10).join(['1,t,d', '2,t,d', '7,t,d']))}]"],
        "lab.csv line 3: label '7' is not one of 1-4",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'hf.csv', 'text,label' + chr(10) + 'hello,4' + chr(10))}]"],
        "hf.csv line 2: label '4' is not one of 0-3",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'extra.csv', chr(10).join(['1,t,d', '2,t,d', '3,t,d,x']))}]"],
        "extra.csv line 3: 4 fields, expected 3 (label, title, description)",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'short.csv', chr(10).join(['1,t,d', '2,t', '3,t,d']))}]"],
        "short.csv line 2: missing field 'description' (2 of 3 fields",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'nonint.csv', chr(10).join(['1,t,d', '2.5,t,d']))}]"],
        "nonint.csv line 2: label '2.5' is not one of 1-4",
    ),
    (  # the quote opened on line 2 is never closed: one record of 2 fields to the end of the file
        lambda d: [f"data.train_files=[{_write(d / 'quote.csv', UNCLOSED_QUOTE)}]"],
        "quote.csv line 2: missing field 'description' (2 of 3 fields: label, title, description); a quoted field "
        "there runs to line 3: is a quote unclosed?",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'bool.jsonl', chr(10).join([ROW, ROW.replace('1}', 'true}')]))}]"],
        "bool.jsonl line 2: label 'true' is not one of 0-3",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'bad.jsonl', chr(10).join([ROW, ROW, ROW_BAD_JSON]))}]"],
        "bad.jsonl line 3: not valid JSON",
    ),
    (
        lambda d: [f"data.train_files=[{_write(d / 'nolabel.jsonl', chr(10).join([ROW, ROW_NO_LABEL]))}]"],
        "nolabel.jsonl line 2: missing field 'label'",
    ),
    (lambda d: ["optim.lrr=1e-4"], "key 'optim.lrr'"),
    (lambda d: ["train.micro_batch_size=big"], "key 'train.micro_batch_size'"),
    (lambda d: ["model.compile=true", "data.padding=longest"], "model.compile=true needs data.padding=max_length"),
    (lambda d: ["checkpoint.every_steps=-2"], "checkpoint.every_steps must be >= -1, got -2 (-1: never)"),
    (
        lambda d: ["checkpoint.every_steps=-1", "train.stop_at_step=10"],
        "train.stop_at_step needs a checkpoint to resume",
    ),
    (lambda d: ["ddp.bucket_cap_mb=0"], "ddp.bucket_cap_mb=0.0: must be above 0"),
    (lambda d: ["ddp.static_graph=true"], "ddp.static_graph=true with train.grad_accum_steps=2"),
]


def test_bad_input_through_launch_sh_is_one_line_before_any_worker(tmp_path):
    make_input, expected = BAD_INPUTS[2]
    proc = launch("modernbert-ddp", f"output_dir={tmp_path / 'out'}", *make_input(tmp_path))
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert expected in proc.stderr
    assert proc.stderr.strip().startswith("error:") and proc.stderr.count("error:") == 1
    assert "Traceback" not in proc.stderr and "torch/distributed/run.py" not in proc.stderr  # torchrun never ran
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("make_input, expected", BAD_INPUTS)
def test_bad_input_is_refused_by_the_check(tmp_path, make_input, expected):
    with pytest.raises((ConfigError, DataError, CheckpointError)) as err:
        check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", *make_input(tmp_path))
    assert expected in str(err.value) and "\n" not in str(err.value)  # one line
    assert not (tmp_path / "out").exists()


def test_a_relative_data_file_not_found_names_the_folder_and_probes_no_hub(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # neither beside the config nor here: said with the folder it was looked for from
    with pytest.raises(DataError) as err:
        check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", "data.eval_files=[nope/val.csv]")
    assert str(err.value) == f"data.eval_files: file not found: nope/val.csv (from {tmp_path})"
    assert "Hub" not in capsys.readouterr().err  # a data file is never a hub id: no reachability probe first


def test_tokenizer_larger_than_the_model_vocabulary(tmp_path):
    model_dir = tmp_path / "model"
    shutil.copytree(RECIPE / "tiny" / "model", model_dir)
    data = json.loads((model_dir / "config.json").read_text())
    data["vocab_size"] = 100
    (model_dir / "config.json").write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="tokens but the model's vocab_size is 100"):
        check("modernbert-ddp", f"model.name_or_path={model_dir}", f"output_dir={tmp_path / 'out'}")


def test_flex_attention_on_a_cpu_run_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="flex_attention cannot train on CPU .* use sdpa"):
        check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", "model.attn_implementation=flex_attention")


def test_rerunning_a_finished_run_changes_nothing(full_run, monkeypatch, capfd):
    out, _ = full_run
    before = (out / "metrics.jsonl").read_text()
    config = copied_config(out)
    assert "config OK" in check("modernbert-ddp", f"output_dir={out}", config=config)  # launch.sh's --check passes it
    err = run_in_workers(monkeypatch, capfd, f"output_dir={out}", config=config)
    assert "already complete: 40 of 40 steps" in err, err[-2000:]
    assert (
        f"To train again, use a new output_dir (or delete {out})." in err
    )  # not checkpoint.resume=none: refused there
    assert (out / "metrics.jsonl").read_text() == before


def test_resume_with_other_settings_is_refused(full_run):
    out, _ = full_run
    with pytest.raises(CheckpointError) as err:  # launch.sh's check, before any worker starts
        check("modernbert-ddp", f"output_dir={out}", "train.max_steps=41", "optim.lr=1e-3", config=copied_config(out))
    assert "written with other settings (optim.lr: 0.002 -> 0.001, train.max_steps: 40 -> 41)" in str(err.value)
    with pytest.raises(CheckpointError) as err:  # the loader state of each rank has one entry per worker
        check("modernbert-ddp", f"output_dir={out}", "data.num_workers=3", config=copied_config(out))
    assert "written with other settings (data.num_workers: " in str(err.value)


def test_stop_at_step_not_after_the_checkpoint_is_refused(full_run, tmp_path):
    out, _ = full_run
    with pytest.raises(CheckpointError, match="train.stop_at_step=20 is not after the checkpoint"):
        check("modernbert-ddp", f"output_dir={out}", "train.stop_at_step=20", config=copied_config(out))


def test_ag_news_csv_with_its_common_header(tmp_path):
    f = tmp_path / "kaggle.csv"
    f.write_text(
        '"Class Index","Title","Description"\n'
        + "".join(f'"{c}","t {i}","d {i}"\n' for i, c in enumerate([1, 2, 3, 4] * 20))
    )
    assert "config OK" in check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{f}]")
    bad = tmp_path / "bad.csv"
    bad.write_text('"Class Index","Title","Description"\n"1","a","b"\n"5","c","d"\n')
    with pytest.raises(DataError, match="bad.csv line 3: label '5' is not one of 1-4"):
        check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]")


def test_a_csv_with_label_title_description_reads_labels_0_to_3(tmp_path):
    """The hub's AG News written to CSV: a header label,title,description (any order), classes 0-3; the text is
    title and description, as in the original layout."""
    f = tmp_path / "hub.csv"
    f.write_text("title,label,description\n" + "".join(f"t {i},{c},d {i}\n" for i, c in enumerate([0, 1, 2, 3] * 20)))
    assert "config OK" in check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{f}]")
    rows = load_recipe("modernbert-ddp")._read_file(str(f), "data.train_files")
    assert rows[:2] == {"text": ["t 0 d 0", "t 1 d 1"], "label": [0, 1]}
    bad = tmp_path / "bad.csv"
    bad.write_text("label,title,description\n0,a,b\n4,c,d\n")
    hint = r"\(the header 'label' means classes 0-3; for 1-4 use Class Index or no header\)"
    with pytest.raises(DataError, match=f"bad.csv line 3: label '4' is not one of 0-3 {hint}"):
        check("modernbert-ddp", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]")


# ----------------------------------------------------------------------------- small eval sets
def test_an_eval_set_smaller_than_the_world_size_counts_its_row_once(tmp_path, monkeypatch, capfd):
    """One validation row on 2 ranks: evaluation finishes, and its loss, accuracy and macro-F1 are those of a
    single-process computation over that one row with the exported model (no row padded in or counted twice)."""
    from torchmetrics.classification import MulticlassF1Score
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    one = tmp_path / "one.csv"
    one.write_text('"2","Striker scores twice","The cup final ends 2-1 after extra time."\n')
    out = tmp_path / "run"
    run_in_workers(
        monkeypatch,
        capfd,
        f"output_dir={out}",
        f"data.eval_files=[{one}]",
        "train.max_steps=2",
        "train.eval_every=0",
        "checkpoint.every_steps=0",
        "mlflow=false",
    )
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    assert summary["eval/samples"] == 1
    model = AutoModelForSequenceClassification.from_pretrained(out / "final").eval()
    tok = AutoTokenizer.from_pretrained(out / "final")
    enc = tok(
        ["Striker scores twice The cup final ends 2-1 after extra time."],
        truncation=True,
        max_length=64,
        padding="max_length",
        return_tensors="pt",
    )
    labels = torch.tensor([1])
    with torch.no_grad():
        ref = model(**enc, labels=labels)
    preds = ref.logits.argmax(-1)
    assert summary["eval/loss"] == pytest.approx(ref.loss.item(), rel=1e-5)
    assert summary["eval/accuracy"] == float((preds == labels).sum())
    assert summary["eval/macro_f1"] == pytest.approx(
        MulticlassF1Score(num_classes=4, average="macro")(preds, labels).item()
    )


def test_tokenize_in_one_pass_gives_the_truncated_rows_and_counts_the_long_texts():
    """`tokenize` (one tokenizer pass with overflowing chunks) against the tokenizer's own truncation and an
    untruncated pass that counts the texts longer than max_length, with both paddings."""
    from transformers import AutoTokenizer

    train = load_recipe("modernbert-ddp")
    tok = AutoTokenizer.from_pretrained(RECIPE / "tiny" / "model")
    rows = train._read_file(str(RECIPE / "tiny" / "data" / "train.csv"), "data.train_files").select(range(1200))
    texts = list(rows["text"])
    lengths = [len(ids) for ids in tok(texts)["input_ids"]]
    for max_length, padding in ((30, "max_length"), (16, "longest"), (64, "max_length")):  # 16: texts of 3+ chunks
        out, truncated = train.tokenize(rows, tok, train.DataConfig(max_length=max_length, padding=padding))
        ref = tok(
            texts, truncation=True, max_length=max_length, padding="max_length" if padding == "max_length" else False
        )
        assert list(out["input_ids"]) == ref["input_ids"] and list(out["attention_mask"]) == ref["attention_mask"]
        assert list(out["labels"]) == list(rows["label"])
        assert truncated == sum(n > max_length for n in lengths) and (max_length == 64 or truncated > 100)


# ----------------------------------------------------------------------------- input formats
def test_every_input_format_gives_the_same_rows(tmp_path):
    """The same 80 rows as AG News CSV without and with its header, with a BOM and CRLF line ends, labels
    written as floats, the Hugging Face layout (CSV with and without header, JSONL, a JSON array, parquet),
    all with a BOM where the format has one: every reader gives identical texts and labels, and --check
    accepts the file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    train = load_recipe("modernbert-ddp")
    rows = [(c, f"title {i}", f'said, "{i}"') for i, c in enumerate([1, 2, 3, 4] * 20)]
    agnews = "".join(f'"{c}","{t}","{d.replace(chr(34), chr(34) * 2)}"\n' for c, t, d in rows)
    texts, labels = [f"{t} {d}" for _, t, d in rows], [c - 1 for c, _, _ in rows]
    hf_csv = "".join(f'"{t}",{y}\n' for t, y in zip([t.replace(chr(34), chr(34) * 2) for t in texts], labels))
    records = [{"text": t, "label": y} for t, y in zip(texts, labels)]
    bom = "\ufeff"
    files = {
        "plain.csv": agnews,
        "bom_crlf.csv": bom + agnews.replace("\n", "\r\n"),
        "header.csv": bom + '"Class Index","Title","Description"\r\n' + agnews.replace("\n", "\r\n"),
        "float_labels.csv": agnews.replace('"3",', '"3.0",'),
        "hf.csv": bom + hf_csv,
        "hf_header.csv": bom
        + "label,text\r\n"
        + "".join(f"{y}.0,{line.rsplit(',', 1)[0]}\r\n" for y, line in zip(labels, hf_csv.splitlines())),
        "rows.jsonl": bom + "\r\n".join(json.dumps(r) for r in records) + "\r\n",
        "rows.json": bom + json.dumps(records, indent=1),
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text, newline="")
    pq.write_table(pa.table({"text": texts, "label": labels}), tmp_path / "rows.parquet")
    for name in [*files, "rows.parquet"]:
        ds = train._read_file(str(tmp_path / name), "data.train_files")
        assert ds["text"] == texts and ds["label"] == labels, name
    assert "(80 train / 400 eval rows)" in check(
        "modernbert-ddp", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{tmp_path / 'header.csv'}]"
    )
