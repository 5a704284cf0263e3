"""A NaN step in the epoch-counted Ray recipes (resnet50-ray-ddp, two-tower-ray): ``train.on_nonfinite`` skip and
stop, and a step that leaves BatchNorm's statistics infinite, on 2 gloo workers forked without Ray
(`ray_cluster.without_ray`), 1 or 2 epochs of tiny.yaml."""

import math
import os
import re

import pytest
import torch
from conftest import ROOT, read_jsonl
from ray_cluster import floats_in, recipe_module, summary, without_ray

STEPS_PER_EPOCH = {"resnet50-ray-ddp": 4, "two-tower-ray": 12}  # tiny.yaml on 2 workers
RUN = ("mlflow=false", "train.epochs=2")


@pytest.fixture
def nan_on_worker_1(monkeypatch):
    """``nan_on_worker_1(bad)``: worker 1's `bad`-th training forward (0: none) returns NaN (logits, or the user embeddings
    of two-tower-ray), patched before the workers are forked from this process; each worker counts
    its own forwards (a skipped step's too). DDP's all-reduce of the gradients takes the NaN to worker 0: both
    see a NaN gradient norm. ``rank="0", images=factor``: worker 0's images are multiplied by `factor` instead
    (through every BatchNorm layer of resnet50-ray-ddp); ``buffers=path``: that worker's buffers before the `bad`-th
    forward and the next go to `path` (``{"before": ..., "after": ...}``)."""
    from torch.nn.parallel import DistributedDataParallel

    forward = DistributedDataParallel.forward
    without_ray(monkeypatch)

    def arm(bad: int, rank: str = "1", images: float | None = None, buffers=None) -> None:
        calls, seen = [], {}

        def nan_forward(self, *args, **kwargs):
            here, n = self.training and os.environ.get("RANK") == rank, len(calls) + 1
            if here and buffers is not None and n in (bad, bad + 1):
                seen["before" if n == bad else "after"] = {k: b.clone() for k, b in self.module.named_buffers()}
                if len(seen) == 2:
                    torch.save(seen, buffers)
            if here and images is not None and n == bad:
                args = (args[0] * images, *args[1:])  # before the first BatchNorm
            out = forward(self, *args, **kwargs)
            if self.training:
                calls.append(1)
                if here and images is None and n == bad:
                    if isinstance(out, tuple):
                        return (out[0] * float("nan"), *out[1:])
                    out.logits = out.logits * float("nan")
            return out

        monkeypatch.setattr(DistributedDataParallel, "forward", nan_forward)

    return arm


# recipe, the batch of the NaN, train.log_every, (step, skipped_steps) of each log line, the step of each epoch's
# end, whether the run stops after epoch 1 (train.stop_at_epoch=1) and is resumed; resnet50-ray-ddp's NaN is in
# worker 0's images, whose BatchNorm statistics are the ones checkpointed and broadcast
SKIPS = [
    ("resnet50-ray-ddp", 6, 1, [(1, 0), (2, 0), (3, 0), (4, 0), (5, 0), (6, 1), (7, 1)], [4, 7], False),
    # the last batch of epoch 1: the epoch ends without an update, its log line (step 11) comes at its end, and
    # the resume from its checkpoint continues at the batches of epoch 2 (step 12 + 1 skipped)
    ("two-tower-ray", 12, 5, [(5, 0), (10, 0), (11, 1), (15, 1), (20, 1), (23, 1)], [11, 23], True),
]


@pytest.mark.parametrize("recipe, bad, log_every, logged, epoch_ends, resume", SKIPS)
def test_a_nan_step_is_skipped_the_epoch_takes_all_its_batches_and_its_checkpoint_stays_finite(
    recipe, bad, log_every, logged, epoch_ends, resume, tmp_path, capfd, nan_on_worker_1
):
    """``train.on_nonfinite=skip``: the NaN step's batch is dropped on both workers (no optimizer or scheduler
    step), the epoch still takes all its batches, so its checkpoint is the epoch's (``checkpoint_epoch_<n>``, one
    step fewer, ``skipped_steps`` 1 in ``state.pt``: where the data of a resume continues), every checkpoint
    is finite, and a NaN through BatchNorm leaves its statistics as they were before the skipped step."""
    buffers = tmp_path / "buffers.pt" if recipe == "resnet50-ray-ddp" else None
    nan_on_worker_1(bad, **({"rank": "0", "images": float("nan"), "buffers": buffers} if buffers else {}))
    spe, out = STEPS_PER_EPOCH[recipe], tmp_path / "run"
    argv = [
        "--config",
        str(ROOT / "recipes" / recipe / "tiny.yaml"),
        f"output_dir={out}",
        *RUN,
        f"train.log_every={log_every}",
        "train.on_nonfinite=skip",
    ]
    capfd.readouterr()
    recipe_module(recipe).main(argv + (["train.stop_at_epoch=1"] if resume else []))
    err = capfd.readouterr().err
    assert f"step {bad}: non-finite gradient norm (nan), step skipped (1 skipped so far)" in err, err[-3000:]
    if resume:
        nan_on_worker_1(0)  # no NaN in the resumed run (its workers count their forwards from 0 again)
        recipe_module(recipe).main(argv)
        err = capfd.readouterr().err
        assert f"resuming from {out / 'checkpoint_epoch_0001'} (epoch 1)" in err, err[-3000:]
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == logged
    assert all(math.isfinite(r["loss"]) for r in train)
    # an epoch whose last batch was skipped logs its last steps at its end, without a gradient norm
    assert [r["step"] for r in train if r.get("grad_norm") is None] == ([epoch_ends[0]] if bad == spe else [])
    assert all(math.isfinite(r["grad_norm"]) for r in train if r.get("grad_norm") is not None)
    assert [r["step"] for r in records if r["event"] == "eval"] == epoch_ends  # one per epoch
    end = summary(records)
    assert (end["step"], end["epoch"]) == (2 * spe - 1, 2)
    assert end["param_fingerprints"][0] == end["param_fingerprints"][1]
    assert torch.isfinite(torch.tensor(end["param_fingerprints"])).all()
    folders = sorted(out.glob("checkpoint_epoch_*"))
    assert [f.name for f in folders] == ["checkpoint_epoch_0001", "checkpoint_epoch_0002"]
    for epoch, folder in enumerate(folders, 1):
        state = torch.load(folder / "state.pt", weights_only=True)
        applied, skipped = epoch_ends[epoch - 1], int(bad <= epoch * spe)
        assert (applied, skipped) == (epoch * spe - skipped, state["skipped_steps"])
        if "scheduler" in state:  # resnet50-ray-ddp: the skipped step did not step the schedule
            assert state["scheduler"]["last_epoch"] == applied
        else:  # two-tower-ray: AdamW's step count is the applied steps
            assert {int(s["step"]) for s in state["optimizer"]["state"].values()} == {applied}
        floats = floats_in({k: state[k] for k in ("model", "optimizer")})
        assert len(floats) > 10 and all(torch.isfinite(t).all() for t in floats), folder
    if buffers:
        seen = torch.load(buffers, weights_only=True)
        assert any("running_var" in k for k in seen["after"]) and seen["after"].keys() == seen["before"].keys()
        assert all(torch.equal(seen["after"][k], t) for k, t in seen["before"].items())


