"""The Qwen SFT Ray Train recipe on CPU: 2 Ray workers, tiny Qwen2 config, offline tokenizer and data."""

import os
import re

import pytest
import torch
from conftest import ROOT, read_jsonl, train_losses
from ray_cluster import (
    floats_in,
    kill_a_worker,
    paused,
    ray_processes,
    recipe_module,
    registered,
    run_driver_forked,
    summary,
    train_steps,
    wait_for,
    without_ray,
)

RECIPE = ROOT / "recipes" / "qwen-ray-sft"


def test_killed_before_ray_registers_then_stop_resume_survive_a_killed_worker_learn_and_export(ray_env, tmp_path):
    """Three runs in one folder, each step's loss compared with the first run's (16 uninterrupted steps):

    1. killed before Ray registered a checkpoint: Ray's controller (which collects the workers' reports) is
       paused from the first step on, so the workers write step 8's and step 16's checkpoints and then block
       on the second report; one is SIGKILLed;
    2. the re-run says it starts afresh, and does, stopping at step 8 (``train.stop_at_step=8``);
    3. the same command resumes at step 9 with ``ray.max_failures=1``: a worker SIGKILLed once Ray registered
       step 12's checkpoint; Ray restarts the group from it, which finishes and exports.

    Each run is the driver forked from pytest (no interpreter start-up); launch.sh is tested with resnet50-ray-ddp.
    """
    out = tmp_path / "run"

    def kill_before_registration(driver: int):
        wait_for(lambda: train_steps(out), "the first step")
        [controller] = ray_processes(ray_env, "TrainController")
        with paused(controller):
            wait_for(lambda: (out / "checkpoint_step_00000016" / "meta.json").is_file(), "step 16's checkpoint")
            kill_a_worker(ray_env)

    killed = run_driver_forked("qwen-ray-sft", ray_env, f"output_dir={out}", alongside=kill_before_registration)
    assert killed.returncode == 1 and "Training failed due to worker errors" in killed.stderr, killed.stderr[-4000:]
    assert registered(out) is None and (out / "checkpoint_step_00000008" / "state.pt").is_file()
    uninterrupted = train_losses(out / "metrics.jsonl")
    assert sorted(uninterrupted) == list(range(1, 17))
    seen = len(read_jsonl(out / "metrics.jsonl"))

    first = run_driver_forked("qwen-ray-sft", ray_env, f"output_dir={out}", "train.stop_at_step=8")
    assert first.returncode == 0, first.stderr[-4000:]
    assert "resuming" not in first.stderr  # it announced step 16 and started at step 0 before
    assert (
        f"starting at step 0: checkpoint_step_00000008, checkpoint_step_00000016 in {out} were written but not "
        f"registered by Ray Train"
    ) in first.stderr and "| starting at step 0" in first.stderr
    records = read_jsonl(out / "metrics.jsonl")[seen:]
    losses = {r["step"]: r["loss"] for r in records if r["event"] == "train"}
    assert sorted(losses) == list(range(1, 9)) and not (out / "final").exists()
    assert losses == {s: uninterrupted[s] for s in range(1, 9)}
    seen += len(records)

    def kill_after_registration(driver: int):
        wait_for(lambda: registered(out) == "checkpoint_step_00000012", "step 12's checkpoint registered")
        kill_a_worker(ray_env)

    second = run_driver_forked(
        "qwen-ray-sft",
        ray_env,
        f"output_dir={out}",
        "checkpoint.every_steps=4",
        "ray.max_failures=1",
        alongside=kill_after_registration,
    )
    assert second.returncode == 0, second.stderr[-4000:]
    assert (
        "checkpoint_step_00000008 (step 8); checkpoint_step_00000016 were written after it but not registered"
        in second.stderr
    )
    loaded = re.findall(r"resumed from \S+/(checkpoint_step_\d+) \(step (\d+), world_size 2\)", second.stderr)
    assert loaded == [("checkpoint_step_00000008", "8"), ("checkpoint_step_00000012", "12")]  # then the restarted group
    assert "holds no random streams" not in second.stderr
    records = read_jsonl(out / "metrics.jsonl")[seen:]
    steps = [r["step"] for r in records if r["event"] == "train"]
    last = len(steps) + 4  # steps 9..last before the kill (12 <= last), 13..16 after the restart
    assert 12 <= last <= 16 and steps == [*range(9, last + 1), 13, 14, 15, 16], steps
    assert train_losses(out / "metrics.jsonl") == uninterrupted  # every step after the resume and the restart
    losses = uninterrupted
    assert sum(losses[s] for s in (14, 15, 16)) / 3 < 0.75 * sum(losses[s] for s in (1, 2, 3)) / 3, losses
    end = summary(records)
    assert end["reports_per_worker"] == [1, 1] and end["param_fingerprints"][0] == end["param_fingerprints"][1]
    assert end["eval/tokens"] > 0 and end["eval/loss"] < losses[1]

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "final")
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 2


