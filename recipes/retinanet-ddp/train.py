"""Fine-tune torchvision's RetinaNet (ResNet-50-FPN) on a COCO-format detection data set with native PyTorch DDP.

Commands (from this folder; NGPU defaults to all visible GPUs, else 2 CPU processes):

    ./launch.sh data.train_images=/data/coco/train2017 data.train_annotations=/data/coco/annotations/instances_train2017.json \
                data.eval_images=/data/coco/val2017 data.eval_annotations=/data/coco/annotations/instances_val2017.json
    CONFIG_FILE=tiny.yaml ./launch.sh                # ResNet-18-FPN, 9 real images, offline, CPU
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh ...   # on each node, with its NODE_RANK

``build_model`` (pretrained weights when reachable, the head rebuilt for the data set's categories), ``DDP`` and
``no_sync`` in ``main``'s step, and ``coco_map`` (pycocotools' COCOeval over the detections of every rank, in
image-id order). What it supports (COCO format and its refusals, outputs, tests): README.md beside this file.
"""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from PIL import Image
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset, Subset
from torchdata.stateful_dataloader import StatefulDataLoader

import cookbook
from cookbook import config
from cookbook.checkpoint import CheckpointError, Checkpointer, ModelOptimizerState
from cookbook.config import ConfigError, check_fields, load_config, to_dict
from cookbook.hub import resolve_path
from cookbook.loop import Run
from cookbook.config import build_optimizer
from cookbook.sampler import ResizableSampler
from cookbook.errors import not_a_file
from cookbook.tabular import INT64, DataError

ARCHS = ("retinanet_resnet50_fpn_v2", "retinanet_resnet50_fpn", "retinanet_resnet18_fpn")
REQUIREMENTS = Path(__file__).resolve().with_name("requirements.txt")  # torchvision, pycocotools: beside this file
BOX_SLACK = 1.0  # pixels a box may reach past its image's edge (rounding in annotation tools)


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    arch: str = "retinanet_resnet50_fpn_v2"  # one of ARCHS
    weights: str = "coco"  # coco (COCO-pretrained detector), imagenet (backbone only), none (random init)
    min_size: int = 800  # shorter image side after resizing (torchvision's GeneralizedRCNNTransform)
    max_size: int = 1333  # longer side cap
    trainable_backbone_layers: int = 3  # 0-5 ResNet stages trained (pretrained backbones); random init trains all
    fpn_channels: int = 256  # retinanet_resnet18_fpn only


@dataclass
class DataConfig:
    train_images: str = "???"  # image folder
    train_annotations: str = "???"  # COCO instances.json
    eval_images: str = ""  # empty: no evaluation
    eval_annotations: str = ""
    hflip_prob: float = 0.5  # horizontal-flip probability (training only)
    num_workers: int = 4  # data-loader worker processes per rank
    eval_batch_size: int = 1  # images per forward in evaluation; 1 (torchvision's reference) makes each image's
    # detections independent of its batch (>1 pads images to a common size), so sharding cannot change mAP


@dataclass
class Train(config.TrainConfig):
    eval_at_start: bool = False  # also evaluate before the first step (logged as step 0)


@dataclass
class Config(config.RunConfig):
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: Train = field(default_factory=Train)


