import json
import os
import re

import pytest
import torch
import torch.distributed as dist

import cookbook.checkpoint as ckpt_mod
from cookbook import distributed_context
from cookbook.checkpoint import (
    Checkpointer,
    CheckpointError,
    ModelOptimizerState,
    RankLocalState,
    ResumeGuard,
    RNGState,
)


class Counter:
    def __init__(self, value=0):
        self.value = value

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


def _model_and_optim(seed: int):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(3):
        model(torch.randn(5, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.fixture()
def group():
    with distributed_context() as info:  # a process group of one (gloo)
        yield info


def test_model_optimizer_moments_round_trip(tmp_path, group):
    model, opt = _model_and_optim(0)
    ck = Checkpointer(tmp_path)
    ck.save(3, {"app": ModelOptimizerState(model, opt), "counter": Counter(3)})
    model2, opt2 = _model_and_optim(1)  # different weights and moments
    counter = Counter()
    meta = ck.load(ck.latest(), {"app": ModelOptimizerState(model2, opt2), "counter": counter})
    assert meta["step"] == 3 and counter.value == 3
    for p, q in zip(model.parameters(), model2.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(opt.state[p][key], opt2.state[q][key], rtol=0, atol=0)


def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, group, monkeypatch):
    ck = Checkpointer(tmp_path)
    ck.save(1, {"counter": Counter(1)})
    real_save = ckpt_mod.dcp.save

    def dying_save(state, checkpoint_id, **writer):  # writes part of a checkpoint, then the process "dies"
        os.makedirs(checkpoint_id, exist_ok=True)
        open(os.path.join(checkpoint_id, "__0_0.distcp"), "wb").write(b"partial")
        raise RuntimeError("node lost")

    monkeypatch.setattr(ckpt_mod.dcp, "save", dying_save)
    with pytest.raises(RuntimeError, match="node lost"):
        ck.save(2, {"counter": Counter(2)})
    assert [p.name for p in ck.complete_checkpoints()] == ["step_00000001"]
    assert (tmp_path / ".tmp-step_00000002").exists() and not (tmp_path / "step_00000002").exists()

    # A crash after the shards were written but before publishing leaves no step_2 either.
    monkeypatch.setattr(ckpt_mod.dcp, "save", real_save)
    monkeypatch.setattr(ckpt_mod, "publish", lambda *a: (_ for _ in ()).throw(OSError("power cut")))
    with pytest.raises(OSError, match="power cut"):
        ck.save(2, {"counter": Counter(2)})
    monkeypatch.undo()
    counter = Counter()
    assert ck.latest().name == "step_00000001"
    ck.load(ck.latest(), {"counter": counter})
    assert counter.value == 1

    # The next save cleans the leftovers and publishes.
    ck.save(2, {"counter": Counter(2)})
    assert ck.latest().name == "step_00000002"
    assert not (tmp_path / ".tmp-step_00000002").exists()


def test_keep_last_n(tmp_path, group):
    ck = Checkpointer(tmp_path, keep_last=2)
    for step in (10, 20, 30, 40):
        ck.save(step, {"counter": Counter(step)})
    assert [p.name for p in ck.complete_checkpoints()] == ["step_00000030", "step_00000040"]
    assert ck.resolve("auto").name == "step_00000040"
    assert ck.resolve("none") is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        ck.resolve(str(tmp_path / "step_00000010"))


def test_rank_local_state_refuses_a_different_world_size(tmp_path, group):
    ck = Checkpointer(tmp_path)
    path = ck.save(5, {"local": RankLocalState(counter=Counter(5), rng=RNGState())})
    meta = path / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))
    with pytest.raises(CheckpointError, match="written by 2 ranks but this job has 1"):
        ck.load(path, {"local": RankLocalState(counter=Counter(), rng=RNGState())})


def test_rng_state_restores_the_stream(tmp_path, group):
    ck = Checkpointer(tmp_path)
    torch.manual_seed(7)
    ck.save(1, {"local": RankLocalState(rng=RNGState())})
    expected = torch.rand(4)
    torch.manual_seed(99)
    ck.load(ck.latest(), {"local": RankLocalState(rng=RNGState())})
    torch.testing.assert_close(torch.rand(4), expected, rtol=0, atol=0)
    assert dist.is_initialized()


