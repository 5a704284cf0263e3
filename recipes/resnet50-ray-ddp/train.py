"""Fine-tune ResNet-50 for image classification with Ray Train (TorchTrainer, one DDP worker per GPU).

Commands (from this folder):

    ./launch.sh                                                    # Imagenette from the hub, all GPUs of this node
    ./launch.sh data.train_dir=/data/hymenoptera_data/train        # any ImageFolder layout (class/image.jpg)
    CONFIG_FILE=tiny.yaml ./launch.sh                              # tiny ResNet and generated images, CPU, offline
    NNODES=2 NODE_RANK=0 MASTER_ADDR=10.0.0.1 ./launch.sh          # on each node, with its NODE_RANK
    RAY_ADDRESS=10.0.0.1:6379 ./launch.sh                          # an existing Ray cluster

``train_loop`` runs on every Ray worker (``prepare_model``, ``prepare_data_loader``, epochs, a checkpoint each
epoch through ``ray.train.report``); ``main`` is the driver. What it supports (data, GPU decoding, resume,
preemption): README.md beside this file.
"""

from __future__ import annotations

import contextlib
import io
import math
import random
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

warnings.filterwarnings("ignore", message=".*set_vital.*")

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import DataLoader, Dataset

import cookbook
from cookbook import ray_train
from cookbook.checkpoint import CheckpointError
from cookbook.config import ConfigError, check_fields, load_config
from cookbook.hub import resolve_path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # ImageNet, what the pretrained weights expect


# ----------------------------------------------------------------------------- config
@dataclass
class ModelConfig:
    backend: str = "auto"  # auto (torchvision if it imports, else transformers), torchvision, transformers
    name_or_path: str = "microsoft/resnet-50"  # transformers backend: hub id or local folder (config.json)
    pretrained: bool = True  # ImageNet weights when reachable, else random init (logged)


@dataclass
class DataConfig:
    train_dir: str = ""  # ImageFolder layout: <dir>/<class>/<image>; empty: hub_id
    val_dir: str = ""  # same layout and classes; empty: hold out val_fraction of train
    hub_id: str = "frgfm/imagenette"
    hub_config: str = "320px"
    val_fraction: float = 0.1
    image_size: int = 224
    num_workers: int = 8  # data-loader processes per Ray worker (JPEG decoding)
    verify_images: bool = True  # decode every file once before training; a bad one stops the run, named
    decode: str = "cpu"  # training images: cpu (PIL in the loader processes) or gpu (nvJPEG on the worker's GPU)


@dataclass
class OptimConfig:
    lr: float = 0.1  # for a global batch of 256; scaled linearly with the global batch
    momentum: float = 0.9
    weight_decay: float = 1e-4
    warmup_epochs: float = 1.0
    label_smoothing: float = 0.1
    max_grad_norm: float = 0.0  # 0: no clipping


@dataclass
class TrainConfig(ray_train.EpochTrainConfig):  # on_nonfinite, max_consecutive_skips: cookbook.ray_train's
    seed: int = 42
    micro_batch_size: int = 128  # images per worker per step
    epochs: int = 10
    stop_at_epoch: int = -1  # > 0: stop after this epoch's checkpoint; re-run to continue
    mixed_precision: str = "bf16"  # bf16 (GPU only) or fp32
    channels_last: bool = True  # GPU only
    log_every: int = 10


@dataclass
class Config(ray_train.EpochRunConfig):  # output_dir, run_name, mlflow, ray, checkpoint: cookbook.ray_train's
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)


# Settings that may differ between a checkpoint and the run that resumes it; any other change is refused.
MAY_CHANGE = (*ray_train.EPOCH_MAY_CHANGE, "data.num_workers", "data.verify_images", "data.decode")