# not data.num_workers: the loader state each rank checkpoints has one entry per worker
MAY_CHANGE = (*config.MAY_CHANGE, "data.eval_batch_size", "train.eval_at_start")
RESIZABLE = True  # resumes on another world size (global data position); cookbook.checkpoint.resizable_recipes


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject values out of range.

    Raises:
        ConfigError: a value out of range, eval images without annotations (or the reverse), a shared section's
            value (`cookbook.config.check_run`), or no pycocotools with an evaluation set (it scores the mAP).
    """
    for key in ("train_images", "train_annotations", "eval_images", "eval_annotations"):
        setattr(cfg.data, key, resolve_path(getattr(cfg.data, key), config_dir))
    if bool(cfg.data.eval_images) != bool(cfg.data.eval_annotations):
        raise ConfigError("data.eval_images and data.eval_annotations: give both, or neither (no evaluation)")
    if cfg.data.eval_annotations:  # coco_map's COCOeval, imported at the first evaluation
        config.require("pycocotools", REQUIREMENTS)
    config.check_run(cfg)
    check_fields(
        cfg,
        at_least={
            "model.min_size": 32,
            "model.max_size": 32,
            "model.fpn_channels": 8,
            "data.num_workers": 0,
            "data.eval_batch_size": 1,
        },
        one_of={
            "model.arch": ARCHS,
            "model.weights": ("coco", "imagenet", "none"),
            "model.trainable_backbone_layers": range(6),
        },
        within={"data.hflip_prob": "[0, 1]"},
    )
    if cfg.model.max_size < cfg.model.min_size:
        raise ConfigError(f"model.max_size ({cfg.model.max_size}) must be >= model.min_size ({cfg.model.min_size})")


# ----------------------------------------------------------------------------- data
def _field(obj: dict, key: str, where: str):
    if key not in obj:
        raise DataError(f"{where}: field '{key}' is missing")
    return obj[key]


def _int_field(obj: dict, key: str, where: str, default: int | None = None) -> int:
    """`obj[key]` as an int: an integer, or a float with no fraction (``3.0``, as some exporters write ids);
    `default` where the key is absent or null, if given."""
    value = obj.get(key) if default is not None else _field(obj, key, where)
    if value is None and default is not None:
        return default
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not INT64[0] <= value <= INT64[1]:
        shown = repr(value) if len(repr(value)) <= 40 else f"a {len(str(abs(value)))}-digit integer"
        raise DataError(
            f"{where}: field '{key}' must be an integer{' of 64 bits' if type(value) is int else ''}, got {shown}"
        )
    return value


def load_coco(
    images_dir: str, annotations: str, field_name: str, resize: tuple[int, int] | None = None
) -> tuple[list[dict], list[dict]]:
    """Read and check a COCO-format detection set.

    Args:
        images_dir: the folder the ``file_name`` of each image is relative to.
        annotations: the ``instances.json`` path.
        field_name: the config key of `annotations` (``data.train_annotations``), for messages.
        resize: ``(model.min_size, model.max_size)`` for a training set: each non-crowd box is also checked as
            training sees it (`_as_trained`: clipped, flipped or not, resized in float32), where torchvision
            refuses a box of zero width or height.

    Returns:
        ``(records, categories)``: one record per image, by increasing image id, with ``image_id``, ``path``,
        ``width``, ``height``, ``boxes`` (list of ``[x1, y1, x2, y2]`` pixels), ``labels`` (1..K, the rank of
        the category id) and ``iscrowd``; ``categories`` as in the file, by increasing id.

    Raises:
        DataError: one line naming the file, the field and the image or annotation index and id: a missing file,
            invalid JSON, a missing section or field, an entry that is not an object, an id that is not an integer (a float
            with no fraction, ``3.0``, is taken as one), an ``iscrowd`` other than 0 or 1,
            a duplicate id, an unknown image or category id, a bbox that is not 4 numbers, has a width or height
            <= 0, lies outside its image or (with `resize`) has none left once clipped and resized, a missing
            image file.
    """
    path = Path(annotations)
    if not path.is_file():
        raise DataError(f"{field_name}: {not_a_file(annotations)}")
    if not Path(images_dir).is_dir():
        raise DataError(f"{field_name.replace('annotations', 'images')}: not a folder: {images_dir}")
    try:
        coco = json.loads(path.read_text(encoding="utf-8-sig"))  # utf-8-sig: a BOM is accepted
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(coco, dict):
        raise DataError(f"{path}: the top level must be an object with images, annotations, categories")
    for section in ("images", "annotations", "categories"):
        if not isinstance(_field(coco, section, str(path)), list):
            raise DataError(f"{path}: field '{section}' must be a list")
        for i, entry in enumerate(coco[section]):
            if not isinstance(entry, dict):
                raise DataError(f"{path}: {section}[{i}] must be an object, got {entry!r}")
    categories = {}
    for i, cat in enumerate(coco["categories"]):
        cid = _int_field(cat, "id", f"{path}: categories[{i}]")
        categories[cid] = cat
    labels = {cid: rank + 1 for rank, cid in enumerate(sorted(categories))}
    images = {}
    for i, img in enumerate(coco["images"]):
        where = f"{path}: images[{i}]"
        iid = _int_field(img, "id", where)
        if iid in images:
            raise DataError(f"{where}: duplicate image id {iid}")
        w, h = _int_field(img, "width", f"{where} (id {iid})"), _int_field(img, "height", f"{where} (id {iid})")
        name = _field(img, "file_name", f"{where} (id {iid})")
        if not isinstance(name, str) or not name:
            raise DataError(f"{where} (id {iid}): field 'file_name' must be a file name, got {name!r}")
        file = Path(images_dir) / name
        if not file.is_file():
            raise DataError(f"{where} (id {iid}): field 'file_name': image file not found: {file}")
        images[iid] = {
            "image_id": iid,
            "path": str(file),
            "width": w,
            "height": h,
            "boxes": [],
            "labels": [],
            "iscrowd": [],
        }
    seen = set()
    for i, ann in enumerate(coco["annotations"]):
        where = f"{path}: annotations[{i}]"
        aid = _int_field(ann, "id", where)
        where = f"{where} (annotation id {aid})"
        if aid in seen:
            raise DataError(f"{where}: duplicate annotation id")
        seen.add(aid)
        iid, cid = _int_field(ann, "image_id", where), _int_field(ann, "category_id", where)
        if iid not in images:
            raise DataError(f"{where}: field 'image_id': unknown image id {iid}")
        if cid not in categories:
            raise DataError(
                f"{where}: field 'category_id': unknown category id {cid} (categories: {sorted(categories)})"
            )
        box = _field(ann, "bbox", where)
        if (
            not isinstance(box, list)
            or len(box) != 4
            or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in box)
        ):
            raise DataError(f"{where}: field 'bbox' must be 4 numbers [x, y, width, height], got {box!r}")
        x, y, w, h = box
        if w <= 0 or h <= 0:
            raise DataError(f"{where}: field 'bbox': width and height must be > 0, got {box!r}")
        img = images[iid]
        if x < -BOX_SLACK or y < -BOX_SLACK or x + w > img["width"] + BOX_SLACK or y + h > img["height"] + BOX_SLACK:
            raise DataError(
                f"{where}: field 'bbox' {box!r} lies outside its image {iid} ({img['width']} x {img['height']} pixels)"
            )
        clipped = [max(x, 0.0), max(y, 0.0), min(x + w, img["width"]), min(y + h, img["height"])]
        crowd = _int_field(ann, "iscrowd", where, default=0)
        if crowd not in (0, 1):
            raise DataError(f"{where}: field 'iscrowd' must be 0 or 1, got {ann['iscrowd']!r}")
        if resize is not None and crowd == 0:  # crowd boxes never reach the loss
            trained, size = _as_trained(clipped, img["width"], img["height"], *resize)
            if any(b[2] <= b[0] or b[3] <= b[1] for b in trained):
                raise DataError(
                    f"{where}: field 'bbox' {box!r} is {clipped[2] - clipped[0]:g} x "
                    f"{clipped[3] - clipped[1]:g} pixels once clipped to its image {iid} ({img['width']} "
                    f"x {img['height']}) and {trained[0][2] - trained[0][0]:g} x {trained[0][3] - trained[0][1]:g} "
                    f"resized to {size[1]} x {size[0]} (model.min_size / max_size): training would see "
                    f"a box without area, which torchvision refuses; fix or remove the annotation"
                )
        img["boxes"].append(clipped)
        img["labels"].append(labels[cid])
        img["iscrowd"].append(crowd)
    return [images[k] for k in sorted(images)], [categories[k] for k in sorted(categories)]


def _as_trained(
    box: list[float], width: int, height: int, min_size: int, max_size: int
) -> tuple[list[list[float]], tuple[int, int]]:
    """A clipped ``[x1, y1, x2, y2]`` box as training hands it to torchvision's RetinaNet: in float32, as is and
    flipped (`CocoDetection`), then resized as ``GeneralizedRCNNTransform`` resizes (scale ``min(min_size /
    shorter side, max_size / longer side)``, image ``floor(side x scale)``, box x new / old side in float32).

    Returns:
        ``([box, flipped box], (new height, new width))``.
    """
    scale = min(min_size / min(height, width), max_size / max(height, width))
    new = (math.floor(height * scale), math.floor(width * scale))
    b = torch.tensor([box], dtype=torch.float32)
    flipped = torch.stack([width - b[:, 2], b[:, 1], width - b[:, 0], b[:, 3]], 1)
    ratio_w = torch.tensor(new[1], dtype=torch.float32) / torch.tensor(width, dtype=torch.float32)
    ratio_h = torch.tensor(new[0], dtype=torch.float32) / torch.tensor(height, dtype=torch.float32)
    ratio = torch.stack([ratio_w, ratio_h, ratio_w, ratio_h])
    return [(v * ratio).reshape(4).tolist() for v in (b, flipped)], new


def _same_categories(train: list[dict], other: list[dict], field_name: str) -> None:
    if [c["id"] for c in train] != [c["id"] for c in other]:
        raise DataError(
            f"{field_name}: its category ids {[c['id'] for c in other]} differ from the training set's "
            f"{[c['id'] for c in train]}"
        )


class DetectionBatch:
    """A list of images (3, H, W) float in [0, 1] and their targets (``boxes`` (N, 4) xyxy pixels, ``labels`` (N,)
    int64, ``image_id``), as torchvision's detection models take them; ``.to`` and ``.pin_memory`` for the loader."""

    def __init__(self, images: list[torch.Tensor], targets: list[dict]):
        self.images, self.targets = images, targets

    def to(self, device, non_blocking: bool = False) -> "DetectionBatch":
        move = lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t
        return DetectionBatch(
            [move(i) for i in self.images], [{k: move(v) for k, v in t.items()} for t in self.targets]
        )

    def pin_memory(self) -> "DetectionBatch":
        pin = lambda t: t.pin_memory() if isinstance(t, torch.Tensor) else t
        return DetectionBatch([pin(i) for i in self.images], [{k: pin(v) for k, v in t.items()} for t in self.targets])

    def __len__(self) -> int:
        return len(self.images)


