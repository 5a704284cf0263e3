"""The ResNet Ray Train recipe on CPU: 2 Ray workers (gloo) on a Ray head in the test's folder."""

import io
import os
import re
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from conftest import ROOT, read_jsonl
from ray_cluster import (
    kill_a_worker,
    paused,
    ray_processes,
    recipe_module,
    registered,
    run_driver_forked,
    run_launch,
    summary,
    train_steps,
    wait_for,
)

from cookbook.checkpoint import CheckpointError

RECIPE = ROOT / "recipes" / "resnet50-ray-ddp"


def test_killed_then_preempted_resumes_take_the_uninterrupted_steps_and_learn(ray_env, tmp_path, monkeypatch):
    """Three runs in one folder, 8 steps per epoch (64 images / (4 x 2 workers)), each step's loss and top-1
    compared with the first run's uninterrupted steps 1-24:

    1. killed with epoch 1's checkpoint registered and epochs 2 and 3 written after it: Ray's controller (which
       collects the workers' reports) is paused once it registered epoch 1, so the workers report epoch 2, then
       block on epoch 3's report; one is SIGKILLed;
    2. the same command through launch.sh resumes from epoch 1 and gets SIGTERM a few steps into epoch 2 (one
       worker paused meanwhile, so that the stop falls mid-epoch): every worker stops after the same step, saves
       a checkpoint there, and the run exits 75;
    3. the same command resumes mid-epoch (the augmentations' random streams restored) and finishes.
    """
    out = tmp_path / "run"
    batch = "train.micro_batch_size=4"

    def kill_with_two_checkpoints_unregistered(driver: int):
        wait_for(lambda: registered(out) == "checkpoint_epoch_0001", "epoch 1's checkpoint registered")
        [controller] = ray_processes(ray_env, "TrainController")
        with paused(controller):
            wait_for(lambda: (out / "checkpoint_epoch_0003" / "meta.json").is_file(), "epoch 3's checkpoint")
            kill_a_worker(ray_env)

    # The driver forked from pytest (no interpreter start-up); the resume goes through launch.sh.
    first = run_driver_forked(
        "resnet50-ray-ddp", ray_env, f"output_dir={out}", batch, alongside=kill_with_two_checkpoints_unregistered
    )
    assert first.returncode == 1 and "Training failed due to worker errors" in first.stderr, first.stderr[-4000:]
    assert registered(out) == "checkpoint_epoch_0001" and (out / "checkpoint_epoch_0003" / "state.pt").is_file()
    records = read_jsonl(out / "metrics.jsonl")
    uninterrupted = {r["step"]: r for r in records if r["event"] == "train"}
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, 25))
    uninterrupted_evals = [r for r in records if r["event"] == "eval"]  # epochs 1-3
    seen = after_first = len(records)

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # plan on this machine, as launch.sh's check does
    with pytest.raises(CheckpointError, match="written by 2 workers but this job has 1"):  # before Ray starts
        recipe_module("resnet50-ray-ddp").main(
            ["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={out}", batch, "ray.num_workers=1"]
        )

    def preempt_mid_epoch(launcher: int):
        wait_for(lambda: len(train_steps(out)) >= 24 + 2, "the resumed run's second step")
        with paused(ray_processes(ray_env, "RayTrainWorker")[-1]):  # the other worker waits for it in a collective
            os.kill(launcher, signal.SIGTERM)  # a scheduler's stop; launch.sh's launcher passes it to the driver
            time.sleep(1.5)  # the driver asks the workers to stop; rank 0 reads it at its next step boundary

    second = run_launch("resnet50-ray-ddp", ray_env, f"output_dir={out}", batch, alongside=preempt_mid_epoch)
    assert second.returncode == 75, second.stderr[-4000:]
    assert (
        "resuming from" in second.stderr
        and "checkpoint_epoch_0001 (epoch 1); checkpoint_epoch_0002, "
        "checkpoint_epoch_0003 were written after it but not registered"
        in second.stderr
    )
    assert re.search(r"resumed from \S+/checkpoint_epoch_0001 \(epoch 1, step 8, world_size 2\)", second.stderr)
    assert "SIGTERM: the workers stop after their next step and save a checkpoint" in second.stderr
    stopped = [r["step"] for r in read_jsonl(out / "metrics.jsonl")[seen:] if r["event"] == "train"]
    stop = stopped[-1]
    assert 10 < stop < 16 and stopped == list(range(9, stop + 1)), stopped  # mid-epoch 2 (steps 9-16)
    assert (
        f"preempted (SIGTERM): every worker stopped after step {stop} and saved {out}/checkpoint_epoch_0001_step_"
        f"{stop:08d}; run the same command again to continue (exit status 75)"
    ) in second.stderr
    assert registered(out) == f"checkpoint_epoch_0001_step_{stop:08d}"
    seen = len(read_jsonl(out / "metrics.jsonl"))

    third = run_driver_forked("resnet50-ray-ddp", ray_env, f"output_dir={out}", batch)
    assert third.returncode == 0, third.stderr[-4000:]
    assert f"resuming from {out}/checkpoint_epoch_0001_step_{stop:08d} (epoch 1, step {stop})" in third.stderr
    assert "holds no random streams" not in second.stderr + third.stderr
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records[seen:] if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(stop + 1, 33))  # continued after the step it stopped at
    resumed = {r["step"]: r for r in records[after_first:] if r["event"] == "train"}  # the 2nd and 3rd runs
    for step in range(9, 25):  # after each resume: the uninterrupted run's loss and top-1 (its augmentations)
        assert (resumed[step]["loss"], resumed[step]["top1"]) == (
            uninterrupted[step]["loss"],
            uninterrupted[step]["top1"],
        ), step
    loss = {**{k: r["loss"] for k, r in uninterrupted.items()}, **{k: r["loss"] for k, r in resumed.items()}}
    first_epoch, last_epoch = sum(loss[s] for s in range(1, 9)) / 8, sum(loss[s] for s in range(25, 33)) / 8
    assert last_epoch < 0.85 * first_epoch, (first_epoch, last_epoch)
    end = summary(records)
    assert end["reports_per_worker"] == [3, 3] and end["epoch"] == 4  # every worker reported each epoch
    assert end["param_fingerprints"][0] == end["param_fingerprints"][1]  # DDP replicas agree
    evals = [r for r in records[seen:] if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [16, 24, 32] and all(e["eval/images"] == 16 for e in evals)
    assert [(e["eval/loss"], e["eval/top1"]) for e in evals[:2]] == [
        (e["eval/loss"], e["eval/top1"]) for e in uninterrupted_evals[1:]
    ]  # epochs 2 and 3
    alone = evaluate_checkpoint(out)  # the same weights in one process: each image counted once, same numbers
    assert alone["images"] == 16 and evals[-1]["eval/top1"] == alone["top1"]
    assert evals[-1]["eval/loss"] == pytest.approx(alone["loss"], rel=1e-5), (evals[-1], alone)
    assert {"samples_per_s_per_device", "top1", "data_wait_frac"} <= set(train[-1])
    assert sorted(p.name for p in out.glob("checkpoint_epoch_*")) == ["checkpoint_epoch_0003", "checkpoint_epoch_0004"]
    # Ray's session files stayed in the head's own folder (not ~/.ray or /tmp/ray).
    assert any(Path(ray_env["_RAY_TMP"]).glob("session_*"))


def evaluate_checkpoint(out: Path) -> dict[str, float]:
    """Loss and top-1 of ``out``'s newest checkpoint over the run's validation images, in this process
    (one process, no Ray): the numbers the run's last eval record must equal."""
    train = recipe_module("resnet50-ray-ddp")
    cfg = train.load_config(train.Config, out / "config.yaml")  # the run's resolved config
    _, val, classes = train.load_data(cfg.data, cfg.train.seed, verify=False)
    model = train.build_model(cfg.model, len(classes))
    newest = sorted(out.glob("checkpoint_epoch_*"))[-1]
    model.load_state_dict(torch.load(newest / "state.pt", weights_only=True)["model"])
    loader = torch.utils.data.DataLoader(
        train.ImageDataset(val, train.ImageTransform(cfg.data.image_size, train=False)), batch_size=5
    )
    return train.evaluate(model, loader, torch.device("cpu"), bf16=False, channels_last=False)


def _evaluate_replicas(overrides: list[str]) -> tuple[dict, dict | None]:
    """The recipe's evaluation on each of 2 workers, as its train loop runs it: replicas with the same weights
    but their own BatchNorm statistics (each trained on its own batches), `sync_buffers`, then `evaluate` of
    this worker's `validation_shard`. Returns the result and rank 0's weights."""
    import cookbook

    train = recipe_module("resnet50-ray-ddp")
    info = cookbook.get_dist_info()
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", overrides)
    train.check_config(cfg, RECIPE)
    _, val, classes = train.load_data(cfg.data, cfg.train.seed, verify=False)
    torch.manual_seed(cfg.train.seed)
    model = train.build_model(cfg.model, len(classes))
    with torch.no_grad():  # BatchNorm running statistics that differ between the workers
        model.train()
        model(
            torch.rand(
                4, 3, cfg.data.image_size, cfg.data.image_size, generator=torch.Generator().manual_seed(info.rank)
            )
        )
    train.sync_buffers(model)
    shard = torch.utils.data.DataLoader(
        train.validation_shard(val, cfg.data.image_size, info.rank, info.world_size),
        batch_size=cfg.train.micro_batch_size,
    )
    result = train.evaluate(model, shard, info.device, bf16=False, channels_last=False)
    return result, model.state_dict() if info.is_main else None


def test_eval_set_smaller_than_the_world_finishes_and_counts_each_image_once(tmp_path):
    """80 images x 0.0125: one validation image for two workers, so worker 1 evaluates nothing (and must not hang)."""
    import cookbook

    overrides = ["data.val_fraction=0.0125", f"output_dir={tmp_path / 'run'}"]
    results = cookbook.distributed(num_processes=2, start_method="fork", timeout_minutes=1)(
        _evaluate_replicas
    ).distributed(overrides)
    (final, state), (other, _) = results
    assert final == other  # summed over both workers: the same on each
    train = recipe_module("resnet50-ray-ddp")
    cfg = train.load_config(train.Config, RECIPE / "tiny.yaml", overrides)
    train.check_config(cfg, RECIPE)
    _, val, classes = train.load_data(cfg.data, cfg.train.seed, verify=False)
    model = train.build_model(cfg.model, len(classes))
    model.load_state_dict(state)  # rank 0's weights and statistics, evaluated in one process
    loader = torch.utils.data.DataLoader(
        train.ImageDataset(val, train.ImageTransform(cfg.data.image_size, train=False)), batch_size=5
    )
    alone = train.evaluate(model, loader, torch.device("cpu"), bf16=False, channels_last=False)
    assert final["images"] == alone["images"] == 1
    assert final["top1"] == alone["top1"] and final["loss"] == pytest.approx(alone["loss"], rel=1e-5)


# ----------------------------------------------------------------------------- bad input (before Ray starts)
def _check(tmp_path, *overrides):
    train = recipe_module("resnet50-ray-ddp")
    train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}", *overrides])


