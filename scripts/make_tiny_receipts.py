"""Make the offline tiny assets of recipes/qwen-zero3-receipts: 40 real SROIE receipts with their OCR cut
down to the lines that matter, a byte-level BPE tokenizer trained on them (ChatML template), and a tiny Qwen3
config.

    python scripts/make_tiny_receipts.py --sroie <SROIE 2019 train split as JSONL>/sroie2019_train.jsonl

Each receipt keeps its id and entities; its ``ocr_boxes`` keep the first two boxes and every box whose text
shares a 4-character piece with an entity value, at most 14, in their original order. The tokenizer (1,024
tokens) compresses this text about 3x better than the FSDP2 recipe's tiny tokenizer, so a receipt is ~200
tokens instead of ~900 and a CPU test stays fast. Deterministic: the same files on every run.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from make_tiny_sft import CHATML  # the same ChatML template as the FSDP2 recipe's tiny tokenizer
from transformers import PreTrainedTokenizerFast, Qwen3Config

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "qwen-zero3-receipts"


def trim(row: dict, max_boxes: int = 14) -> dict:
    """The row with only the OCR boxes that carry entity text (plus the first two)."""
    values = [v.upper() for v in row["entities"].values() if isinstance(v, str)]
    pieces = {v[i : i + 4] for v in values for i in range(max(1, len(v) - 3))}
    keep = [
        i
        for i, box in enumerate(row["ocr_boxes"])
        if i < 2 or any(box[8].upper()[j : j + 4] in pieces for j in range(max(1, len(box[8]) - 3)))
    ]
    return {"id": row["id"], "entities": row["entities"], "ocr_boxes": [row["ocr_boxes"][i] for i in keep[:max_boxes]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sroie", type=Path, required=True, help="SROIE train JSONL ({id, entities, ocr_boxes})")
    parser.add_argument("--rows", type=int, default=40)
    parser.add_argument("--out", type=Path, default=RECIPE / "tiny")
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("receipts_train", RECIPE / "train.py")
    recipe = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = recipe
    spec.loader.exec_module(recipe)

    rows = [trim(json.loads(line)) for line in args.sroie.read_text().splitlines()[: args.rows]]
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    with open(args.out / "data" / "receipts.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    corpus = [m["content"] for row in rows for m in recipe.receipt_messages(row, "tiny", list(recipe.FIELDS))]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1024,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
        model_max_length=4096,
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    model_dir = args.out / "qwen3"
    tok.save_pretrained(model_dir)
    Qwen3Config(
        vocab_size=-(-len(tok) // 64) * 64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.pad_token_id,
    ).save_pretrained(model_dir)
    print(f"wrote {len(rows)} receipts and a {len(tok)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
