"""Write SROIE receipts as chat rows, exactly as recipes/qwen-zero3-receipts builds its conversations,
so that the FSDP2 recipe can train on the same data in `zero3_receipts.sh`'s side-by-side run.

    python benchmarks/receipts_to_chat.py sroie2019_train.jsonl receipts_chat.jsonl
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

from cookbook import sft

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "qwen-zero3-receipts" / "train.py"


def main(src: str, dst: str) -> None:
    spec = importlib.util.spec_from_file_location("zero3_receipts_train", RECIPE)
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe  # its dataclasses look their module up
    spec.loader.exec_module(recipe)
    rows = sft.load_rows(src)
    with open(dst, "w") as f:
        for n, row in enumerate(rows, 1):
            f.write(
                json.dumps({"messages": recipe.receipt_messages(row, f"{src} row {n}", list(recipe.FIELDS))}) + "\n"
            )
    print(f"{len(rows)} receipts -> {dst}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(sys.argv[1], sys.argv[2])
