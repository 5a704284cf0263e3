"""cookbook.hf_trainer's callbacks, driven in this process by the Trainer's own callback machinery
(`CallbackHandler`, `DefaultFlowCallback`) with the event order of ``Trainer._inner_training_loop``."""

import json
import os
import signal
import time
from types import SimpleNamespace

import pytest
from conftest import recipe_modules
import torch
from transformers import TrainingArguments
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerControl, TrainerState

from cookbook.checkpoint import CheckpointSaveError, ResumeGuard
from cookbook.config import ConfigError
from cookbook.dist import DistInfo
from cookbook.hf_trainer import MetricsCallback, NonFiniteSteps, PublishCheckpoints, RunControl, published_checkpoints
from cookbook.loop import NonFiniteError, NonFinitePolicy, Preempted
from cookbook.metrics import MetricsLogger

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
STEP, EVAL, SAVE = 0.05, 0.5, 0.5  # seconds: a training step, an evaluation (twice: loss and generation), a save


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluations_and_saves_are_left_out_of_the_step_time(tmp_path):
    """Steps of 0.05 s; after step 2 an evaluation (0.5 s in the Trainer's loop + 0.5 s of generation, as the
    recipe's ``evaluate`` does), after step 3 a checkpoint save (0.5 s), step 4 evaluates and stops with a save
    (RunControl's train.stop_at_step). Every window's step time is the step's alone, and the tokens counted per step give the
    throughput. Each evaluation leaves the random streams as they were (before: changed by its loader)."""
    args = TrainingArguments(
        output_dir=str(tmp_path / ".staging"),
        use_cpu=True,
        report_to="none",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="steps",
        save_steps=3,
    )
    state = TrainerState(max_steps=6, logging_steps=1, eval_steps=2, save_steps=3)
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, max_steps=6)

    callback = MetricsCallback(metrics, pad_id=0)
    handler = CallbackHandler([DefaultFlowCallback(), RunControl(4), callback], None, None, None, None)
    batch = {
        "input_ids": torch.ones(2, 5, dtype=torch.long),
        "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]),
    }  # 7 real tokens
    saved, kept = [], []
    control = handler.on_train_begin(args, state, TrainerControl())
    while not control.should_training_stop:
        control = handler.on_step_begin(args, state, control)
        callback.count([batch], data_wait_s=0.0)  # CountBatches, as the step's batches arrive
        time.sleep(STEP)  # forward, backward, optimizer step
        state.global_step += 1
        control = handler.on_step_end(args, state, control)
        # Trainer._maybe_log_save_evaluate: log, evaluate, save
        if control.should_log:
            control = handler.on_log(args, state, control, logs={"loss": 1.0, "learning_rate": 1e-3, "grad_norm": 0.5})
        if control.should_evaluate:
            rng = torch.get_rng_state()
            time.sleep(2 * EVAL)  # the evaluation loop and the generation, then on_evaluate
            torch.rand(3)  # the eval loader draws its seed from torch's generator
            control = handler.on_evaluate(
                args, state, control, metrics={"eval_loss": 2.0, "eval_runtime": EVAL, "eval_em_all": 0.5, "epoch": 1.0}
            )
            kept.append(torch.equal(torch.get_rng_state(), rng))  # training draws next what it would without eval
        if control.should_save:
            time.sleep(SAVE)
            saved.append(state.global_step)
            control = handler.on_save(args, state, control)
    handler.on_train_end(args, state, control)

    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and saved == [3, 4] and kept == [True, True]
    for r in train:  # without the pause, step 3 took 1.05 s (both evaluations) and step 4 0.55 s (the save)
        assert STEP <= r["step_time_s"] < STEP + 0.3, train
        assert r["tokens_per_s"] * r["step_time_s"] == pytest.approx(7, rel=1e-6)
        assert r["samples_per_s"] * r["step_time_s"] == pytest.approx(2, rel=1e-6)
    evals = [r for r in records if r["event"] == "eval"]
    assert [r["step"] for r in evals] == [2, 4]
    assert {k: v for k, v in evals[0].items() if k.startswith("eval/")} == {"eval/loss": 2.0, "eval/em_all": 0.5}
    assert callback.last_eval == {"loss": 2.0, "em_all": 0.5}


