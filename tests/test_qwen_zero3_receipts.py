"""The TRL + DeepSpeed receipts recipe on CPU: 2 gloo ranks, tiny Qwen3, offline tokenizer, 40 real receipts.

Every run starts from the same random weights saved to disk (``init``), trains on the same 32 receipts with
one global step = the whole training set (16 rows x 2 ranks), constant lr and clipping at 1.0, so the losses
of different sharding schemes and of the FSDP2 recipe are directly comparable.

A launch through launch.sh costs ~25-40 s of imports and start-up on 2 cores, so only the ZeRO-3 run with
its faults (a killed worker, then a preemption) and the bad-input refusal go through it (the way users run the
recipe). The other runs call the same ``main`` in 2 forked workers (``@cookbook.distributed``) of this process,
which has imported the libraries once; the other faults (a NaN step, a failed save, a stalled rank) are
injected into those workers.
"""

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import (
    ROOT,
    free_port,
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
from cookbook import hf_trainer

RECIPE = ROOT / "recipes" / "qwen-zero3-receipts"
STEPS = 10  # the ZeRO-3 run (killed, restarted, preempted, resumed) and its uninterrupted ZeRO-2 reference
SHORT = 6  # the FSDP2 and LoRA runs
# Same math on CPU in fp32 (ZeRO-2 vs ZeRO-3 vs FSDP2; a resumed vs an uninterrupted run): only the order
# of floating-point sums differs. Measured: <= 8e-8 (ZeRO-3 resumed vs ZeRO-2) and <= 2e-7 (ZeRO-2 vs FSDP2)
# relative over 6 steps; 1e-5 leaves room, while a lost optimizer state or a wrong step changes the loss by >1e-3.
PARITY_RTOL = 1e-5
COMMON = (f"train.max_steps={STEPS}", "checkpoint.every_steps=3")


def recipe_module():
    return load_recipe("qwen-zero3-receipts")


@pytest.fixture(scope="session")
def init(tmp_path_factory):
    """Random initial weights of the tiny Qwen3, saved once; every run loads them (model.pretrained=true)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("init") / "qwen3"
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(RECIPE / "tiny" / "qwen3")).save_pretrained(path)
    AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def ds_env(tmp_path_factory):
    """DeepSpeed JIT builds (none are expected: the recipe skips the CPU shared-memory op) stay in the session."""
    return {"TORCH_EXTENSIONS_DIR": str(tmp_path_factory.mktemp("torch_extensions"))}


def run_forked(recipe, out, init, *overrides):
    """A recipe's ``main`` on 2 forked workers, as its launch.sh would run it after the --check.

    Garbage is collected here first: an earlier launch that failed (a test's injected fault) leaves its
    rendezvous store in reference cycles, and a worker that collected it (accelerate calls ``gc.collect()``
    as training starts) would end that store's server thread, which a forked child does not have: a crash."""
    import gc

    import deepspeed  # noqa: F401  imported once here, inherited by the forked workers
    import peft  # noqa: F401
    import trl  # noqa: F401

    gc.collect()
    main_in_workers(recipe, f"output_dir={out}", f"model.name_or_path={init}", "model.pretrained=true", *overrides)
    return out


def per_token_loss(model_dir, rows: list[dict]) -> tuple[float, int]:
    """Single-process reference: transformers' own loss of each validation row alone (no padding), weighted by
    its number of label tokens: (sum of token losses / number of label tokens, number of label tokens)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    loss_sum, tokens = 0.0, 0
    for ex in rows:
        labels = torch.tensor([ex["labels"]])
        n = int((labels[:, 1:] != -100).sum())
        with torch.no_grad():
            loss_sum += float(model(input_ids=torch.tensor([ex["input_ids"]]), labels=labels).loss) * n
        tokens += n
    return loss_sum / tokens, tokens


def tiny_config(*overrides):
    """tiny.yaml with `overrides`, its paths resolved as the recipe resolves them."""
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


def validation_rows(model_dir, *overrides) -> list[dict]:
    """The validation rows of tiny.yaml (with `overrides`), tokenized as the recipe does."""
    from transformers import AutoTokenizer

    cfg = tiny_config(*overrides)
    return recipe_module().load_receipts(cfg.data, AutoTokenizer.from_pretrained(model_dir), cfg.train.seed).val


def one_receipt_file(tmp_path, index: int = 3):
    """An eval file holding one of the tiny receipts, as a JSON list (the other format the recipe reads)."""
    path = tmp_path / "one_receipt.json"
    path.write_text("[" + (RECIPE / "tiny" / "data" / "receipts.jsonl").read_text().splitlines()[index] + "]\n")
    return path


@pytest.fixture(autouse=True)
def _cpu_env(monkeypatch, ds_env):
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    for k, v in ds_env.items():
        monkeypatch.setenv(k, v)


@contextlib.contextmanager
def stderr_to(path):
    """This process's stderr, fd 2 and ``sys.stderr`` (where cookbook's log writes), into the file `path`; workers
    forked meanwhile inherit both."""
    with open(path, "w", buffering=1) as f:
        saved_fd, saved = os.dup(2), sys.stderr
        os.dup2(f.fileno(), 2)
        sys.stderr = f
        try:
            yield
        finally:
            sys.stderr = saved
            os.dup2(saved_fd, 2)
            os.close(saved_fd)


def logged_since(path, since: float) -> list[int]:
    """The steps of the train records that a run writing the metrics.jsonl `path` logged after the time `since`
    (``time.time()``; a line being written is left out)."""
    steps = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if record["event"] == "train" and record["time"] > since:
                steps.append(record["step"])
    return steps


@pytest.fixture(scope="session")
def zero3(tmp_path_factory, init, ds_env):
    """ZeRO-3, full fine-tuning, through launch.sh, with two faults of one job for real:

    1. rank 1 is SIGKILLed as soon as checkpoint-3 is published; the launcher restarts the group, which resumes
       from it by itself;
    2. once the restarted workers have logged a step (each record needs both ranks: one logged after the kill is
       theirs), SIGTERM to the launcher (torchrun passes it on): every rank finishes its step, they agree on the
       step to stop after (one step later), a checkpoint is published there and the launcher exits with 75.

    The same command then resumes (in forked workers, as launch.sh runs them) and finishes with evaluation,
    export and MLflow. Returns ``(out, (the launch's exit status, its stderr), the resumed run's stderr)``."""
    out = tmp_path_factory.mktemp("zero3") / "run"
    os.environ.update(COOKBOOK_DEVICE="cpu", **ds_env)
    proc = start_launch(
        "qwen-zero3-receipts",
        f"output_dir={out}",
        f"model.name_or_path={init}",
        "model.pretrained=true",
        *COMMON,
        env=ds_env,
    )
    try:
        wait_for(proc, (out / "checkpoints" / "checkpoint-3").is_dir)
        kill_worker(proc, rank="1")
        killed = time.time()
        wait_for(proc, lambda: logged_since(out / "metrics.jsonl", killed))
        proc.send_signal(signal.SIGTERM)
        _, first = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    with stderr_to(out.parent / "resumed.txt"):
        run_forked("qwen-zero3-receipts", out, init, *COMMON)
    return out, (proc.returncode, first), (out.parent / "resumed.txt").read_text()


@pytest.fixture(scope="session")
def zero2(tmp_path_factory, init, ds_env):
    """ZeRO-2, full fine-tuning, uninterrupted; no export (ZeRO-3's run covers it)."""
    import os

    out = tmp_path_factory.mktemp("zero2") / "run"
    os.environ.update(COOKBOOK_DEVICE="cpu", **ds_env)
    return run_forked(
        "qwen-zero3-receipts",
        out,
        init,
        *COMMON,
        "deepspeed.config=zero2.json",
        "mlflow=false",
        "checkpoint.export_hf=false",
        "eval.max_samples=2",
    )


def test_a_killed_worker_and_then_a_preemption_lose_no_step(zero3, zero2):
    """The restart after the kill resumes from checkpoint-3; the SIGTERM stops every rank after the same step, with
    a checkpoint there and exit status 75; the same command continues from it. The per-step losses of the three
    attempts together equal the uninterrupted run's (a replayed step's later record wins), and the MLflow run is
    one, continued, FINISHED."""
    out, (status, first), second = zero3
    root = out / "checkpoints"
    assert status == 75, first[-4000:]
    restarts = [line for line in first.splitlines() if line.startswith("restart ")]
    assert restarts == [
        "restart 1 of 3: rank 1 was killed by SIGKILL; the workers resume from the newest checkpoint"
    ], first[-4000:]
    assert f"resumed from {root / 'checkpoint-3'}" in first, first[-4000:]
    stopped = re.search(
        rf"preempted \(SIGTERM\) after step (\d+) of {STEPS}: checkpoint (\S+); run the same command "
        rf"again to continue \(exit status 75\)",
        first,
    )
    assert stopped and "preempted: the workers were asked to save a checkpoint" in first, first[-4000:]
    step = int(stopped[1])
    assert 5 <= step < STEPS and stopped[2] == str(root / f"checkpoint-{step}"), first[-4000:]
    assert f"resumed from {root / f'checkpoint-{step}'}" in second and f"done: {STEPS} steps" in second, second[-3000:]
    steps = [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert steps[:3] == [1, 2, 3] and steps[-(STEPS - 3) :] == list(range(4, STEPS + 1)), steps
    losses = train_losses(out / "metrics.jsonl")
    # The uninterrupted reference is the ZeRO-2 run: same weights, data and optimizer, so the same math.
    reference = train_losses(zero2 / "metrics.jsonl")
    torch.testing.assert_close(
        torch.tensor([losses[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        torch.tensor([reference[s] for s in range(1, STEPS + 1)], dtype=torch.float64),
        rtol=PARITY_RTOL,
        atol=0,
    )
    summaries = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"]
    assert len(summaries) == 1 and summaries[0]["step"] == STEPS
    from mlflow.tracking import MlflowClient

    client = MlflowClient(summaries[0]["mlflow_uri"])
    assert client.get_run(summaries[0]["mlflow_run_id"]).info.status == "FINISHED"
    assert {m.step for m in client.get_metric_history(summaries[0]["mlflow_run_id"], "loss")} == set(
        range(1, STEPS + 1)
    )


def test_a_launch_without_gpus_does_not_warn_about_a_missing_accelerator(zero3):
    """On a node without GPUs the launcher tells DeepSpeed it runs on CPU (DS_ACCELERATOR=cpu), so no process
    prints DeepSpeed's "unable to detect" warning."""
    launched = zero3[1][1]
    assert "world size 2 (gloo)" in launched and "Setting accelerator to CPU" not in launched, launched[-3000:]


@pytest.mark.parametrize("which", ["zero3", "zero2"])
def test_full_fine_tuning_loss_falls(which, request):
    out = request.getfixturevalue(which)
    out = out[0] if isinstance(out, tuple) else out
    losses = train_losses(out / "metrics.jsonl")
    assert losses[STEPS] < losses[1] - 1.0, losses


def test_metrics_have_throughput_and_generation_eval(zero3):
    out = zero3[0]
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert all(
        r["tokens_per_s_per_device"] > 0 and r["samples_per_s_per_device"] > 0 and r["rss_gib"] > 0 for r in train
    )
    # 16 receipts per rank per step: samples/s x step time = 16
    assert train[-1]["samples_per_s_per_device"] * train[-1]["step_time_s"] == pytest.approx(16, rel=1e-3)
    ev = [r for r in records if r["event"] == "eval"][-1]
    assert ev["step"] == STEPS and ev["eval/samples"] == 8  # 20% of 40 receipts held out, each scored once
    for key in ("json_valid", "em_company", "em_date", "em_address", "em_total", "em_all"):
        hits = ev[f"eval/{key}"] * 8  # rates over the 8 receipts: whole counts
        assert 0 <= hits <= 8 and hits == pytest.approx(round(hits), abs=1e-9), (key, ev)
    assert ev["eval/unparsable"] + round(ev["eval/json_valid"] * 8) == 8
    summary_line = [line for line in zero3[2].splitlines() if " done: " in line][-1]
    assert (
        "exact match on 8 receipts: company" in summary_line
        and f"unparsable {ev['eval/unparsable']:.0f}" in summary_line
    )
    assert ev["eval/loss"] < train[0]["loss"]
    summary = [r for r in records if r["event"] == "summary"][-1]
    import mlflow

    mlflow.set_tracking_uri(summary["mlflow_uri"])
    logged = mlflow.get_run(summary["mlflow_run_id"]).data.metrics
    assert logged["eval_json_valid"] == ev["eval/json_valid"] and logged["eval_em_total"] == ev["eval/em_total"]
    assert "tokens_per_s_per_device" in logged


def test_eval_loss_is_the_per_token_loss_over_the_validation_rows(zero3):
    """The final evaluation (2 ranks, 4 + 4 rows of unequal lengths) equals the single-process loss of the same
    weights (the export) over the 8 validation rows: sum of token losses / number of label tokens."""
    out = zero3[0]
    ev = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"][-1]
    loss, tokens = per_token_loss(out / "final", validation_rows(out / "final"))
    assert ev["eval/loss"] == pytest.approx(loss, rel=1e-5, abs=0)
    assert ev["eval/tokens"] == tokens


def test_score_counts_exact_matches_per_field_and_unparsable_answers():
    train = recipe_module()
    targets = [
        {"company": "BOOK TA .K SDN BHD", "date": "25/12/2018", "address": "NO.53 JALAN", "total": "9.00"},
        {"company": "AEON", "date": None, "address": "KL", "total": "1.00"},
        {"company": "MR DIY", "date": "01/01/2019", "address": "JB", "total": "5.50"},
        {"company": "X", "date": "1", "address": "Y", "total": "2"},
        {"company": "Z", "date": "2", "address": "W", "total": "3"},
    ]
    texts = [
        '{"company": "BOOK  TA .K SDN BHD", "date": "25/12/2018", "address": " NO.53 JALAN", "total": "9.00"}',
        '{"company": "AEON", "address": "KL", "total": "1.0"}',  # date missing = null (right); total wrong
        '{"company": "MR DIY", "date": "01/01/2019", "address": "JB", "total": "5.50"',  # cut: unparsable
        '["X", "1", "Y", "2"]',  # JSON, but not an object: unparsable
        '{"company": null, "date": "2", "address": "W", "total": "3"}',
    ]
    counts = train.score([train.parse_fields(t) for t in texts], targets, list(train.FIELDS))
    assert counts == {
        "samples": 5.0,
        "json_valid": 3.0,
        "unparsable": 2.0,
        "em_company": 2.0,
        "em_date": 3.0,
        "em_address": 3.0,
        "em_total": 2.0,
        "em_all": 1.0,
    }
    with pytest.raises(ValueError, match="4 predictions for 5 targets"):
        train.score([None] * 4, targets, list(train.FIELDS))


def test_checkpoints_are_published_with_meta(zero3):
    root = zero3[0] / "checkpoints"
    names = sorted(p.name for p in root.iterdir())
    assert names == ["checkpoint-10", "checkpoint-9"], names  # keep_last=2
    meta = json.loads((root / "checkpoint-10" / "meta.json").read_text())
    assert meta["step"] == 10 and meta["world_size"] == 2
    assert not list((zero3[0] / ".staging").glob("checkpoint-*"))  # nothing left unpublished


def test_a_truncated_shard_of_the_newest_checkpoint_is_passed_over_with_one_warning(zero3, init, tmp_path, caplog):
    """On a copy of the ZeRO-3 run: rank 1's optimizer partition of checkpoint-10 cut to 1000 bytes (a copy cut
    short, a disk fault) makes the resume check take checkpoint-9, with one warning naming the file; an explicit
    checkpoint.resume of the damaged folder is refused. The same for 4 KiB of it overwritten in place (its checksum)
    and for its meta.json deleted."""
    from cookbook.checkpoint import CheckpointError

    out = _copy_run(zero3, tmp_path)
    newest, previous = out / "checkpoints" / "checkpoint-10", out / "checkpoints" / "checkpoint-9"
    shard = newest / "global_step10" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    size = shard.stat().st_size
    overrides = (*COMMON, f"model.name_or_path={init}", "model.pretrained=true", f"output_dir={out}")

    def warnings() -> list[str]:
        caplog.clear()
        with caplog.at_level("WARNING", logger="cookbook"):
            assert recipe_module().check_resume(tiny_config(*overrides), 2) == previous
        return [r.getMessage() for r in caplog.records]

    with open(shard, "r+b") as f:  # 4 KiB overwritten in place, the size unchanged: only the checksum tells
        f.seek(size // 2)
        f.write(b"\xff" * 4096)
    [line] = warnings()
    assert re.fullmatch(
        re.escape(
            f"warning: checkpoint {newest} is damaged (global_step10/zero_pp_rank_1_mp_rank_00_"
            f"optim_states.pt does not match its checksum (xxh3_64:"
        )
        + r"\w+ in meta\.json, "
        r"xxh3_64:\w+ now\)\); resuming from " + re.escape(f"{previous} instead"),
        line,
    ), line
    os.truncate(shard, 1000)
    assert warnings() == [
        f"warning: checkpoint {newest} is damaged (global_step10/zero_pp_rank_1_mp_rank_00_optim_states.pt is 1000 "
        f"bytes, meta.json says {size}); resuming from {previous} instead"
    ]
    with pytest.raises(CheckpointError, match=r"is a damaged checkpoint \(global_step10/zero_pp_rank_1_mp_rank_00_"):
        recipe_module().check_resume(tiny_config(*overrides, f"checkpoint.resume={shard.parent.parent}"), 2)
    (newest / "meta.json").unlink()  # published folders always hold one: its loss is damage, not a save under way
    assert warnings() == [
        f"warning: checkpoint {newest} is damaged (no meta.json inside); resuming from {previous} instead"
    ]


def test_final_model_is_full_and_reloads_with_the_trained_logits(zero3, init):
    """Every tensor of the export has the model's shape; its logits equal those of the fp32 weights that
    DeepSpeed's own zero_to_fp32 rebuilds from the ZeRO-3 partitions of the last checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    final = zero3[0] / "final"
    reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(init))
    saved = load_file(final / "model.safetensors")
    expected = reference.state_dict()
    assert set(saved) == set(expected)
    for name, tensor in saved.items():
        assert tensor.shape == expected[name].shape, name
    trained = get_fp32_state_dict_from_zero_checkpoint(str(zero3[0] / "checkpoints" / f"checkpoint-{STEPS}"))
    reference.load_state_dict(trained)
    assert not torch.equal(
        trained["model.layers.0.mlp.up_proj.weight"],
        AutoModelForCausalLM.from_pretrained(init).state_dict()["model.layers.0.mlp.up_proj.weight"],
    )
    tok = AutoTokenizer.from_pretrained(final)
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "TOTAL 9.00\n\nExtract the company."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )["input_ids"]
    exported = AutoModelForCausalLM.from_pretrained(final).eval()
    with torch.no_grad():
        torch.testing.assert_close(
            exported(input_ids=ids).logits, reference.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )


def test_loss_parity_with_the_fsdp2_recipe(zero2, init, tmp_path):
    """The FSDP2 recipe on the same initial weights, the same 32 training receipts (as chat rows), the same
    optimizer, lr, clipping and global batch: its losses equal ZeRO's within PARITY_RTOL. Both keep fp32
    master weights (on CPU everything is fp32), so they do not drift apart."""
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", [f"model.name_or_path={init}"])
    train.check_config(cfg, RECIPE)
    rows = [json.loads(line) for line in (RECIPE / "tiny" / "data" / "receipts.jsonl").read_text().splitlines()]
    from transformers import AutoTokenizer

    split = train.load_receipts(cfg.data, AutoTokenizer.from_pretrained(init), cfg.train.seed)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(
        "".join(
            json.dumps({"messages": train.receipt_messages(rows[i], "tiny", cfg.data.fields)}) + "\n"
            for i in split.train_index
        )
    )
    out = run_forked(
        "qwen-fsdp2-sft",
        tmp_path / "fsdp2",
        init,
        f"model.tokenizer={init}",
        f"data.train_files=[{chats}]",
        "data.eval_fraction=0",
        "data.packing=false",
        "data.max_length=256",
        "train.micro_batch_size=16",
        "train.grad_accum_steps=1",
        f"train.max_steps={SHORT}",
        "train.activation_checkpointing=none",
        "optim.scheduler=constant",
        "optim.warmup_ratio=0",
        "optim.lr=3e-3",
        "optim.betas=[0.9,0.95]",
        "optim.weight_decay=0",
        "optim.max_grad_norm=1.0",
        "checkpoint.every_steps=0",
        "checkpoint.export_hf=false",
        "mlflow=false",
    )
    fsdp, zero = train_losses(out / "metrics.jsonl"), train_losses(zero2 / "metrics.jsonl")
    torch.testing.assert_close(
        torch.tensor([zero[s] for s in range(1, SHORT + 1)], dtype=torch.float64),
        torch.tensor([fsdp[s] for s in range(1, SHORT + 1)], dtype=torch.float64),
        rtol=PARITY_RTOL,
        atol=0,
    )


# ----------------------------------------------------------------------------- faults in forked workers
def run_in_workers(monkeypatch, capfd, out, init, *overrides) -> str:
    """`run_forked` of the ZeRO-3 recipe, returning the workers' stderr (this test's, through `capfd`)."""
    import logging

    log = logging.getLogger("cookbook")
    inherited = [h for h in log.handlers if getattr(h, "_cookbook", False)]
    for h in inherited:  # each worker then logs to this test's stderr, not to a stream set up earlier
        log.removeHandler(h)
    try:
        capfd.readouterr()
        try:
            run_forked("qwen-zero3-receipts", out, init, *overrides)
        finally:
            run_in_workers.err = capfd.readouterr().err
        return run_in_workers.err
    finally:
        for h in inherited:
            log.addHandler(h)


NAN_STEP, FAILED_SAVE = 3, 4


@pytest.fixture
def nan_then_full_disk_on_rank_1(monkeypatch):
    """On rank 1 only: its token embeddings of step `NAN_STEP` are multiplied by NaN (so its loss and gradients are
    NaN, and through ZeRO's gradient reduce-scatter both ranks' gradient norm), and its checkpoint save of
    step `FAILED_SAVE` meets a file-size limit (RLIMIT_FSIZE of 500 kB, below its 1.2 MB optimizer partition: EFBIG,
    as a full disk's ENOSPC would). Patched here, before the workers are forked from this process."""
    import resource

    from deepspeed.runtime.engine import DeepSpeedEngine

    forward, save, calls = torch.nn.Embedding.forward, DeepSpeedEngine.save_checkpoint, []

    def nan_forward(self, *args, **kwargs):  # the token embedding: one call per training micro-batch
        out = forward(self, *args, **kwargs)
        if self.training and os.environ.get("RANK") == "1":
            calls.append(1)
            if len(calls) == NAN_STEP:  # one micro-batch per step
                out = out * float("nan")
        return out

    def limited_save(self, save_dir, *args, **kwargs):
        if os.environ.get("RANK") == "1" and save_dir.endswith(f"checkpoint-{FAILED_SAVE}"):
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing the process
            resource.setrlimit(resource.RLIMIT_FSIZE, (500_000, resource.RLIM_INFINITY))
        if os.environ.get("RANK") == "0" and save_dir.endswith(f"checkpoint-{FAILED_SAVE}"):
            write = self.checkpoint_engine.save

            def late_write(*a, **kw):  # after the save's collectives: rank 1 fails first, whatever the load
                deadline = time.monotonic() + 120
                while os.path.exists(save_dir) and time.monotonic() < deadline:
                    time.sleep(0.05)  # until rank 1's failed save has deleted the folder
                # its error ends the group meanwhile: this rank is stopped before its write would make the folder
                # again (seen: a record whose staging folder was left); it ends at the group's SIGTERM, not 10 s later
                signal.signal(signal.SIGTERM, lambda *_: os._exit(128 + signal.SIGTERM))
                time.sleep(30)
                self.checkpoint_engine.save = write
                return write(*a, **kw)

            self.checkpoint_engine.save = late_write
        return save(self, save_dir, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Embedding, "forward", nan_forward)
    monkeypatch.setattr(DeepSpeedEngine, "save_checkpoint", limited_save)


def test_a_nan_step_is_skipped_and_a_failed_save_keeps_the_previous_checkpoint(
    init, tmp_path, monkeypatch, capfd, nan_then_full_disk_on_rank_1
):
    """train.on_nonfinite=skip: DeepSpeed discards the update of the NaN step (the weights and the LR schedule of
    checkpoint-3 are checkpoint-2's), the step is logged and counted, nothing published holds a NaN. Then rank 1's
    save of step 4 fails: one line from rank 1 naming the checkpoint, the OS error and the intact checkpoint-3."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    from safetensors.torch import load_file

    from cookbook.checkpoint import _mount_point
    from cookbook.hf_trainer import published_checkpoints

    out = tmp_path / "run"
    root = out / "checkpoints"
    with pytest.raises(cookbook.WorkerError) as failed:
        run_in_workers(
            monkeypatch,
            capfd,
            out,
            init,
            "train.max_steps=6",
            "checkpoint.every_steps=1",
            "checkpoint.keep_last=0",
            "train.on_nonfinite=skip",
            "mlflow=false",
        )
    err = run_in_workers.err
    assert f"step {NAN_STEP}: non-finite gradient norm, update discarded, step skipped (1 skipped so far)" in err, err[
        -3000:
    ]
    partition = (
        out
        / ".staging"
        / f"checkpoint-{FAILED_SAVE}"
        / f"global_step{FAILED_SAVE}"
        / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    )
    assert failed.value.exc_type == "cookbook.checkpoint.CheckpointSaveError" and failed.value.rank == 1, (
        f"{failed.value}\n{err[-5000:]}"
    )
    assert str(failed.value.exception) == (
        f"could not save the checkpoint of step {FAILED_SAVE} to {root / f'checkpoint-{FAILED_SAVE}'} (rank 1: EFBIG, "
        f"File too large: '{partition}'); the previous checkpoint {root / 'checkpoint-3'} is intact. Raise the file "
        f"size limit (ulimit -f) or the largest file size of {_mount_point(root)} and run the "
        f"same command again: it resumes from {root / 'checkpoint-3'}"
    )
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(1, 0), (2, 0), (3, 1), (4, 1)]
    assert train[NAN_STEP - 1]["grad_norm"] == float("inf") and all(
        r["grad_norm"] < 10 for r in train if r["step"] != 3
    )
    assert [p.name for p in published_checkpoints(root)] == ["checkpoint-1", "checkpoint-2", "checkpoint-3"]
    assert not partition.parent.parent.exists()  # the failed save's staging folder is gone: it would hold the space
    # the skip count is in each checkpoint, for a resume to continue it
    assert [json.loads((root / f"checkpoint-{n}" / "meta.json").read_text())["skipped_steps"] for n in (1, 2, 3)] == [
        0,
        0,
        1,
    ]
    weights = {n: get_fp32_state_dict_from_zero_checkpoint(str(root / f"checkpoint-{n}")) for n in (1, 2, 3)}
    for name, tensor in weights[3].items():
        assert torch.equal(tensor, weights[2][name]), name  # the NaN step's update was discarded
    assert not torch.equal(
        weights[2]["model.layers.0.mlp.up_proj.weight"], weights[1]["model.layers.0.mlp.up_proj.weight"]
    )
    schedules = [
        torch.load(root / f"checkpoint-{n}" / "scheduler.pt", weights_only=True)["last_epoch"] for n in (1, 2, 3)
    ]
    assert schedules == [1, 2, 2]  # no scheduler step for the discarded update
    for n in (1, 2, 3):
        assert all(torch.isfinite(t).all() for t in weights[n].values())
        assert all(torch.isfinite(t).all() for t in load_file(root / f"checkpoint-{n}" / "model.safetensors").values())


STALL_TIMEOUT_S = 4


@pytest.fixture
def rank_1_stalls_at_step_3(monkeypatch, tmp_path):
    """Rank 1 stops itself (SIGSTOP) after its backward of step 3, before DeepSpeed's optimizer step, as a rank that
    hangs would (a stuck read, a wedged GPU): under ZeRO-2, rank 0 then waits in the step's gradient-norm all-reduce,
    on the copy of the world group that DeepSpeed made for ZeRO (not on the default group). Each rank writes its pid to
    ``rank<r>.pid`` in the returned folder first. Patched before the workers are forked. A thread here SIGKILLs
    rank 1 once rank 0 has exited (or 60 s after its stop), as a launcher would."""
    import threading

    import psutil
    from deepspeed.runtime.engine import DeepSpeedEngine

    step, calls, pids = DeepSpeedEngine.step, [], tmp_path / "pids"
    pids.mkdir()

    def stalling_step(self, *args, **kwargs):
        calls.append(1)
        (pids / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
        if len(calls) == 3 and os.environ["RANK"] == "1":
            os.kill(os.getpid(), signal.SIGSTOP)
        return step(self, *args, **kwargs)

    def kill_rank_1():
        deadline = time.monotonic() + 600  # start-up can take a minute on a loaded machine: wait for the stop first
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError, psutil.Error, ValueError):
                if psutil.Process(int((pids / "rank1.pid").read_text())).status() == psutil.STATUS_STOPPED:
                    break
            time.sleep(0.05)
        deadline = time.monotonic() + 60  # from rank 1's stop
        while time.monotonic() < deadline:
            with contextlib.suppress(psutil.Error, ValueError):
                if psutil.Process(int((pids / "rank0.pid").read_text())).status() != psutil.STATUS_ZOMBIE:
                    time.sleep(0.05)
                    continue
            break
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((pids / "rank1.pid").read_text()), signal.SIGKILL)

    monkeypatch.setattr(DeepSpeedEngine, "step", stalling_step)
    threading.Thread(target=kill_rank_1, daemon=True).start()
    return pids


def test_a_stalled_rank_is_named_by_the_rank_whose_collective_times_out(
    init, tmp_path, monkeypatch, capfd, rank_1_stalls_at_step_3
):
    """train.collective_timeout_s reaches DeepSpeed's own process group (torch gives a new group 30 minutes; without
    `cookbook.dist.apply_collective_timeout` rank 0 waits until rank 1 is killed, 60 s): rank 0 waits there
    STALL_TIMEOUT_S, and its one line names rank 1, its pid and the step, with where it waited."""
    out = tmp_path / "run"
    with pytest.raises(cookbook.WorkerError) as failed:
        run_in_workers(
            monkeypatch,
            capfd,
            out,
            init,
            "deepspeed.config=zero2.json",
            "train.max_steps=6",
            "checkpoint.every_steps=-1",
            "checkpoint.export_hf=false",
            "mlflow=false",
            f"train.collective_timeout_s={STALL_TIMEOUT_S}",
        )
    assert failed.value.exc_type == "cookbook.dist.CollectiveTimeout" and failed.value.rank == 0, (
        f"{failed.value}\n{run_in_workers.err[-30000:]}"
    )
    pid, host = int((rank_1_stalls_at_step_3 / "rank1.pid").read_text()), socket.gethostname()
    message = str(failed.value.exception)
    site = re.fullmatch(
        rf"a collective did not finish within {STALL_TIMEOUT_S} s \((.+)\) at step 3: rank 1 \(pid {pid} on {host}\) did not "
        rf"reach it \(every rank last finished step 2, but it did not time out with this rank within "
        rf"{STALL_TIMEOUT_S / 4:g} s\) - it is stalled \(stopped, hung, or much slower\); `py-spy dump --pid {pid}` on "
        rf"{host} shows where it is; this rank's stacks: {re.escape(str(out / 'debug' / 'stacks_rank0.txt'))}",
        message,
    )
    assert site, message
    assert re.fullmatch(r"(\w+: )?`.+`, \w+\.py:\d+", site[1]) and "(*args, **kwargs)" not in site[1], site[1]


@pytest.mark.parametrize("ds_config, eval_rows", [("zero3.json", 1), ("zero2.json", 9)])
def test_lora_loss_falls_and_merged_export_reloads(ds_config, eval_rows, init, tmp_path):
    """LoRA; the final evaluation equals the single-process loss over exactly the validation rows. ZeRO-3: an
    eval file of one receipt, fewer rows than ranks (rank 1 runs filler forward passes only; all 40 receipts
    train). ZeRO-2: 9 held-out receipts in batches of 8, so one rank has more rows than the other."""
    data = (
        [f"data.eval_files=[{one_receipt_file(tmp_path)}]"]
        if eval_rows == 1
        else ["data.eval_fraction=0.225", "train.micro_batch_size=8"]
    )
    out = run_forked(
        "qwen-zero3-receipts",
        tmp_path / "lora",
        init,
        "lora.enabled=true",
        f"deepspeed.config={ds_config}",
        f"train.max_steps={SHORT}",
        "checkpoint.every_steps=-1",
        "mlflow=false",
        "eval.max_new_tokens=2",
        "optim.lr=1e-2",
        *data,
    )
    losses = train_losses(out / "metrics.jsonl")
    assert losses[SHORT] < losses[1] - 0.3, losses  # LoRA on a random tiny model learns slowly
    ev = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"][-1]
    loss, tokens = per_token_loss(out / "final", validation_rows(init, *data))
    assert ev["eval/loss"] == pytest.approx(loss, rel=1e-5, abs=0)
    assert ev["eval/tokens"] == tokens and ev["eval/samples"] == eval_rows
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(init), out / "adapter").eval()
    base = AutoModelForCausalLM.from_pretrained(init).eval()
    ids = torch.arange(3, 40).unsqueeze(0)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, adapted(input_ids=ids).logits, rtol=1e-4, atol=1e-5)
        assert not torch.allclose(merged(input_ids=ids).logits, base(input_ids=ids).logits, atol=1e-3)


# ----------------------------------------------------------------------------- bad input (in-process --check)
def check(*overrides):
    """Run the recipe's preflight (what launch.sh runs before any worker) in this process."""
    train = recipe_module()
    train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", *overrides])


def _receipts(tmp_path, edit):
    rows = [json.loads(line) for line in (RECIPE / "tiny" / "data" / "receipts.jsonl").read_text().splitlines()]
    edit(rows)
    path = tmp_path / "receipts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda rows: rows[4].update(entities={}), "line 5 (id X00016469623): field 'entities' has none of"),
        (lambda rows: rows[6].update(ocr_boxes=[]), "line 7 (id X00016469672): field 'ocr_boxes' is empty"),
        (lambda rows: rows[2]["ocr_boxes"][1].pop(), "line 3 (id X00016469620): ocr_boxes[1] must be"),
        # longer than data.max_length=256: dropped, not cut; 5 of 40 is more than data.max_dropped_fraction=0.1
        (
            lambda rows: [r["entities"].update(total="9.00 " * 200) for r in rows[9:14]],
            "receipts.jsonl: 5 of 40 rows dropped (12%, more than data.max_dropped_fraction=0.1): 5 longer than "
            "data.max_length=256, dropped rather than cut, longest line 10 (",
        ),
    ],
)
def test_bad_receipts_are_named(tmp_path, edit, message):
    from cookbook.sft import SFTDataError

    bad = _receipts(tmp_path, edit)
    with pytest.raises(SFTDataError, match=re.escape(message)):
        check(f"data.train_files=[{bad}]", f"output_dir={tmp_path / 'out'}")


def test_a_receipt_longer_than_max_length_is_dropped_and_counted(tmp_path, capsys):
    from transformers import AutoTokenizer

    long = _receipts(tmp_path, lambda rows: rows[9]["entities"].update(total="9.00 " * 200))
    check(f"data.train_files=[{long}]", f"output_dir={tmp_path / 'out'}")
    out = capsys.readouterr().out
    assert re.search(
        r"data: receipts\.jsonl: 40 rows read, 39 examples kept, 1 dropped \(longer than max_length=256, "
        r"dropped rather than cut: line 10 \(\d+ tokens\)\)",
        out,
    ), out
    assert "(32 train / 7 validation receipts)" in out  # eval_fraction 0.2 of the 39 kept
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", [f"data.train_files=[{long}]"])
    train.check_config(cfg, RECIPE)
    split = train.load_receipts(cfg.data, AutoTokenizer.from_pretrained(RECIPE / "tiny" / "qwen3"), cfg.train.seed)
    rows = [json.loads(line) for line in long.read_text().splitlines()]
    # positions skip the dropped row (index 9), and each validation target is its own receipt's
    assert sorted(split.train_index + split.val_index) == [i for i in range(40) if i != 9]
    assert split.val_targets == [{f: rows[i]["entities"].get(f) for f in cfg.data.fields} for i in split.val_index]


def test_eval_files_are_the_validation_split(tmp_path, capsys):
    """data.eval_files (relative to the config's folder, like train files) replace the held-out split: every
    train receipt trains; a bad eval row is named by its file, row and id."""
    from cookbook.sft import SFTDataError

    check("data.eval_files=[tiny/data/receipts.jsonl]", f"output_dir={tmp_path / 'out'}")
    out = capsys.readouterr().out
    assert "(40 train / 40 validation receipts)" in out
    assert re.search(r"^data \(eval files\): .*receipts\.jsonl: 40 rows read, 40 examples kept", out, re.M), out
    check(f"data.eval_files=[{one_receipt_file(tmp_path)}]", f"output_dir={tmp_path / 'out'}")
    assert "(40 train / 1 validation receipts)" in capsys.readouterr().out
    bad = _receipts(tmp_path, lambda rows: rows[6].update(ocr_boxes=[]))
    with pytest.raises(SFTDataError, match=re.escape(f"{bad} line 7 (id X00016469672): field 'ocr_boxes' is empty")):
        check(f"data.eval_files=[{bad}]", f"output_dir={tmp_path / 'out'}")


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda ds: ds.update(train_micro_batch_size_per_gpu=4),
            "train_micro_batch_size_per_gpu=4 disagrees with train.micro_batch_size = 16",
        ),
        # DeepSpeed would apply a step whose gradient norm is NaN: neither train.on_nonfinite=stop nor skip could hold
        (
            lambda ds: ds["bf16"].update(check_grad_overflow=False),
            "bf16.check_grad_overflow=false makes DeepSpeed apply a "
            "step whose gradient norm is NaN or infinite, which train.on_nonfinite (stop or skip) cannot undo: remove it",
        ),
        (
            lambda ds: ds["zero_optimization"].update(stage=2, compute_grad_norm=False),
            "zero_optimization.compute_grad_norm=false leaves DeepSpeed without the gradient norm",
        ),
    ],
)
def test_deepspeed_settings_disagreeing_with_the_recipe(tmp_path, edit, message):
    from cookbook.config import ConfigError

    ds = json.loads((RECIPE / "zero3.json").read_text())
    edit(ds)
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    with pytest.raises(ConfigError, match=re.escape(message)):
        check(f"deepspeed.config={tmp_path / 'ds.json'}", f"output_dir={tmp_path / 'out'}")


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("checkpoint.every_steps=-2",), "checkpoint.every_steps must be >= -1, got -2 (-1: never)"),
        (("checkpoint.every_steps=-1", "train.stop_at_step=2"), "train.stop_at_step needs a checkpoint to resume from"),
        (("train.mixed_precision=fp16",), "train.mixed_precision must be one of 'bf16', 'fp32', got 'fp16'"),
        (("train.activation_checkpointing=true",), "train.activation_checkpointing must be one of 'none', 'full'"),
        (("train.on_nonfinite=ignore",), "train.on_nonfinite must be one of stop, skip, got 'ignore'"),
        (("model.name_or_path=../nope/qwen3",), "model.name_or_path: folder not found: ../nope/qwen3"),
    ],
)
def test_bad_settings_are_refused(tmp_path, overrides, message):
    from cookbook.config import ConfigError

    with pytest.raises(ConfigError, match=re.escape(message)):
        check(*overrides, f"output_dir={tmp_path / 'out'}")


