"""cookbook.loop: the step bookkeeping every torchrun recipe shares, checked in one process on a toy model."""

import json
import math
import logging
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import torch

from cookbook.checkpoint import Checkpointer, ModelOptimizerState, TrainState
from cookbook.dist import DistInfo
import cookbook.loop
import cookbook.policy
from cookbook.loop import EpochBatches, NonFiniteError, Run, TrainLoop, log_outputs
from cookbook.loop import _already_complete as already_complete
from cookbook.metrics import MetricsLogger

CPU = DistInfo(rank=0, local_rank=0, world_size=1, device=torch.device("cpu"), backend="gloo")
DATA = [(torch.full((4, 3), float(i)), torch.full((4, 1), float(i % 3))) for i in range(5)]  # one epoch: 5 batches


class ResumableLoader:
    """Like a restored StatefulDataLoader: the first pass starts at batch `start`, later passes at 0."""

    def __init__(self, start: int):
        self.start = start

    def __iter__(self):
        start, self.start = self.start, 0
        return iter(DATA[start:])


def _run(out, max_steps=7, stop_at_step=-1, eval_every=2, evaluate_sleep=0.0, export=True):
    """Train a linear model with the loop; returns (per-step losses, loop, records of metrics.jsonl)."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    state = TrainState()
    checkpointer = Checkpointer(out / "checkpoints", keep_last=0)
    ckpt_state = {"app": ModelOptimizerState(model, optimizer), "train": state}
    latest = checkpointer.latest()
    if latest is not None:
        checkpointer.load(latest, ckpt_state)
    epochs_set = []

    def evaluate():
        time.sleep(evaluate_sleep)
        with torch.no_grad():
            return {"loss": float(sum(torch.nn.functional.mse_loss(model(x), y) for x, y in DATA) / len(DATA))}

    metrics = MetricsLogger(out, CPU, mlflow=False, max_steps=max_steps, count_tokens=False)
    loop = TrainLoop(
        state=state,
        max_steps=max_steps,
        stop_at_step=stop_at_step,
        metrics=metrics,
        log_every=3,
        eval_every=eval_every,
        evaluate=evaluate,
        checkpointer=checkpointer,
        checkpoint_every=3,
        checkpoint_state=ckpt_state,
        config={"a": 1},
    )
    batches = EpochBatches(ResumableLoader(start=state.step % len(DATA)), state, epochs_set.append)
    losses = {}
    with loop:
        for step in loop.steps():
            (x, y), _ = batches.next()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            metrics.add(samples=4, tokens=0, data_wait_s=0.0)
            losses[step] = loss.item()
            if step == _run.signal_at:
                signal.raise_signal(signal.SIGUSR1)  # a preemption warning, mid-step (to this thread: handled now)
            loop.end_step(loss, lr=0.01, grad_norm=None)
        final = loop.finish(export=(lambda: {"export_dir": (out / "final", "torch.load")}) if export else None)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return losses, loop, records, final, epochs_set


_run.signal_at = None  # a step during which the process signals itself (SIGUSR1)


def test_log_eval_and_checkpoint_cadence(tmp_path):
    losses, loop, records, final, epochs = _run(tmp_path)
    assert sorted(losses) == list(range(1, 8))
    assert [r["step"] for r in records if r["event"] == "train"] == [3, 6, 7]
    train = [r for r in records if r["event"] == "train"]
    assert train[0]["loss"] == pytest.approx(sum(losses[s] for s in (1, 2, 3)) / 3)  # the window's mean
    assert train[2]["loss"] == pytest.approx(losses[7])
    assert [r["step"] for r in records if r["event"] == "eval"] == [2, 4, 6, 7]  # every 2, and the final one
    steps = [int(p.name.split("_")[1]) for p in Checkpointer(tmp_path / "checkpoints").complete_checkpoints()]
    assert steps == [3, 6, 7]
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert summary["step"] == 7 and summary["export_dir"] == str(tmp_path / "final")
    assert summary["eval/loss"] == pytest.approx(final["loss"])
    assert epochs == [0, 1]  # 7 steps of 1 batch: the second pass over 5 batches starts at step 6
    assert not loop.stopped


def test_stop_and_resume_give_the_same_per_step_losses(tmp_path, caplog):
    whole, *_ = _run(tmp_path / "whole")
    with caplog.at_level(logging.INFO, logger="cookbook"):
        first, loop, records, final, _ = _run(tmp_path / "split", stop_at_step=4)
    assert final is None and loop.stopped and sorted(first) == [1, 2, 3, 4]
    # a run that stops early still says where its metrics are, then how to continue
    assert caplog.messages[-2:] == [
        f"metrics:     {tmp_path / 'split' / 'metrics.jsonl'}",
        f"stopped at step 4 of 7 (train.stop_at_step); to continue from "
        f"{tmp_path / 'split' / 'checkpoints' / 'step_00000004'}, run again without "
        f"train.stop_at_step (or with a larger value)",
    ]
    assert not [r for r in records if r["event"] == "summary"]
    steps = [int(p.name.split("_")[1]) for p in Checkpointer(tmp_path / "split" / "checkpoints").complete_checkpoints()]
    assert steps == [3, 4]  # every 3, and where it stopped
    second, *_ = _run(tmp_path / "split")
    assert sorted(second) == [5, 6, 7]
    assert {**first, **second} == pytest.approx(whole, rel=0, abs=0)


def test_eval_time_is_left_out_of_the_step_time(tmp_path, monkeypatch):
    launched = time.time()
    monkeypatch.setenv("COOKBOOK_LAUNCH_TIME", repr(launched))  # as cookbook.launch sets it
    _, _, records, _, _ = _run(tmp_path, max_steps=3, eval_every=1, evaluate_sleep=0.4)
    wall = time.time() - launched
    (rec,) = [r for r in records if r["event"] == "train"]
    assert rec["step_time_s"] < 0.1  # two evaluations of 0.4 s ran inside this window
    # The summary times the start-up (launch to the end of step 1) and the final evaluation (one sleep of 0.4 s).
    summary = [r for r in records if r["event"] == "summary"][-1]
    assert 0 < summary["first_step_s"] <= summary["startup_s"] < wall - 1.2  # before 3 evaluations of 0.4 s
    assert 0.4 <= summary["final_eval_s"] < 0.4 + (wall - 1.2)


def test_already_complete(tmp_path):
    state = TrainState()
    state.step = 7
    assert not already_complete(state, 8, tmp_path)
    assert already_complete(state, 7, tmp_path)
    assert not already_complete(state, 7, tmp_path, final=tmp_path / "final")  # killed before its export
    (tmp_path / "final").mkdir()
    assert already_complete(state, 7, tmp_path, final=tmp_path / "final")


def _loop(tmp_path, **kw):
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, count_tokens=False)
    return TrainLoop(state=TrainState(), max_steps=3, metrics=metrics, **kw)


def test_non_finite_gradient_norm_stops_before_the_optimizer_step(tmp_path):
    loop = _loop(tmp_path)
    assert loop.skip_step(torch.tensor(2.5)) is False and loop.skip_step(None) is False
    with pytest.raises(NonFiniteError, match=r"gradient norm of step 1 is nan: the step was not applied"):
        loop.skip_step(torch.tensor(float("nan")))
    with pytest.raises(NonFiniteError, match=r"is inf"):
        loop.skip_step(float("inf"))


def test_a_step_body_without_end_step_is_an_error(tmp_path):
    loop = _loop(tmp_path)
    with pytest.raises(RuntimeError, match=r"must end with loop.end_step"):
        for _ in loop.steps():
            pass


def test_epoch_batches_reshuffle_each_pass_and_time_the_wait(tmp_path):
    state, seen = TrainState(), []
    batches = EpochBatches([{"x": torch.tensor([i])} for i in range(3)], state, seen.append)
    got, waits = batches.take(7)
    assert [int(b["x"]) for b in got] == [0, 1, 2, 0, 1, 2, 0]
    assert state.epoch == 2 and seen == [0, 1, 2] and all(w >= 0 for w in waits)
    with pytest.raises(RuntimeError, match="yields no batch"):
        EpochBatches([], TrainState()).next()


class SlowStart:
    """A loader whose every pass waits `delay` seconds before its first batch (workers that start afresh)."""

    def __init__(self, n: int, delay: float):
        self.n, self.delay = n, delay

    def __iter__(self):
        time.sleep(self.delay)
        return iter([{"x": torch.tensor([i])} for i in range(self.n)])


def test_the_wait_for_the_first_batch_of_each_pass_is_in_that_windows_record(tmp_path):
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, count_tokens=False)
    batches = EpochBatches(SlowStart(3, delay=0.2), TrainState(), metrics=metrics)
    metrics.start(0)
    windows = []
    for step in range(1, 7):  # passes start at steps 1 and 4; a window of 2 steps
        _, waits = batches.take(1)
        metrics.add(samples=1, tokens=0, data_wait_s=waits[0])
        if step % 2 == 0:
            windows.append(metrics.log_step(step, 0.0, 0.1, None))
    assert [w.get("epoch_start_wait_s") is not None for w in windows] == [True, True, False]
    assert 0.2 <= windows[0]["epoch_start_wait_s"] < 0.2 + 2 * windows[0]["step_time_s"]
    assert windows[1]["epoch_start_wait_s"] >= 0.2


def test_the_closing_lines_show_the_final_metrics_and_where_each_output_is(tmp_path, monkeypatch):
    lines = []
    monkeypatch.setattr(cookbook.loop, "get_logger", lambda: SimpleNamespace(info=lines.append))
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, count_tokens=False)
    final_eval = {"loss": 0.5, "accuracy": 0.75, "samples": 400.0, "rows": 3.0, "tokens": 9.0}  # counts are not shown
    outputs = {
        "export_dir": (tmp_path / "final", "AutoModel.from_pretrained"),
        "adapter_dir": (tmp_path / "a", ""),
        "other_dir": (None, "torch.load"),
    }
    log_outputs(7, final_eval, metrics, tmp_path / "checkpoints", outputs)
    assert lines == [
        "done: 7 steps | eval loss 0.5000 accuracy 0.7500",
        f"metrics:     {tmp_path / 'metrics.jsonl'}",
        f"checkpoints: {tmp_path / 'checkpoints'}",
        f"model:       {tmp_path / 'final'} (AutoModel.from_pretrained)",
        f"adapter:     {tmp_path / 'a'}",
    ]
    lines.clear()
    log_outputs(3, {}, metrics, None, {})
    assert lines == ["done: 3 steps", f"metrics:     {tmp_path / 'metrics.jsonl'}"]
    lines.clear()
    log_outputs(3, {}, metrics, None, {}, timings={"startup_s": 25.08, "first_step_s": 12.0, "final_eval_s": 1.94})
    assert lines[:2] == ["done: 3 steps", "time:        startup 25.1 s (first step 12.0 s) | final eval 1.9 s"]


def test_run_resumes_and_takes_the_cadence_from_the_shared_sections(tmp_path):
    from cookbook.config import CheckpointConfig, RunConfig, TrainConfig, load_config
    from dataclasses import dataclass, field

    @dataclass
    class Config(RunConfig):
        train: TrainConfig = field(default_factory=TrainConfig)
        checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    cfg = load_config(
        Config,
        None,
        [
            f"output_dir={tmp_path}",
            "mlflow=false",
            "train.log_every=2",
            "train.eval_every=3",
            "train.stop_at_step=4",
            "checkpoint.every_steps=0",
        ],
    )
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def start(**kw):
        state = TrainState()
        return Run(
            cfg,
            CPU,
            state=state,
            checkpoint={"app": ModelOptimizerState(model, optimizer), "train": state},
            may_change=("train.stop_at_step",),
            max_steps=5,
            experiment="tests",
            final=tmp_path / "final",
            count_tokens=False,
            **kw,
        )

    loop = start(evaluate=lambda: {"loss": 1.0})
    assert (tmp_path / "config.yaml").is_file() and loop.state.step == 0
    assert (loop.stop_at, loop.log_every, loop.eval_every, loop.checkpoint_every) == (4, 2, 3, 0)
    assert loop.config["train"]["eval_every"] == 3 and loop.profiler is None
    with loop:
        for _ in loop.steps():
            loop.end_step(torch.tensor(1.0), lr=0.1)
    assert loop.state.step == 4 and [p.name for p in loop.checkpointer.complete_checkpoints()] == ["step_00000004"]
    cfg.train.stop_at_step = -1
    loop = start()  # resumed: the checkpoint of step 4
    assert loop.state.step == 4
    with loop:
        for _ in loop.steps():
            loop.end_step(torch.tensor(1.0), lr=0.1)
    assert loop.state.step == 5
    loop = start()
    assert not loop.complete and loop.state.step == 5  # the final model is not exported yet: finish the run
    (tmp_path / "final").mkdir()
    loop = start()
    assert loop.complete and loop.state.step == 5  # already complete: no new metrics run, no step, no finish
    with loop:
        assert list(loop.steps()) == [] and loop.finish() is None


def test_a_preemption_signal_stops_after_the_step_with_a_checkpoint_and_the_resume_loses_nothing(tmp_path):
    from cookbook.errors import EXIT_PREEMPTED
    from cookbook.loop import Preempted

    whole, *_ = _run(tmp_path / "whole")
    out = tmp_path / "split"
    before = signal.getsignal(signal.SIGUSR1)
    _run.signal_at = 3  # SIGUSR1 (Slurm's warning before a job's end) arrives during step 3
    try:
        with pytest.raises(Preempted) as stop:
            _run(out)
    finally:
        _run.signal_at = None
    assert stop.value.code == EXIT_PREEMPTED == 75
    assert signal.getsignal(signal.SIGUSR1) is before  # the loop's handler is gone with the loop
    steps = [int(p.name.split("_")[1]) for p in Checkpointer(out / "checkpoints").complete_checkpoints()]
    assert steps == [3]  # step 3 finished, then the checkpoint; step 4 never started
    second, *_ = _run(out)
    assert sorted(second) == [4, 5, 6, 7]
    assert second == pytest.approx({s: whole[s] for s in (4, 5, 6, 7)}, rel=0, abs=0)


def _train_with_nan(
    out,
    nan_at,
    on_nonfinite="skip",
    max_consecutive_skips=5,
    max_steps=6,
    applied=False,
    batchnorm=False,
    huge_at=(),
    checkpoint_every=2,
    buffers=None,
):
    """Train the linear model of `_run` with a NaN loss in the attempts listed in `nan_at` (1-based, counting
    skipped ones); returns (loop, model, scheduler, records of metrics.jsonl, the step numbers run).

    `batchnorm`: a BatchNorm1d before the linear layer, and the NaN goes into its input; the inputs of the attempts
    in `huge_at` are scaled by 1e20 (finite loss and gradients, an infinite running variance). `buffers`: a dict
    that gets the model's buffers at the start of each attempt."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 1)) if batchnorm else torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s))
    state = TrainState()
    checkpointer = Checkpointer(out / "checkpoints", keep_last=0)
    ckpt_state = {"app": ModelOptimizerState(model, optimizer), "train": state}
    metrics = MetricsLogger(out, CPU, mlflow=False, max_steps=max_steps, count_tokens=False)
    loop = TrainLoop(
        state=state,
        max_steps=max_steps,
        metrics=metrics,
        log_every=1,
        checkpointer=checkpointer,
        checkpoint_every=checkpoint_every,
        checkpoint_state=ckpt_state,
        on_nonfinite=on_nonfinite,
        max_consecutive_skips=max_consecutive_skips,
    )
    batches = EpochBatches(DATA, state)
    run, attempt = [], 0
    try:
        with loop:
            for step in loop.steps():
                attempt += 1
                run.append(step)
                if buffers is not None:
                    buffers[attempt] = {k: b.clone() for k, b in model.named_buffers()}
                (x, y), _ = batches.next()
                nan = float("nan") if attempt in nan_at else 1.0
                if batchnorm:  # rows differ, so that the batch variance is not 0
                    x = (x + torch.arange(4.0)[:, None]) * nan * (1e20 if attempt in huge_at else 1.0)
                    nan = 1.0
                loss = torch.nn.functional.mse_loss(model(x), y) * nan
                loss.backward()
                if applied:  # the update first, then the check (TorchRec's pipeline)
                    optimizer.step()
                    optimizer.zero_grad()
                    loop.skip_step(loss=loss, applied=True)
                else:
                    if loop.skip_step(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))):
                        optimizer.zero_grad(set_to_none=True)
                        continue
                    optimizer.step()
                    optimizer.zero_grad()
                lr = scheduler.get_last_lr()[0]
                scheduler.step()
                metrics.add(samples=4, tokens=0, data_wait_s=0.0)
                loop.end_step(loss, lr=lr)
            loop.finish()
    finally:
        records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return loop, model, scheduler, records, run


