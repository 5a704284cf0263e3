"""The RetinaNet DDP recipe on its tiny twin (ResNet-18-FPN, 9 real images with hand-drawn boxes), 2 CPU ranks.

PyPI's torchvision does not import beside the CPU torch (its compiled ops need CUDA libraries): the README's test
command installs it into ``.torchvision-cpu`` and `torchvision_cpu.apply` makes it importable in this process, with a
pure-PyTorch nms. The runs are ``main`` on 2 workers forked from this process (`main_in_workers`), which inherit it.
"""

import json
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
import torchvision_cpu
from conftest import ROOT, check, load_recipe, main_in_workers, read_jsonl, train_losses

from cookbook.checkpoint import CheckpointError

torchvision_cpu.apply()

RECIPE = ROOT / "recipes" / "retinanet-ddp"
recipe = load_recipe("retinanet-ddp")
STEPS = 30
RESUME_AT = 25  # the full run's checkpoint that the resume test starts from: steps 26-30 after it


def run_workers(monkeypatch, *overrides: str) -> None:
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    log = logging.getLogger("cookbook")
    inherited = [h for h in log.handlers if getattr(h, "_cookbook", False)]
    for h in inherited:
        log.removeHandler(h)
    try:
        main_in_workers("retinanet-ddp", *overrides)
    finally:
        for h in inherited:
            log.addHandler(h)


@pytest.fixture(scope="module")
def full_run(tmp_path_factory):
    """One uninterrupted 30-step run of tiny.yaml (evaluated at step 0 and at the end), checkpoints at 25 and 30
    (``checkpoint.every_steps=25``, which may change on a resume): the resume test takes 5 steps after step 25's."""
    out = tmp_path_factory.mktemp("retina") / "full"
    mp = pytest.MonkeyPatch()
    try:
        run_workers(mp, f"output_dir={out}", f"checkpoint.every_steps={RESUME_AT}")
    finally:
        mp.undo()
    return out


def test_nms_equals_a_brute_force_reference():
    from torchvision.ops import batched_nms, nms

    g = torch.Generator().manual_seed(0)
    for n in (0, 1, 7, 60):
        xy = torch.rand(n, 2, generator=g) * 50
        boxes = torch.cat([xy, xy + 1 + torch.rand(n, 2, generator=g) * 30], 1)
        scores = torch.rand(n, generator=g)
        for thr in (0.3, 0.5):
            kept = nms(boxes, scores, thr)
            assert kept.dtype == torch.int64
            ref = []  # brute force: each box, by score, survives unless a kept box overlaps it by IoU > thr
            for i in sorted(range(n), key=lambda i: -scores[i].item()):
                if all(_iou(boxes[i], boxes[j]) <= thr for j in ref):
                    ref.append(i)
            assert kept.tolist() == ref
    labels = torch.randint(0, 3, (60,), generator=g)
    kept = batched_nms(boxes, scores, labels, 0.5)
    ref = sorted(
        (
            i
            for c in range(3)
            for i in (labels == c).nonzero()[:, 0][nms(boxes[labels == c], scores[labels == c], 0.5)].tolist()
        ),
        key=lambda i: -scores[i].item(),
    )
    assert kept.tolist() == ref