def collate(samples: list[tuple[torch.Tensor, dict]]) -> DetectionBatch:
    return DetectionBatch([s[0] for s in samples], [s[1] for s in samples])


class CocoDetection(Dataset):
    """Images of `records` (`load_coco`) as (image, target); training drops crowd boxes and flips horizontally with
    probability `hflip_prob`, decided by (seed, epoch, index) alone, so any worker count gives the same batches."""

    def __init__(self, records: list[dict], train: bool, hflip_prob: float = 0.0, seed: int = 0):
        self.records, self.train, self.hflip_prob, self.seed, self.epoch = records, train, hflip_prob, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict]:
        rec = self.records[index]
        with Image.open(rec["path"]) as im:
            if im.size != (rec["width"], rec["height"]):
                raise DataError(
                    f"{rec['path']}: the image is {im.size[0]} x {im.size[1]} pixels but its entry "
                    f"(image id {rec['image_id']}) says {rec['width']} x {rec['height']}"
                )
            image = torch.frombuffer(bytearray(im.convert("RGB").tobytes()), dtype=torch.uint8)
        image = image.view(rec["height"], rec["width"], 3).permute(2, 0, 1).float().div_(255)
        boxes = torch.tensor(rec["boxes"], dtype=torch.float32).reshape(-1, 4)
        labels = torch.tensor(rec["labels"], dtype=torch.int64)
        crowd = torch.tensor(rec["iscrowd"], dtype=torch.int64)
        if self.train:
            keep = crowd == 0
            boxes, labels = boxes[keep], labels[keep]
            g = torch.Generator().manual_seed((self.seed * 1_000_003 + self.epoch) * 1_000_003 + index)
            if torch.rand((), generator=g).item() < self.hflip_prob:
                image = image.flip(-1)
                boxes = torch.stack(
                    [rec["width"] - boxes[:, 2], boxes[:, 1], rec["width"] - boxes[:, 0], boxes[:, 3]], 1
                )
            return image, {"boxes": boxes, "labels": labels, "image_id": rec["image_id"]}
        return image, {"boxes": boxes, "labels": labels, "iscrowd": crowd, "image_id": rec["image_id"]}