def test_resume_none_over_old_checkpoints_is_refused(tmp_path, group):
    ck = Checkpointer(tmp_path)
    assert ck.check_resume("none", world_size=1) is None  # empty folder: fine
    ck.save(1, {"counter": Counter(1)})
    with pytest.raises(CheckpointError, match="holds checkpoints of an earlier run"):
        ck.check_resume("none", world_size=1)
    with pytest.raises(CheckpointError, match="stop_at_step=1 is not after"):
        ck.check_resume("auto", world_size=1, stop_at_step=1)
    with pytest.raises(CheckpointError, match=r"other settings \(lr: 0.1 -> 0.2\)"):
        ck.save(2, {"counter": Counter(2)}, {"config": {"lr": 0.1}})
        ck.check_resume("auto", world_size=1, config={"lr": 0.2})


def test_a_restarted_group_continues_its_own_checkpoints_whatever_resume_says(tmp_path, group, monkeypatch):
    """After a failure the launcher starts the workers again (``COOKBOOK_RESTART_COUNT`` > 0): a run configured
    with resume=none (or an older path) resumes from the newest checkpoint it wrote itself."""
    ck = Checkpointer(tmp_path)
    monkeypatch.setenv("COOKBOOK_RESTART_COUNT", "1")
    assert ck.check_resume("none", world_size=1) is None  # failed before its first checkpoint: starts fresh
    first = ck.save(1, {"counter": Counter(1)})
    newest = ck.save(2, {"counter": Counter(2)})
    assert ck.check_resume("none", world_size=1) == newest
    assert ck.check_resume(str(first), world_size=1) == newest
    monkeypatch.setenv("COOKBOOK_RESTART_COUNT", "0")
    with pytest.raises(CheckpointError, match="holds checkpoints of an earlier run"):
        ck.check_resume("none", world_size=1)


def test_the_resume_guard_over_another_folder_layout(tmp_path):
    """Checkpoints published as Hugging Face Trainer folders (checkpoint-<n> with meta.json alone), counted in
    epochs, under the same guard."""
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    for step in (3, 10, 6):
        (root / f"checkpoint-{step}").mkdir(parents=True)
        meta = {"step": step, "epoch": step // 3, "world_size": 2, "config": {"lr": 0.1}}
        (root / f"checkpoint-{step}" / "meta.json").write_text(json.dumps(meta))
    (root / "checkpoint-12").mkdir()  # not published: no meta.json
    guard = ResumeGuard(
        root,
        folder="checkpoint-<n>",
        files=(),
        run_dir=run,
        cannot_remap="ZeRO partitions cannot be remapped",
        same_size="NGPU x NNODES = {n}",
    )
    assert [p.name for p in guard.complete_checkpoints()] == [
        "checkpoint-3",
        "checkpoint-6",
        "checkpoint-10",
    ]  # by number
    assert guard.check("auto", 2, {"lr": 0.1}, stop_at=("train.stop_at_epoch", 4)) == root / "checkpoint-10"
    assert guard.check(str(root / "checkpoint-3"), 2, {"lr": 0.1}) == root / "checkpoint-3"
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint.resume='\S+checkpoint-12' is not a complete checkpoint folder "
        r"\(no meta.json inside\).* or the path of a checkpoint-<n> folder",
    ):
        guard.check(str(root / "checkpoint-12"), 2)
    fresh = rf"start afresh with a new output_dir \(or delete {re.escape(str(run))}\)$"
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint-10 was written by 2 ranks but this job has 4: ZeRO partitions "
        r"cannot be remapped \(resuming on another number of processes is "
        r"supported by modernbert-ddp, qwen-fsdp2-sft and retinanet-ddp only\)\. "
        r"Resume with NGPU x NNODES = 2, or " + fresh,
    ):
        guard.check("auto", 4)
    with pytest.raises(
        CheckpointError, match=r"other settings \(lr: 0.1 -> 0.2\); resuming would mix two runs.* " + fresh
    ):
        guard.check("auto", 2, {"lr": 0.2})
    with pytest.raises(CheckpointError, match="holds checkpoints of an earlier run.*" + fresh):
        guard.check("none", 2)
    with pytest.raises(
        CheckpointError, match=r"train.stop_at_epoch=3 is not after the checkpoint \S+checkpoint-10 \(epoch 3\)"
    ):
        guard.check("auto", 2, stop_at=("train.stop_at_epoch", 3))
    assert guard.already_complete(10, 10, "step", {"model": run / "final"}) == (
        f"already complete: 10 of 10 steps; model in {run / 'final'}. To train again, use a new output_dir (or delete {run})."
    )


