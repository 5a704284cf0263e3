"""cookbook.ray_train pieces that need no Ray cluster: which checkpoint a re-run resumes from, the
worker-count check, a recipe's own exception leaving a worker, and the launcher passing SIGTERM /
Ctrl-C on to the driver."""

import json
import os
import pickle
import signal
import subprocess
import sys
import time

import importlib.metadata
import random

import numpy as np
import pytest
import torch
from conftest import ROOT

from cookbook import ray_train
from cookbook.checkpoint import CheckpointError
from cookbook.ray_train.driver import _SNAPSHOT_FILE, _check_resume, _RayCheckpoints
from cookbook.ray_train import worker
from cookbook.ray_train.worker import (
    STATE_FILE as _STATE_FILE,
    _check_announced,
    rng_state,
    set_rng_state,
    worker_entry,
)

RAY = importlib.metadata.version("ray")


def _checkpoint(root, name, step, world_size=2):
    d = root / name
    d.mkdir(parents=True)
    (d / _STATE_FILE).write_bytes(b"x")
    (d / "meta.json").write_text(json.dumps({"step": step, "world_size": world_size, "config": {}}))


def _snapshot(root, latest):
    result = {"checkpoint_dir_name": latest, "metrics": {}} if latest else None
    (root / _SNAPSHOT_FILE).write_text(json.dumps({"ray_version": RAY, "latest_checkpoint_result": result}))


def test_a_rerun_resumes_from_the_checkpoint_ray_registered(tmp_path, capsys):
    for step in (8, 16, 24):
        _checkpoint(tmp_path, f"checkpoint_step_{step:08d}", step)
    guard = _RayCheckpoints(tmp_path, "step")
    # No snapshot: the run stopped before Ray registered any checkpoint, and Ray starts afresh; so does the driver.
    assert guard.latest() is None
    assert _check_resume(guard, "auto", {}, (), ("train.stop_at_step", -1)) is None
    err = capsys.readouterr().err
    assert "resuming" not in err and err.startswith(
        "starting at step 0: checkpoint_step_00000008, checkpoint_step_00000016, checkpoint_step_00000024 in "
    )
    assert "were written but not registered by Ray Train before the run stopped" in err and "will be replaced" in err
    _snapshot(tmp_path, "checkpoint_step_00000016")  # 24 was written, then the run stopped before Ray registered it
    assert guard.latest().name == "checkpoint_step_00000016"
    path = _check_resume(guard, "auto", {}, (), ("train.stop_at_step", 20))  # 20 is after 16
    assert path.name == "checkpoint_step_00000016"
    err = capsys.readouterr().err
    assert "resuming from" in err and "checkpoint_step_00000016 (step 16)" in err
    assert "checkpoint_step_00000024 were written after it but not registered" in err
    with pytest.raises(
        CheckpointError, match=r"train.stop_at_step=16 is not after the checkpoint .*checkpoint_step_00000016"
    ):
        _check_resume(guard, "auto", {}, (), ("train.stop_at_step", 16))
    with pytest.raises(CheckpointError, match="checkpoint.resume='none' but .* holds checkpoints of an earlier run"):
        _check_resume(guard, "none", {}, (), ("train.stop_at_step", -1))
    with pytest.raises(
        CheckpointError,
        match=r"resumes a run from the newest checkpoint it registered in its output_dir, "
        r"\S+checkpoint_step_00000016; use checkpoint.resume=auto",
    ):
        _check_resume(guard, str(tmp_path / "checkpoint_step_00000024"), {}, (), ("train.stop_at_step", -1))
    assert _check_resume(guard, str(tmp_path / "checkpoint_step_00000016"), {}, (), ("train.stop_at_step", -1)) == path
    _snapshot(tmp_path, None)  # a snapshot without a registered checkpoint: Ray starts afresh
    assert guard.latest() is None
    # What Ray itself refuses to resume from is refused before Ray starts, named:
    (tmp_path / _SNAPSHOT_FILE).write_text("{not json")
    with pytest.raises(
        CheckpointError,
        match=rf"{_SNAPSHOT_FILE}: Ray Train's record of the run's checkpoints is "
        rf"unreadable \(JSONDecodeError: .*start afresh with a new output_dir",
    ):
        guard.latest()
    (tmp_path / _SNAPSHOT_FILE).write_text(json.dumps({"ray_version": "1.0.0", "latest_checkpoint_result": None}))
    with pytest.raises(
        CheckpointError,
        match=rf"was written by Ray 1.0.0, and Ray {RAY} does not resume "
        rf"from it: install ray==1.0.0 to continue this run",
    ):
        guard.latest()
    _snapshot(tmp_path, "checkpoint_step_00000032")
    with pytest.raises(
        CheckpointError,
        match=r"checkpoint_step_00000032: Ray Train registered it as the run's newest "
        r"checkpoint, but it is missing or incomplete \(it needs meta.json, state.pt\)",
    ):
        guard.latest()


