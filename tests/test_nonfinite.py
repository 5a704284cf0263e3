"""A NaN loss for real in the ModernBERT DDP recipe (tiny.yaml, 2 gloo ranks forked from this process): the NaN is
made on rank 1 alone, in its forward of a chosen step, and reaches rank 0 through DDP's gradient all-reduce, so both
ranks see a NaN gradient norm and decide alike. ``train.on_nonfinite=skip`` drops that step and trains on;
``stop`` ends the run there, with the newest checkpoint from before it. No checkpoint ever holds a NaN."""

import os

import pytest
import torch
from conftest import read_jsonl
from safetensors.torch import load_file
from test_modernbert_ddp import run_in_workers
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import cookbook

BAD_STEP = 5


@pytest.fixture
def nan_on_rank_1(monkeypatch, tmp_path):
    """Rank 1's training forward of step `BAD_STEP` returns its loss times NaN (patched here, before the workers are
    forked from this process; one micro-batch per step, so the forward calls count the steps, skipped ones too).
    Rank 0 saves its weights as its forwards `BAD_STEP` to `BAD_STEP` + 2 start (before, after the skipped step, after
    the next one) to ``weights_<call>.pt`` in the folder returned."""
    from torch.nn.parallel import DistributedDataParallel

    forward, calls = DistributedDataParallel.forward, []
    folder = tmp_path / "weights"
    folder.mkdir()

    def nan_forward(self, *args, **kwargs):
        if self.training and os.environ.get("RANK") == "0" and BAD_STEP <= len(calls) + 1 <= BAD_STEP + 2:
            torch.save(
                {n: p.detach().clone() for n, p in self.module.named_parameters()},
                folder / f"weights_{len(calls) + 1}.pt",
            )
        out = forward(self, *args, **kwargs)
        if self.training:
            calls.append(1)
            if os.environ.get("RANK") == "1" and len(calls) == BAD_STEP:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(DistributedDataParallel, "forward", nan_forward)
    return folder


def _tensors_of_checkpoint(folder, tmp_path) -> dict:
    flat = tmp_path / f"{folder.name}.pt"
    dcp_to_torch_save(folder, flat)
    found = {}

    def walk(prefix, value):
        if isinstance(value, torch.Tensor):
            found[prefix] = value
        elif isinstance(value, dict):
            for k, v in value.items():
                walk(f"{prefix}.{k}", v)
        elif isinstance(value, (list, tuple)):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)

    walk("", torch.load(flat, weights_only=False))
    return found


RUN = (
    "train.grad_accum_steps=1",
    "train.max_steps=8",
    "train.eval_every=0",
    "train.log_every=1",
    "checkpoint.every_steps=2",
    "checkpoint.keep_last=0",
    "mlflow=false",
)


def test_skip_drops_the_nan_step_and_every_weight_and_checkpoint_stays_finite(
    tmp_path, monkeypatch, capfd, nan_on_rank_1
):
    out = tmp_path / "run"
    err = run_in_workers(monkeypatch, capfd, f"output_dir={out}", *RUN, "train.on_nonfinite=skip")
    assert f"step {BAD_STEP}: non-finite gradient norm (nan), step skipped (1 skipped so far)" in err, err[-3000:]
    train = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 9))  # all 8 steps, on 9 batches
    assert [r["skipped_steps"] for r in train] == [0] * (BAD_STEP - 1) + [1] * (9 - BAD_STEP)
    assert all(torch.isfinite(torch.tensor([r["loss"], r["grad_norm"]])).all() for r in train)
    summary = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "summary"][-1]
    assert summary["step"] == 8 and torch.isfinite(torch.tensor(summary["param_fingerprints"])).all()
    exported = load_file(out / "final" / "model.safetensors")
    assert exported and all(torch.isfinite(t).all() for t in exported.values())
    folders = sorted((out / "checkpoints").glob("step_*"))
    assert [f.name for f in folders] == [f"step_{s:08d}" for s in (2, 4, 6, 8)]
    for folder in folders:
        tensors = _tensors_of_checkpoint(folder, tmp_path)
        floats = {k: t for k, t in tensors.items() if t.is_floating_point()}
        assert len(floats) > 10 and all(torch.isfinite(t).all() for t in floats.values()), folder
        steps = {int(t) for k, t in tensors.items() if k.endswith(".step")}  # AdamW's, one per parameter
        assert steps == {int(folder.name.rsplit("_", 1)[1])}, folder  # the applied steps: the skipped one is left out
    before, after, next_step = (torch.load(nan_on_rank_1 / f"weights_{c}.pt") for c in range(BAD_STEP, BAD_STEP + 3))
    saved = _tensors_of_checkpoint(folders[1], tmp_path)  # step 4, the last update before the skipped step
    assert sorted(before) == sorted(after) == sorted(next_step) and len(before) > 10
    for name, weight in before.items():
        torch.testing.assert_close(weight, saved[f".app.model.{name}"], rtol=0, atol=0, msg=name)
        torch.testing.assert_close(after[name], weight, rtol=0, atol=0, msg=name)  # the skipped step changed nothing
    assert any(not torch.equal(next_step[n], after[n]) for n in after)  # an applied step does


def test_stop_ends_the_run_at_the_nan_step_with_the_checkpoint_before_it(tmp_path, monkeypatch, capfd, nan_on_rank_1):
    out = tmp_path / "run"
    with pytest.raises(cookbook.WorkerError) as failed:
        run_in_workers(monkeypatch, capfd, f"output_dir={out}", *RUN)  # train.on_nonfinite=stop, the default
    assert failed.value.exc_type == "cookbook.loop.NonFiniteError" and failed.value.exception.exit_status == 4
    newest = out / "checkpoints" / f"step_{BAD_STEP - 1:08d}"
    assert str(failed.value.exception) == (
        f"the gradient norm of step {BAD_STEP} is nan: the step was not applied and the run stops "
        f"(train.on_nonfinite=stop); the newest checkpoint, from before it, is {newest}. Lower optim.lr or raise the "
        f"warm-up, check the data of this step, or set train.on_nonfinite=skip to drop such steps"
    )
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000002", "step_00000004"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"] == [1, 2, 3, 4]
    assert not (out / "final").exists()