def test_bad_input_fails_before_ray_starts(tmp_path, monkeypatch):
    train = recipe_module("qwen-ray-sft")
    base = ["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}"]
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with pytest.raises(ValueError, match="ray.num_workers=64"):
        train.main([*base, "ray.num_workers=64"])
    bad = tmp_path / "rows.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    with pytest.raises(ValueError, match="rows.jsonl line 1: the conversation has no assistant turn"):
        train.main([*base, f"data.train_files=[{bad}]"])
    with pytest.raises(ValueError, match="model.name_or_path: folder not found: /no/such/model"):
        train.main([*base, "model.name_or_path=/no/such/model"])
    with pytest.raises(ValueError, match="model.attn_implementation=flex_attention cannot train on CPU"):
        train.main([*base, "model.attn_implementation=flex_attention"])


def test_a_bad_row_is_named_by_the_first_check_on_a_used_output_dir(tmp_path, monkeypatch, capfd):
    """The data is checked before the resume: another data file on a used output_dir (which the resume refuses,
    another setting) is named by its bad row at once, not after the resume's refusal was answered. The used folder
    is step 8's checkpoint as Ray registers it."""
    import importlib.metadata
    import json

    from cookbook.checkpoint import CheckpointError
    from cookbook.config import to_dict
    from cookbook.sft import SFTDataError

    train, out = recipe_module("qwen-ray-sft"), tmp_path / "out"
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (out / "checkpoint_step_00000008").mkdir(parents=True)
    (out / "checkpoint_step_00000008" / "state.pt").write_bytes(b"x")
    meta = {"step": 8, "world_size": 2, "config": to_dict(tiny_config(f"output_dir={out}"))}
    (out / "checkpoint_step_00000008" / "meta.json").write_text(json.dumps(meta))
    (out / "checkpoint_manager_snapshot.json").write_text(
        json.dumps(
            {
                "ray_version": importlib.metadata.version("ray"),
                "latest_checkpoint_result": {"checkpoint_dir_name": "checkpoint_step_00000008", "metrics": {}},
            }
        )
    )
    base = ["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={out}"]
    train.main(base)  # the same settings resume
    assert "resuming from" in capfd.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n'
        '{"messages": [{"role": "user", "content": "no answer here"}]}\n'
    )
    with pytest.raises(SFTDataError, match="bad.jsonl line 2"):
        train.main([*base, f"data.train_files=[{bad}]"])
    with pytest.raises(CheckpointError, match="other settings"):  # a good file instead: the resume's refusal
        train.main([*base, "train.seed=7"])


def tiny_config(*overrides):
    train = recipe_module("qwen-ray-sft")
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", list(overrides))
    train.check_config(cfg, RECIPE)
    return cfg


def _ddp_eval(rows: list) -> tuple:
    """The recipe's evaluate on the DDP-wrapped model (as Ray Train's prepare_model wraps it on 2 CPU workers) over
    `rows`; the model's weights from rank 0."""
    from functools import partial

    import torch
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader

    import cookbook
    from cookbook import sft

    train = recipe_module("qwen-ray-sft")
    info = cookbook.get_dist_info()
    cfg = tiny_config()
    torch.manual_seed(cfg.train.seed)
    inner = train.build_model(cfg.model, 100, info.device)
    batches = DataLoader(
        rows[info.rank :: info.world_size],
        batch_size=cfg.train.micro_batch_size,
        collate_fn=partial(sft.collate, pad_id=0),
    )  # as train_loop's final evaluation
    result = sft.evaluate(DistributedDataParallel(inner), batches, info.device)
    return result, inner.state_dict() if info.rank == 0 else None


def test_eval_of_one_row_on_two_workers_equals_one_process():
    """Fewer eval rows than workers: the worker without a row runs no forward, and the value is that row's loss per
    label token computed in one process."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import cookbook
    from cookbook import sft

    cfg = tiny_config()
    _, evals, _ = sft.training_rows(cfg.data, AutoTokenizer.from_pretrained(cfg.model.tokenizer), cfg.train.seed)
    result, state = cookbook.distributed(num_processes=2, start_method="fork", timeout_minutes=1)(
        _ddp_eval
    ).distributed(evals[:1])[0]
    plain = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(cfg.model.name_or_path)).eval()
    plain.load_state_dict(state)
    batch = sft.collate(evals[:1], pad_id=0)
    labels = (batch["labels"][:, 1:] != -100).sum()
    with torch.no_grad():
        expected = sft.token_loss_sum(plain, batch) / labels
    assert result["tokens"] == labels
    assert float(result["loss"]) == pytest.approx(float(expected), rel=1e-5)


# ----------------------------------------------------------------------------- a NaN step (train.on_nonfinite)
BAD_STEP, ACCUM = 5, 2  # the step whose first micro-batch gets a NaN on worker 1; tiny.yaml's grad_accum_steps
NAN_RUN = ("mlflow=false", "train.max_steps=8", "checkpoint.every_steps=2", f"train.grad_accum_steps={ACCUM}")


@pytest.fixture
def nan_on_worker_1(monkeypatch):
    """Worker 1's training forward of the first micro-batch of step `BAD_STEP` returns NaN logits (patched here,
    before the workers are forked from this process; each worker counts its own forwards, skipped steps too). Its
    gradients reach worker 0 through DDP's all-reduce at the step's last micro-batch: both see a NaN gradient norm."""
    from torch.nn.parallel import DistributedDataParallel

    forward, calls = DistributedDataParallel.forward, []

    def nan_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if os.environ.get("RANK") == "1" and len(calls) == (BAD_STEP - 1) * ACCUM + 1:
                out.logits = out.logits * float("nan")
        return out

    monkeypatch.setattr(DistributedDataParallel, "forward", nan_forward)
    without_ray(monkeypatch)


def _driver(capfd, out, *overrides) -> str:
    """The recipe's driver (``main``) on tiny.yaml, its workers forked without Ray (`without_ray`); returns stderr."""
    capfd.readouterr()
    recipe_module("qwen-ray-sft").main(
        ["--config", str(RECIPE / "tiny.yaml"), f"output_dir={out}", *NAN_RUN, *overrides]
    )
    return capfd.readouterr().err