# ----------------------------------------------------------------------------- model
def build_model(cfg: ModelConfig, num_classes: int, log) -> torch.nn.Module:
    """RetinaNet for `num_classes` labels (1..K; 0 unused, as in torchvision's COCO model).

    ``weights=coco`` loads torchvision's COCO detector and rebuilds its classification head for `num_classes`;
    when the weights cannot be fetched it falls back to the ImageNet backbone, then to random init (logged).
    """
    from torchvision.models import ResNet18_Weights, ResNet50_Weights, resnet18
    from torchvision.models.detection import retinanet as tv_retinanet
    from torchvision.models.detection.backbone_utils import BackboneWithFPN
    from torchvision.ops.feature_pyramid_network import LastLevelP6P7

    size = dict(min_size=cfg.min_size, max_size=cfg.max_size)
    if cfg.arch == "retinanet_resnet18_fpn":  # small twin: ResNet-18 + FPN through torchvision's RetinaNet class
        weights = ResNet18_Weights.IMAGENET1K_V1 if cfg.weights != "none" else None
        backbone = _try(log, "ImageNet ResNet-18", lambda: resnet18(weights=weights)) if weights else None
        pretrained = backbone is not None
        backbone = backbone or resnet18(norm_layer=partial(torch.nn.GroupNorm, 8))
        if pretrained:  # train only the last model.trainable_backbone_layers stages, as torchvision does
            stages = ["layer4", "layer3", "layer2", "layer1", "conv1"][: cfg.trainable_backbone_layers]
            for name, p in backbone.named_parameters():
                p.requires_grad_(any(name.startswith(s) for s in stages))
        backbone = BackboneWithFPN(
            backbone,
            {"layer2": "0", "layer3": "1", "layer4": "2"},
            [128, 256, 512],
            cfg.fpn_channels,
            extra_blocks=LastLevelP6P7(cfg.fpn_channels, cfg.fpn_channels),
        )
        return tv_retinanet.RetinaNet(backbone, num_classes, **size)
    builder = getattr(tv_retinanet, cfg.arch)
    v2 = cfg.arch.endswith("_v2")
    det_weights = (
        tv_retinanet.RetinaNet_ResNet50_FPN_V2_Weights if v2 else tv_retinanet.RetinaNet_ResNet50_FPN_Weights
    ).COCO_V1
    bb_weights = ResNet50_Weights.IMAGENET1K_V2 if v2 else ResNet50_Weights.IMAGENET1K_V1
    tbl = cfg.trainable_backbone_layers
    model = None
    if cfg.weights == "coco":
        model = _try(log, "COCO RetinaNet", lambda: builder(weights=det_weights, trainable_backbone_layers=tbl, **size))
        if model is not None:  # a new classification head for this data set's categories
            head = model.head.classification_head
            norm = partial(torch.nn.GroupNorm, 32) if v2 else None
            model.head.classification_head = tv_retinanet.RetinaNetClassificationHead(
                model.backbone.out_channels, head.num_anchors, num_classes, **({"norm_layer": norm} if norm else {})
            )
            return model
    if cfg.weights in ("coco", "imagenet"):
        model = _try(
            log,
            "ImageNet ResNet-50",
            lambda: builder(
                weights=None,
                weights_backbone=bb_weights,
                num_classes=num_classes,
                trainable_backbone_layers=tbl,
                **size,
            ),
        )
    if model is None:
        log.info("model: random init (no pretrained weights)")
        model = builder(weights=None, weights_backbone=None, num_classes=num_classes, **size)
    return model