def _iou(a, b) -> float:
    iw = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    return float(inter / ((a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter))


def test_loss_falls_and_map_rises(full_run):
    losses = train_losses(full_run / "metrics.jsonl")
    assert sorted(losses) == list(range(1, STEPS + 1))
    first, last = sum(losses[s] for s in range(1, 4)) / 3, sum(losses[s] for s in range(STEPS - 2, STEPS + 1)) / 3
    assert last < 0.6 * first, (first, last)
    evals = [r for r in read_jsonl(full_run / "metrics.jsonl") if r["event"] == "eval"]
    assert [e["step"] for e in evals] == [0, STEPS]
    assert all(e["eval/images"] == 9 for e in evals)  # every image once, none duplicated across ranks
    start, end = evals[0], evals[-1]
    assert end["eval/map_50"] > start["eval/map_50"] + 0.05, (start, end)
    assert end["eval/map"] > start["eval/map"], (start, end)
    rec = [r for r in read_jsonl(full_run / "metrics.jsonl") if r["event"] == "train"][-1]
    assert rec["samples_per_s_per_device"] == pytest.approx(rec["samples_per_s"] / 2) and "tokens_per_s" not in rec
    summary = [r for r in read_jsonl(full_run / "metrics.jsonl") if r["event"] == "summary"][-1]
    assert summary["param_fingerprints"][0] == summary["param_fingerprints"][1]
    assert json.loads((full_run / "final" / "categories.json").read_text())[1]["name"] == "bee"


def test_sharded_evaluation_equals_single_process(full_run):
    """The final model, evaluated in this one process over the whole set, gives the 2-rank run's numbers exactly."""
    cfg = recipe.load_config(recipe.Config, RECIPE / "tiny.yaml")
    recipe.check_config(cfg, RECIPE)
    records, cats = recipe.load_coco(cfg.data.eval_images, cfg.data.eval_annotations, "data.eval_annotations")
    model = recipe.build_model(cfg.model, len(cats) + 1, logging.getLogger("test"))
    model.load_state_dict(torch.load(full_run / "final" / "model.pt"))
    loader = torch.utils.data.DataLoader(
        recipe.CocoDetection(records, train=False), batch_size=1, collate_fn=recipe.collate
    )
    torch.set_num_threads(1)  # as each rank ran
    single = recipe.evaluate(model, loader, torch.device("cpu"), lambda: torch.autocast("cpu", enabled=False))
    sharded = [r for r in read_jsonl(full_run / "metrics.jsonl") if r["event"] == "eval"][-1]
    assert single["images"] == 9
    assert (single["map"], single["map_50"]) == (sharded["eval/map"], sharded["eval/map_50"])
    assert single["map_50"] > 0


def test_resume_gives_the_same_losses_as_an_uninterrupted_run(full_run, tmp_path, monkeypatch):
    out = tmp_path / "run"
    name = f"step_{RESUME_AT:08d}"
    shutil.copytree(full_run / "checkpoints" / name, out / "checkpoints" / name)
    run_workers(monkeypatch, f"output_dir={out}", "train.eval_at_start=false")  # resume=auto: from step 25
    resumed, full = train_losses(out / "metrics.jsonl"), train_losses(full_run / "metrics.jsonl")
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1))
    assert [resumed[s] for s in range(RESUME_AT + 1, STEPS + 1)] == [full[s] for s in range(RESUME_AT + 1, STEPS + 1)]


def test_resume_with_other_data_workers_is_refused(full_run):
    """launch.sh's check of a resume: each rank's checkpointed loader state has one entry per data-loader worker, so
    data.num_workers must not change (data.eval_batch_size, in MAY_CHANGE, may)."""
    ckpt = full_run / "checkpoints" / "step_00000030"
    with pytest.raises(CheckpointError) as err:
        check("retinanet-ddp", f"output_dir={full_run}", "data.num_workers=2")
    assert str(err.value).startswith(
        f"{ckpt} was written with other settings (data.num_workers: 0 -> 2); resuming would "
        "mix two runs. Use the same settings"
    )
    assert "config OK" in check("retinanet-ddp", f"output_dir={full_run}", "data.eval_batch_size=2")


def _write(tmp_path, mutate, raw: str | None = None):
    coco = json.loads((RECIPE / "tiny" / "instances.json").read_text())
    mutate(coco)
    path = tmp_path / "instances.json"
    path.write_text(raw if raw is not None else json.dumps(coco), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda c: c["images"][0].update(file_name="missing.jpg"),
            r"images\[0\] \(id 1\): field 'file_name': image file not found: .*missing.jpg",
        ),
        (
            lambda c: c["annotations"][0].update(bbox=[100, 40, 154, 58]),
            r"annotations\[0\] \(annotation id 1\): field 'bbox' \[100, 40, 154, 58\] lies outside its image 1 \(224 x 149",
        ),
        (
            lambda c: c["annotations"][0].update(bbox=[224, 40, 1, 20]),  # 1 pixel on the right border: clipped to none
            r"annotations\[0\] \(annotation id 1\): field 'bbox' \[224, 40, 1, 20\] is 0 x 20 pixels once clipped to its "
            r"image 1 \(224 x 149\) and 0 x 17.047 resized to 192 x 127 \(model.min_size / max_size\): training would "
            r"see a box without area, which torchvision refuses; fix or remove the annotation",
        ),
        (
            lambda c: c["annotations"][2].update(category_id=7),
            r"annotations\[2\] \(annotation id 3\): field 'category_id': unknown category id 7 \(categories: \[1, 2\]\)",
        ),
        (
            lambda c: c["annotations"][1].update(bbox=[56, 22, -36, 22]),
            r"annotations\[1\] \(annotation id 2\): field 'bbox': width and height must be > 0, got \[56, 22, -36, 22\]",
        ),
        (
            lambda c: c["annotations"][3].update(image_id=3.5),
            r"annotations\[3\] \(annotation id 4\): field 'image_id' must be an integer, got 3.5",
        ),
        (
            lambda c: c["annotations"][3].update(image_id=10**400),  # json.loads reads it: a tensor cannot hold it
            r"annotations\[3\] \(annotation id 4\): field 'image_id' must be an integer of 64 bits, got a 401-digit integer",
        ),
        (
            lambda c: c["annotations"][3].update(image_id=float("inf")),  # written 1e999 or Infinity
            r"annotations\[3\] \(annotation id 4\): field 'image_id' must be an integer, got inf",
        ),
        (
            lambda c: c["annotations"][3].update(iscrowd="no"),
            r"annotations\[3\] \(annotation id 4\): field 'iscrowd' must be an integer, got 'no'",
        ),
        (
            lambda c: c["annotations"][3].update(iscrowd=2),
            r"annotations\[3\] \(annotation id 4\): field 'iscrowd' must be 0 or 1, got 2",
        ),
        (
            lambda c: c["annotations"][3].pop("image_id"),
            r"annotations\[3\] \(annotation id 4\): field 'image_id' is missing",
        ),
        (lambda c: c["annotations"][2].pop("id"), r"annotations\[2\]: field 'id' is missing"),
        (
            lambda c: c["annotations"][1].pop("category_id"),
            r"annotations\[1\] \(annotation id 2\): field 'category_id' is missing",
        ),
        (lambda c: c["annotations"][0].pop("bbox"), r"annotations\[0\] \(annotation id 1\): field 'bbox' is missing"),
        (lambda c: c["images"][1].pop("file_name"), r"images\[1\] \(id 2\): field 'file_name' is missing"),
        (lambda c: c["images"][0].pop("height"), r"images\[0\] \(id 1\): field 'height' is missing"),
        (lambda c: c["categories"][1].pop("id"), r"categories\[1\]: field 'id' is missing"),
        (lambda c: c.pop("categories"), r"field 'categories' is missing"),
        (lambda c: c["annotations"].append(7), r"annotations\[11\] must be an object, got 7"),
    ],
)
def test_bad_input_names_file_field_and_annotation(tmp_path, mutate, message):
    path = _write(tmp_path, mutate)
    with pytest.raises(recipe.DataError, match=rf"^{tmp_path}/instances.json: {message}"):
        check("retinanet-ddp", f"data.train_annotations={path}", f"data.train_images={RECIPE / 'tiny' / 'images'}")


