"""Make the offline tiny assets of recipes/qwen-fsdp2-sft: a byte-level BPE tokenizer, tiny Qwen3
and Llama configs, the ~10 M-parameter Llama of the from-scratch example, and small generated chat /
Alpaca data; and the same tokenizer for recipes/qwen-ray-sft/tiny/qwen2 (the Llama and the chat rows are
copied into recipes/unsloth-lora-ddp/tiny and recipes/axolotl-lora-ddp/tiny).

    python scripts/make_tiny_sft.py            # writes recipes/qwen-fsdp2-sft/tiny/ and the Ray twin's tokenizer

Chat templates: tiny/qwen3 carries Qwen3's own template and the Ray recipe's tiny/qwen2 Qwen2.5's
(scripts/chat_templates/*.jinja: the ``chat_template`` of the Qwen3 tokenizer_config.json of
Qwen3-0.6B..14B, and of Qwen2.5-*-Instruct's, copied unchanged; Apache-2.0), so the tiny twins
render system prompts, ``<think>`` blocks, tools and tool calls, and rewrite earlier turns, as the
real models do. tiny/llama keeps a plain ChatML template (the Llama 3 template needs its header
tokens, which this tokenizer does not have).

The data is synthetic and learnable (arithmetic and a fixed table of facts), so a tiny model's
loss falls within a few dozen steps. Deterministic: the same files on every run.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, PreTrainedTokenizerFast, Qwen3Config

CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
TEMPLATES = Path(__file__).resolve().parent / "chat_templates"
COLOURS = {
    "apple": "red",
    "banana": "yellow",
    "grass": "green",
    "sky": "blue",
    "snow": "white",
    "coal": "black",
    "orange": "orange",
    "plum": "purple",
}
SYSTEM = "You are a concise assistant."


def conversations(n: int, rng: random.Random) -> list[list[dict]]:
    out = []
    for _ in range(n):
        turns = [{"role": "system", "content": SYSTEM}] if rng.random() < 0.5 else []
        for _ in range(rng.choice([1, 1, 2])):
            if rng.random() < 0.5:
                a, b = rng.randint(0, 49), rng.randint(0, 49)
                turns += [
                    {"role": "user", "content": f"What is {a} plus {b}?"},
                    {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
                ]
            else:
                thing = rng.choice(sorted(COLOURS))
                turns += [
                    {"role": "user", "content": f"What colour is {thing}?"},
                    {"role": "assistant", "content": f"The colour of {thing} is {COLOURS[thing]}."},
                ]
        out.append(turns)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    recipes = Path(__file__).resolve().parents[1] / "recipes"
    parser.add_argument("--out", type=Path, default=recipes / "qwen-fsdp2-sft" / "tiny")
    parser.add_argument(
        "--ray-out",
        type=Path,
        default=recipes / "qwen-ray-sft" / "tiny" / "qwen2",
        help="where the Ray recipe's tiny Qwen2 tokenizer goes",
    )
    args = parser.parse_args()
    out = args.out
    rng = random.Random(0)
    chats = conversations(600, rng)
    alpaca = [
        {
            "instruction": f"Add {a} and {b}.",
            "input": "" if i % 2 else "Answer with a sentence.",
            "output": f"{a} plus {b} is {a + b}.",
        }
        for i, (a, b) in enumerate((rng.randint(0, 49), rng.randint(0, 49)) for _ in range(200))
    ]
    (out / "data").mkdir(parents=True, exist_ok=True)
    with open(out / "data" / "chat.jsonl", "w") as f:
        for turns in chats:
            f.write(json.dumps({"messages": turns}) + "\n")
    (out / "data" / "alpaca.json").write_text(json.dumps(alpaca, indent=1) + "\n")

    corpus = [m["content"] for turns in chats for m in turns] + [r["instruction"] + " " + r["output"] for r in alpaca]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
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
    vocab = -(-len(tok) // 64) * 64  # room for the tokenizer, rounded like real models
    common = dict(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=tok.pad_token_id,
    )
    # The classic FSDP example size: a Llama-style model of about 10 M parameters, trained from scratch.
    llama_10m = LlamaConfig(
        **{
            **common,
            "hidden_size": 384,
            "intermediate_size": 1024,
            "num_hidden_layers": 6,
            "num_attention_heads": 6,
            "num_key_value_heads": 6,
            "head_dim": 64,
            "max_position_embeddings": 2048,
        }
    )
    qwen3, qwen25 = ((TEMPLATES / f).read_text() for f in ("qwen3.jinja", "qwen2.5.jinja"))
    for name, config, template in [
        ("qwen3", Qwen3Config(**common), qwen3),
        ("llama", LlamaConfig(**common), CHATML),
        ("llama-10m", llama_10m, CHATML),
    ]:
        config.save_pretrained(out / name)
        tok.chat_template = template
        tok.save_pretrained(out / name)
    tok.chat_template = qwen25
    tok.save_pretrained(args.ray_out)  # its config.json (a tiny Qwen2) is the Ray recipe's own
    for twin in ("unsloth-lora-ddp", "axolotl-lora-ddp"):  # each recipe folder holds its tiny files (a copy works)
        shutil.copytree(out / "llama", recipes / twin / "tiny" / "llama", dirs_exist_ok=True)
        (recipes / twin / "tiny" / "data").mkdir(parents=True, exist_ok=True)
        shutil.copyfile(out / "data" / "chat.jsonl", recipes / twin / "tiny" / "data" / "chat.jsonl")
    print(
        f"wrote {out}: {len(chats)} chats, {len(alpaca)} alpaca rows, tokenizer of {len(tok)} tokens, vocab_size {vocab}"
    )


if __name__ == "__main__":
    main()