def test_a_resizable_guard_keeps_the_global_batch(tmp_path):
    """A resizable guard resumes another world size when micro-batch x accumulation x ranks is the checkpoint's
    (the two keys may change within it), and otherwise says which value keeps it."""
    root = tmp_path / "checkpoints"
    (root / "step_00000010").mkdir(parents=True)
    written = {"train": {"micro_batch_size": 4, "grad_accum_steps": 2, "seed": 1}}
    meta = {"step": 10, "world_size": 2, "config": written}
    (root / "step_00000010" / "meta.json").write_text(json.dumps(meta))
    (root / "step_00000010" / ".metadata").write_bytes(b"")
    guard = ResumeGuard(root, files=(), resizable=True)
    same = {"train": {"micro_batch_size": 4, "grad_accum_steps": 2, "seed": 1}}
    assert guard.check("auto", 2, same) == root / "step_00000010"
    assert guard.check("auto", 1, {"train": {"micro_batch_size": 4, "grad_accum_steps": 4, "seed": 1}})
    assert guard.check("auto", 4, {"train": {"micro_batch_size": 2, "grad_accum_steps": 2, "seed": 1}})
    assert guard.check("auto", 2, {"train": {"micro_batch_size": 8, "grad_accum_steps": 1, "seed": 1}})
    with pytest.raises(
        CheckpointError,
        match=r"step_00000010 was written with a global batch of 16 samples \(4 micro-batch "
        r"x 2 accumulation x 2 ranks\) but this job's is 8 \(4 x 2 x 1\); a resume "
        r"keeps the global batch, .* To continue on 1 rank, set "
        r"train.grad_accum_steps=4 \(4 x 4 x 1 = 16\) or train.micro_batch_size=8 "
        r"\(8 x 2 x 1 = 16\); or resume with the same number of processes \(NGPU x "
        r"NNODES = 2\), or start afresh with a new output_dir$",
    ):
        guard.check("auto", 1, same)
    with pytest.raises(CheckpointError, match=r"To continue on 3 ranks, no micro-batch x accumulation x 3 makes 16;"):
        guard.check("auto", 3, same)
    with pytest.raises(CheckpointError, match=r"other settings \(train.seed: 1 -> 2\)"):
        guard.check("auto", 1, {"train": {"micro_batch_size": 4, "grad_accum_steps": 4, "seed": 2}})
    plain = ResumeGuard(root, files=())  # not resizable: the batch keys are settings like any other
    with pytest.raises(
        CheckpointError, match=r"this job has 1: its per-rank data-loader and RNG state cannot be remapped"
    ):
        plain.check("auto", 1, {"train": {"micro_batch_size": 4, "grad_accum_steps": 4, "seed": 1}})
    with pytest.raises(
        CheckpointError, match=r"other settings \(train.grad_accum_steps: 2 -> 1, train.micro_batch_size"
    ):
        plain.check("auto", 2, {"train": {"micro_batch_size": 8, "grad_accum_steps": 1, "seed": 1}})