def test_bad_input_stops_launch_before_workers(tmp_path):
    bad = _receipts(tmp_path, lambda rows: rows[0].update(entities={"company": ""}))
    proc = launch("qwen-zero3-receipts", f"output_dir={tmp_path / 'out'}", f"data.train_files=[{bad}]")
    assert proc.returncode == 2 and "line 1 (id X00016469612)" in proc.stderr, proc.stderr[-2000:]
    assert "torch/distributed/run.py" not in proc.stderr and "accelerate" not in proc.stderr


def test_one_process_launch(init, ds_env, tmp_path):
    """NGPU=1: launch.sh starts one worker (`accelerate launch --multi_gpu` refused one process); it trains and
    evaluates all 8 validation rows itself."""
    out = tmp_path / "one"
    proc = launch(
        "qwen-zero3-receipts",
        f"output_dir={out}",
        f"model.name_or_path={init}",
        "model.pretrained=true",
        "train.max_steps=1",
        "checkpoint.every_steps=-1",
        "checkpoint.export_hf=false",
        "mlflow=false",
        "eval.max_new_tokens=4",
        ngpu=1,
        env=ds_env,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "world size 1 (gloo)" in proc.stderr
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "train"] == [1]
    ev = [r for r in records if r["event"] == "eval"][-1]
    assert ev["eval/samples"] == 8 and ev["eval/tokens"] == sum(
        sum(label != -100 for label in row["labels"][1:]) for row in validation_rows(init)
    )


