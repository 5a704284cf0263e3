"""Image + text rows for the vision-language MoE benchmark (benchmarks/moe_first_gpu_runs.sh): real photos and
real instruction text, in the recipe's input format (recipes/moe-lora-fsdp2-ep/README.md#image--text-input).

    python benchmarks/vl_rows.py --images ../shared/data/datasets/images/hymenoptera_data/train \\
        --alpaca .data/alpaca_data_sample5000.json --out .data/vl

Copies the first `--per-class` photos (sorted file names) of the ``ants`` and ``bees`` folders of PyTorch's
transfer-learning data set (an ImageNet subset) to OUT/photos/ and writes OUT/vl.jsonl, `--rows` rows of two
turns each: two photos (an ant and a bee, in either order) with "Which insect is in each picture?" and the
answer, then one Alpaca instruction and its answer (the i-th row with a non-empty answer). Row i shows ant
i mod N and bee 7i + 3 mod N, the ant first in even rows. The photo-text pairing of the second turn is
arbitrary: the rows measure throughput with images of the real size and text of the real length.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

QUESTION = "Which insect is in each picture?"


def vl_rows(ants: list[str], bees: list[str], alpaca: list[dict], n_rows: int) -> list[dict]:
    """`n_rows` rows over the photo paths `ants` / `bees` (as the rows will name them) and the Alpaca rows.

    Raises:
        ValueError: fewer Alpaca rows with an answer than `n_rows`, or no photo of a class.
    """
    answered = [r for r in alpaca if r.get("output", "").strip()]
    if len(answered) < n_rows or not ants or not bees:
        raise ValueError(
            f"{n_rows} rows need {n_rows} answered Alpaca rows ({len(answered)}) and photos of both classes"
        )
    rows = []
    for i, text in enumerate(answered[:n_rows]):
        ant, bee = ants[i % len(ants)], bees[(7 * i + 3) % len(bees)]
        images, answer = (
            ([ant, bee], "The first picture shows an ant, the second a bee.")
            if i % 2 == 0
            else ([bee, ant], "The first picture shows a bee, the second an ant.")
        )
        instruction = text["instruction"] + (f"\n\n{text['input']}" if text.get("input", "").strip() else "")
        rows.append(
            {
                "images": images,
                "messages": [
                    {
                        "role": "user",
                        "content": [{"type": "image"}, {"type": "image"}, {"type": "text", "text": QUESTION}],
                    },
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": instruction},
                    {"role": "assistant", "content": text["output"]},
                ],
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=Path, required=True, help="folder with ants/ and bees/ subfolders of JPEGs")
    parser.add_argument("--alpaca", type=Path, required=True, help="Alpaca JSON (instruction, input, output)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--per-class", type=int, default=32)
    parser.add_argument("--rows", type=int, default=128)
    args = parser.parse_args()
    photos = {}
    for kind in ("ants", "bees"):
        (args.out / "photos" / kind).mkdir(parents=True, exist_ok=True)
        photos[kind] = []
        for src in sorted((args.images / kind).glob("*.jpg"))[: args.per_class]:
            shutil.copyfile(src, args.out / "photos" / kind / src.name)
            photos[kind].append(f"photos/{kind}/{src.name}")
    rows = vl_rows(photos["ants"], photos["bees"], json.loads(args.alpaca.read_text()), args.rows)
    with (args.out / "vl.jsonl").open("w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"{args.out / 'vl.jsonl'}: {len(rows)} rows, {sum(map(len, photos.values()))} photos, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