def _driver(recipe: str, capfd, *overrides: str) -> tuple[int, str]:
    """Run the recipe's driver on its tiny.yaml with `overrides` through ``cookbook.run_main``, as ``python train.py``,
    in a forked process; returns its exit status and stderr."""
    capfd.readouterr()
    pid = os.fork()
    if pid == 0:  # the driver's process (its output goes to capfd's files): run_main ends it with the exit status
        import cookbook

        cookbook.run_main(
            recipe_module(recipe).main, argv=["--config", str(ROOT / "recipes" / recipe / "tiny.yaml"), *overrides]
        )
    status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    return status, capfd.readouterr().err


def test_a_nan_step_stops_an_epoch_run_and_the_driver_exits_4_naming_the_epoch_checkpoint(
    tmp_path, capfd, nan_on_worker_1
):
    """``train.on_nonfinite=stop`` (the default) in two-tower-ray: both workers stop before the update of the NaN
    step; the driver (through ``cookbook.run_main``, as ``python train.py``) prints one line naming the step and
    the first epoch's checkpoint and exits 4; no checkpoint is written after it."""
    recipe = "two-tower-ray"
    bad, out = STEPS_PER_EPOCH[recipe] + 2, tmp_path / "run"  # mid-epoch 2
    nan_on_worker_1(bad)
    status, err = _driver(recipe, capfd, f"output_dir={out}", *RUN, "train.log_every=1")
    line = (
        f"error: the gradient norm of step {bad} is nan: the step was not applied and the run stops "
        f"(train.on_nonfinite=stop); the newest checkpoint, from before it, is {out / 'checkpoint_epoch_0001'}. "
        f"Lower optim.lr or raise the warm-up, check the data of this step, or set train.on_nonfinite=skip to "
        f"drop such steps"
    )
    assert status == 4, err[-3000:]
    assert [l for l in err.splitlines() if "error" in l.lower() or "Traceback" in l] == [line], err[-3000:]
    assert sorted(p.name for p in out.glob("checkpoint_epoch_*")) == ["checkpoint_epoch_0001"]
    assert [r["step"] for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "train"] == list(range(1, bad))


def test_a_finite_step_that_leaves_batchnorm_statistics_infinite_is_never_checkpointed(
    tmp_path, capfd, nan_on_worker_1
):
    """resnet50-ray-ddp, 1 epoch: the images of epoch 1's last step on worker 0 are scaled by 1e20, so its loss and
    gradient norm are finite but BatchNorm's running variance becomes infinite; the epoch's checkpoint is refused and
    the driver exits 4 with one line (train.on_nonfinite=stop, the default; skip does the same); no checkpoint and no
    summary are written."""
    out, last = tmp_path / "run", STEPS_PER_EPOCH["resnet50-ray-ddp"]
    nan_on_worker_1(last, rank="0", images=1e20)
    status, err = _driver("resnet50-ray-ddp", capfd, f"output_dir={out}", "mlflow=false", "train.epochs=1")
    assert status == 4, err[-3000:]
    lines = [l for l in err.splitlines() if "error" in l.lower() or "Traceback" in l]
    assert len(lines) == 1 and re.fullmatch(
        rf"error: after step {last}, \d+ values of the model's parameters and buffers are NaN or infinite "
        r"\(\S+\.running_var( and \d+ more)?\): checkpoint_epoch_0001 is not saved and the run stops, whatever "
        r"train.on_nonfinite says; no checkpoint was saved before it. Lower optim.lr or raise the warm-up, or check "
        r"the data",
        lines[0],
    ), err[-3000:]
    assert not list(out.glob("checkpoint_*"))
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, last + 1))
    assert not [r for r in records if r["event"] == "summary"]


def test_a_bad_on_nonfinite_is_refused_before_ray_starts(tmp_path):
    from cookbook.config import ConfigError

    with pytest.raises(ConfigError, match="^train.on_nonfinite must be one of stop, skip, got 'ignore'$"):
        recipe_module("two-tower-ray").main(
            [
                "--config",
                str(ROOT / "recipes" / "two-tower-ray" / "tiny.yaml"),
                "--check",
                f"output_dir={tmp_path}",
                "train.on_nonfinite=ignore",
            ]
        )