def _checkpoint_steps(out):
    return [int(p.name.split("_")[1]) for p in Checkpointer(out / "checkpoints").complete_checkpoints()]


def test_run_calls_the_loaders_sampler_set_epoch_at_each_pass(tmp_path):
    """Without `set_epoch`, `Run` reshuffles through the loader's sampler: each pass has its own epoch's order."""
    from torch.utils.data import DataLoader, DistributedSampler

    from cookbook.config import RunConfig, load_config

    cfg = load_config(RunConfig, None, [f"output_dir={tmp_path}", "mlflow=false"])
    sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=3)
    state = TrainState()
    run = Run(
        cfg,
        CPU,
        state=state,
        checkpoint={"train": state},
        loader=DataLoader(range(8), batch_size=8, sampler=sampler),
        may_change=(),
        max_steps=3,
        experiment="tests",
        count_tokens=False,
    )
    passes = [run.take(1)[0][0].tolist() for _ in range(3)]
    assert sampler.epoch == 2 and state.epoch == 2
    assert passes == [_order(e) for e in range(3)] and len({tuple(p) for p in passes}) == 3


def _order(epoch: int) -> list[int]:
    from torch.utils.data import DistributedSampler

    sampler = DistributedSampler(range(8), num_replicas=1, rank=0, shuffle=True, seed=3)
    sampler.set_epoch(epoch)
    return list(sampler)