def test_accelerate_launch_with_the_shipped_config_trains_the_same_steps(zero3, init, ds_env, tmp_path):
    """`accelerate launch --config_file accelerate_zero3.yaml` (2 processes, no GPU) runs the same job as launch.sh:
    its first two losses equal those of the ZeRO-3 launch above (same seed, data and weights)."""
    out = tmp_path / "acc"
    env = {
        **os.environ,
        **ds_env,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
        "COOKBOOK_DEVICE": "cpu",
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [
            "accelerate",
            "launch",
            "--config_file",
            str(RECIPE / "accelerate_zero3.yaml"),
            "--num_processes",
            "2",
            "--main_process_port",
            str(free_port()),
            str(RECIPE / "train.py"),
            "--config",
            str(RECIPE / "tiny.yaml"),
            f"output_dir={out}",
            f"model.name_or_path={init}",
            "model.pretrained=true",
            "train.max_steps=2",
            "checkpoint.every_steps=-1",
            "checkpoint.export_hf=false",
            "mlflow=false",
            "eval.max_new_tokens=2",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world size 2 (gloo) | DeepSpeed ZeRO-3 (zero3.json)" in proc.stderr
    ours, reference = train_losses(out / "metrics.jsonl"), train_losses(zero3[0] / "metrics.jsonl")
    assert sorted(ours) == [1, 2]
    for step in (1, 2):
        assert ours[step] == pytest.approx(reference[step], rel=PARITY_RTOL), step


def _copy_run(zero3, tmp_path):
    out = tmp_path / "run"
    shutil.copytree(zero3[0] / "checkpoints", out / "checkpoints")
    shutil.copytree(zero3[0] / "final", out / "final")
    return out


def _follow(message: str, out, world_size: int, *overrides) -> int:
    """Take each way out that a refusal offers (the text after its last ": "), one at a time, on a copy of the
    run `out`; each must be accepted (`check_resume` passes and nothing is reported complete). Returns the
    number of remedies taken."""
    train = recipe_module()
    advice = message.rsplit(": ", 1)[-1]
    remedies = [(out, [o], world_size) for o in re.findall(r"\b(checkpoint\.resume=[^\s,;)]+)", advice)]
    resumes = [int(n) for n in re.findall(r"NGPU x NNODES = (\d+)", advice)]  # resume as it was written
    for n in resumes:
        cfg = tiny_config(*COMMON, *overrides, f"output_dir={out}")
        assert train.check_resume(cfg, n) == out / "checkpoints" / f"checkpoint-{STEPS}"
    if "new output_dir" in advice:
        remedies.append((None, [], world_size))
    if f"(or delete {out})" in advice:  # the whole folder: its metrics.jsonl and MLflow run id too
        remedies.append(("delete", [], world_size))
    for i, (source, extra, ranks) in enumerate(remedies):
        run_dir = out.parent / f"follow-{i}"
        if source is not None:
            shutil.copytree(out, run_dir)
        if source == "delete":
            shutil.rmtree(run_dir)
        cfg = tiny_config(*COMMON, *overrides, f"output_dir={run_dir}", *extra)
        resume = train.check_resume(cfg, ranks)  # raises if this advice does not work
        assert hf_trainer.already_complete(cfg.output_dir, resume, STEPS) is None, (advice, source, extra)
    return len(remedies) + len(resumes)


@pytest.mark.parametrize(
    "overrides, world_size, message",
    [
        ((), 2, f"already complete: {STEPS} of {STEPS} steps"),
        (("checkpoint.resume=none",), 2, "holds checkpoints of an earlier run"),
        ((), 4, "written by 2 ranks but this job has 4"),
        (("optim.lr=1e-3",), 2, "was written with other settings"),
    ],
)
def test_advice_to_start_again_works_when_followed(zero3, init, tmp_path, overrides, world_size, message):
    """Each refusal over an earlier run (and the note that it is complete) offers ways to go on that work."""
    from cookbook.checkpoint import CheckpointError

    train = recipe_module()
    out = _copy_run(zero3, tmp_path)
    overrides = (f"model.name_or_path={init}", "model.pretrained=true", *overrides)  # as the zero3 run
    cfg = tiny_config(*COMMON, *overrides, f"output_dir={out}")
    try:
        resume = train.check_resume(cfg, world_size)
    except CheckpointError as exc:
        text = str(exc)
    else:
        text = hf_trainer.already_complete(cfg.output_dir, resume, STEPS)
    assert message in text
    assert _follow(text, out, world_size, *overrides) >= 2


@pytest.mark.parametrize("config", ["config.yaml", "llama3.2-1b.yaml", "tiny.yaml"])
def test_shipped_configs_are_valid(config):
    train = recipe_module()
    cfg = train.load_config(train.Config, RECIPE / config)
    train.check_config(cfg, RECIPE)
    for ds in ("zero1.json", "zero2.json", "zero3.json"):
        cfg.deepspeed.config = str(RECIPE / ds)
        train.check_deepspeed_config(cfg, world_size=8)