def test_a_nan_step_is_skipped_on_both_workers_and_a_resume_after_it_continues_its_data(
    tmp_path, capfd, nan_on_worker_1
):
    """``train.on_nonfinite=skip``: the NaN step is dropped (no optimizer or scheduler step), every checkpoint and
    the export stay finite; a run stopped after it and resumed takes the uninterrupted run's steps (the data
    continues after the batches the skipped step took)."""
    out = tmp_path / "run"
    err = _driver(capfd, out, "train.on_nonfinite=skip")
    assert f"step {BAD_STEP}: non-finite gradient norm (nan), step skipped (1 skipped so far)" in err, err[-3000:]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(s, int(s >= BAD_STEP)) for s in range(1, 9)]
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in train)
    end = summary(read_jsonl(out / "metrics.jsonl"))
    assert end["param_fingerprints"][0] == end["param_fingerprints"][1]
    assert torch.isfinite(torch.tensor(end["param_fingerprints"])).all()
    folders = sorted(out.glob("checkpoint_step_*"))
    assert [f.name for f in folders] == [f"checkpoint_step_{s:08d}" for s in (2, 4, 6, 8)]
    for folder in folders:
        state = torch.load(folder / "state.pt", weights_only=True)
        step = int(folder.name.rsplit("_", 1)[1])
        assert state["scheduler"]["last_epoch"] == step  # the skipped step stepped neither the scheduler ...
        assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {step}  # ... nor AdamW
        assert state["skipped_steps"] == int(step >= BAD_STEP)
        floats = floats_in({k: state[k] for k in ("model", "optimizer")})
        assert len(floats) > 20 and all(torch.isfinite(t).all() for t in floats), folder
    from safetensors.torch import load_file

    exported = load_file(out / "final" / "model.safetensors")
    assert exported and all(torch.isfinite(t).all() for t in exported.values())

    again = tmp_path / "again"  # the same run, stopped at step 6 (after the skip) and resumed
    _driver(capfd, again, "train.on_nonfinite=skip", "train.stop_at_step=6")
    err = _driver(capfd, again, "train.on_nonfinite=skip")
    assert f"resuming from {again / 'checkpoint_step_00000006'} (step 6)" in err, err[-3000:]
    resumed = [r for r in read_jsonl(again / "metrics.jsonl") if r["event"] == "train"][6:]
    assert [(r["step"], r["skipped_steps"]) for r in resumed] == [(7, 1), (8, 1)]
    assert train_losses(again / "metrics.jsonl") == {r["step"]: r["loss"] for r in train}


def test_a_nan_step_stops_the_run_and_the_driver_exits_4_naming_the_checkpoint_before_it(
    tmp_path, capfd, nan_on_worker_1
):
    """``train.on_nonfinite=stop`` (the default): both workers stop before the update of step 5; the driver (through
    ``cookbook.run_main``, as ``python train.py`` runs it) prints one line naming the step and step 4's checkpoint
    and exits 4. Ray is not asked to restart the workers (they end normally and hand the message back)."""
    out = tmp_path / "run"
    capfd.readouterr()
    pid = os.fork()
    if pid == 0:  # the driver's process (its output goes to capfd's files): run_main ends it with the exit status
        import cookbook

        cookbook.run_main(
            recipe_module("qwen-ray-sft").main,
            argv=["--config", str(RECIPE / "tiny.yaml"), f"output_dir={out}", *NAN_RUN],
        )
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    err = capfd.readouterr().err
    newest = out / f"checkpoint_step_{BAD_STEP - 1:08d}"
    line = (
        f"error: the gradient norm of step {BAD_STEP} is nan: the step was not applied and the run stops "
        f"(train.on_nonfinite=stop); the newest checkpoint, from before it, is {newest}. Lower optim.lr or raise "
        f"the warm-up, check the data of this step, or set train.on_nonfinite=skip to drop such steps"
    )
    assert status == 4, err[-3000:]
    assert [l for l in err.splitlines() if "error" in l.lower() or "Traceback" in l] == [line], err[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint_step_*")) == [
        "checkpoint_step_00000002",
        "checkpoint_step_00000004",
    ]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"] == [1, 2, 3, 4]
    assert not (out / "final").exists() and "done:" not in err