def test_the_workers_refuse_an_older_state_than_the_driver_announced(monkeypatch):
    monkeypatch.setattr(worker, "_announced", None)
    _check_announced(None)  # a fresh start
    _check_announced("checkpoint_step_00000005")  # a restart after a failure, from a checkpoint of this run
    monkeypatch.setattr(worker, "_announced", "checkpoint_step_00000010")
    _check_announced("checkpoint_step_00000010")
    _check_announced("checkpoint_step_00000015")  # restarted after Ray registered a newer one
    monkeypatch.setattr(worker, "_announced", "checkpoint_epoch_0001_step_00000012")  # a preemption mid-epoch 2
    _check_announced("checkpoint_epoch_0001_step_00000012")
    _check_announced("checkpoint_epoch_0002")
    with pytest.raises(RuntimeError, match="handed the workers checkpoint_epoch_0001, but the driver announced"):
        _check_announced("checkpoint_epoch_0001")
    monkeypatch.setattr(worker, "_announced", "checkpoint_step_00000010")
    for handed in (None, "checkpoint_step_00000005"):
        with pytest.raises(
            RuntimeError,
            match=rf"Ray Train handed the workers {handed or 'no checkpoint'}, but the "
            rf"driver announced a resume from checkpoint_step_00000010",
        ):
            _check_announced(handed)


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_ray_registered_before_it(
    tmp_path, capsys, caplog, monkeypatch
):
    """A truncated state.pt of Ray's newest checkpoint fails its checksum: the driver warns, resumes from the one
    registered before it and rewrites Ray's snapshot so that Ray hands that one; a worker handed it refuses it."""
    from ray.train import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import _CheckpointManagerState

    from cookbook.checkpoint import CHECKSUMS_KEY, checksums

    names = [f"checkpoint_step_{step:08d}" for step in (8, 16, 24)]
    for step, name in zip((8, 16, 24), names):
        d = tmp_path / name
        d.mkdir()
        torch.save({"step": torch.tensor(step), "w": torch.randn(64)}, d / _STATE_FILE)
        meta = {"step": step, "world_size": 2, "config": {}, CHECKSUMS_KEY: checksums(d)}
        (d / "meta.json").write_text(json.dumps(meta))
    results = [{"checkpoint_dir_name": n, "metrics": {"step": s}} for n, s in zip(names, (8, 16, 24))]
    snapshot = {
        "ray_version": RAY,
        "checkpoint_results": results,
        "checkpoint_report_indices": [0, 1, 2],
        "latest_checkpoint_result": results[2],
        "pending_training_results": [],
        "pending_validation_specs": [],
        "current_report_index": 3,
        "validated_checkpoint_dir_names": [],
        "timed_out_validation_checkpoint_dir_names": [],
        "failed_validation_checkpoint_dir_names": [],
    }
    _CheckpointManagerState.model_validate(snapshot)  # the form Ray writes
    (tmp_path / _SNAPSHOT_FILE).write_text(json.dumps(snapshot))
    state = tmp_path / names[2] / _STATE_FILE
    state.write_bytes(state.read_bytes()[:-100])  # a copy cut short
    monkeypatch.setattr(worker, "_announced", None)
    monkeypatch.setattr("ray.train.get_checkpoint", lambda: Checkpoint.from_directory(str(tmp_path / names[2])))
    with pytest.raises(
        CheckpointError,
        match=rf"{names[2]}: state.pt does not match its checksum \(xxh3_64:\w+ in meta.json, xxh3_64:\w+ now\), damaged",
    ):
        worker.load_checkpoint()  # what Ray hands a restarted worker group: refused, not read
    capsys.readouterr()
    path = _check_resume(_RayCheckpoints(tmp_path, "step"), "auto", {}, (), ("train.stop_at_step", -1))
    assert path == tmp_path / names[1]
    warned = caplog.text  # rank 0's warning line
    assert f"checkpoint {tmp_path / names[2]} is damaged (state.pt does not match its checksum" in warned, warned
    assert f"resuming from {path} instead" in warned and f"resuming from {path} (step 16)" in capsys.readouterr().err
    written = _CheckpointManagerState.model_validate(json.loads((tmp_path / _SNAPSHOT_FILE).read_text()))
    assert written.latest_checkpoint_result.checkpoint_dir_name == names[1]
    assert [r.checkpoint_dir_name for r in written.checkpoint_results] == names[:2]
    assert written.checkpoint_report_indices == [0, 1]
    assert _RayCheckpoints(tmp_path, "step").latest() == path  # a second look agrees, with no rewrite needed
    (tmp_path / names[1] / _STATE_FILE).write_bytes(
        b""
    )  # and when every registered one is damaged, nothing is resumed in silence
    (tmp_path / names[0] / _STATE_FILE).write_bytes(b"")
    with pytest.raises(CheckpointError, match="no complete checkpoint remains"):
        _check_resume(_RayCheckpoints(tmp_path, "step"), "auto", {}, (), ("train.stop_at_step", -1))