def _try(log, what: str, build):
    """`build()`, or None when its weights cannot be downloaded (no network, no cache); the fallback is logged."""
    try:
        model = build()
        log.info(f"model: {what} weights loaded")
        return model
    except (OSError, RuntimeError, ValueError) as exc:  # URLError is an OSError; a partial download a RuntimeError
        log.warning(
            f"model: {what} weights not reachable ({type(exc).__name__}: {str(exc).splitlines()[0][:120]}); "
            f"falling back"
        )
        return None


def _load_weights_rank0_first(info, build):
    """Rank 0 downloads (or reads the cache) first; the others then read the cache."""
    if info.rank != 0:
        cookbook.barrier()
    out = build()
    if info.rank == 0:
        cookbook.barrier()
    return out


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, autocast) -> dict[str, float]:
    """mAP@[.5:.95] (``map``) and mAP@.5 (``map_50``) over every rank's shard of the evaluation set.

    Each rank detects on its shard; the detections and targets are gathered to rank 0 and scored there in
    image-id order by pycocotools' COCOeval (`coco_map`), so the result equals one process scoring the whole
    set; rank 0 sends it to the others. Returns also ``images`` (the count scored).
    """
    model.eval()
    local = []
    for batch in loader:
        batch = batch.to(device, non_blocking=True)
        with autocast():
            outputs = model(batch.images)
        for out, tgt in zip(outputs, batch.targets):
            local.append(
                (
                    tgt["image_id"],
                    {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in out.items()},
                    {k: tgt[k].cpu() for k in ("boxes", "labels", "iscrowd")},
                )
            )
    model.train()
    gathered = [None] * dist.get_world_size() if dist.is_initialized() else [local]
    if dist.is_initialized():
        dist.gather_object(local, gathered if dist.get_rank() == 0 else None, dst=0)
    result = [None]
    if not dist.is_initialized() or dist.get_rank() == 0:
        items = sorted((x for part in gathered for x in part), key=lambda x: x[0])
        result = [{**coco_map(items), "images": float(len(items))}]
    if dist.is_initialized():
        dist.broadcast_object_list(result, src=0)
    return result[0]