def test_a_resizable_checkpointer_loads_another_world_size_without_the_per_rank_state(tmp_path, group, capfd):
    """On another world size: the global entries (a counter, the data position) are loaded, the per-rank state is
    left as it is, and one line says what was resharded, remapped and not restored."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from cookbook.sampler import DataPosition, ResizableSampler

    def loader():
        return StatefulDataLoader(
            range(40),
            batch_size=2,
            sampler=ResizableSampler(range(40), 1, 0, drop_last=True),
            collate_fn=lambda rows: rows,
        )

    saved = loader()
    it = iter(saved)
    for _ in range(3):
        next(it)
    path = Checkpointer(tmp_path).save(
        5,
        {"counter": Counter(5), "data": DataPosition(saved), "local": RankLocalState(counter=Counter(7))},
        {"config": {"train": {"micro_batch_size": 2, "grad_accum_steps": 1}}},
    )
    meta = path / "meta.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))  # as if 2 ranks wrote it
    counter, local, fresh = Counter(), Counter(-1), loader()
    state = {"counter": counter, "data": DataPosition(fresh), "local": RankLocalState(counter=local)}
    with pytest.raises(CheckpointError, match="written by 2 ranks but this job has 1"):
        Checkpointer(tmp_path).load(path, state)  # not resizable
    capfd.readouterr()
    Checkpointer(tmp_path, resizable=True).load(path, state)
    assert counter.value == 5 and local.value == -1  # per-rank state untouched
    assert fresh.sampler.start == 6 and [i for b in fresh for i in b] == fresh.sampler.order()[6:40]
    lines = [line.split(" ", 1)[1] for line in capfd.readouterr().err.splitlines() if " resized: " in line]
    assert lines == [
        f"resized: {path} was written by 2 ranks, this job has 1. Resharded by DCP: the model and optimizer "
        f"state. Remapped: the data position, epoch 0 at sample 6 of 40 in the same order (global batch 4 "
        f"samples, as before). Not restored, as in a fresh run (seeded at start-up): the per-rank state "
        f"(local: counter)"
    ]
    with pytest.raises(ValueError, match="only with a DataPosition"):
        Checkpointer(tmp_path, resizable=True).load(path, {"counter": Counter()})


def test_a_resume_that_changes_the_runs_length_says_why_and_what_to_do(tmp_path):
    """A bigger train.max_steps (or train.epochs) over a finished run's checkpoint is refused with the reason (the
    learning-rate schedule is laid out over the length) and the ways that work: a new run, or train.stop_at_step."""
    run, root = tmp_path / "run", tmp_path / "run" / "checkpoints"
    (root / "step_00000040").mkdir(parents=True)
    written = {
        "model": {"name_or_path": "m"},
        "optim": {"lr": 0.1},
        "train": {"max_steps": 40, "epochs": 1, "stop_at_step": -1},
    }
    meta = {"step": 40, "epoch": 1, "world_size": 1, "config": written}
    (root / "step_00000040" / "meta.json").write_text(json.dumps(meta))
    guard = ResumeGuard(root, files=(), run_dir=run)
    longer = {**written, "train": {**written["train"], "max_steps": 80}}
    with pytest.raises(CheckpointError) as err:
        guard.check("auto", 1, longer)
    assert str(err.value) == (
        f"{root / 'step_00000040'} was written with other settings (train.max_steps: 40 -> 80); resuming would mix two "
        "runs. It is the end of a finished run (step 40 of train.max_steps=40), and a finished run cannot be extended: "
        "the learning-rate schedule is laid out over train.max_steps (its decay ends there, a warm-up ratio is a "
        "fraction of it), so the steps after the checkpoint would follow another schedule than the one that brought "
        f"the run there. To train longer, start a new run with train.max_steps=80 in a new output_dir (or delete {run}); "
        "it starts from model.name_or_path, so name the model this run exported there (such as its output_dir's final "
        "folder) to start from this run's weights. To split one run into parts, keep train.max_steps and set "
        "train.stop_at_step (each part resumes the last)"
    )
    with pytest.raises(
        CheckpointError,
        match=r"\(optim.lr: 0.1 -> 0.2, train.max_steps: 40 -> 80\); resuming would mix "
        r"two runs\. It is the end of a finished run",
    ):
        guard.check("auto", 1, {**longer, "optim": {"lr": 0.2}})  # every change is listed
    by_steps = {
        **written,
        "train": {**written["train"], "epochs": 3},
    }  # train.max_steps > 0 decides: epochs are no length
    with pytest.raises(CheckpointError, match=r"\(train.epochs: 1 -> 3\); resuming would mix two runs\. Use the same"):
        guard.check("auto", 1, by_steps)
    by_epochs = {**written, "train": {**written["train"], "max_steps": -1}}  # a run counted in epochs (Ray's)
    (root / "step_00000040" / "meta.json").write_text(json.dumps({**meta, "config": by_epochs}))
    with pytest.raises(
        CheckpointError,
        match=r"It is the end of a finished run \(epoch 1 of train.epochs=1\), and a "
        r"finished run cannot be extended: .* new run with train.epochs=2 in",
    ):
        guard.check("auto", 1, {**by_epochs, "train": {**by_epochs["train"], "epochs": 2}})
    meta["step"] = 20  # not finished: a resume may not shorten or lengthen it either
    (root / "step_00000040" / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(
        CheckpointError,
        match=r"It is step 20 of a run of train.max_steps=40, and a resume cannot change "
        r"a run's length: the learning-rate schedule",
    ):
        guard.check("auto", 1, {**written, "train": {**written["train"], "max_steps": 30}})
    with pytest.raises(
        CheckpointError,
        match=r"other settings \(optim.lr: 0.1 -> 0.2\); resuming would mix two runs\. "
        r"Use the same settings, or start afresh",
    ):
        guard.check("auto", 1, {**written, "optim": {"lr": 0.2}})  # other keys: the message as before
    assert guard.check("auto", 1, written) == root / "step_00000040"