def check_config(cfg: Config, config_dir: Path) -> None:
    """Resolve paths against the config file's folder and reject incompatible values."""
    cfg.data.train_dir = resolve_path(cfg.data.train_dir, config_dir)
    cfg.data.val_dir = resolve_path(cfg.data.val_dir, config_dir)
    cfg.model.name_or_path = resolve_path(cfg.model.name_or_path, config_dir)
    cfg.output_dir = str(Path(cfg.output_dir).expanduser().resolve())  # workers may start elsewhere
    check_fields(
        cfg,
        at_least={
            "train.micro_batch_size": 1,
            "train.epochs": 1,
            "train.log_every": 1,
            "data.image_size": 1,
            "data.num_workers": 0,
            "optim.momentum": 0,
            "optim.weight_decay": 0,
            "optim.warmup_epochs": 0,
            "optim.max_grad_norm": 0,
        },
        one_of={
            "model.backend": ("auto", "torchvision", "transformers"),
            "train.mixed_precision": ("bf16", "fp32"),
            "data.decode": ("cpu", "gpu"),
        },
        within={"optim.lr": "(0, inf)", "optim.label_smoothing": "[0, 1]"},
    )
    if cfg.data.val_dir and not cfg.data.train_dir:
        raise ConfigError("data.val_dir is set but data.train_dir is empty")
    if not cfg.data.val_dir and not 0.0 < cfg.data.val_fraction < 1.0:
        raise ConfigError(f"data.val_fraction must be in (0, 1) without data.val_dir, got {cfg.data.val_fraction}")


# ----------------------------------------------------------------------------- data
class DataError(ValueError):
    """An image folder or file is unusable; the message names it."""


def list_image_folder(
    root: str, classes: list[str] | None = None, ignored: list[str] | None = None
) -> tuple[list[tuple[str, int]], list[str]]:
    """``(samples, classes)`` of an ImageFolder tree: one sub-folder per class (sorted names ->
    labels 0..n-1), image files inside at any depth, by extension (`IMAGE_EXTENSIONS`, any case).
    Hidden files and folders (name starting with ``.``, such as ``.DS_Store`` and the ``._x.jpg``
    files macOS leaves on other file systems), files of other extensions and files beside the
    class folders are left out.

    Args:
        root: the folder.
        classes: the training set's classes, for a validation folder (must be the same).
        ignored: when given, the paths of the files left out are appended to it.

    Raises:
        DataError: the folder is missing, has fewer than two class folders, a class folder holds
            no image, or its classes differ from `classes`.
    """
    path = Path(root)
    if not path.is_dir():
        raise DataError(f"image folder not found: {root}")
    found = sorted(d.name for d in path.iterdir() if d.is_dir() and not d.name.startswith("."))
    if classes is not None and found != classes:
        raise DataError(f"{root}: class folders {found} differ from the training classes {classes}")
    if len(found) < 2:
        raise DataError(f"{root}: expected one sub-folder per class (at least 2), found {found}")
    samples, left_out = [], sorted(p for p in path.iterdir() if p.is_file())
    for label, name in enumerate(found):
        files = []
        for p in sorted(p for p in (path / name).rglob("*") if p.is_file()):
            hidden = any(part.startswith(".") for part in p.relative_to(path).parts)
            (files if p.suffix.lower() in IMAGE_EXTENSIONS and not hidden else left_out).append(p)
        if not files:
            raise DataError(f"{path / name}: the class folder '{name}' holds no image ({', '.join(IMAGE_EXTENSIONS)})")
        samples += [(str(p), label) for p in files]
    if ignored is not None:
        ignored += [str(p) for p in left_out]
    return samples, found


def verify_images(samples: list[tuple[str, int]], threads: int = 8) -> None:
    """Decode every image once (at reduced size for JPEG, so it is fast).

    Raises:
        DataError: naming the first undecodable files and how many there are.
    """

    def bad(path: str) -> str | None:
        try:
            with Image.open(path) as im:
                im.draft("RGB", (64, 64))
                im.convert("RGB")
            return None
        except Exception as exc:  # PIL raises several types for broken files
            return f"{path} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"

    with ThreadPoolExecutor(threads) as pool:
        failures = [b for b in pool.map(bad, [p for p, _ in samples]) if b]
    if failures:
        raise DataError(
            f"{len(failures)} image(s) cannot be decoded, e.g. {'; '.join(failures[:3])}: remove or "
            f"replace them (or set data.verify_images=false to skip this check)"
        )


def load_data(
    cfg: DataConfig, seed: int, verify: bool, ignored: list[str] | None = None
) -> tuple[object, object, list[str]]:
    """Train and validation samples and the class names: ``[(path, label)]`` lists for folders, or
    Hugging Face ``Dataset`` splits with ``image``/``label`` columns for ``hub_id``.

    Args:
        verify: decode every image once (`verify_images`).
        ignored: when given, the files of the folders that are not taken as images are appended
            to it (see `list_image_folder`).
    """
    if not cfg.train_dir:
        import datasets

        hub = datasets.load_dataset(cfg.hub_id, cfg.hub_config or None)
        names = hub["train"].features["label"].names
        val = hub["validation"] if "validation" in hub else hub["test"]
        return hub["train"], val, names
    train, classes = list_image_folder(cfg.train_dir, ignored=ignored)
    if cfg.val_dir:
        val, _ = list_image_folder(cfg.val_dir, classes, ignored)
    else:
        order = random.Random(seed).sample(range(len(train)), len(train))
        n_val = max(1, int(len(train) * cfg.val_fraction))
        val, train = [train[i] for i in sorted(order[:n_val])], [train[i] for i in sorted(order[n_val:])]
    if verify:
        verify_images(train + val)
    return train, val, classes