def coco_map(items: list[tuple[int, dict, dict]]) -> dict[str, float]:
    """``{"map": mAP@[.5:.95], "map_50": mAP@.5}`` of detections against targets, by pycocotools' COCOeval itself.

    Args:
        items: ``(image_id, detections, targets)`` per image: detections ``boxes`` (N, 4) xyxy pixels,
            ``scores`` (N,), ``labels`` (N,); targets ``boxes``, ``labels``, ``iscrowd`` (M,). An image may have
            no target (it still counts its false positives) and targets may be crowd regions (COCOeval ignores
            detections matched to them).

    Boxes go in as COCO ``[x, y, width, height]``, a target's ``area`` is its box's. torchmetrics'
    MeanAveragePrecision differs from COCOeval on such sets (its recall thresholds are float32: 0.124046 against
    0.124764 on a crowd / empty-image set). -1 where no category has a non-crowd target (COCOeval's "absent"); 0
    where there are targets and no detection.
    """
    import io

    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(boxes: torch.Tensor) -> list[list[float]]:
        return [[x1, y1, x2 - x1, y2 - y1] for x1, y1, x2, y2 in boxes.double().tolist()]

    images, gts, dts, cats = [], [], [], set()
    for iid, det, tgt in items:
        images.append({"id": int(iid)})
        for box, label, crowd in zip(xywh(tgt["boxes"]), tgt["labels"].tolist(), tgt["iscrowd"].tolist()):
            gts.append(
                {
                    "id": len(gts) + 1,
                    "image_id": int(iid),
                    "category_id": label,
                    "bbox": box,
                    "area": box[2] * box[3],
                    "iscrowd": crowd,
                }
            )
            cats.add(label)
        for box, label, score in zip(xywh(det["boxes"]), det["labels"].tolist(), det["scores"].double().tolist()):
            dts.append({"image_id": int(iid), "category_id": label, "bbox": box, "score": score})
            cats.add(label)
    if not any(g["iscrowd"] == 0 for g in gts):
        return {"map": -1.0, "map_50": -1.0}
    if not dts:
        return {"map": 0.0, "map_50": 0.0}
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and the summary table
        gt = COCO()
        gt.dataset = {"images": images, "annotations": gts, "categories": [{"id": c} for c in sorted(cats)]}
        gt.createIndex()
        coco_eval = COCOeval(gt, gt.loadRes(dts), iouType="bbox")
        coco_eval.evaluate()
        coco_eval.accumulate()
        coco_eval.summarize()
    return {"map": float(coco_eval.stats[0]), "map_50": float(coco_eval.stats[1])}