def test_skip_drops_a_non_finite_step_without_touching_the_weights_or_the_schedule(tmp_path, monkeypatch):
    lines = []
    for module in (cookbook.loop, cookbook.policy):  # the policy logs the skip
        monkeypatch.setattr(module, "get_logger", lambda: SimpleNamespace(info=lines.append))
    loop, model, scheduler, records, run = _train_with_nan(tmp_path, nan_at={3})
    assert run == [1, 2, 3, 3, 4, 5, 6]  # step 3 came again with the next batch
    assert lines[0] == "step 3: non-finite gradient norm (nan), step skipped (1 skipped so far)"
    assert loop.nonfinite.skipped_steps == 1 and loop.state.step == 6
    assert scheduler.last_epoch == 6  # stepped once per applied step: the skipped one did not advance it
    assert all(torch.isfinite(p).all() for p in model.parameters())
    train = [r for r in records if r["event"] == "train"]
    assert [(r["step"], r["skipped_steps"]) for r in train] == [(1, 0), (2, 0), (3, 1), (4, 1), (5, 1), (6, 1)]
    assert all(math.isfinite(r["loss"]) for r in train)
    assert _checkpoint_steps(tmp_path) == [2, 4, 6]


def test_skip_stops_after_max_consecutive_skips(tmp_path):
    with pytest.raises(NonFiniteError) as stop:
        _train_with_nan(tmp_path, nan_at={4, 5, 6}, max_consecutive_skips=2)
    assert str(stop.value).startswith(
        "the gradient norm of step 4 is nan: the step was not applied, and that makes 3 "
        "non-finite steps in a row (train.max_consecutive_skips=2), so the run stops; "
        f"the newest checkpoint, from before it, is {tmp_path / 'checkpoints'}"
    ), stop.value
    assert stop.value.exit_status == 4
    assert _checkpoint_steps(tmp_path) == [2]