def sample_crop(width: int, height: int, rng=random) -> tuple[int, int, int, int]:
    """The box ``(x, y, w, h)`` in pixels of a random resized crop of a `width` x `height` image: area
    8-100% of the image's, aspect ratio w/h log-uniform in 3/4-4/3, position uniform; after 10 draws
    that do not fit, the centred square of the short side. The draws of torchvision's
    ``RandomResizedCrop.get_params`` (Szegedy et al. 2015, "Going deeper with convolutions"; its
    fallback is a centre crop at the nearest allowed aspect ratio instead), drawn from `rng` (Python's ``random`` module, or a ``random.Random``), so both decode paths
    (`ImageTransform`, `EncodedImageDataset`) draw the same boxes from the same stream."""
    for _ in range(10):
        area = width * height * rng.uniform(0.08, 1.0)
        ratio = math.exp(rng.uniform(math.log(3 / 4), math.log(4 / 3)))
        cw, ch = round(math.sqrt(area * ratio)), round(math.sqrt(area / ratio))
        if 0 < cw <= width and 0 < ch <= height:
            return rng.randint(0, width - cw), rng.randint(0, height - ch), cw, ch
    side = min(width, height)
    return (width - side) // 2, (height - side) // 2, side, side


class ImageTransform:
    """PIL image -> uint8 tensor (3, size, size). Training: random resized crop (`sample_crop`) and
    horizontal flip (probability 0.5); evaluation: resize the short side to size / 0.875 and centre
    crop (the torchvision ImageNet recipe)."""

    def __init__(self, size: int, train: bool):
        self.size, self.train = size, train

    def __call__(self, img: Image.Image) -> torch.Tensor:
        img = img.convert("RGB")
        w, h = img.size
        if self.train:
            x, y, cw, ch = sample_crop(w, h)
            img = img.resize((self.size, self.size), Image.BILINEAR, box=(x, y, x + cw, y + ch))
            if random.random() < 0.5:
                img = img.transpose(Image.FLIP_LEFT_RIGHT)
        else:
            short = round(self.size / 0.875)
            scale = short / min(w, h)
            img = img.resize((max(short, round(w * scale)), max(short, round(h * scale))), Image.BILINEAR)
            left, top = (img.width - self.size) // 2, (img.height - self.size) // 2
            img = img.crop((left, top, left + self.size, top + self.size))
        return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1)


class ImageDataset(Dataset):
    """``(uint8 image, label)`` pairs from ``[(path, label)]`` or a Hugging Face image data set."""

    def __init__(self, samples, transform: ImageTransform):
        self.samples, self.transform = samples, transform

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if isinstance(self.samples, list):
            path, label = self.samples[i]
            try:
                with Image.open(path) as im:
                    return self.transform(im), label
            except OSError as exc:
                raise DataError(f"cannot decode {path}: {exc}") from None
        row = self.samples[i]
        return self.transform(row["image"]), int(row["label"])