@pytest.fixture
def images(tmp_path):
    root = tmp_path / "images"
    shutil.copytree(RECIPE / "tiny" / "data" / "train", root)
    return root


def _jpeg(truncate: bool = False) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buffer, "JPEG")
    return buffer.getvalue()[: len(buffer.getvalue()) // 2] if truncate else buffer.getvalue()


@pytest.mark.parametrize(
    "content, reason",
    [
        (b"not a jpeg", "UnidentifiedImageError: cannot identify image file"),
        ("truncated", "OSError: image file is truncated"),
    ],
)
def test_undecodable_image_is_named(tmp_path, images, content, reason):
    (images / "checks" / "broken.jpg").write_bytes(_jpeg(truncate=True) if content == "truncated" else content)
    with pytest.raises(ValueError, match=rf"1 image\(s\) cannot be decoded, e.g. .*checks/broken.jpg \({reason}"):
        _check(tmp_path, f"data.train_dir={images}")


def test_files_that_are_not_images_are_left_out_and_named(tmp_path, images, capsys):
    (images / "README.txt").write_text("ants and bees")  # beside the class folders
    (images / "checks" / "notes.txt").write_text("hand-labelled")
    (images / "checks" / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    (images / "checks" / "._checks_000.png").write_bytes(b"\0\5\26\7 AppleDouble")  # macOS metadata, not an image
    (images / "checks" / ".thumbs").mkdir()
    (images / "checks" / ".thumbs" / "checks_000.png").write_bytes((images / "checks" / "checks_000.png").read_bytes())
    (images / "stripes" / "scan.JPEG").write_bytes(_jpeg())  # an image: the extension's case does not matter
    _check(tmp_path, f"data.train_dir={images}")
    out, err = capsys.readouterr()
    assert "(2 classes, 65 train / 16 val images)" in out  # 80 + scan.JPEG
    assert err.strip() == (
        f"note: 5 file(s) in the image folders are not images by their name and are left out, e.g. "
        f"{images / 'README.txt'}, {images / 'checks' / '.DS_Store'}, {images / 'checks' / '._checks_000.png'}"
    )


def test_empty_class_folder_is_named(tmp_path, images):
    (images / "zebras").mkdir()
    with pytest.raises(ValueError, match=r"zebras: the class folder 'zebras' holds no image"):
        _check(tmp_path, f"data.train_dir={images}")


def test_more_workers_than_cpus(tmp_path, monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    with pytest.raises(ValueError, match=r"ray.num_workers=4096 x ray.cpus_per_worker=1 CPUs, but the Ray cluster has"):
        _check(tmp_path, "ray.num_workers=4096")


def test_missing_storage_on_several_nodes(tmp_path, monkeypatch):
    monkeypatch.setenv("COOKBOOK_NNODES", "2")
    with pytest.raises(ValueError, match=r"/no/such/mount does not exist. With 2 nodes output_dir must be on storage"):
        train = recipe_module("resnet50-ray-ddp")
        train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", "output_dir=/no/such/mount/run"])


def test_bad_input_through_launch_sh_is_one_line(tmp_path, ray_env):
    env = {**ray_env, "RAY_ADDRESS": ""}  # a local run: checked against this machine before Ray starts
    proc = run_launch("resnet50-ray-ddp", env, f"output_dir={tmp_path / 'out'}", "ray.num_workers=4096")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.strip().startswith("error: ray.num_workers=4096") and proc.stderr.count("error:") == 1
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()
