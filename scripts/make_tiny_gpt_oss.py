"""Regenerate recipes/gpt-oss-lora-trl/tiny/: the tiny twin's chat rows, a byte-level BPE tokenizer trained on them
with the harmony special tokens and a harmony-format chat template, and a 2-layer `gpt_oss` config.

    python scripts/make_tiny_gpt_oss.py            # writes tiny/data/chat.jsonl and tiny/gpt_oss/

The rows are written here (no download): arithmetic and unit questions with an assistant ``thinking`` (the
analysis channel), weather / currency look-ups with a tool call and its result, some with ``reasoning_effort``.
The chat template is that of openai/gpt-oss (the harmony format; `CHAT_TEMPLATE`), so the tiny twin renders
as the real models do: earlier assistant turns lose their thinking and end in ``<|end|>``, the last one keeps it and
ends in ``<|return|>``.
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

# The chat template of openai/gpt-oss-20b and -120b (the harmony format), written out here: the tiny twin renders
# exactly as the official one does. What the recipe relies on: a system message (model identity, knowledge cutoff,
# today's date, "Reasoning: <effort>", the valid channels); a first system / developer message and the tools as one
# developer message ("# Instructions", "# Tools" as a TypeScript namespace); an assistant tool call as
# "<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>ARGS<|call|>" (its first call only),
# its thinking (or content) as an analysis message only when no final answer follows it; a tool result as
# "<|start|>functions.NAME to=assistant<|channel|>commentary<|message|>JSON-QUOTED<|end|>"; the last assistant
# turn (add_generation_prompt false) with its thinking in the analysis channel and its answer in the final channel,
# ending in <|return|>; every earlier final answer without its thinking, ending in <|end|>.
CHAT_TEMPLATE = r"""{#- The harmony chat template of openai/gpt-oss (20b / 120b) -#}
{%- macro render_typescript_type(param_spec, required_params, is_nullable=false) -%}
    {%- if param_spec.type == "array" -%}
        {%- if param_spec['items'] -%}
            {%- if param_spec['items']['type'] == "string" -%}{{- "string[]" }}
            {%- elif param_spec['items']['type'] == "number" or param_spec['items']['type'] == "integer" -%}{{- "number[]" }}
            {%- elif param_spec['items']['type'] == "boolean" -%}{{- "boolean[]" }}
            {%- else -%}
                {%- set inner_type = render_typescript_type(param_spec['items'], required_params) -%}
                {%- if inner_type == "object | object" or inner_type|length > 50 -%}{{- "any[]" }}{%- else -%}{{- inner_type + "[]" }}{%- endif -%}
            {%- endif -%}
            {%- if param_spec.nullable -%}{{- " | null" }}{%- endif -%}
        {%- else -%}
            {{- "any[]" }}{%- if param_spec.nullable -%}{{- " | null" }}{%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type is defined and param_spec.type is iterable and param_spec.type is not string and param_spec.type is not mapping and param_spec.type[0] is defined -%}
        {%- if param_spec.type | length > 1 -%}{{- param_spec.type | join(" | ") }}{%- else -%}{{- param_spec.type[0] }}{%- endif -%}
    {%- elif param_spec.oneOf -%}
        {%- set has_object_variants = false -%}
        {%- for variant in param_spec.oneOf -%}{%- if variant.type == "object" -%}{%- set has_object_variants = true -%}{%- endif -%}{%- endfor -%}
        {%- if has_object_variants and param_spec.oneOf|length > 1 -%}{{- "any" }}
        {%- else -%}
            {%- for variant in param_spec.oneOf -%}
                {{- render_typescript_type(variant, required_params) -}}
                {%- if variant.description %}{{- "// " + variant.description }}{%- endif -%}
                {%- if variant.default is defined %}{{ "// default: " + variant.default|tojson }}{%- endif -%}
                {%- if not loop.last %}{{- " | " }}{% endif -%}
            {%- endfor -%}
        {%- endif -%}
    {%- elif param_spec.type == "string" -%}
        {%- if param_spec.enum -%}
            {{- '"' + param_spec.enum|join('" | "') + '"' -}}
        {%- else -%}
            {{- "string" }}{%- if param_spec.nullable %}{{- " | null" }}{%- endif -%}
        {%- endif -%}
    {%- elif param_spec.type == "number" -%}{{- "number" }}
    {%- elif param_spec.type == "integer" -%}{{- "number" }}
    {%- elif param_spec.type == "boolean" -%}{{- "boolean" }}
    {%- elif param_spec.type == "object" -%}
        {%- if param_spec.properties -%}
            {{- "{\n" }}
            {%- for prop_name, prop_spec in param_spec.properties.items() -%}
                {{- prop_name -}}{%- if prop_name not in (param_spec.required or []) -%}{{- "?" }}{%- endif -%}{{- ": " }}
                {{ render_typescript_type(prop_spec, param_spec.required or []) }}
                {%- if not loop.last -%}{{-", " }}{%- endif -%}
            {%- endfor -%}
            {{- "}" }}
        {%- else -%}
            {{- "object" }}
        {%- endif -%}
    {%- else -%}
        {{- "any" }}
    {%- endif -%}
{%- endmacro -%}

{%- macro render_tool_namespace(namespace_name, tools) -%}
    {{- "## " + namespace_name + "\n\n" }}
    {{- "namespace " + namespace_name + " {\n\n" }}
    {%- for tool in tools %}
        {%- set tool = tool.function %}
        {{- "// " + tool.description + "\n" }}
        {{- "type "+ tool.name + " = " }}
        {%- if tool.parameters and tool.parameters.properties %}
            {{- "(_: {\n" }}
            {%- for param_name, param_spec in tool.parameters.properties.items() %}
                {%- if param_spec.description %}
                    {{- "// " + param_spec.description + "\n" }}
                {%- endif %}
                {{- param_name }}
                {%- if param_name not in (tool.parameters.required or []) -%}
                    {{- "?" }}
                {%- endif -%}
                {{- ": " }}
                {{- render_typescript_type(param_spec, tool.parameters.required or []) }}
                {%- if param_spec.default is defined -%}
                    {%- if param_spec.enum %}
                        {{- ", // default: " + param_spec.default }}
                    {%- elif param_spec.oneOf %}
                        {{- "// default: " + param_spec.default }}
                    {%- else %}
                        {{- ", // default: " + param_spec.default|tojson }}
                    {%- endif -%}
                {%- endif -%}
                {%- if not loop.last %}
                    {{- ",\n" }}
                {%- else %}
                    {{- ",\n" }}
                {%- endif -%}
            {%- endfor %}
            {{- "}) => any;\n\n" }}
        {%- else -%}
            {{- "() => any;\n\n" }}
        {%- endif -%}
    {%- endfor %}
    {{- "} // namespace " + namespace_name }}
{%- endmacro -%}

{%- macro build_system_message() -%}
    {%- if reasoning_effort is not defined %}
        {%- set reasoning_effort = "medium" %}
    {%- endif %}
    {%- if not model_identity is defined %}
        {%- set model_identity = "You are ChatGPT, a large language model trained by OpenAI." %}
    {%- endif %}
    {{- model_identity + "\n" }}
    {{- "Knowledge cutoff: 2024-06\n" }}
    {{- "Current date: " + strftime_now("%Y-%m-%d") + "\n\n" }}
    {{- "Reasoning: " + reasoning_effort + "\n\n" }}
    {{- "# Valid channels: analysis, commentary, final. Channel must be included for every message." }}
    {%- if tools -%}
        {{- "\nCalls to these tools must go to the commentary channel: 'functions'." }}
    {%- endif -%}
{%- endmacro -%}

{#- Main system message #}
{{- "<|start|>system<|message|>" }}
{{- build_system_message() }}
{{- "<|end|>" }}

{#- Extract developer message #}
{%- if messages[0].role == "developer" or messages[0].role == "system" %}
    {%- set developer_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set developer_message = "" %}
    {%- set loop_messages = messages %}
{%- endif %}

{#- Render developer message #}
{%- if developer_message or tools %}
    {{- "<|start|>developer<|message|>" }}
    {%- if developer_message %}
        {{- "# Instructions\n\n" }}
        {{- developer_message }}
        {{- "\n\n" }}
    {%- endif %}
    {%- if tools -%}
        {{- "# Tools\n\n" }}
        {{- render_tool_namespace("functions", tools) }}
    {%- endif -%}
    {{- "<|end|>" }}
{%- endif %}

{#- Render messages #}
{%- set last_tool_call = namespace(name=none) %}
{%- for message in loop_messages -%}
    {#- At this point only assistant/user/tool messages should remain #}
    {%- if message.role == 'assistant' -%}
        {#- Checks to ensure the messages are being passed in the format we expect #}
        {%- if "content" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.content or "<|channel|>final<|message|>" in message.content %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the content field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "thinking" in message %}
            {%- if "<|channel|>analysis<|message|>" in message.thinking or "<|channel|>final<|message|>" in message.thinking %}
                {{- raise_exception("You have passed a message containing <|channel|> tags in the thinking field. Instead of doing this, you should pass analysis messages (the string between '<|message|>' and '<|end|>') in the 'thinking' field, and final messages (the string between '<|message|>' and '<|end|>') in the 'content' field.") }}
            {%- endif %}
        {%- endif %}
        {%- if "tool_calls" in message %}
            {#- We need very careful handling here - we want to drop the tool call analysis message if the model #}
            {#- has output a later <|final|> message, but otherwise we want to retain it. This is the only case #}
            {#- when we render CoT/analysis messages in inference. #}
            {%- set future_final_message = namespace(found=false) %}
            {%- for future_message in loop_messages[loop.index:] %}
                {%- if future_message.role == 'assistant' and "tool_calls" not in future_message %}
                    {%- set future_final_message.found = true %}
                {%- endif %}
            {%- endfor %}
            {#- We assume max 1 tool call per message, and so we infer the tool call name #}
            {#- in "tool" messages from the most recent assistant tool call name #}
            {%- set tool_call = message.tool_calls[0] %}
            {%- if tool_call.function %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {%- if message.content and message.thinking %}
                {{- raise_exception("Cannot pass both content and thinking in an assistant message with tool calls! Put the analysis message in one or the other, but not both.") }}
            {%- elif message.content and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.content + "<|end|>" }}
            {%- elif message.thinking and not future_final_message.found %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {{- "<|start|>assistant to=" }}
            {{- "functions." + tool_call.name + "<|channel|>commentary " }}
            {{- (tool_call.content_type if tool_call.content_type is defined else "json") + "<|message|>" }}
            {{- tool_call.arguments|tojson }}
            {{- "<|call|>" }}
            {%- set last_tool_call.name = tool_call.name %}
        {%- elif loop.last and not add_generation_prompt %}
            {#- Only render the CoT if the final turn is an assistant turn and add_generation_prompt is false #}
            {#- This is a situation that should only occur in training, never in inference. #}
            {%- if "thinking" in message %}
                {{- "<|start|>assistant<|channel|>analysis<|message|>" + message.thinking + "<|end|>" }}
            {%- endif %}
            {#- <|return|> indicates the end of generation, but <|end|> does not #}
            {#- <|return|> should never be an input to the model, but we include it as the final token #}
            {#- when training, so the model learns to emit it. #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}
        {%- else %}
            {#- CoT is dropped during all previous turns, so we never render it for inference #}
            {{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}
            {%- set last_tool_call.name = none %}
        {%- endif %}
    {%- elif message.role == 'tool' -%}
        {%- if last_tool_call.name is none %}
            {{- raise_exception("Message has tool role, but there was no previous assistant message with a tool call!") }}
        {%- endif %}
        {{- "<|start|>functions." + last_tool_call.name }}
        {{- " to=assistant<|channel|>commentary<|message|>" + message.content|tojson + "<|end|>" }}
    {%- elif message.role == 'user' -%}
        {{- "<|start|>user<|message|>" + message.content + "<|end|>" }}
    {%- endif -%}
{%- endfor -%}

{#- Generation prompt #}
{%- if add_generation_prompt -%}
<|start|>assistant
{%- endif -%}"""

WEATHER = {
    "name": "get_weather",
    "description": "Current weather of a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
RATE = {
    "name": "exchange_rate",
    "description": "Exchange rate between two currencies.",
    "parameters": {
        "type": "object",
        "properties": {"base": {"type": "string"}, "quote": {"type": "string"}},
        "required": ["base", "quote"],
    },
}


def make_rows(n_math: int = 16, n_tools: int = 12, seed: int = 0) -> list[dict]:
    """The tiny twin's chat rows: `n_math` questions answered with a thinking step, `n_tools` tool-call rows."""
    rng = random.Random(seed)
    efforts = ["low", "medium", "high"]
    rows = []
    for i in range(n_math):
        a, b = rng.randint(2, 40), rng.randint(2, 40)
        if i % 2:
            q, think, ans = (
                f"What is {a} plus {b}?",
                f"Add {a} and {b}: {a} + {b} = {a + b}.",
                f"{a} plus {b} is {a + b}.",
            )
        else:
            q, think, ans = (
                f"How many minutes are in {a} hours?",
                f"One hour has 60 minutes, so {a} x 60 = {a * 60}.",
                f"{a} hours are {a * 60} minutes.",
            )
        row = {"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": ans, "thinking": think}]}
        if i % 4 == 0:
            row["messages"].insert(0, {"role": "system", "content": "Answer in one short sentence."})
        if i % 3 == 0:
            row["reasoning_effort"] = efforts[i % 3 + (i // 3) % 3 if i % 3 + (i // 3) % 3 < 3 else 0]
        rows.append(row)
    cities = {
        "Paris": ("sunny", 21),
        "Oslo": ("snow", -3),
        "Lima": ("cloudy", 18),
        "Cairo": ("hot and dry", 35),
        "Tokyo": ("rain", 14),
        "Quito": ("mild", 16),
    }
    pairs = {("EUR", "USD"): 1.09, ("USD", "JPY"): 151.2, ("GBP", "EUR"): 1.17}
    for i in range(n_tools):
        if i % 2 == 0:
            city = list(cities)[(i // 2) % len(cities)]
            sky, temp = cities[city]
            row = {
                "tools": [WEATHER],
                "messages": [
                    {"role": "user", "content": f"What is the weather in {city} right now?"},
                    {
                        "role": "assistant",
                        "content": "",
                        "thinking": f"I need the current weather of {city}.",
                        "tool_calls": [
                            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": city}}}
                        ],
                    },
                    {"role": "tool", "name": "get_weather", "content": json.dumps({"sky": sky, "celsius": temp})},
                    {"role": "assistant", "content": f"In {city} it is {sky}, {temp} degrees Celsius."},
                ],
            }
        else:
            (base, quote), rate = list(pairs.items())[(i // 2) % len(pairs)]
            row = {
                "tools": [RATE],
                "reasoning_effort": efforts[i % 3],
                "messages": [
                    {"role": "developer", "content": "Quote rates with two decimals."},
                    {"role": "user", "content": f"How many {quote} is one {base}?"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "type": "function",
                                "function": {
                                    "name": "exchange_rate",
                                    "arguments": json.dumps({"base": base, "quote": quote}),
                                },
                            }
                        ],
                    },
                    {"role": "tool", "content": json.dumps({"rate": rate})},
                    {
                        "role": "assistant",
                        "content": f"One {base} is {rate:.2f} {quote}.",
                        "thinking": f"The tool says {rate}; round to two decimals.",
                    },
                ],
            }
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
    trainer = trainers.BpeTrainer(
        vocab_size=768,
        special_tokens=[PAD, *HARMONY],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|return|>",
        pad_token=PAD,
        clean_up_tokenization_spaces=False,
        model_max_length=512,
    )
    tok.add_special_tokens({"additional_special_tokens": HARMONY})
    tok.chat_template = CHAT_TEMPLATE
    model_dir = args.out / "gpt_oss"
    tok.save_pretrained(model_dir)
    GptOssConfig(
        vocab_size=-(-len(tok) // 64) * 64,
        hidden_size=64,
        intermediate_size=64,
        num_hidden_layers=2,
        num_local_experts=4,
        num_experts_per_tok=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        max_position_embeddings=512,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "original_max_position_embeddings": 128,
            "rope_theta": 150000.0,
        },
        tie_word_embeddings=False,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    ).save_pretrained(model_dir)
    print(f"wrote {len(rows)} rows and a {len(tok)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