# ----------------------------------------------------------------------------- recipe
def preflight(cfg: Config, world_size: int) -> str:
    """What ``--check`` runs in one process before torchrun starts any worker (launch.sh); returns what the data holds."""
    train, cats = load_coco(
        cfg.data.train_images,
        cfg.data.train_annotations,
        "data.train_annotations",
        (cfg.model.min_size, cfg.model.max_size),
    )  # boxes as training sees them
    n_eval = 0
    if cfg.data.eval_annotations:
        evals, eval_cats = load_coco(cfg.data.eval_images, cfg.data.eval_annotations, "data.eval_annotations")
        _same_categories(cats, eval_cats, "data.eval_annotations")
        n_eval = len(evals)
    per_step = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
    if len(train) < per_step:
        raise ConfigError(
            f"the training set ({len(train)} images) is too small for one step of "
            f"{cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {world_size} images"
        )
    Checkpointer(Path(cfg.output_dir) / "checkpoints", resizable=RESIZABLE).check_resume(
        cfg.checkpoint.resume, world_size, to_dict(cfg), MAY_CHANGE, cfg.train.stop_at_step
    )
    return f"{len(train)} train / {n_eval} eval images, {len(cats)} categories"


def load(path: str, overrides: list[str]) -> Config:
    # First: transformers (check_config's scheduler names, get_scheduler) imports torchvision wherever it is installed,
    # and one built for another torch (PyPI's wheel beside the CPU torch) fails there in a chain of tracebacks.
    config.require("torchvision", REQUIREMENTS, torch_build=True)
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