def test_checkpoints_are_published_with_meta_and_the_oldest_deleted(tmp_path):
    staging, root = tmp_path / ".staging", tmp_path / "checkpoints"
    args = TrainingArguments(output_dir=str(staging), use_cpu=True, report_to="none", save_total_limit=2)
    publisher = PublishCheckpoints(root, config={"optim": {"lr": 0.1}})
    for step in (2, 4, 6):
        (staging / f"checkpoint-{step}").mkdir(parents=True)
        (staging / f"checkpoint-{step}" / "weights").write_text(str(step))  # as the Trainer wrote it
        publisher.on_save(args, TrainerState(global_step=step), TrainerControl())
    assert [p.name for p in published_checkpoints(root)] == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert (root / "checkpoint-6" / "weights").read_text() == "6" and not list(staging.iterdir())
    meta = json.loads((root / "checkpoint-6" / "meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["config"]) == (6, 1, {"optim": {"lr": 0.1}})


def _publish(publisher, staging, args, step):
    folder = staging / f"checkpoint-{step}"
    (folder / f"global_step{step}").mkdir(parents=True)
    (folder / f"global_step{step}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x" * 1000)
    (folder / "trainer_state.json").write_text("{}")
    publisher.on_save(args, TrainerState(global_step=step), TrainerControl())


def test_a_truncated_shard_makes_the_resume_fall_back_with_one_warning(tmp_path, caplog):
    """meta.json lists every file of the checkpoint with its size: a shard cut short after publishing (a copy
    interrupted, a disk fault) makes the checkpoint damaged; resume=auto takes the one before, with one warning."""
    staging, root = tmp_path / ".staging", tmp_path / "checkpoints"
    args = TrainingArguments(output_dir=str(staging), use_cpu=True, report_to="none")
    publisher = PublishCheckpoints(root, config={})
    for step in (3, 6):
        _publish(publisher, staging, args, step)
    meta = json.loads((root / "checkpoint-6" / "meta.json").read_text())
    assert meta["files"] == {"global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt": 1000, "trainer_state.json": 2}
    shard = root / "checkpoint-6" / "global_step6" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    os.truncate(shard, 100)
    guard = ResumeGuard(root, folder="checkpoint-<n>", files=())
    assert [p.name for p in published_checkpoints(root)] == ["checkpoint-3"]
    with caplog.at_level("WARNING", logger="cookbook"):
        assert guard.resolve("auto") == root / "checkpoint-3"
    assert [r.getMessage() for r in caplog.records] == [
        f"warning: checkpoint {root / 'checkpoint-6'} is damaged (global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt "
        f"is 100 bytes, meta.json says 1000); resuming from {root / 'checkpoint-3'} instead"
    ]
    shard.unlink()
    assert (
        guard.problem(root / "checkpoint-6")
        == "global_step6/zero_pp_rank_0_mp_rank_00_optim_states.pt is missing (meta.json lists it)"
    )
    (staging / "checkpoint-7").mkdir()  # what a failed save left unpublished
    publisher.on_train_begin(args, TrainerState(), TrainerControl())
    assert not list(staging.iterdir())


def test_a_publish_that_fails_names_the_checkpoint_and_the_os_error(tmp_path):
    staging, root = tmp_path / ".staging", tmp_path / "checkpoints"
    args = TrainingArguments(output_dir=str(staging), use_cpu=True, report_to="none")
    root.write_text("")  # a file where the checkpoints folder should be: mkdir fails
    with pytest.raises(CheckpointSaveError) as failed:
        _publish(PublishCheckpoints(root, config={}), staging, args, 2)
    assert str(failed.value).startswith(
        f"could not save the checkpoint of step 2 to {root / 'checkpoint-2'} (EEXIST, File exists: '{root}'); there is "
        f"no earlier checkpoint. Fix the cause on "
    )
    assert str(failed.value).endswith(" and run the same command again: it starts from step 0")


def test_a_preemption_signal_stops_after_the_step_with_a_checkpoint(tmp_path, caplog):
    """SIGUSR1 during step 3 (one process: no vote to wait for) sets should_save and should_training_stop at the end
    of step 3; after the run, `raise_if_stopped` raises Preempted (75) naming the checkpoint; the handler is gone."""
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="steps", save_steps=100
    )
    state = TrainerState(max_steps=6, save_steps=100)
    before = signal.getsignal(signal.SIGUSR1)
    preemption = RunControl(0)
    handler = CallbackHandler([DefaultFlowCallback(), preemption], None, None, None, None)
    control, saved = handler.on_train_begin(args, state, TrainerControl()), []
    while not control.should_training_stop:
        control = handler.on_step_begin(args, state, control)
        if state.global_step == 2:
            signal.raise_signal(
                signal.SIGUSR1
            )  # during step 3 (to this thread: handled now, whatever other threads run)
        state.global_step += 1
        control = handler.on_step_end(args, state, control)
        if control.should_save:
            saved.append(state.global_step)
            control = handler.on_save(args, state, control)
    handler.on_train_end(args, state, control)
    assert state.global_step == 3 and saved == [3]
    assert signal.getsignal(signal.SIGUSR1) is before
    with caplog.at_level("INFO", logger="cookbook"), pytest.raises(Preempted) as stop:
        preemption.raise_if_stopped(state, tmp_path / "checkpoint-3")
    assert stop.value.code == 75
    assert caplog.messages[-1] == (
        f"preempted (SIGUSR1) after step 3 of 6: checkpoint {tmp_path / 'checkpoint-3'}; "
        f"run the same command again to continue (exit status 75)"
    )


def _as_deepspeed(callback: NonFiniteSteps, args, control) -> NonFiniteSteps:
    """`callback` after ``on_train_begin`` with a DeepSpeed optimizer (an object of its wrapper's class)."""
    from accelerate.utils import DeepSpeedOptimizerWrapper

    callback.on_train_begin(args, TrainerState(), control, optimizer=object.__new__(DeepSpeedOptimizerWrapper))
    return callback


def test_nonfinite_steps_reads_deepspeeds_decision_and_applies_the_policy(tmp_path):
    """on_optimizer_step after DeepSpeed discarded the update (``optimizer.step_was_skipped``): stop names the step
    and the newest checkpoint; skip counts it for the train records. Under DeepSpeed the gradients are not looked
    at before the step (DeepSpeed has already applied or discarded it)."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "meta.json").write_text('{"step": 4}')
    args, control = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), TrainerControl()
    discarded, applied = SimpleNamespace(step_was_skipped=True), SimpleNamespace(step_was_skipped=False)
    stop = _as_deepspeed(NonFiniteSteps(NonFinitePolicy("stop"), tmp_path), args, control)
    nan_model = torch.nn.Linear(2, 1)
    nan_model.weight.grad = torch.full_like(nan_model.weight, float("nan"))
    stop.on_pre_optimizer_step(args, TrainerState(global_step=4), control, model=nan_model)  # not DeepSpeed's way
    assert torch.isnan(nan_model.weight.grad).all()
    stop.on_optimizer_step(args, TrainerState(global_step=4), control, optimizer=applied)
    with pytest.raises(NonFiniteError) as failed:
        stop.on_optimizer_step(args, TrainerState(global_step=4), control, optimizer=discarded)
    assert str(failed.value) == (
        f"the gradient norm of step 5 is not finite (DeepSpeed discarded the update): the step was not applied and the "
        f"run stops (train.on_nonfinite=stop); the newest checkpoint, from before it, is {tmp_path / 'checkpoint-4'}. "
        f"Lower optim.lr or raise the warm-up, check the data of this step, or set train.on_nonfinite=skip to drop "
        f"such steps"
    )
    skip = _as_deepspeed(NonFiniteSteps(NonFinitePolicy("skip", max_consecutive_skips=1), tmp_path), args, control)
    for step, optimizer in enumerate([discarded, applied, discarded], start=5):
        skip.on_optimizer_step(args, TrainerState(global_step=step - 1), control, optimizer=optimizer)
    assert skip.policy.log_extra() == {"skipped_steps": 2.0} and stop.policy.log_extra() == {}
    with pytest.raises(
        NonFiniteError,
        match=r"^the gradient norm of step 8 is not finite .* that makes 2 non-finite "
        r"steps in a row \(train.max_consecutive_skips=1\)",
    ):
        skip.on_optimizer_step(args, TrainerState(global_step=7), control, optimizer=discarded)


def test_nonfinite_steps_without_deepspeed_leaves_the_optimizer_step_out(tmp_path):
    """A plain Trainer: on_pre_optimizer_step (after clipping, before ``optimizer.step()``) finds a NaN or
    infinite gradient, sets every trainable gradient to None, so that AdamW changes neither the weights nor its
    state, and counts the step; finite gradients pass untouched; the count starts from a resumed checkpoint's
    ``skipped_steps`` and goes into the next one's meta.json; stop raises before the step with the newest
    checkpoint."""
    (tmp_path / "checkpoint-4").mkdir()
    (tmp_path / "checkpoint-4" / "meta.json").write_text('{"step": 4, "skipped_steps": 2}')
    args, control = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), TrainerControl()
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    model[1].bias.requires_grad_(False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    skip = NonFiniteSteps(
        NonFinitePolicy("skip", max_consecutive_skips=1), tmp_path, resume_from=tmp_path / "checkpoint-4"
    )
    skip.on_train_begin(args, TrainerState(), control, optimizer=optimizer)
    publisher = PublishCheckpoints(tmp_path / "published", {}, more_meta=skip.meta)

    def step(global_step: int, bad: float | None) -> bool:
        """One optimizer step whose gradients are finite, or hold `bad` in one element; True: it changed weights."""
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        if bad is not None:
            model[0].weight.grad[0, 1] = bad
        before = [p.detach().clone() for p in model.parameters()]
        skip.on_pre_optimizer_step(args, TrainerState(global_step=global_step), control, model=model)
        optimizer.step()
        return any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))

    assert step(4, None) and len(optimizer.state) == 3
    adam_state = {k: v.clone() for k, v in optimizer.state[model[0].weight].items()}
    assert not step(5, float("inf"))  # step 6 of the run skipped: no weight, no optimizer state changed
    assert all(torch.equal(v, optimizer.state[model[0].weight][k]) for k, v in adam_state.items())
    assert all(p.grad is None for p in model.parameters() if p.requires_grad)
    assert skip.policy.log_extra() == {"skipped_steps": 3.0}
    assert step(6, None)  # finite again: the run in a row starts over
    assert not step(7, float("nan"))
    (tmp_path / ".staging" / "checkpoint-8").mkdir(parents=True)
    state = TrainerState(global_step=8, is_world_process_zero=True)
    publisher.on_save(
        TrainingArguments(output_dir=str(tmp_path / ".staging"), use_cpu=True, report_to="none"), state, control
    )
    assert json.loads((tmp_path / "published" / "checkpoint-8" / "meta.json").read_text())["skipped_steps"] == 4
    with pytest.raises(
        NonFiniteError,
        match=r"^the gradients of step 9 are not finite on every rank \(the optimizer "
        r"step was left out\): the step was not applied, and that makes 2 "
        r"non-finite steps in a row",
    ):
        step(8, float("nan"))
    stop = NonFiniteSteps(NonFinitePolicy("stop"), tmp_path)
    stop.on_train_begin(args, TrainerState(), control, optimizer=optimizer)
    with pytest.raises(NonFiniteError) as failed:
        optimizer.zero_grad()
        model(torch.ones(4, 3)).sum().backward()
        model[1].weight.grad[0, 0] = float("nan")
        stop.on_pre_optimizer_step(args, TrainerState(global_step=9), control, model=model)
    assert str(failed.value) == (
        f"the gradients of step 10 are not finite on every rank (the optimizer step was left out): the step was not "
        f"applied and the run stops (train.on_nonfinite=stop); the newest checkpoint, from before it, is "
        f"{tmp_path / 'checkpoint-4'}. Lower optim.lr or raise the warm-up, check the data of this step, or set "
        f"train.on_nonfinite=skip to drop such steps"
    )


def test_an_accelerate_config_naming_another_deepspeed_json_is_refused(tmp_path, monkeypatch):
    """`accelerate launch` exports its config's deepspeed_config_file; the Trainer would ignore it, so a file other
    than deepspeed.config is refused by name, the same file (relative to the working directory or to the recipe
    folder) is accepted."""
    (deepspeed_config,) = recipe_modules("qwen-zero3-receipts", "deepspeed_config")
    check_accelerate_deepspeed_file = deepspeed_config.check_accelerate_deepspeed_file

    recipe = tmp_path / "recipe"
    recipe.mkdir()
    for name in ("zero2.json", "zero3.json"):
        (recipe / name).write_text("{}")
    zero3 = recipe / "zero3.json"
    monkeypatch.chdir(tmp_path)
    check_accelerate_deepspeed_file(zero3, env={})
    check_accelerate_deepspeed_file(zero3, env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": "zero3.json"})  # recipe folder
    check_accelerate_deepspeed_file(zero3, env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": "recipe/zero3.json"})  # cwd
    with pytest.raises(
        ConfigError,
        match=r"deepspeed_config_file '.*zero2.json' disagrees with deepspeed.config = "
        r".*zero3.json: .*deepspeed.config=zero2.json",
    ):
        check_accelerate_deepspeed_file(zero3, env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": "zero2.json"})
    with pytest.raises(ConfigError, match=r"deepspeed_config_file 'zero1.json' .* is not a file"):
        check_accelerate_deepspeed_file(zero3, env={"ACCELERATE_DEEPSPEED_CONFIG_FILE": "zero1.json"})


def test_nonfinite_steps_start_where_deepspeed_is_not_installed(tmp_path, monkeypatch):
    """accelerate exports ``DeepSpeedOptimizerWrapper`` only where DeepSpeed is installed (the GPU image has no
    DeepSpeed): on_train_begin must then take the plain-Trainer path instead of raising ImportError, and a NaN
    gradient is still left out before the optimizer step."""
    import accelerate.utils

    monkeypatch.delattr(accelerate.utils, "DeepSpeedOptimizerWrapper")
    args, control = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none"), TrainerControl()
    model = torch.nn.Linear(2, 1)
    skip = NonFiniteSteps(NonFinitePolicy("skip", max_consecutive_skips=2), tmp_path)
    skip.on_train_begin(args, TrainerState(), control, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    model.weight.grad = torch.full_like(model.weight, float("nan"))
    skip.on_pre_optimizer_step(args, TrainerState(global_step=0), control, model=model)
    assert model.weight.grad is None and skip.policy.log_extra() == {"skipped_steps": 1.0}


def _epoch_reads(sampler_for, rows=28, micro=1, accum=4, ranks=2, epochs=2):
    """Rows each Trainer update step reads on `ranks` ranks, per epoch: the micro-batches of accelerate's
    sharded loader (as the Trainer prepares it), grouped into updates as ``Trainer._run_epoch`` does."""
    from accelerate.data_loader import prepare_data_loader

    out, now = [], {"epoch": 0}
    for epoch in range(epochs):
        per_rank = []
        for rank in range(ranks):
            loader = prepare_data_loader(
                torch.utils.data.DataLoader(
                    list(range(rows)), batch_size=micro, sampler=sampler_for(rows, lambda: now["epoch"])
                ),
                num_processes=ranks,
                process_index=rank,
                put_on_device=False,
            )
            now["epoch"] = epoch
            batches = [b.tolist() for b in loader]
            updates = -(-len(batches) // accum)  # the Trainer's num_update_steps_per_epoch
            per_rank.append([sum(batches[i * accum : (i + 1) * accum], []) for i in range(updates)])
        out.append([sum(step, []) for step in zip(*per_rank)])
    return out


def test_an_epoch_reads_every_row_once_in_full_global_batches():
    """28 rows, global batch 1 x 4 x 2 = 8: the recipes count 3 steps per epoch. The Trainer's own sampler made
    3.5 updates of it (epochs=2 ran 6 steps = 1.71 passes, the last update of 4 rows); WholeEpochs: 3 full steps
    of 8 distinct rows per epoch, 4 rows left out (others each epoch), the order seeded by args.seed + the Trainer's epoch."""
    from cookbook.hf_trainer import FullBatchesSampler, epoch_line

    epochs = _epoch_reads(lambda n, epoch_of: FullBatchesSampler(n, 8, 42, epoch_of))
    for steps in epochs:
        assert [len(s) for s in steps] == [8, 8, 8]
        read = sum(steps, [])
        assert len(set(read)) == 24 and set(read) <= set(range(28))
    assert sum(epochs[0], []) != sum(epochs[1], [])
    assert epochs == _epoch_reads(lambda n, epoch_of: FullBatchesSampler(n, 8, 42, epoch_of))  # a resume reads the same
    assert epoch_line(28, 8) == (
        "epoch: 28 rows = 3 steps of 8 rows, every row read once; the last partial global "
        "batch (4 rows, others each epoch) is dropped"
    )
    before = _epoch_reads(lambda n, epoch_of: torch.utils.data.RandomSampler(list(range(n))))
    assert [len(s) for s in before[0]] == [8, 8, 8, 4]  # the Trainer's own: 4 updates per epoch, one of 4 rows


def test_each_rank_draws_its_own_dropout_masks_and_a_resume_its_saved_ones():
    """cookbook.checkpoint.seed_per_rank (start_run, Ray's WorkerRun, the Trainer's RunControl): seed + rank."""
    from transformers import set_seed

    from cookbook.checkpoint import RNGState, seed_per_rank

    def mask():
        return torch.nn.functional.dropout(torch.ones(64), 0.5).tolist()

    def trainer_mask(rank):
        set_seed(42)  # what the Trainer does on every rank
        control = RunControl(0)
        control.on_train_begin(SimpleNamespace(seed=42, process_index=rank), TrainerState(), None)
        control.close()  # the signal handlers it installed
        return mask()

    assert trainer_mask(0) != trainer_mask(1)
    assert trainer_mask(1) == trainer_mask(1)
    set_seed(42)
    before = mask()
    set_seed(42)
    assert mask() == before  # the Trainer alone: the same mask on every rank
    seed_per_rank(42, 0)
    saved = RNGState().state_dict()
    first = mask()
    seed_per_rank(42, 1)
    RNGState().load_state_dict(saved)  # a resume restores this rank's own streams after seeding
    assert mask() == first


def test_a_run_whose_last_checkpoint_and_final_model_are_there_is_finished(tmp_path, caplog):
    """`finished`: the checkpoint at max_steps and the final model there: True, with the one line; else False."""
    from cookbook.hf_trainer import finished

    checkpoint = tmp_path / "checkpoints" / "checkpoint-6"
    checkpoint.mkdir(parents=True)
    (checkpoint / "meta.json").write_text('{"step": 6}')
    assert not finished(tmp_path, checkpoint, 6)  # no final model yet
    (tmp_path / "final").mkdir()
    assert not finished(tmp_path, checkpoint, 8) and not finished(tmp_path, None, 6)
    with caplog.at_level("INFO", logger="cookbook"):
        assert finished(tmp_path, checkpoint, 6)
    assert caplog.messages == [
        f"already complete: 6 of 6 steps; model in {tmp_path / 'final'}. To train again, use a "
        f"new output_dir (or delete {tmp_path})."
    ]
