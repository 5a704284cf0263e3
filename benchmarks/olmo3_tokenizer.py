"""Build a tokenizer whose ids fit OLMo-3's 100,278 embedding rows from the Llama-3 tokenizer (offline), for
`benchmarks/unsloth_axolotl_vs_trl.sh MODEL=olmo3-7b`.

    python benchmarks/olmo3_tokenizer.py .data/llama-3-tokenizer DEST [--check alpaca_data_sample5000.json]

OLMo-3's own tokenizer (allenai's dolma2 tokenizer: OpenAI's cl100k_base byte-level BPE and special tokens, 100,278
ids, ``vocab_size`` of recipes/axolotl-lora-ddp/models/olmo-3-7b/config.json) is not available offline here. The
Llama-3 tokenizer cannot be used as it is: its 128,256 ids (special tokens from 128,000 up) overflow the embedding.
Meta built Llama-3's vocabulary from the 100K tokens of tiktoken (cl100k_base) plus 28K more ("Introducing Meta
Llama 3", 2024), with cl100k_base's split regex; this keeps its ids below 100,256 (``BASE_IDS``) and the merges
among them, so the result is a cl100k-style byte-level BPE with the ids OLMo-3's embedding has. Special tokens in
the ids 100,256..100,277 (the others ``<|reserved_ID|>``): ``<|endoftext|>`` 100257 (the config's
``eos_token_id``), ``<|im_start|>`` 100264, ``<|im_end|>`` 100265 (end of each chat turn, the tokenizer's EOS, as
Llama-3's ``<|eot_id|>`` is) and ``<|pad|>`` 100277 (the config's ``pad_token_id``), and a ChatML chat template
(the format of OLMo-3's instruct models). Whether these ids are those of allenai's files is not checked here;
for a random-init benchmark only the id range and the token counts matter.

``--check FILE``: tokenize every Alpaca row of FILE (instruction, input, output joined) with both tokenizers and
print the number of rows, the largest id, and how many rows get the same ids from both (all rows whose Llama-3 ids
are all below 100,256 must). Exit status 2 if an id is out of range or such a row differs.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

BASE_IDS = 100256  # cl100k_base's ranks 0..100255, shared with Llama-3's first ids
VOCAB_SIZE = 100278  # OLMo-3's embedding rows (models/olmo-3-7b/config.json)
SPECIALS = {"<|endoftext|>": 100257, "<|im_start|>": 100264, "<|im_end|>": 100265, "<|pad|>": 100277}
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + "
    "'<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def build(src: str, dest: str) -> int:
    """Write the truncated tokenizer (tokenizer.json, tokenizer_config.json) of `src` (a Llama-3 tokenizer folder)
    to `dest`; return its number of ids (the largest id + 1, <= ``VOCAB_SIZE``).

    Raises:
        ValueError: `src` is not a byte-level BPE whose ids 0..BASE_IDS-1 are ordinary tokens.
    """
    tok = json.loads((Path(src) / "tokenizer.json").read_text())
    model = tok["model"]
    if model.get("type") != "BPE" or len(model["vocab"]) < BASE_IDS:
        raise ValueError(f"{src}: not a BPE tokenizer with at least {BASE_IDS} ordinary tokens")
    vocab = {t: i for t, i in model["vocab"].items() if i < BASE_IDS}
    merges = []
    for m in model["merges"]:
        a, b = m.split(" ", 1) if isinstance(m, str) else m
        if a in vocab and b in vocab and a + b in vocab:
            merges.append(m)
    model.update(vocab=vocab, merges=merges)
    names = {i: t for t, i in SPECIALS.items()}  # every id up to VOCAB_SIZE: the library renumbers gaps away
    tok["added_tokens"] = [
        {
            "id": i,
            "content": names.get(i, f"<|reserved_{i}|>"),
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in range(BASE_IDS, VOCAB_SIZE)
    ]
    tok["post_processor"] = None  # no BOS (Llama-3's template adds <|begin_of_text|>; ChatML has none)
    out = Path(dest)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|pad|>",
        "model_input_names": ["input_ids", "attention_mask"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 65536,
        "chat_template": CHATML,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return VOCAB_SIZE


def check(src: str, dest: str, rows_file: str) -> tuple[int, int, int, int]:
    """Tokenize every Alpaca row of `rows_file` with `src` and `dest`; return (rows, largest id of `dest`, rows whose
    Llama-3 ids are all below ``BASE_IDS``, how many of those get different ids from `dest`)."""
    from transformers import AutoTokenizer

    full, cut = AutoTokenizer.from_pretrained(src), AutoTokenizer.from_pretrained(dest)
    got = {t: cut.convert_tokens_to_ids(t) for t in SPECIALS}
    if got != SPECIALS or len(cut) != VOCAB_SIZE:
        raise ValueError(f"{dest}: special token ids {got}, {len(cut)} ids; want {SPECIALS}, {VOCAB_SIZE}")
    rows = json.loads(Path(rows_file).read_text())
    top, inside, differ = 0, 0, 0
    for r in rows:
        text = "\n".join(r.get(k) or "" for k in ("instruction", "input", "output"))
        a = full(text, add_special_tokens=False)["input_ids"]
        b = cut(text, add_special_tokens=False)["input_ids"]
        top = max(top, max(b, default=0))
        if max(a, default=0) < BASE_IDS:
            inside += 1
            differ += a != b
    return len(rows), top, inside, differ


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--check", default=None, metavar="ALPACA_JSON")
    a = p.parse_args(argv)
    if Path(a.src).resolve() != Path(a.dest).resolve():
        try:
            n = build(a.src, a.dest)
        except (ValueError, OSError, KeyError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(f"{a.dest}: {n} ids (<= {VOCAB_SIZE}), specials {SPECIALS}")
    if a.check:
        try:
            rows, top, inside, differ = check(a.src, a.dest, a.check)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        print(
            f"{rows} rows: largest id {top}; {inside} rows in Llama-3 ids < {BASE_IDS}, {differ} tokenized differently"
        )
        if top >= VOCAB_SIZE or differ:
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
