"""Write Alpaca / ShareGPT / chat rows as the ``{"messages": [...]}`` JSONL that config.yaml's ``chat_template``
data set reads, with the same conversion (`cookbook.sft.to_messages`) as the Unsloth and TRL paths:

    python recipes/axolotl-lora-ddp/prepare_data.py alpaca_data_sample5000.json recipes/axolotl-lora-ddp/data/alpaca_chat.jsonl

Rows with an empty answer are skipped (as the other paths skip them). Exit status 2 with one line naming the
file and the 1-based row on a row that cannot be read.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cookbook import sft


def convert(src: str, dst: str) -> int:
    """Write the conversations of `src` to `dst` (JSONL, UTF-8); returns how many were written.

    Raises:
        cookbook.sft.SFTDataError: a missing file or a bad row, naming the file and the row (its line in JSONL).
    """
    out, rows = [], sft.load_rows(src)
    for n, row in enumerate(rows, 1):
        try:
            out.append(json.dumps({"messages": sft.to_messages(row, rows.label(n), src)}, ensure_ascii=False))
        except sft.EmptyAnswerError:
            continue
    Path(dst).parent.mkdir(parents=True, exist_ok=True)
    Path(dst).write_text("\n".join(out) + "\n", encoding="utf-8")
    return len(out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    try:
        print(f"{convert(sys.argv[1], sys.argv[2])} conversations written to {sys.argv[2]}")
    except sft.SFTDataError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