@pytest.mark.parametrize(
    "name, prelude, message",
    [
        (
            "retinanet-ddp",
            "sys.modules['torchvision'] = None",  # not importable, wherever the environment has it
            "torchvision is not installed: `pip install 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/"
            "cpu` (the build for torch {torch})",
        ),
        (
            "retinanet-ddp",
            f"sys.path.insert(0, {str(torchvision_cpu.FOLDER)!r})",  # PyPI's wheel beside the CPU torch
            "torchvision 0.28.0 is installed but does not import (RuntimeError: operator torchvision::nms does not exist): "
            "its build does not match torch {torch}: install the torchvision build made for that torch: `pip install "
            "--force-reinstall --no-deps 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu`",
        ),
        (
            "modernbert-ddp",
            f"sys.path.insert(0, {str(torchvision_cpu.FOLDER)!r})",  # a recipe that never uses it
            "torchvision 0.28.0 is installed but does not import (RuntimeError: operator torchvision::nms does not exist): "
            "its build does not match torch {torch}: install the torchvision build made for that torch: `pip install "
            "--force-reinstall --no-deps 'torchvision==0.28.*' --index-url https://download.pytorch.org/whl/cpu`",
        ),
    ],
    ids=["missing", "built-for-cuda-torch", "modernbert-imports-it"],
)
def test_a_missing_or_mismatched_torchvision_is_refused_by_the_check_in_one_line(name, prelude, message):
    """launch.sh's check in a process of its own: one line and status 2 (never restarted, no worker started), before
    transformers (which imports torchvision) is imported; the test process itself has torchvision through the shim.
    The hint installs the build for the installed torch (PyPI's plain ``pip install torchvision==0.28.0`` brings
    the CUDA build beside a CPU torch). Any recipe (modernbert-ddp: torchmetrics imports torchvision at the
    recipe's top level, before: a 40-line traceback, exit 1) says it in one line (`cookbook.builds`)."""
    recipe_dir = ROOT / "recipes" / name
    argv = [str(recipe_dir / "train.py"), "--check", "--config", str(recipe_dir / "tiny.yaml")]
    code = f"import runpy, sys; {prelude}; sys.argv = {argv!r}; runpy.run_path(sys.argv[0], run_name='__main__')"
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COOKBOOK_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""},
    )
    assert (proc.returncode, proc.stdout, proc.stderr) == (
        2,
        "",
        f"error: {message.format(requirements=RECIPE / 'requirements.txt', torch=torch.__version__)}\n",
    )


def test_a_bom_is_accepted_with_the_same_records(tmp_path):
    plain = RECIPE / "tiny" / "instances.json"
    path = tmp_path / "bom.json"
    path.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    images = str(RECIPE / "tiny" / "images")
    assert recipe.load_coco(images, str(path), "f") == recipe.load_coco(images, str(plain), "f")