class EncodedImageDataset(Dataset):
    """``data.decode=gpu``: the training samples for decoding on the GPU. Each item is ``(encoded, crop,
    label, name)``:

    - ``encoded``: a JPEG's file bytes as a 1-D uint8 tensor when the file is a JPEG in colour (YCbCr,
      PIL's mode ``RGB``), for `decode_on_device`; any other image (PNG, WebP, ..., grayscale or CMYK
      JPEGs, which nvJPEG's RGB output does not promise) decoded here with PIL and converted to RGB,
      uint8 (3, H, W), as the CPU path converts it;
    - ``crop``: int64 (5,) ``x, y, w, h, flip``: the box of `sample_crop` and the flip, drawn from
      Python's ``random`` in this loader process in the CPU path's order (`ImageTransform`), so the two
      paths draw the same boxes and flips from the same streams;
    - ``label``: int; ``name``: the file's path (or the hub row's index), for error messages.

    Only the file's header is parsed here (its size and kind), so the loader processes do little work.
    `samples` as `ImageDataset` takes them; a hub data set's ``image`` column cast with
    ``decode=False`` (``{"bytes", "path"}``). Raises `DataError` naming a file PIL cannot open."""

    def __init__(self, samples):
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor, int, str]:
        if isinstance(self.samples, list):
            name, label = self.samples[i]
            data = Path(name).read_bytes()
        else:
            row = self.samples[i]
            image, label, name = row["image"], int(row["label"]), f"row {i}"
            data = image["bytes"] if image.get("bytes") is not None else Path(image["path"]).read_bytes()
        try:
            with Image.open(io.BytesIO(data)) as im:
                w, h = im.size
                if im.format == "JPEG" and im.mode == "RGB":
                    encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
                else:
                    encoded = torch.from_numpy(np.asarray(im.convert("RGB"), dtype=np.uint8).copy()).permute(2, 0, 1)
        except OSError as exc:
            raise DataError(f"cannot decode {name}: {exc}") from None
        x, y, cw, ch = sample_crop(w, h)
        flip = random.random() < 0.5
        return encoded, torch.tensor([x, y, cw, ch, int(flip)]), label, name


def collate_encoded(
    items: list[tuple[torch.Tensor, torch.Tensor, int, str]],
) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor, list[str]]:
    """`EncodedImageDataset` items -> ``(encoded list, crops int64 (B, 5), labels int64 (B,), names)``."""
    encoded, crops, labels, names = zip(*items)
    return list(encoded), torch.stack(crops), torch.tensor(labels), list(names)


