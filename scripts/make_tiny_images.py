"""Generate the tiny ImageFolder data set of recipes/resnet50-ray-ddp (offline CI data).

Two classes a small CNN separates in a few epochs: "stripes" (horizontal bands) and "checks"
(a checkerboard), each in random colours with noise, 32 x 32 PNG. Run from the repo root:

    python scripts/make_tiny_images.py
"""

from pathlib import Path

import numpy as np
from PIL import Image

OUT = Path(__file__).resolve().parents[1] / "recipes" / "resnet50-ray-ddp" / "tiny" / "data"


def image(kind: str, rng: np.random.Generator, size: int = 32) -> Image.Image:
    """One noisy RGB image of the given kind."""
    period = int(rng.integers(4, 9))
    yy, xx = np.mgrid[:size, :size]
    phase = int(rng.integers(0, period))
    mask = (
        ((yy + phase) // period) % 2 if kind == "stripes" else (((yy + phase) // period + (xx + phase) // period) % 2)
    )
    a, b = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
    img = np.where(mask[..., None] == 1, a, b) + rng.normal(0, 20, (size, size, 3))
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8))


def main(per_class: int = 40, seed: int = 0) -> None:
    rng = np.random.default_rng(seed)
    for kind in ("checks", "stripes"):
        folder = OUT / "train" / kind
        folder.mkdir(parents=True, exist_ok=True)
        for i in range(per_class):
            image(kind, rng).save(folder / f"{kind}_{i:03d}.png")
    print(f"wrote {2 * per_class} images under {OUT}")


if __name__ == "__main__":
    main()