def test_the_random_streams_survive_a_weights_only_checkpoint(tmp_path):
    def draws():
        return random.random(), float(np.random.rand()), float(torch.rand(()))

    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    draws()
    torch.save({"rng_per_worker": [rng_state()]}, tmp_path / _STATE_FILE)
    expected = draws()
    random.seed(4), np.random.seed(5), torch.manual_seed(6)
    set_rng_state(torch.load(tmp_path / _STATE_FILE, weights_only=True)["rng_per_worker"][0])  # no pickled code
    assert draws() == expected


def test_resuming_with_another_worker_count_is_refused(tmp_path):
    guard = _RayCheckpoints(tmp_path, "epoch")
    guard.check_world_size(tmp_path, {"step": 4, "world_size": 2}, 2)
    guard.check_world_size(tmp_path, {"step": 4}, 3)  # a checkpoint that did not record it
    with pytest.raises(
        CheckpointError,
        match=rf"written by 2 workers but this job has 1.*ray.num_workers=2.*"
        rf"a new output_dir \(or delete {tmp_path}\)",
    ):
        guard.check_world_size(tmp_path, {"step": 4, "world_size": 2}, 1)


def test_a_recipe_exception_leaves_the_worker_as_an_importable_error(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(
        "class DataError(ValueError):\n    pass\n\n"
        "def train_loop(config):\n    raise DataError(f\"cannot decode {config['file']}\")\n"
    )
    with pytest.raises(ray_train.RecipeError) as err:
        worker_entry({"script": str(script), "config": {"file": "x.jpg"}})
    assert str(err.value) == "DataError: cannot decode x.jpg"
    # Ray's controller and the driver unpickle it without the recipe module:
    code = "import pickle, sys; e = pickle.loads(sys.stdin.buffer.read()); print(type(e).__name__, e)"
    out = subprocess.run(
        [sys.executable, "-c", code],
        input=pickle.dumps(err.value),
        capture_output=True,
        env={**os.environ, "PYTHONPATH": str(ROOT / "shared")},
    )
    assert out.stdout.decode().strip() == "RecipeError DataError: cannot decode x.jpg", out.stderr.decode()
    script.write_text("def train_loop(config):\n    raise KeyError('other errors pass unchanged')\n")
    with pytest.raises(KeyError):
        worker_entry({"script": str(script), "config": {}})


def test_a_recipe_file_imports_its_sibling_modules_in_the_worker(tmp_path):
    folder = tmp_path / "my-recipe"
    folder.mkdir()
    (folder / "sibling_of_train.py").write_text("class DataError(ValueError):\n    pass\n")
    (folder / "train.py").write_text(
        "from sibling_of_train import DataError\n\ndef train_loop(config):\n    raise DataError(config['file'])\n"
    )
    with pytest.raises(ray_train.RecipeError, match="^DataError: x.jpg$"):  # the recipe's class, from its folder
        worker_entry({"script": str(folder / "train.py"), "config": {"file": "x.jpg"}})


DRIVER = """
import signal, sys, time
from pathlib import Path
log = Path(sys.argv[1])
def note(signum, frame):
    with log.open("a") as f:
        f.write(signal.Signals(signum).name + "\\n")
def on(signum, frame):
    note(signum, frame)
    time.sleep(0.3)  # a driver shutting down gracefully
    sys.exit(7)
signal.signal(signal.SIGINT, on)
signal.signal(signal.SIGTERM, on)
signal.signal(signal.SIGUSR1, note)  # Slurm's warning before the end of a job: the driver carries on
log.write_text("")
time.sleep(60)
"""


@pytest.mark.parametrize("sig, to_group", [(signal.SIGTERM, False), (signal.SIGINT, True)])
def test_the_launcher_passes_sigterm_and_ctrl_c_to_the_driver_once_and_waits(tmp_path, sig, to_group):
    driver, log = tmp_path / "driver.py", tmp_path / "signals.txt"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "NNODES")}
    env["PYTHONPATH"] = str(ROOT / "shared")
    launcher = subprocess.Popen(
        [sys.executable, "-m", "cookbook.ray_train.launch", str(driver), str(log)],
        env=env,
        start_new_session=True,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 30
    while not log.exists():  # the driver is up and has its handlers
        assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read()
        time.sleep(0.05)
    if to_group:  # a Ctrl-C in the terminal goes to the launcher's whole process group
        os.killpg(launcher.pid, sig)
    else:  # `kill <pid>` / a scheduler's SIGTERM goes to the launcher alone, as does Slurm's SIGUSR1 before it
        launcher.send_signal(signal.SIGUSR1)
        while "SIGUSR1" not in log.read_text():
            assert time.monotonic() < deadline and launcher.poll() is None, launcher.stderr.read()
            time.sleep(0.05)
        launcher.send_signal(sig)
    assert launcher.wait(timeout=30) == 7  # it waited for the driver and returned its status
    assert log.read_text().split() == ([] if to_group else ["SIGUSR1"]) + [sig.name]  # the driver got each once
    assert "Traceback" not in launcher.stderr.read()


def test_a_driver_ended_by_a_signal_gives_128_plus_its_number_and_a_line(tmp_path):
    """A second SIGTERM stops the driver at once (killed by the signal): the launcher exits 143 and says so, not
    Python's 241 for ``sys.exit(-15)`` without a word."""
    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, signal\nsignal.signal(signal.SIGTERM, signal.SIG_DFL)\nos.kill(os.getpid(), signal.SIGTERM)\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "NNODES")}
    env["PYTHONPATH"] = str(ROOT / "shared")
    done = subprocess.run(
        [sys.executable, "-m", "cookbook.ray_train.launch", str(driver)], env=env, capture_output=True, text=True
    )
    assert done.returncode == 143, done.stderr
    assert done.stderr.strip().splitlines()[-1] == "the driver was killed by SIGTERM (exit status 143)"


def test_the_ray_recipes_launch_scripts_run_the_same_commands():
    """Each Ray recipe's launch.sh is the same program (their comments differ): the recipe tests run one
    recipe's resume through its launch.sh and the others' through the driver, forked (no interpreter start-up)."""

    def commands(recipe: str) -> list[str]:
        lines = (ROOT / "recipes" / recipe / "launch.sh").read_text().splitlines()
        return [line.split("  #")[0].rstrip() for line in lines if line.strip() and not line.lstrip().startswith("#")]

    scripts = {r: commands(r) for r in ("resnet50-ray-ddp", "qwen-ray-sft", "two-tower-ray")}
    assert scripts["resnet50-ray-ddp"][-1].startswith('exec python3 -m cookbook.ray_train.launch "$HERE/train.py"')
    assert scripts["qwen-ray-sft"] == scripts["resnet50-ray-ddp"] == scripts["two-tower-ray"]