def gpu_decode_problem() -> str | None:
    """Why ``torchvision.io.decode_jpeg(device="cuda")`` cannot run here, or ``None`` when it can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import torchvision.io  # noqa: F401
    except Exception as exc:  # beside the CPU torch wheel: RuntimeError (torchvision::nms), or not installed
        return f"torchvision.io does not import ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
    if not hasattr(torch.ops.image, "decode_jpegs_cuda"):
        return "this torchvision has no nvJPEG decoder (torch.ops.image.decode_jpegs_cuda)"
    return None


def check_decode(decode: str, on_cpu: bool, here: bool = True) -> None:
    """Refuse ``data.decode=gpu`` where it cannot run; called by the driver before Ray starts and by each
    worker before its data loaders start.

    Args:
        decode: ``data.decode``.
        on_cpu: the workers will train on CPUs.
        here: the workers run on this machine, so CUDA and torchvision are checked here too (the driver on
            a cluster's head leaves that to the workers).

    Raises:
        ConfigError: one line naming ``data.decode`` and what to use instead.
    """
    if decode != "gpu":
        return
    problem = (
        "the workers train on CPUs (no GPU, ray.use_gpu=false or COOKBOOK_DEVICE=cpu)"
        if on_cpu
        else gpu_decode_problem()
        if here
        else None
    )
    if problem:
        raise ConfigError(
            f"data.decode=gpu decodes the training JPEGs with nvJPEG on the GPU, but {problem}: "
            f"set data.decode=cpu (PIL in the loader processes)"
        )


def decode_on_device(encoded: list[torch.Tensor], names: list[str], device: torch.device) -> list[torch.Tensor]:
    """Each item of `encoded` (`EncodedImageDataset`'s: 1-D uint8 JPEG bytes, or an image the loader
    decoded, uint8 (3, H, W)) as a uint8 (3, H, W) image on `device`. The JPEGs are decoded in one batched
    ``torchvision.io.decode_jpeg(..., device=device)`` call (nvJPEG, RGB, EXIF orientation not applied,
    as in the CPU path). Should nvJPEG refuse the batch (an encoding it does not handle), each of its JPEGs
    is decoded alone, those nvJPEG refuses again with PIL on this process's CPU (a warning names the
    first of them).

    Raises:
        DataError: a JPEG that PIL cannot decode either, named from `names`.
    """
    jpegs = [i for i, e in enumerate(encoded) if e.ndim == 1]
    out = [e.to(device, non_blocking=True) if e.ndim == 3 else None for e in encoded]
    if jpegs:
        from torchvision.io import ImageReadMode, decode_jpeg  # only here: it does not import beside CPU torch

        try:
            for i, image in zip(jpegs, decode_jpeg([encoded[i] for i in jpegs], mode=ImageReadMode.RGB, device=device)):
                out[i] = image
        except RuntimeError:
            for i in jpegs:
                try:
                    out[i] = decode_jpeg(encoded[i], mode=ImageReadMode.RGB, device=device)
                except RuntimeError as exc:
                    try:
                        with Image.open(io.BytesIO(encoded[i].numpy().tobytes())) as im:
                            rgb = np.asarray(im.convert("RGB"), dtype=np.uint8).copy()
                    except OSError as pil_exc:
                        raise DataError(f"cannot decode {names[i]}: {pil_exc}") from None
                    cookbook.get_logger().warning(
                        f"nvJPEG cannot decode {names[i]} ({str(exc).splitlines()[0]}); decoded with PIL on the CPU"
                    )
                    out[i] = torch.from_numpy(rgb).permute(2, 0, 1).to(device)
    return out


def random_resized_crop(images: list[torch.Tensor], crops: torch.Tensor, size: int) -> torch.Tensor:
    """Crop, resize and flip each image as `crops` say; plain torch ops on the images' device (GPU in
    training, CPU in the tests). The resize is bilinear with antialiasing (``F.interpolate(...,
    antialias=True)``, which follows PIL's filter), in float, rounded to uint8: the CPU path's
    ``Image.resize(BILINEAR, box=...)`` within rounding.

    Args:
        images: B uint8 images (3, H_i, W_i), any sizes.
        crops: int64 (B, 5): ``x, y, w, h, flip`` per image (`EncodedImageDataset`), the box inside the image.
        size: the output side S in pixels.

    Returns:
        uint8 (B, 3, S, S) on the images' device.

    Raises:
        ValueError: a box that is empty or reaches outside its image.
    """
    out = torch.empty((len(images), 3, size, size), dtype=torch.uint8, device=images[0].device)
    for i, (image, (x, y, w, h, flip)) in enumerate(zip(images, crops.tolist())):
        if not (w > 0 and h > 0 and 0 <= x <= image.shape[2] - w and 0 <= y <= image.shape[1] - h):
            raise ValueError(f"crop box x={x} y={y} w={w} h={h} does not fit image {i} of {tuple(image.shape)}")
        box = image[None, :, y : y + h, x : x + w].float()
        resized = F.interpolate(box, size=(size, size), mode="bilinear", align_corners=False, antialias=True)[0]
        out[i] = (resized.flip(-1) if flip else resized).round_().clamp_(0, 255).to(torch.uint8)
    return out


def device_batch(batch, device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A training loader's batch as ``(uint8 images (B, 3, S, S), labels (B,))`` on `device`: with
    ``data.decode=cpu`` the batch already is (Ray's loader moved it); with ``gpu`` the `collate_encoded`
    batch decoded (`decode_on_device`), cropped, resized and flipped (`random_resized_crop`) there."""
    if len(batch) == 2:
        return batch
    encoded, crops, labels, names = batch
    return (
        random_resized_crop(decode_on_device(encoded, names, device), crops, size),
        labels.to(device, non_blocking=True),
    )


def validation_shard(samples, image_size: int, rank: int, world_size: int) -> Dataset:
    """Worker `rank`'s share of the validation `samples` (as `ImageDataset` takes them): every `world_size`-th
    from `rank` on, possibly none, with the evaluation transform; the shards of all workers cover each once."""
    return torch.utils.data.Subset(
        ImageDataset(samples, ImageTransform(image_size, train=False)), range(rank, len(samples), world_size)
    )


# ----------------------------------------------------------------------------- model and step
def torchvision_available() -> bool:
    """True when torchvision imports beside this torch (it does not beside the CPU torch 2.13 wheel)."""
    try:
        import torchvision.models  # noqa: F401
    except Exception:
        return False
    return True


def build_model(cfg: ModelConfig, num_classes: int) -> torch.nn.Module:
    """ResNet-50 with a `num_classes`-way head; ImageNet weights if ``pretrained`` and reachable."""
    log = cookbook.get_logger()
    backend = cfg.backend if cfg.backend != "auto" else ("torchvision" if torchvision_available() else "transformers")
    if backend == "torchvision":
        import torchvision

        model = None
        if cfg.pretrained:
            try:
                model = torchvision.models.resnet50(weights="IMAGENET1K_V2")
            except Exception as exc:  # no network: URLError, or a hash mismatch
                log.warning(f"ImageNet weights not reachable ({type(exc).__name__}); random init")
        model = model or torchvision.models.resnet50()
        model.fc = torch.nn.Linear(model.fc.in_features, num_classes)
        return model
    from transformers import AutoConfig, ResNetConfig, ResNetForImageClassification

    if cfg.pretrained:
        try:
            return ResNetForImageClassification.from_pretrained(
                cfg.name_or_path, num_labels=num_classes, ignore_mismatched_sizes=True
            )
        except OSError as exc:
            log.warning(
                f"{cfg.name_or_path}: pretrained weights not reachable ({str(exc).splitlines()[0]}); random init"
            )
    try:
        config = AutoConfig.from_pretrained(cfg.name_or_path, num_labels=num_classes)
    except OSError:
        config = ResNetConfig(num_labels=num_classes)  # the defaults are ResNet-50
    return ResNetForImageClassification(config)


def normalize(images: torch.Tensor, channels_last: bool) -> torch.Tensor:
    """uint8 (B, 3, H, W) on the device -> float, ImageNet mean/std, optionally channels-last."""
    mean = torch.tensor(MEAN, device=images.device).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=images.device).view(1, 3, 1, 1) * 255
    x = (images.float() - mean) / std
    return x.contiguous(memory_format=torch.channels_last) if channels_last else x


