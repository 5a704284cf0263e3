"""Regenerate recipes/gpt-oss-lora-trl/tiny/: the tiny twin's chat rows, a byte-level BPE tokenizer trained on them
with the harmony special tokens and a harmony-format chat template, and a 2-layer `gpt_oss` config.

    python scripts/make_tiny_gpt_oss.py            # writes tiny/data/chat.jsonl and tiny/gpt_oss/

The rows are written here (no download): arithmetic and unit questions with an assistant ``thinking`` (the
analysis channel), weather / currency look-ups with a tool call and its result, some with ``reasoning_effort``.
The chat template is this cookbook's own rendering of the harmony format (roles system / developer / user /
assistant / tool; thinking -> analysis channel, content -> final channel, tool calls -> commentary channel
``to=functions.NAME`` ending in ``<|call|>``; the last assistant turn ends in ``<|return|>``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GptOssConfig, PreTrainedTokenizerFast

RECIPE = Path(__file__).resolve().parents[1] / "recipes" / "gpt-oss-lora-trl"
HARMONY = ["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<|constrain|>"]
PAD = "<|endoftext|>"

# The harmony format: <|start|>{role}<|message|>{text}<|end|>, assistant turns with <|channel|>{analysis|final|
# commentary}; the last assistant turn ends in <|return|> (the end of generation), a tool call in <|call|>.
CHAT_TEMPLATE = r"""{%- set ns = namespace(call="tool", start=0) -%}
<|start|>system<|message|>You are a helpful assistant.
Reasoning: {{ reasoning_effort | default("medium") }}

# Valid channels: analysis, commentary, final.<|end|>
{%- if messages and messages[0].role in ["system", "developer"] %}{% set ns.start = 1 %}{% endif -%}
{%- if ns.start or tools -%}
<|start|>developer<|message|>
{%- if ns.start %}# Instructions

{{ messages[0].content }}{% endif -%}
{%- if tools %}{% if ns.start %}{{ "\n\n" }}{% endif %}# Tools
{%- for tool in tools %}{% set f = tool.function if tool.function is defined else tool %}{{ "\n" }}functions.{{ f.name }}: {{ f.description | default("") }} {{ f.parameters | default({}) | tojson }}
{%- endfor %}{% endif %}<|end|>
{%- endif -%}
{%- for m in messages[ns.start:] -%}
{%- if m.role == "user" -%}
<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == "assistant" -%}
{%- if m.thinking %}<|start|>assistant<|channel|>analysis<|message|>{{ m.thinking }}<|end|>{% endif -%}
{%- for call in m.tool_calls or [] -%}
{%- set f = call.function if call.function is defined else call -%}
{%- set ns.call = f.name -%}
<|start|>assistant<|channel|>commentary to=functions.{{ f.name }} <|constrain|>json<|message|>
{{- f.arguments | tojson if f.arguments is mapping else f.arguments }}<|call|>
{%- endfor -%}
{%- if m.content -%}
<|start|>assistant<|channel|>final<|message|>{{ m.content }}{% if loop.last %}<|return|>{% else %}<|end|>{% endif %}
{%- endif -%}
{%- elif m.role == "tool" -%}
<|start|>functions.{{ m.name | default(ns.call) }} to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- elif m.role in ["system", "developer"] -%}
<|start|>developer<|message|>{{ m.content }}<|end|>
{%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt %}<|start|>assistant{% endif -%}"""

WEATHER = {"name": "get_weather", "description": "Current weather of a city.",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
RATE = {"name": "exchange_rate", "description": "Exchange rate between two currencies.",
        "parameters": {"type": "object", "properties": {"base": {"type": "string"}, "quote": {"type": "string"}},
                       "required": ["base", "quote"]}}


def make_rows(n_math: int = 16, n_tools: int = 12, seed: int = 0) -> list[dict]:
    """The tiny twin's chat rows: `n_math` questions answered with a thinking step, `n_tools` tool-call rows."""
    rng = random.Random(seed)
    efforts = ["low", "medium", "high"]
    rows = []
    for i in range(n_math):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if i % 2:
            q, think, ans = f"What is {a} plus {b}?", f"Add {a} and {b}: {a} + {b} = {a + b}.", f"{a} plus {b} is {a + b}."
        else:
            q, think, ans = (f"How many minutes are in {a} hours?", f"One hour has 60 minutes, so {a} x 60 = {a * 60}.",
                             f"{a} hours are {a * 60} minutes.")
        row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans, "thinking": think}]}
        if i % 4 == 0:
            row["messages"].insert(0, {"role": "system", "content": "Answer in one short sentence."})
        if i % 3 == 0:
            row["reasoning_effort"] = efforts[i % 3 + (i // 3) % 3 if i % 3 + (i // 3) % 3 < 3 else 0]
        rows.append(row)
    cities = {"Paris": ("sunny", 21), "Oslo": ("snow", -3), "Lima": ("cloudy", 18), "Cairo": ("hot and dry", 35),
              "Tokyo": ("rain", 14), "Quito": ("mild", 16)}
    pairs = {("EUR", "USD"): 1.09, ("USD", "JPY"): 151.2, ("GBP", "EUR"): 1.17}
    for i in range(n_tools):
        if i % 2 == 0:
            city = list(cities)[(i // 2) % len(cities)]
            sky, temp = cities[city]
            row = {"tools": [WEATHER], "messages": [
                {"role": "user", "content": f"What is the weather in {city} right now?"},
                {"role": "assistant", "content": "", "thinking": f"I need the current weather of {city}.",
                 "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}]},
                {"role": "tool", "name": "get_weather", "content": json.dumps({"sky": sky, "celsius": temp})},
                {"role": "assistant", "content": f"In {city} it is {sky}, {temp} degrees Celsius."}]}
        else:
            (base, quote), rate = list(pairs.items())[(i // 2) % len(pairs)]
            row = {"tools": [RATE], "reasoning_effort": efforts[i % 3], "messages": [
                {"role": "developer", "content": "Quote rates with two decimals."},
                {"role": "user", "content": f"How many {quote} is one {base}?"},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "exchange_rate",
                                                                  "arguments": json.dumps({"base": base, "quote": quote})}}]},
                {"role": "tool", "content": json.dumps({"rate": rate})},
                {"role": "assistant", "content": f"One {base} is {rate:.2f} {quote}.",
                 "thinking": f"The tool says {rate}; round to two decimals."}]}
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RECIPE / "tiny")
    args = parser.parse_args()
    rows = make_rows()
    (args.out / "data").mkdir(parents=True, exist_ok=True)
    with open(args.out / "data" / "chat.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False) + "\n")

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    corpus = [json.dumps(row, ensure_ascii=False) for row in rows] + [CHAT_TEMPLATE]
    trainer = trainers.BpeTrainer(vocab_size=768, special_tokens=[PAD, *HARMONY],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|return|>", pad_token=PAD,
                                  clean_up_tokenization_spaces=False, model_max_length=512)
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.chat_template = CHAT_TEMPLATE
    model_dir = args.out / "gpt_oss"
    tok.save_pretrained(model_dir)
    GptOssConfig(vocab_size=-(-len(tok) // 64) * 64, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                 num_local_experts=4, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 sliding_window=8, layer_types=["sliding_attention", "full_attention"], max_position_embeddings=512,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                  "truncate": False, "original_max_position_embeddings": 128, "rope_theta": 150000.0},
                 tie_word_embeddings=False, pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id,
                 bos_token_id=None).save_pretrained(model_dir)
    print(f"wrote {len(rows)} rows and a {len(tok)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