def test_integral_floats_and_a_null_iscrowd_read_as_the_integers_they_hold(tmp_path):
    """Some exporters write ids, sizes and iscrowd as floats (``3.0``) or iscrowd as null: the same records."""

    def floats(coco):
        for img in coco["images"]:
            img.update(id=float(img["id"]), width=float(img["width"]), height=float(img["height"]))
        for ann in coco["annotations"]:
            ann.update(
                id=float(ann["id"]),
                image_id=float(ann["image_id"]),
                category_id=float(ann["category_id"]),
                iscrowd=None,
            )
        for cat in coco["categories"]:
            cat["id"] = float(cat["id"])

    images = str(RECIPE / "tiny" / "images")
    records, cats = recipe.load_coco(images, str(_write(tmp_path, floats)), "f")
    plain_records, plain_cats = recipe.load_coco(images, str(RECIPE / "tiny" / "instances.json"), "f")
    assert records == plain_records and [c["id"] for c in cats] == [c["id"] for c in plain_cats] == [1, 2]
    assert all(type(r["image_id"]) is int and type(r["width"]) is int for r in records)


def _crowd_and_empty_image_set():
    """5 images, 4 targets each (image 2: one crowd region; image 3: none), 6 detections each, 4 of them near
    the targets (seeded)."""
    g = torch.Generator().manual_seed(0)
    items = []
    for iid in range(1, 6):
        n = 0 if iid == 3 else 4
        xy, wh = torch.rand(n, 2, generator=g) * 80, 10 + torch.rand(n, 2, generator=g) * 30
        crowd = torch.tensor([int(iid == 2 and i == 0) for i in range(n)], dtype=torch.int64)
        dxy = torch.rand(6, 2, generator=g) * 80
        if n:
            dxy[:n] = xy + torch.randn(n, 2, generator=g) * 3
        dwh = 10 + torch.rand(6, 2, generator=g) * 30
        if n:
            dwh[:n] = wh + torch.randn(n, 2, generator=g) * 3
        det = {
            "boxes": torch.cat([dxy, dxy + dwh], 1),
            "scores": torch.rand(6, generator=g),
            "labels": torch.ones(6, dtype=torch.int64),
        }
        items.append(
            (
                iid,
                det,
                {"boxes": torch.cat([xy, xy + wh], 1), "labels": torch.ones(n, dtype=torch.int64), "iscrowd": crowd},
            )
        )
    return items


def test_map_is_cocoevals_on_a_crowd_and_empty_image_set(tmp_path, capsys):
    """recipe.coco_map equals pycocotools' COCOeval run from files, as COCO's tools run it (0.114659...); the
    torchmetrics MeanAveragePrecision it replaced gave 0.114329 (float32 recall thresholds)."""
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval
    from torchmetrics.detection import MeanAveragePrecision

    items = _crowd_and_empty_image_set()
    gt = {"images": [{"id": i} for i, _, _ in items], "categories": [{"id": 1}], "annotations": []}
    dt = []
    for iid, det, tgt in items:
        for (x1, y1, x2, y2), crowd in zip(tgt["boxes"].tolist(), tgt["iscrowd"].tolist()):
            gt["annotations"].append(
                {
                    "id": len(gt["annotations"]) + 1,
                    "image_id": iid,
                    "category_id": 1,
                    "bbox": [x1, y1, x2 - x1, y2 - y1],
                    "area": (x2 - x1) * (y2 - y1),
                    "iscrowd": crowd,
                }
            )
        for (x1, y1, x2, y2), score in zip(det["boxes"].tolist(), det["scores"].tolist()):
            dt.append({"image_id": iid, "category_id": 1, "bbox": [x1, y1, x2 - x1, y2 - y1], "score": score})
    (tmp_path / "gt.json").write_text(json.dumps(gt))
    (tmp_path / "dt.json").write_text(json.dumps(dt))
    coco = COCO(str(tmp_path / "gt.json"))
    ref = COCOeval(coco, coco.loadRes(str(tmp_path / "dt.json")), iouType="bbox")
    ref.evaluate()
    ref.accumulate()
    ref.summarize()
    capsys.readouterr()
    assert recipe.coco_map(items) == {"map": ref.stats[0], "map_50": ref.stats[1]}
    assert ref.stats[0] == pytest.approx(0.1146594659)
    before = MeanAveragePrecision(box_format="xyxy", iou_type="bbox", backend="pycocotools")
    before.update([d for _, d, _ in items], [t for _, _, t in items])
    assert before.compute()["map"].item() == pytest.approx(0.1143294349)
    assert recipe.coco_map(items[2:3]) == {"map": -1.0, "map_50": -1.0}  # no target at all: COCOeval's "absent"