def logits_of(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Logits of a torchvision model (a tensor) or a transformers one (``.logits``)."""
    out = model(x)
    return out.logits if hasattr(out, "logits") else out


def train_step(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    images: torch.Tensor,
    labels: torch.Tensor,
    bf16: bool,
    channels_last: bool,
    label_smoothing: float = 0.0,
    max_grad_norm: float = 0.0,
    skip: Callable[[torch.Tensor], bool] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """One optimizer step on a uint8 batch; returns ``(loss, correct, grad_norm)`` as device tensors
    (``grad_norm``: the total norm before clipping by `max_grad_norm` (0: none), ``None`` without clipping or
    `skip`). Also used by ``benchmarks/resnet50_ray.py`` without Ray.

    `skip` (``WorkerRun.skip_step``) checks the gradient norm before the update (a host sync); when it says
    ``True`` the gradients are dropped and no update is made, and the result is ``None``."""
    x = normalize(images, channels_last)
    with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        logits = logits_of(model, x)
    loss = F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)
    loss.backward()
    grad_norm = None  # DDP all-reduced the gradients: the norm is the same on every worker (a NaN on one: on all)
    if max_grad_norm > 0 or skip is not None:
        grad_norm = torch.nn.utils.clip_grad_norm_(
            model.parameters(), max_grad_norm if max_grad_norm > 0 else float("inf")
        )
    if skip is not None and skip(
        grad_norm
    ):  # NaN / inf: the run stops, or (train.on_nonfinite=skip) the batch is dropped
        optimizer.zero_grad(set_to_none=True)
        return None
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), (logits.argmax(-1) == labels).sum(), grad_norm


@torch.no_grad()
def sync_buffers(model: torch.nn.Module) -> None:
    """Copy rank 0's buffers (BatchNorm running mean, variance and count) to every rank; collective.

    DDP broadcasts rank 0's buffers at the start of each training forward, then every worker's
    batch updates its own copy, so after the last step the workers' statistics differ and only
    rank 0's are checkpointed. Call this before evaluating the unwrapped model so every worker
    evaluates the checkpointed weights. A no-op without a process group of several ranks."""
    if torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)


@torch.no_grad()
def evaluate(model: torch.nn.Module, loader, device: torch.device, bf16: bool, channels_last: bool) -> dict[str, float]:
    """Loss (cross-entropy, no label smoothing) and top-1 accuracy over the whole validation set,
    each worker holding a disjoint shard (possibly empty): per-worker sums of loss, correct
    predictions and images are added up across workers (``cookbook.all_reduce_sum``, the one
    collective here), so each image counts once whatever the split.

    Args:
        model: the unwrapped module (``model.module`` of DDP), not the DDP wrapper: DDP's forward
            broadcasts buffers, a collective that a worker without validation images never joins
            (the run hangs). See `sync_buffers`.
        loader: ``(uint8 images (B, 3, H, W), labels (B,))`` batches of this worker's shard.

    Returns:
        ``{"loss", "top1", "images"}``: mean loss and accuracy over all images (0 when there are
        none) and the number of images.
    """
    model.eval()
    sums = {
        "loss": torch.zeros((), device=device, dtype=torch.float64),
        "correct": torch.zeros((), device=device, dtype=torch.float64),
        "images": torch.zeros((), device=device, dtype=torch.float64),
    }
    for images, labels in loader:
        with torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
            logits = logits_of(model, normalize(images, channels_last))
        sums["loss"] += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        sums["correct"] += (logits.argmax(-1) == labels).sum()
        sums["images"] += labels.numel()
    totals = cookbook.all_reduce_sum(sums, device)
    model.train()
    n = max(totals["images"], 1.0)
    return {"loss": totals["loss"] / n, "top1": totals["correct"] / n, "images": totals["images"]}


# ----------------------------------------------------------------------------- worker
def train_loop(config_dict: dict) -> None:
    """What every Ray Train worker runs: set-up, epochs with a checkpoint each, summary."""
    import ray.train.torch

    cfg: Config = ray_train.config_from_dict(Config, config_dict)
    info = ray_train.worker_info()
    torch.manual_seed(cfg.train.seed)
    random.seed(cfg.train.seed + info.rank)
    on_gpu = info.device.type == "cuda"
    bf16 = on_gpu and cfg.train.mixed_precision == "bf16"
    channels_last = on_gpu and cfg.train.channels_last

    # ---- set-up: data, model (DDP), optimizer, resume
    check_decode(cfg.data.decode, on_cpu=not on_gpu)  # the driver checked where it planned the workers
    train_set, val_set, classes = load_data(cfg.data, cfg.train.seed, verify=False)  # the driver verified
    # Loader processes start afresh each epoch (not persistent): their augmentation streams are seeded from this
    # worker's torch stream, which checkpoints restore, so a resumed run augments as an uninterrupted one.
    loader_kw = dict(num_workers=cfg.data.num_workers, pin_memory=on_gpu)
    batch_kw = dict(batch_size=cfg.train.micro_batch_size, shuffle=True, drop_last=True, **loader_kw)
    if cfg.data.decode == "gpu":  # loaders read file bytes and draw the crops; device_batch decodes on the GPU
        if not isinstance(train_set, list):
            import datasets

            train_set = train_set.cast_column("image", datasets.Image(decode=False))
        train_loader = ray.train.torch.prepare_data_loader(
            DataLoader(EncodedImageDataset(train_set), collate_fn=collate_encoded, **{**batch_kw, "pin_memory": False}),
            move_to_device=False,
        )
    else:
        train_loader = ray.train.torch.prepare_data_loader(
            DataLoader(ImageDataset(train_set, ImageTransform(cfg.data.image_size, train=True)), **batch_kw)
        )
    val_shard = validation_shard(val_set, cfg.data.image_size, info.rank, info.world_size)
    val_loader = ray.train.torch.prepare_data_loader(
        DataLoader(val_shard, batch_size=cfg.train.micro_batch_size, **loader_kw), add_dist_sampler=False
    )
    steps_per_epoch = len(train_loader)
    if steps_per_epoch == 0:
        raise DataError(
            f"{len(train_set)} training images are too few for one step of "
            f"{cfg.train.micro_batch_size} x {info.world_size} workers"
        )
    max_steps = cfg.train.epochs * steps_per_epoch

    inner = build_model(cfg.model, len(classes)).to(info.device)
    if channels_last:
        inner = inner.to(memory_format=torch.channels_last)
    model = ray.train.torch.prepare_model(inner)  # DDP (on one worker: the model itself)
    global_batch = cfg.train.micro_batch_size * info.world_size
    lr = cfg.optim.lr * global_batch / 256
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]  # biases and batch-norm
    optimizer = torch.optim.SGD(
        [{"params": decay, "weight_decay": cfg.optim.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        momentum=cfg.optim.momentum,
        nesterov=True,
    )
    warmup = int(cfg.optim.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / max(warmup, 1)
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(max_steps - warmup, 1)))
        ),
    )
    run = ray_train.WorkerRun(
        cfg,
        info,
        "resnet50-ray",
        {"model": inner, "optimizer": optimizer, "scheduler": scheduler, "classes": classes},
        max_steps=max_steps,
        steps_per_epoch=steps_per_epoch,
        stop_at=("train.stop_at_epoch", cfg.train.stop_at_epoch),
        count_tokens=False,
        about=f"ResNet {sum(p.numel() for p in inner.parameters()) / 1e6:.1f} M params "
        f"({type(inner).__module__.split('.')[0]}) | {len(classes)} classes | {len(train_set)} "
        f"train / {len(val_set)} val images | global batch {global_batch} | lr {lr:g} | "
        f"{'bf16 autocast' if bf16 else 'fp32'}{', channels-last' if channels_last else ''}",
    )

    def evaluate_replicas() -> dict[str, float]:
        sync_buffers(inner)  # every worker evaluates the weights rank 0 checkpoints
        return evaluate(inner, val_loader, info.device, bf16, channels_last)  # not DDP: no collective per batch

    # ---- train loop: one checkpoint per epoch
    with run:
        for epoch in run.epochs():
            if info.world_size > 1:
                train_loader.sampler.set_epoch(epoch)
            for batch, wait in run.timed(train_loader):
                images, labels = device_batch(batch, info.device, cfg.data.image_size)  # data.decode=gpu: decoded here
                lr_now = scheduler.get_last_lr()[0]
                run.metrics.add(samples=labels.numel(), tokens=0, data_wait_s=wait)
                stepped = train_step(
                    model,
                    optimizer,
                    images,
                    labels,
                    bf16,
                    channels_last,
                    cfg.optim.label_smoothing,
                    cfg.optim.max_grad_norm,
                    skip=run.skip_step,
                )
                if stepped is None:  # a non-finite step dropped (train.on_nonfinite=skip): no scheduler step either
                    continue
                loss, correct, grad_norm = stepped
                scheduler.step()
                run.end_step(loss, lr=lr_now, grad_norm=grad_norm, window={"top1": correct / labels.numel()})
            run.end_epoch(evaluate_replicas)
            with run.checkpoint() as saved:  # state.pt + meta.json on rank 0 (also mid-epoch, after a stop request)
                ray.train.report(**saved)  # every worker; Ray registers checkpoint_epoch_<n> once all have reported

        # ---- summary (Ray Train destroys the process group)
        run.finish(inner)


# ----------------------------------------------------------------------------- driver
def load(path: str, overrides: list[str]) -> Config:
    cfg = load_config(Config, path, overrides)
    check_config(cfg, Path(path).resolve().parent)
    return cfg


def preflight(cfg: Config, world_size: None) -> str:
    """``--check``: the driver's checks (the driver plans the workers: no world size)."""
    return driver_checks(cfg)[1]


def driver_checks(cfg: Config) -> tuple[ray_train.RayDriver, str]:
    """The driver's checks before Ray starts (``--check`` runs them alone), the data's before the resume's; returns
    the driver and what the data holds."""
    driver = ray_train.RayDriver(cfg, ("train.stop_at_epoch", cfg.train.stop_at_epoch))  # the workers planned here
    check_decode(cfg.data.decode, driver.on_cpu, here=driver.use_gpu is not None)
    if cfg.data.train_dir:
        ignored: list[str] = []
        train, val, classes = load_data(cfg.data, cfg.train.seed, verify=cfg.data.verify_images, ignored=ignored)
        if ignored:
            print(
                f"note: {len(ignored)} file(s) in the image folders are not images by their name and are left out, "
                f"e.g. {', '.join(ignored[:3])}",
                file=sys.stderr,
            )
        if driver.workers and len(train) < cfg.train.micro_batch_size * driver.workers:
            raise ConfigError(
                f"{len(train)} training images are too few for one step of {cfg.train.micro_batch_size} "
                f"x {driver.workers} workers"
            )
        data_note = f"{len(classes)} classes, {len(train)} train / {len(val)} val images"
    else:
        data_note = f"hub data set {cfg.data.hub_id}"
    return driver.check_resume(MAY_CHANGE), data_note


@cookbook.cli(load, preflight, sized=False)  # --check: preflight
def main(cfg: Config) -> None:
    driver, _ = driver_checks(cfg)
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    # Already complete: said, exit 0. Else Ray started or joined, the workers sized; SIGTERM / SIGUSR1: a stop request.
    with driver.started(cfg.train.epochs):
        trainer = TorchTrainer(
            **driver.worker_loop(__file__),  # each worker imports this file and runs its train_loop(config)
            scaling_config=ScalingConfig(**driver.scaling),  # ray.num_workers DDP processes, one per GPU on GPUs
            run_config=RunConfig(**driver.run_options),  # output_dir, checkpoint.keep_last, ray.max_failures
        )
        driver.finish(trainer.fit())


if __name__ == "__main__":
    cookbook.run_main(main, user_errors=(ConfigError, DataError, CheckpointError))