def test_stop_names_the_step_and_the_newest_checkpoint(tmp_path):
    with pytest.raises(NonFiniteError) as stop:
        _train_with_nan(tmp_path, nan_at={5}, on_nonfinite="stop")
    latest = tmp_path / "checkpoints" / "step_00000004"
    assert str(stop.value) == (
        "the gradient norm of step 5 is nan: the step was not applied and the run stops (train.on_nonfinite=stop); "
        f"the newest checkpoint, from before it, is {latest}. Lower optim.lr or raise the warm-up, check the data of "
        "this step, or set train.on_nonfinite=skip to drop such steps"
    )
    assert _checkpoint_steps(tmp_path) == [2, 4]


def _checkpoint_tensors(out):
    """Every tensor of every checkpoint under ``<out>/checkpoints``, by checkpoint step."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    found = {}
    for folder in Checkpointer(out / "checkpoints").complete_checkpoints():
        dcp_to_torch_save(folder, out / f"{folder.name}.pt")
        state = torch.load(out / f"{folder.name}.pt", weights_only=False)
        found[int(folder.name.split("_")[1])] = list(_tensors(state))
    return found


def _tensors(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _tensors(v)


def summary_of(records):
    return [r for r in records if r["event"] == "summary"][-1]


def test_skip_leaves_the_batchnorm_statistics_of_a_non_finite_step_as_they_were(tmp_path):
    buffers = {}
    loop, model, _, records, run = _train_with_nan(tmp_path, nan_at={3}, batchnorm=True, buffers=buffers)
    assert run == [1, 2, 3, 3, 4, 5, 6] and loop.nonfinite.skipped_steps == 1
    names = ["0.running_mean", "0.running_var", "0.num_batches_tracked"]
    assert sorted(buffers[4]) == sorted(names)
    assert all(torch.equal(buffers[4][k], buffers[3][k]) for k in names)  # the NaN forward's statistics are gone
    assert not torch.equal(buffers[3]["0.running_mean"], buffers[2]["0.running_mean"])  # an applied step's stay
    assert int(model[0].num_batches_tracked) == 6  # the applied steps' batches
    assert all(torch.isfinite(t).all() for t in [*model.parameters(), *model.buffers()])
    saved = _checkpoint_tensors(tmp_path)
    assert sorted(saved) == [2, 4, 6]
    assert all(
        len(ts) > 5 and all(torch.isfinite(t).all() for t in ts if t.is_floating_point()) for ts in saved.values()
    )
    assert summary_of(records)["step"] == 6


@pytest.mark.parametrize("on_nonfinite", ["skip", "stop"])
@pytest.mark.parametrize(
    "checkpoint_every, refused",
    [(2, "its checkpoint is not saved"), (-1, "the run is not done (no final evaluation, export or summary)")],
)
def test_non_finite_weights_or_statistics_are_never_saved_nor_called_done(
    tmp_path, on_nonfinite, checkpoint_every, refused
):
    # step 2's loss and gradient norm are finite, but its input makes BatchNorm's running variance infinite
    with pytest.raises(NonFiniteError) as stop:
        _train_with_nan(
            tmp_path,
            nan_at=(),
            on_nonfinite=on_nonfinite,
            batchnorm=True,
            huge_at={2},
            checkpoint_every=checkpoint_every,
        )
    step = 2 if checkpoint_every == 2 else 6
    assert str(stop.value) == (
        f"after step {step}, 3 values of the model's parameters and buffers are NaN or infinite (0.running_var): "
        f"{refused} and the run stops, whatever train.on_nonfinite says; no checkpoint was saved before it. Lower "
        f"optim.lr or raise the warm-up, or check the data"
    )
    assert stop.value.exit_status == 4 and _checkpoint_steps(tmp_path) == []
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in records if r["event"] == "summary"]


def test_an_applied_non_finite_update_stops_before_the_next_save(tmp_path):
    # NaN at step 3: the update has run (the check comes after it); the next save is at step 4, and it does not happen
    with pytest.raises(
        NonFiniteError,
        match=r"^the loss of step 3 is not finite on every rank and its update was "
        r"already applied .* so the run stops before saving it",
    ):
        _train_with_nan(tmp_path, nan_at={3}, on_nonfinite="skip", applied=True)
    assert _checkpoint_steps(tmp_path) == [2]


def test_a_loss_is_checked_when_there_is_no_gradient_norm(tmp_path):
    loop = _loop(tmp_path, on_nonfinite="skip")
    assert loop.skip_step(loss=torch.tensor(1.5)) is False and loop.skip_step() is False
    assert loop.skip_step(loss=torch.tensor([1.0, float("-inf")])) is True and loop.nonfinite.skipped_steps == 1
    with pytest.raises(NonFiniteError, match=r"^the loss of step 1 is not finite on every rank: the step was not"):
        _loop(tmp_path).skip_step(loss=float("nan"))


def test_on_nonfinite_is_checked(tmp_path):
    from cookbook.config import ConfigError, RunConfig, load_config

    cfg = load_config(RunConfig, None, [f"output_dir={tmp_path}", "mlflow=false", "train.on_nonfinite=ignore"])

    def run():
        state = TrainState()
        return Run(
            cfg,
            CPU,
            state=state,
            checkpoint={"train": state},
            may_change=(),
            max_steps=3,
            experiment="tests",
            count_tokens=False,
        )

    with pytest.raises(ConfigError, match=r"^train.on_nonfinite must be one of stop, skip, got 'ignore'$"):
        run()
    cfg.train.on_nonfinite, cfg.train.max_consecutive_skips = "skip", 2
    loop = run()
    assert (loop.nonfinite.on_nonfinite, loop.nonfinite.max_consecutive_skips) == ("skip", 2)


def _dropout_draws(tmp_path, eval_every):
    """A step body that draws a dropout mask, an evaluation that iterates a DataLoader (which draws its seed from
    torch's generator): the masks of 6 steps."""
    torch.manual_seed(0)
    metrics = MetricsLogger(tmp_path / str(eval_every), CPU, mlflow=False, count_tokens=False)

    def evaluate():
        list(torch.utils.data.DataLoader(list(range(4)), batch_size=2, shuffle=True))
        return {"loss": 1.0}

    loop = TrainLoop(state=TrainState(), max_steps=6, metrics=metrics, eval_every=eval_every, evaluate=evaluate)
    masks = []
    with loop:
        for _ in loop.steps():
            masks.append(torch.nn.functional.dropout(torch.ones(32), 0.5).tolist())
            loop.end_step(torch.tensor(1.0), lr=0.1)
    return masks


def test_evaluation_does_not_change_the_training_runs_random_draws(tmp_path):
    """train.eval_every=2 and 0 draw the same dropout masks (before: equal up to step 2, different from step 3)."""
    assert _dropout_draws(tmp_path, 2) == _dropout_draws(tmp_path, 0)


def test_a_finished_run_is_answered_by_the_check_at_once_and_the_launcher_starts_no_worker(tmp_path, monkeypatch):
    """TrainLoop.finish leaves complete.json; check_run (the first thing every recipe's --check and worker do)
    then says "already complete" with exit status 0 (before: the check passed and the workers built the model and
    read the data to find it out, ~60 s for modernbert-ddp); other settings (train.max_steps) are another run."""
    from dataclasses import dataclass, field

    from cookbook.config import CheckpointConfig, RunConfig, TrainConfig, check_run, load_config
    from cookbook.entry import AlreadyComplete
    from cookbook.run_lock import OUTPUT_DIR_FILE_ENV, reported_complete

    @dataclass
    class Config(RunConfig):
        train: TrainConfig = field(default_factory=TrainConfig)
        checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    out = tmp_path / "run"
    cfg = load_config(
        Config, None, [f"output_dir={out}", "mlflow=false", "train.max_steps=2", "checkpoint.every_steps=-1"]
    )
    monkeypatch.setenv(OUTPUT_DIR_FILE_ENV, str(tmp_path / "reported"))  # as cookbook.launch runs the check
    check_run(cfg)
    assert not reported_complete(tmp_path / "reported")
    state = TrainState()
    with Run(
        cfg,
        CPU,
        state=state,
        checkpoint={"train": state},
        may_change=(),
        max_steps=2,
        experiment="tests",
        count_tokens=False,
    ) as loop:
        for _ in loop.steps():
            loop.end_step(torch.tensor(1.0), lr=0.1)
        loop.finish()
    with pytest.raises(AlreadyComplete) as done:
        check_run(
            load_config(
                Config,
                None,
                [
                    f"output_dir={out}",
                    "mlflow=false",
                    "train.max_steps=2",
                    "checkpoint.every_steps=-1",
                    "train.log_every=5",
                ],
            )
        )  # may change
    assert str(done.value) == (
        f"already complete: 2 of 2 steps; metrics in {out / 'metrics.jsonl'}. To train "
        f"again, use a new output_dir (or delete {out})."
    )
    assert reported_complete(tmp_path / "reported")
    check_run(
        load_config(
            Config, None, [f"output_dir={out}", "mlflow=false", "train.max_steps=3", "checkpoint.every_steps=-1"]
        )
    )  # more steps: the run continues
    shutil.copytree(out, tmp_path / "copy")
    check_run(
        load_config(
            Config,
            None,
            [f"output_dir={tmp_path / 'copy'}", "mlflow=false", "train.max_steps=2", "checkpoint.every_steps=-1"],
        )
    )  # a copied folder: the run decides


def test_with_a_fused_optimizer_stop_checks_the_gradient_norm_without_a_sync_and_never_applies_nor_saves_it(tmp_path):
    """``on_nonfinite=stop`` with a fused AdamW: `skip_step` reads no number from the device (it returns False for the
    NaN step 3); the optimizer skips that step itself (``found_inf``: weights and AdamW state as after step 2), and
    the run stops with the same message as the check at once, before the save at step 4 and the log line of
    steps 3-4; step 4 did run."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
    state, checkpointer = TrainState(), Checkpointer(tmp_path / "checkpoints", keep_last=0)
    metrics = MetricsLogger(tmp_path, CPU, mlflow=False, max_steps=6, count_tokens=False)
    loop = TrainLoop(
        state=state,
        max_steps=6,
        metrics=metrics,
        log_every=2,
        checkpointer=checkpointer,
        checkpoint_every=2,
        checkpoint_state={"app": ModelOptimizerState(model, optimizer), "train": state},
    )
    batches, seen, skips = EpochBatches(DATA, state), {}, []
    with pytest.raises(NonFiniteError) as stopped, loop:
        for step in loop.steps():
            (x, y), _ = batches.next()
            loss = torch.nn.functional.mse_loss(model(x * float("nan") if step == 3 else x), y)
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            skips.append(loop.skip_step(grad_norm))
            optimizer.step()
            optimizer.zero_grad()
            seen[step] = (
                [p.detach().clone() for p in model.parameters()],
                float(optimizer.state_dict()["state"][0]["step"]),
            )
            loop.end_step(loss.detach(), lr=0.1, grad_norm=grad_norm)
    assert str(stopped.value).startswith(
        "the gradient norm of step 3 is nan: the step was not applied and the run stops (train.on_nonfinite=stop); "
        f"the newest checkpoint, from before it, is {tmp_path / 'checkpoints' / 'step_00000002'}"
    )
    assert skips == [False] * 4 and sorted(seen) == [1, 2, 3, 4]
    assert all(torch.equal(a, b) for a, b in zip(seen[3][0], seen[2][0])) and seen[3][1] == seen[2][1] == 2
    assert all(torch.isfinite(p).all() for p in seen[4][0]) and not torch.equal(seen[4][0][0], seen[3][0][0])
    assert _checkpoint_steps(tmp_path) == [2]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == [2]
