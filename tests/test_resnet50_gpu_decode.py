"""``data.decode=gpu`` of the ResNet Ray Train recipe, on CPU: the refusal where it cannot run, the loader items
(file bytes, crop boxes, labels) and the device-side crop + resize + flip against the CPU (PIL) path.
No Ray, no torchvision: nvJPEG itself runs only on a GPU (``benchmarks/resnet50_ray.py pipeline``)."""

import io
import random

import numpy as np
import pytest
import torch
from PIL import Image
from conftest import ROOT
from ray_cluster import recipe_module

RECIPE = ROOT / "recipes" / "resnet50-ray-ddp"


@pytest.fixture(scope="module")
def train():
    return recipe_module("resnet50-ray-ddp")


@pytest.fixture(scope="module")
def jpegs(tmp_path_factory):
    """An ImageFolder of 6 colour JPEGs of different sizes (smooth content, as photographs), a grayscale JPEG and a
    PNG; ``(samples, root)``."""
    root = tmp_path_factory.mktemp("jpegs")
    rng = np.random.default_rng(0)
    samples = []

    def smooth(w, h, *channels):
        coarse = rng.integers(0, 256, (max(h // 16, 2), max(w // 16, 2), *channels), dtype=np.uint8)
        return Image.fromarray(coarse).resize((w, h), Image.BICUBIC)

    for i, (w, h) in enumerate([(320, 240), (97, 131), (500, 375), (64, 64), (1000, 40), (211, 300)]):
        image = smooth(w, h, 3)
        path = root / ("ants" if i % 2 else "bees") / f"img_{i}.jpg"
        path.parent.mkdir(exist_ok=True)
        image.save(path, "JPEG", quality=90)
        samples.append((str(path), i % 2))
    gray, png = root / "ants" / "gray.jpg", root / "bees" / "small.png"
    smooth(70, 50).save(gray, "JPEG")
    smooth(30, 40, 3).save(png)
    return samples + [(str(gray), 1), (str(png), 0)], root


def _check(tmp_path, *overrides):
    train = recipe_module("resnet50-ray-ddp")
    train.main(["--config", str(RECIPE / "tiny.yaml"), "--check", f"output_dir={tmp_path / 'out'}", *overrides])


def test_gpu_decode_is_refused_before_ray_where_the_workers_have_no_gpu(tmp_path, monkeypatch, capsys, train):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # planned on this machine
    monkeypatch.setenv("COOKBOOK_DEVICE", "cpu")
    with pytest.raises(train.ConfigError) as err:
        _check(tmp_path, "data.decode=gpu")
    assert str(err.value) == (
        "data.decode=gpu decodes the training JPEGs with nvJPEG on the GPU, but the workers train "
        "on CPUs (no GPU, ray.use_gpu=false or COOKBOOK_DEVICE=cpu): set data.decode=cpu (PIL in "
        "the loader processes)"
    )
    assert not (tmp_path / "out").exists()
    _check(tmp_path, "data.decode=cpu")
    assert "config OK" in capsys.readouterr().out
    with pytest.raises(train.ConfigError, match=r"^data.decode must be one of 'cpu', 'gpu', got 'nvjpeg'"):
        _check(tmp_path, "data.decode=nvjpeg")
    # A worker given a GPU checks CUDA and torchvision itself; this machine has neither.
    with pytest.raises(train.ConfigError, match=r"^data.decode=gpu decodes .* but no CUDA device: set data.decode=cpu"):
        train.check_decode("gpu", on_cpu=False)
    train.check_decode("gpu", on_cpu=False, here=False)  # a cluster's head without GPUs leaves it to the workers


def test_crop_boxes_fit_and_follow_the_cpu_paths_stream(train):
    rng = random.Random(3)
    for w, h in [(500, 375), (97, 131), (1000, 40), (1, 1), (3000, 2)]:
        for _ in range(200):
            x, y, cw, ch = train.sample_crop(w, h, rng)
            assert 0 < cw and 0 < ch and 0 <= x <= w - cw and 0 <= y <= h - ch
    assert train.sample_crop(1000, 10, random.Random(0)) == (495, 0, 10, 10)  # no draw fits: the centred square
    areas = [cw * ch / (500 * 375) for cw, ch in (train.sample_crop(500, 375, rng)[2:] for _ in range(2000))]
    # 8-100% of the area; boxes that do not fit (large, far from the image's aspect) are drawn again, so the mean
    # falls below the uniform draw's 0.54
    assert 0.079 < min(areas) < 0.1 and 0.9 < max(areas) <= 1.0 and 0.4 < np.mean(areas) < 0.5


def test_loaders_yield_file_bytes_crops_and_labels(train, jpegs):
    samples, _ = jpegs
    loader = torch.utils.data.DataLoader(
        train.EncodedImageDataset(samples), batch_size=4, collate_fn=train.collate_encoded, num_workers=1
    )
    seen = []
    for encoded, crops, labels, names in loader:
        assert crops.dtype == labels.dtype == torch.int64 and crops.shape == (len(encoded), 5)
        for e, (x, y, w, h, flip), label, name in zip(encoded, crops.tolist(), labels.tolist(), names):
            with Image.open(name) as im:
                width, height, kind = *im.size, (im.format, im.mode)
                rgb = np.asarray(im.convert("RGB"))
            if kind == ("JPEG", "RGB"):  # travels encoded, for nvJPEG
                assert e.dtype == torch.uint8 and e.ndim == 1 and e.numpy().tobytes() == open(name, "rb").read()
            else:  # grayscale JPEG, PNG: decoded in the loader, RGB
                assert e.shape == (3, height, width) and torch.equal(e, torch.from_numpy(rgb.copy()).permute(2, 0, 1))
            assert 0 <= x <= width - w and 0 <= y <= height - h and flip in (0, 1)
            seen.append((name, label))
    assert seen == samples


def test_hub_rows_cast_without_decoding_yield_the_file_bytes(train, jpegs):
    """A hub data set's ``image`` column as ``train_loop`` casts it for data.decode=gpu (``decode=False``)."""
    import datasets

    samples, _ = jpegs
    rows = datasets.Dataset.from_dict({"image": [p for p, _ in samples[:2]], "label": [l for _, l in samples[:2]]})
    rows = rows.cast_column("image", datasets.Image()).cast_column("image", datasets.Image(decode=False))
    encoded, crop, label, name = train.EncodedImageDataset(rows)[1]
    assert encoded.numpy().tobytes() == open(samples[1][0], "rb").read() and label == samples[1][1] and name == "row 1"


def test_device_crop_matches_the_cpu_path_for_the_same_draws(train, jpegs):
    """Item by item, with the same seed: the CPU path's PIL crop and the GPU path's crop of the same decoded image
    (decoded here by PIL, as nvJPEG would on a GPU) use the same box and flip; the pixels agree within one level
    except the outermost ring, where PIL's filter also reads the pixels just outside the box."""
    samples, _ = jpegs
    size = 48
    cpu = train.ImageDataset(samples, train.ImageTransform(size, train=True))
    gpu = train.EncodedImageDataset(samples)
    flips = set()
    for i in range(len(samples)):
        random.seed(i)
        expected, label = cpu[i]
        random.seed(i)
        encoded, crop, label_gpu, _ = gpu[i]
        assert label == label_gpu
        if encoded.ndim == 1:
            with Image.open(io.BytesIO(encoded.numpy().tobytes())) as im:
                encoded = torch.from_numpy(np.asarray(im.convert("RGB")).copy()).permute(2, 0, 1)
        got = train.random_resized_crop([encoded], crop[None], size)
        assert got.shape == (1, 3, size, size) and got.dtype == torch.uint8
        diff = (got[0].int() - expected.int()).abs()
        assert diff[:, 1:-1, 1:-1].max() <= 1 and diff.float().mean() < 0.5, (samples[i], crop, diff.max())
        flips.add(int(crop[4]))
    assert flips == {0, 1}


def test_device_crop_flips_batches_mixed_sizes_and_refuses_boxes_outside(train):
    gen = torch.Generator().manual_seed(0)
    images = [
        torch.randint(0, 256, (3, h, w), dtype=torch.uint8, generator=gen) for h, w in [(30, 40), (17, 9), (64, 64)]
    ]
    crops = torch.tensor([[5, 2, 20, 25, 0], [0, 0, 9, 17, 0], [10, 10, 16, 16, 0]])
    plain = train.random_resized_crop(images, crops, 16)
    crops[:, 4] = 1
    flipped = train.random_resized_crop(images, crops, 16)
    assert plain.shape == (3, 3, 16, 16) and plain.dtype == torch.uint8
    assert torch.equal(flipped, plain.flip(-1))
    assert torch.equal(plain[2], images[2][:, 10:26, 10:26])  # a box of the output's size: the pixels themselves
    with pytest.raises(ValueError, match=r"crop box x=30 y=0 w=20 h=10 does not fit image 0 of \(3, 30, 40\)"):
        train.random_resized_crop(images[:1], torch.tensor([[30, 0, 20, 10, 0]]), 16)


def test_device_batch_of_decoded_images_on_cpu(train, jpegs):
    """`device_batch` end to end without nvJPEG: a batch whose images the loaders decoded (PNG, grayscale)."""
    samples, _ = jpegs
    random.seed(0)
    batch = train.collate_encoded([train.EncodedImageDataset(samples[-2:])[i] for i in range(2)])
    images, labels = train.device_batch(batch, torch.device("cpu"), 24)
    assert images.shape == (2, 3, 24, 24) and images.dtype == torch.uint8 and labels.tolist() == [1, 0]
    assert torch.equal(images, train.random_resized_crop(batch[0], batch[1], 24))