@cookbook.cli(load, preflight)  # --check: preflight
def main(cfg: Config) -> None:
    # ---- set-up
    info = cookbook.init_distributed(cfg.train.collective_timeout_s, debug_dir=Path(cfg.output_dir) / "debug")
    log = cookbook.get_logger()
    out_dir = Path(cfg.output_dir)
    torch.manual_seed(cfg.train.seed)
    use_bf16 = info.device.type == "cuda" and cfg.train.mixed_precision == "bf16"
    autocast = partial(torch.autocast, info.device.type, dtype=torch.bfloat16, enabled=use_bf16)
    train_records, categories = load_coco(
        cfg.data.train_images,
        cfg.data.train_annotations,
        "data.train_annotations",
        (cfg.model.min_size, cfg.model.max_size),
    )
    train_ds = CocoDetection(train_records, train=True, hflip_prob=cfg.data.hflip_prob, seed=cfg.train.seed)
    sampler = ResizableSampler(
        train_ds, num_replicas=info.world_size, rank=info.rank, shuffle=True, seed=cfg.train.seed, drop_last=True
    )
    # Loader processes start afresh each epoch (not persistent): the flips depend on the epoch, which set_epoch
    # sets on the data set in this process, and only workers started after it see it (persistent ones would flip
    # every epoch as the first one).
    loader_kw = dict(
        collate_fn=collate,
        num_workers=cfg.data.num_workers,
        pin_memory=info.device.type == "cuda",
        persistent_workers=False,
    )
    train_loader = StatefulDataLoader(
        train_ds, batch_size=cfg.train.micro_batch_size, sampler=sampler, drop_last=True, **loader_kw
    )
    eval_loader = None
    if cfg.data.eval_annotations:
        eval_records, eval_cats = load_coco(cfg.data.eval_images, cfg.data.eval_annotations, "data.eval_annotations")
        _same_categories(categories, eval_cats, "data.eval_annotations")
        eval_ds = CocoDetection(eval_records, train=False)
        # Each rank evaluates a disjoint slice; no image is duplicated to even out the shards.
        eval_shard = Subset(eval_ds, range(info.rank, len(eval_ds), info.world_size))
        eval_loader = StatefulDataLoader(eval_shard, batch_size=cfg.data.eval_batch_size, **loader_kw)

    steps_per_epoch = len(train_loader) // cfg.train.grad_accum_steps
    if steps_per_epoch == 0:
        raise ConfigError(
            f"the training set ({len(train_ds)} images) is too small for one step of "
            f"{cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} x {info.world_size} images"
        )
    max_steps = cfg.train.max_steps if cfg.train.max_steps > 0 else cfg.train.epochs * steps_per_epoch

    model = _load_weights_rank0_first(info, lambda: build_model(cfg.model, len(categories) + 1, log)).to(info.device)
    n_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    # DDP broadcasts rank 0's parameters: every rank starts from the same weights, pretrained or not.
    model = DDP(model, device_ids=[info.local_rank] if info.device.type == "cuda" else None)

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer, scheduler = build_optimizer(
        cfg.optim, params, max_steps, fused=info.device.type == "cuda", decay_1d=False
    )

    global_batch = cfg.train.micro_batch_size * cfg.train.grad_accum_steps * info.world_size
    run_eval = (lambda: evaluate(model.module, eval_loader, info.device, autocast)) if eval_loader is not None else None

    def set_epoch(epoch: int) -> None:
        sampler.set_epoch(epoch)
        train_ds.set_epoch(epoch)  # the flips of this pass

    with Run(
        cfg,
        info,
        app=ModelOptimizerState(model, optimizer),
        scheduler=scheduler,
        loader=train_loader,
        set_epoch=set_epoch,
        may_change=MAY_CHANGE,
        max_steps=max_steps,
        experiment="retinanet-ddp",
        final=out_dir / "final",
        count_tokens=False,
        evaluate=run_eval,
    ) as run:
        run.say(
            f"world size {info.world_size} ({info.backend}, {info.device.type}) | {cfg.model.arch} "
            f"{n_params / 1e6:.1f} M trainable params | {len(categories)} categories | global batch {global_batch} "
            f"images = {cfg.train.micro_batch_size} x {cfg.train.grad_accum_steps} accumulation x {info.world_size} "
            f"ranks | {len(train_ds)} train images | {max_steps} steps ({steps_per_epoch}/epoch) | precision "
            f"{'bf16 autocast' if use_bf16 else 'fp32'}"
        )
        if run_eval is not None and cfg.train.eval_at_start and run.state.step == 0:
            run.metrics.log_eval(0, run_eval())

        # ---- train loop
        for _ in run.steps():
            optimizer.zero_grad(set_to_none=True)  # also drops a skipped step's gradients
            micro_batches, waits = run.take(cfg.train.grad_accum_steps)
            step_loss = torch.zeros((), device=info.device)
            for i, (batch, wait) in enumerate(zip(micro_batches, waits)):
                # Skip DDP's gradient all-reduce on all but the last micro-batch of a step.
                with model.no_sync() if i < len(micro_batches) - 1 else contextlib.nullcontext():
                    with autocast():
                        losses = model(batch.images, batch.targets)  # focal classification + box regression
                    loss = (losses["classification"] + losses["bbox_regression"]).float() / cfg.train.grad_accum_steps
                    loss.backward()
                step_loss += loss.detach()
                run.metrics.add(samples=len(batch), tokens=0, data_wait_s=wait)
            grad_norm = torch.nn.utils.clip_grad_norm_(  # max_grad_norm 0: no clipping, but the norm is checked
                params, cfg.optim.max_grad_norm if cfg.optim.max_grad_norm > 0 else float("inf")
            )
            if run.skip_step(grad_norm):
                continue  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the step is dropped
            lr = scheduler.get_last_lr()[0]
            optimizer.step()
            scheduler.step()
            run.end_step(step_loss, lr=lr, grad_norm=grad_norm)

        # ---- save
        run.finish(
            export=lambda: {
                "export_dir": (
                    export(model.module, out_dir / "final", cfg, categories, info),
                    "train.build_model + load_state_dict(torch.load('model.pt'))",
                )
            },
            summary=lambda: {
                "param_fingerprints": cookbook.all_gather_object(cookbook.param_fingerprint(model.module))
            },
        )

    # ---- clean-up
    cookbook.destroy_distributed()


def export(model: torch.nn.Module, folder: Path, cfg: Config, categories: list[dict], info) -> Path:
    """Rank 0 writes ``model.pt`` (state dict), ``categories.json`` (label k = categories[k - 1]) and
    ``model.json`` (the model section); collective."""
    if info.is_main:
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        torch.save({k: v.cpu() for k, v in model.state_dict().items()}, tmp / "model.pt")
        (tmp / "categories.json").write_text(json.dumps(categories, indent=1))
        (tmp / "model.json").write_text(json.dumps(to_dict(cfg)["model"], indent=1))
        cookbook.checkpoint.publish(tmp, folder)
    cookbook.barrier()
    return folder


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, DataError, CheckpointError))
