"""cookbook.hf_trainer's callbacks, driven in this process by the Trainer's own callback machinery
(`CallbackHandler`, `DefaultFlowCallback`) with the event order of ``Trainer._inner_training_loop``."""

import json
import time

import pytest
import torch
from transformers import TrainingArguments
from transformers.trainer_callback import CallbackHandler, DefaultFlowCallback, TrainerControl, TrainerState

from cookbook.dist import DistInfo
from cookbook.hf_trainer import MetricsCallback, PublishCheckpoints, StopAtStep, published_checkpoints
from cookbook.metrics import MetricsLogger

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
STEP, EVAL, SAVE = 0.05, 0.5, 0.5  # seconds: a training step, an evaluation (twice: loss and generation), a save


def read_jsonl(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_evaluations_and_saves_are_left_out_of_the_step_time(tmp_path):
    """Steps of 0.05 s; after step 2 an evaluation (0.5 s in the Trainer's loop + 0.5 s of generation in
    ``evaluate_more``), after step 3 a checkpoint save (0.5 s), step 4 evaluates and stops with a save
    (StopAtStep). Every window's step time is the step's alone, and the tokens counted per step give the
    throughput."""
    args = TrainingArguments(output_dir=str(tmp_path / ".staging"), use_cpu=True, report_to="none", logging_steps=1,
                             eval_strategy="steps", eval_steps=2, save_strategy="steps", save_steps=3)
    state = TrainerState(max_steps=6, logging_steps=1, eval_steps=2, save_steps=3)
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, max_steps=6)

    def generation(model):
        time.sleep(EVAL)
        return {"em_all": 0.5}

    callback = MetricsCallback(metrics, pad_id=0, evaluate_more=generation)
    handler = CallbackHandler([DefaultFlowCallback(), StopAtStep(4), callback], None, None, None, None)
    batch = {"input_ids": torch.ones(2, 5, dtype=torch.long),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]])}  # 7 real tokens
    saved = []
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
            time.sleep(EVAL)  # Trainer.evaluate's loop, then its on_evaluate
            control = handler.on_evaluate(args, state, control, metrics={"eval_loss": 2.0, "eval_runtime": EVAL,
                                                                         "epoch": 1.0})
        if control.should_save:
            time.sleep(SAVE)
            saved.append(state.global_step)
            control = handler.on_save(args, state, control)
    handler.on_train_end(args, state, control)

    records = read_jsonl(tmp_path / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and saved == [3, 4]
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
    args = TrainingArguments(output_dir=str(staging), use_cpu=True, report_to="none")
    publisher = PublishCheckpoints(root, keep_last=2, config={"optim": {"lr": 0.1}})
    for step in (2, 4, 6):
        (staging / f"checkpoint-{step}").mkdir(parents=True)
        (staging / f"checkpoint-{step}" / "weights").write_text(str(step))  # as the Trainer wrote it
        publisher.on_save(args, TrainerState(global_step=step), TrainerControl())
    assert [p.name for p in published_checkpoints(root)] == ["checkpoint-4", "checkpoint-6"]
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-4", "checkpoint-6"]
    assert (root / "checkpoint-6" / "weights").read_text() == "6" and not list(staging.iterdir())
    meta = json.loads((root / "checkpoint-6" / "meta.json").read_text())
    assert (meta["step"], meta["world_size"], meta["config"]) == (6, 1, {"optim": {"lr": 0.1}})
