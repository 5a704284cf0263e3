"""The ResNet Ray Train recipe on CPU: 2 Ray workers (gloo) on a Ray head in the test's folder."""

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from conftest import ROOT, read_jsonl
from ray_cluster import recipe_module, run_driver_forked, run_launch, summary

from cookbook.checkpoint import CheckpointError

RECIPE = ROOT / "recipes" / "resnet50-ray-ddp"


def test_stop_after_the_first_checkpoint_resume_and_learn(ray_env, tmp_path, monkeypatch):
    out = tmp_path / "run"
    # The stopped run: the driver forked from pytest (no interpreter start-up); the resume goes through launch.sh.
    first = run_driver_forked("resnet50-ray-ddp", ray_env, f"output_dir={out}", "train.stop_at_epoch=1")
    assert first.returncode == 0, first.stderr[-4000:]
    assert (out / "checkpoint_epoch_0001" / "state.pt").is_file() and not (out / "checkpoint_epoch_0002").exists()
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records if r["event"] == "train"] == [1, 2, 3, 4]  # 64 images / (8 x 2 workers)
    assert summary(records)["reports_per_worker"] == [1, 1]

    # As after an interruption: a later checkpoint folder that Ray had not registered yet.
    shutil.copytree(out / "checkpoint_epoch_0001", out / "checkpoint_epoch_0002")
    meta = json.loads((out / "checkpoint_epoch_0002" / "meta.json").read_text())
    (out / "checkpoint_epoch_0002" / "meta.json").write_text(json.dumps({**meta, "epoch": 2, "step": 8}))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # plan on this machine, as launch.sh's check does
    with pytest.raises(CheckpointError, match="written by 2 workers but this job has 1"):  # before Ray starts
        recipe_module("resnet50-ray-ddp").main(["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={out}",
                                                "ray.num_workers=1"])

    second = run_launch("resnet50-ray-ddp", ray_env, f"output_dir={out}")  # same command: Ray resumes the run
    assert second.returncode == 0, second.stderr[-4000:]
    assert "resuming from" in second.stderr and "checkpoint_epoch_0002 were written after it but not registered" in second.stderr
    assert "resumed from" in second.stderr and "checkpoint_epoch_0001 (epoch 1, step 4, world_size 2)" in second.stderr
    records = read_jsonl(out / "metrics.jsonl")
    train = [r for r in records if r["event"] == "train"]
    assert [r["step"] for r in train] == list(range(1, 17))  # the second run continued at step 5
    loss = {r["step"]: r["loss"] for r in train}
    first_epoch, last_epoch = sum(loss[s] for s in range(1, 5)) / 4, sum(loss[s] for s in range(13, 17)) / 4
    assert last_epoch < 0.85 * first_epoch, (first_epoch, last_epoch)
    end = summary(records)
    assert end["reports_per_worker"] == [3, 3] and end["epoch"] == 4  # every worker reported each epoch
    assert end["param_fingerprints"][0] == end["param_fingerprints"][1]  # DDP replicas agree
    evals = [r for r in records if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [4, 8, 12, 16] and all(e["eval/images"] == 16 for e in evals)
    alone = evaluate_checkpoint(out)  # the same weights in one process: each image counted once, same numbers
    assert alone["images"] == 16 and evals[-1]["eval/top1"] == alone["top1"]
    assert evals[-1]["eval/loss"] == pytest.approx(alone["loss"], rel=1e-5), (evals[-1], alone)
    assert {"samples_per_s_per_device", "top1", "data_wait_frac"} <= set(train[-1])
    assert sorted(p.name for p in out.glob("checkpoint_epoch_*")) == ["checkpoint_epoch_0003", "checkpoint_epoch_0004"]
    # Ray's session files stayed in the test's folder.
    assert any((Path(ray_env["_BASE"]) / "ray").glob("session_*"))


def evaluate_checkpoint(out: Path) -> dict[str, float]:
    """Loss and top-1 of ``out``'s newest checkpoint over the run's validation images, in this process
    (one process, no Ray): the numbers the run's last eval record must equal."""
    train = recipe_module("resnet50-ray-ddp")
    cfg = train.load_config(train.Config, out / "config.yaml")  # the run's resolved config
    _, val, classes = train.load_data(cfg.data, cfg.train.seed, verify=False)
    model = train.build_model(cfg.model, len(classes))
    newest = sorted(out.glob("checkpoint_epoch_*"))[-1]
    model.load_state_dict(torch.load(newest / "state.pt", weights_only=False)["model"])
    loader = torch.utils.data.DataLoader(train.ImageDataset(val, train.ImageTransform(cfg.data.image_size, train=False)),
                                         batch_size=5)
    return train.evaluate(model, loader, torch.device("cpu"), bf16=False, channels_last=False)


def test_eval_set_smaller_than_the_world_finishes_and_counts_each_image_once(ray_env, tmp_path):
    out = tmp_path / "run"
    # 80 images x 0.0125: one validation image for two workers, so worker 1 evaluates nothing.
    proc = run_driver_forked("resnet50-ray-ddp", ray_env, f"output_dir={out}", "train.epochs=1",
                             "data.val_fraction=0.0125", timeout=180)  # a hang is killed at the timeout
    assert proc.returncode == 0, proc.stderr[-4000:]
    final = [r for r in read_jsonl(out / "metrics.jsonl") if r["event"] == "eval"][-1]
    alone = evaluate_checkpoint(out)
    assert final["eval/images"] == alone["images"] == 1
    assert final["eval/top1"] == alone["top1"] and final["eval/loss"] == pytest.approx(alone["loss"], rel=1e-5)


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
    return buffer.getvalue()[:len(buffer.getvalue()) // 2] if truncate else buffer.getvalue()


@pytest.mark.parametrize("content, reason", [(b"not a jpeg", "UnidentifiedImageError: cannot identify image file"),
                                             ("truncated", "OSError: image file is truncated")])
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
    assert err.strip() == (f"note: 5 file(s) in the image folders are not images by their name and are left out, e.g. "
                           f"{images / 'README.txt'}, {images / 'checks' / '.DS_Store'}, {images / 'checks' / '._checks_000.png'}")


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
