"""cookbook.sft on an offline tokenizer (a tiny byte-level BPE trained here, with a ChatML
template) and a tiny random Qwen3: assistant-only labels, row formats, errors, truncation,
packing, packed-vs-unpacked loss equality, collate, the token loss and evaluate, the --check helpers."""

import hashlib
import json
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from conftest import assert_fp32_close, fp32_sum_rtol
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from cookbook.config import ConfigError
from cookbook.sft import (
    IGNORE_INDEX,
    SFTDataError,
    SFTStats,
    chunked_token_loss_sum,
    check_one_step,
    check_vocab,
    collate,
    evaluate,
    load_tokenizer,
    load_hub_rows,
    linear_cross_entropy_sum,
    load_rows,
    pack,
    pad_batch,
    pad_token_id,
    prepare,
    register_varlen,
    to_conversation,
    to_messages,
    tokenize_conversation,
    token_loss_sum,
    token_loss_sums,
    varlen_attention,
)

ROOT = Path(__file__).resolve().parents[1]

# Qwen2.5-style ChatML, without a default system prompt and without <think> handling.
CHATML = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
CORPUS = [
    "You are a helpful assistant.",
    "What is the capital of France?",
    "The capital of France is Paris.",
    "And of Germany?",
    "Berlin is the capital of Germany.",
    "Write a short poem about the sea.",
    "Hello! How can I help you today?",
    "What is two plus two? It is four.",
]
CONVERSATION = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "The capital of France is Paris."},
    {"role": "user", "content": "And of Germany?"},
    {"role": "assistant", "content": "Berlin is the capital of Germany."},
]


@pytest.fixture(scope="module")
def tokenizer():
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 4, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|im_end|>", pad_token="<|endoftext|>", clean_up_tokenization_spaces=False
    )
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.chat_template = CHATML
    return tok


def spans(labels):
    """Maximal runs of labelled positions, as (start, stop)."""
    out, start = [], None
    for i, label in enumerate(labels + [IGNORE_INDEX]):
        if label != IGNORE_INDEX and start is None:
            start = i
        elif label == IGNORE_INDEX and start is not None:
            out.append((start, i))
            start = None
    return out


def test_only_assistant_content_and_end_token_are_labelled(tokenizer):
    ids, labels, truncated = tokenize_conversation(tokenizer, CONVERSATION, max_length=1000)
    assert not truncated and len(ids) == len(labels)
    assert tokenizer.decode(ids) == "".join(
        f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION
    )
    found = [tokenizer.decode(ids[a:b]) for a, b in spans(labels)]
    assert found == ["The capital of France is Paris.<|im_end|>", "Berlin is the capital of Germany.<|im_end|>"]
    assert all(labels[i] == ids[i] for i in range(len(ids)) if labels[i] != IGNORE_INDEX)
    content_tokens = [
        len(tokenizer(m["content"], add_special_tokens=False)["input_ids"])
        for m in CONVERSATION
        if m["role"] == "assistant"
    ]
    assert all(n > 1 for n in content_tokens)
    assert sum(label != IGNORE_INDEX for label in labels) == sum(content_tokens) + 2
    assert labels[0] == IGNORE_INDEX


def test_row_formats_give_the_expected_messages():
    alpaca = {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"}
    assert to_messages(alpaca, 1, "a.jsonl") == [
        {"role": "user", "content": "Translate to French.\n\nGood morning"},
        {"role": "assistant", "content": "Bonjour"},
    ]
    for empty in ({"input": ""}, {"input": None}, {}):
        row = {"instruction": "Say hi.", "output": "Hi!", **empty}
        assert to_messages(row, 2, "a.jsonl") == [
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi!"},
        ]
    sharegpt = {
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "2+2?"},
            {"from": "gpt", "value": "4"},
        ]
    }
    assert to_messages(sharegpt, 3, "s.json") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
    ]
    assert to_messages({"messages": CONVERSATION}, 4, "c.jsonl") == CONVERSATION


@pytest.mark.parametrize(
    "row, expected",
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, ["data.jsonl row 7", "no assistant turn"]),
        (
            {"prompt": "Hi", "completion": "Hello"},
            [
                "data.jsonl row 7",
                "unknown format",
                "'completion', 'prompt'",
                "'messages'",
                "'conversations'",
                "'instruction' + 'output'",
            ],
        ),
        (
            {"messages": [{"role": "user", "content": "Hi"}, {"role": "bot", "content": "Yo"}]},
            ["data.jsonl row 7", "messages[1].role is 'bot'", "system, user, assistant"],
        ),
        (
            {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "  "}]},
            ["data.jsonl row 7", "'conversations[1].value' is empty"],
        ),
        ({"instruction": "Hi", "output": ""}, ["data.jsonl row 7", "'output' is empty"]),
    ],
)
def test_bad_rows_name_the_row_and_field(row, expected):
    with pytest.raises(SFTDataError) as err:
        to_messages(row, 7, "data.jsonl")
    for text in expected:
        assert text in str(err.value)


def test_prepare_skips_and_names_rows_with_an_empty_answer(tokenizer):
    rows = [
        {"instruction": "Say hi.", "output": "Hi!"},
        {"instruction": "Say nothing.", "output": " "},
        {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]},
        {"instruction": "Say yo.", "output": "Yo"},
    ]
    examples, stats = prepare(rows, tokenizer, 64, "train.jsonl")
    assert len(examples) == stats.examples == 2
    assert stats.empty_answers == [2, 3]
    assert "2 skipped with an empty answer (rows 2, 3)" in stats.summary()


def test_prepare_names_the_failing_row(tokenizer):
    rows = [{"instruction": "Say hi.", "output": "Hi!"}, {"messages": [{"role": "user", "content": "Hi"}]}]
    with pytest.raises(SFTDataError, match=r"^train\.jsonl row 2: the conversation has no assistant turn"):
        prepare(rows, tokenizer, 64, "train.jsonl")


def test_tokenizer_without_chat_template(tokenizer):
    bare = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    with pytest.raises(
        SFTDataError, match="no usable chat template: set tokenizer.chat_template or use a chat/instruct"
    ):
        tokenize_conversation(bare, CONVERSATION, 64)
    with pytest.raises(SFTDataError, match="no usable chat template"):
        prepare([{"messages": CONVERSATION}], bare, 64, "train.jsonl")


def test_vocab_larger_than_the_model(tokenizer):
    check_vocab(tokenizer, len(tokenizer))
    with pytest.raises(SFTDataError, match=f"tokenizer has {len(tokenizer)} tokens but the model's vocab_size is 256"):
        check_vocab(tokenizer, 256)


def test_template_that_rewrites_earlier_turns_is_rejected(tokenizer):
    tok = PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    # Like Qwen3: the last assistant turn gets an (empty) reasoning block, earlier ones do not.
    tok.chat_template = CHATML.replace(
        "message['content'] + '<|im_end|>'",
        "(('<think></think>' + message['content']) if (loop.last and message['role'] == 'assistant') "
        "else message['content']) + '<|im_end|>'",
    )
    ids, labels, _ = tokenize_conversation(tok, CONVERSATION[:3], 1000)  # one assistant turn: fine
    assert [tok.decode(ids[a:b]) for a, b in spans(labels)] == [
        "<think></think>The capital of France is Paris.<|im_end|>"
    ]
    with pytest.raises(SFTDataError, match=r"not prefix-stable: messages\[:3\] rendered differs .* at token"):
        tokenize_conversation(tok, CONVERSATION, 1000)


def test_load_rows(tmp_path):
    rows = [{"instruction": "a", "output": "b"}, {"messages": CONVERSATION}]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    (tmp_path / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert load_rows(tmp_path / "d.json") == rows
    assert load_rows(tmp_path / "d.jsonl") == rows
    with pytest.raises(SFTDataError, match=f"data file not found: {tmp_path / 'missing.jsonl'}"):
        load_rows(tmp_path / "missing.jsonl")
    (tmp_path / "bad.jsonl").write_text('{"instruction": "a", "output": "b"}\n{"instruction": \n')
    with pytest.raises(SFTDataError, match="bad.jsonl line 2: not valid JSON"):
        load_rows(tmp_path / "bad.jsonl")
    (tmp_path / "list.json").write_text('[{"instruction": "a", "output": "b"}, [1, 2]]')
    with pytest.raises(SFTDataError, match="list.json row 2: expected a JSON object, got list"):
        load_rows(tmp_path / "list.json")


def test_truncation_is_flagged_and_counted(tokenizer):
    long_answer = " ".join(["The capital of France is Paris."] * 20)
    rows = [
        {"instruction": "Say hi.", "output": "Hi!"},
        {"instruction": "Tell me about France.", "output": long_answer},
    ]
    full_ids, _, _ = tokenize_conversation(tokenizer, to_messages(rows[1], 2, "t"), 10_000)
    assert len(full_ids) > 64
    ids, labels, truncated = tokenize_conversation(tokenizer, to_messages(rows[1], 2, "t"), 64)
    assert truncated and len(ids) == len(labels) == 64 and ids == full_ids[:64]
    examples, stats = prepare(rows, tokenizer, 64, "t")
    short = len(examples[0]["input_ids"])
    assert (stats.rows, stats.examples, stats.truncated, stats.dropped) == (2, 2, 1, 0)
    assert stats.tokens == short + 64
    assert stats.loss_tokens == sum(label != IGNORE_INDEX for ex in examples for label in ex["labels"])
    assert stats.loss_fraction == pytest.approx(stats.loss_tokens / stats.tokens)
    # Cut before the assistant turn starts: nothing to learn, so the row is dropped and counted.
    _, stats = prepare(rows, tokenizer, 8, "t")
    assert (stats.examples, stats.truncated, stats.dropped) == (0, 0, 2)
    assert [row for row, _ in stats.dropped_rows] == [1, 2] and stats.dropped_rows[1][1] == len(full_ids)


def test_pack_layout(tokenizer):
    docs = [[5, 6, 7], [8, 9, 10, 11, 12], [13, 14, 15, 16], [17, 18, 19, 20, 21, 22, 23, 24], [25]]
    examples = [{"input_ids": d, "labels": [IGNORE_INDEX] + d[1:]} for d in docs]
    rows = pack(examples, seq_len=10, pad_id=0)
    assert all(len(r[k]) == 10 for r in rows for k in ("input_ids", "labels", "position_ids"))
    # next-fit: [3 + 5] + pad 2 | [4] + pad 6 (the 8 does not fit) | [8 + 1] + pad 1
    assert [r["position_ids"] for r in rows] == [
        [0, 1, 2, 0, 1, 2, 3, 4, 0, 1],
        [0, 1, 2, 3, 0, 1, 2, 3, 4, 5],
        [0, 1, 2, 3, 4, 5, 6, 7, 0, 0],
    ]
    assert rows[0]["input_ids"] == [5, 6, 7, 8, 9, 10, 11, 12, 0, 0]
    assert rows[0]["labels"] == [-100, 6, 7, -100, 9, 10, 11, 12, -100, -100]
    # Every document whole, in order: cut each row at position 0 and drop the padding documents.
    pieces = []
    for r in rows:
        starts = [i for i, p in enumerate(r["position_ids"]) if p == 0] + [10]
        pieces += [r["input_ids"][a:b] for a, b in zip(starts, starts[1:])]
    assert [p for p in pieces if set(p) != {0}] == docs
    assert sum(r["input_ids"].count(0) for r in rows) == 3 * 10 - sum(len(d) for d in docs) == 9
    with pytest.raises(SFTDataError, match="example 0: 11 tokens"):
        pack([{"input_ids": list(range(11)), "labels": [IGNORE_INDEX] * 11}], 10, 0)
    with pytest.raises(SFTDataError, match="example 0: its first token has a label"):
        pack([{"input_ids": [1, 2], "labels": [1, 2]}], 10, 0)


def test_pad_batch():
    batch = pad_batch(
        [{"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [7], "labels": [-100]}],
        pad_id=0,
        pad_to_multiple_of=4,
    )
    assert batch["input_ids"].tolist() == [[4, 5, 6, 0], [7, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 0, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 5, 6, -100], [-100, -100, -100, -100]]
    assert all(t.dtype == torch.long for t in batch.values())


def doc_losses(logits, labels, bounds):
    """Summed next-token cross entropy of each [a, b) slice of one row (labels shifted by one)."""
    per_token = F.cross_entropy(logits[:-1].float(), labels[1:], ignore_index=IGNORE_INDEX, reduction="none")
    return torch.stack([per_token[a : b - 1].sum() for a, b in bounds])


def test_packed_and_unpacked_losses_are_equal(tokenizer):
    rows = [
        {"messages": CONVERSATION},
        {"instruction": "Say hi.", "output": "Hello! How can I help you today?"},
        {"instruction": "Write a short poem.", "input": "about the sea", "output": "The sea is four."},
    ]
    examples, stats = prepare(rows, tokenizer, 512, "t")
    lengths = [len(ex["input_ids"]) for ex in examples]
    seq_len = sum(lengths) + 5
    (row,) = pack(examples, seq_len, tokenizer.pad_token_id)
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
    )
    model = Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()
    starts = [sum(lengths[:k]) for k in range(3)]
    bounds = [(s, s + n) for s, n in zip(starts, lengths)]
    with torch.no_grad():
        alone = torch.cat(
            [
                doc_losses(
                    model(torch.tensor([ex["input_ids"]]), use_cache=False).logits[0],
                    torch.tensor(ex["labels"]),
                    [(0, len(ex["input_ids"]))],
                )
                for ex in examples
            ]
        )
        ids, labels, pos = (torch.tensor([row[k]]) for k in ("input_ids", "labels", "position_ids"))
        packed = doc_losses(model(ids, position_ids=pos, use_cache=False).logits[0], labels[0], bounds)
        # The shifted loss over the whole row equals the sum of the documents' losses: no token is
        # trained across a boundary (each document's first label is -100).
        whole = F.cross_entropy(
            model(ids, position_ids=pos, use_cache=False).logits[0, :-1],
            labels[0, 1:],
            ignore_index=IGNORE_INDEX,
            reduction="sum",
        )
        # transformers 5.x: with the default use_cache=True a cache is created and packing is not detected.
        leaky = doc_losses(model(ids, position_ids=pos).logits[0], labels[0], bounds)
    assert model.config._attn_implementation == "sdpa" and model.dtype == torch.float32 and (alone > 0).all()
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(whole, alone.sum(), rtol=1e-5, atol=1e-5)
    assert (leaky[1:] - alone[1:]).abs().min() > 1e-4, "packed rows attend across documents with use_cache=True"
    torch.testing.assert_close(leaky[0], alone[0], rtol=1e-5, atol=1e-5)


def test_load_rows_edge_files(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    bom = tmp_path / "bom.jsonl"
    bom.write_bytes(b"\xef\xbb\xbf" + (json.dumps(row) + "\n").encode() * 2)
    assert load_rows(bom) == [row, row]
    single = tmp_path / "one.json"
    single.write_text(json.dumps(row, indent=2))
    assert load_rows(single) == [row]
    wrapped = tmp_path / "wrapped.json"
    wrapped.write_text(json.dumps({"data": [row]}, indent=2))
    with pytest.raises(
        SFTDataError, match=r"holds one JSON object whose 'data' is a list of objects \(keys \['data'\]\)"
    ):
        load_rows(wrapped)
    receipt = {"id": "X1", "ocr_boxes": [[0, 0, 1, 0, 1, 1, 0, 1, "TOTAL 9.00"]], "entities": {"total": "9.00"}}
    one_line = tmp_path / "one_receipt.jsonl"  # a JSONL file of one row of a recipe's own format
    one_line.write_text(json.dumps(receipt) + "\n")
    assert load_rows(one_line) == [receipt]


# ----------------------------------------------------------------------------- content parts, tools, real templates
# The tiny tokenizers carry the real models' templates (scripts/make_tiny_sft.py): sha256 of the
# chat_template string of Qwen3's tokenizer_config.json (Qwen3-0.6B..14B) and of Qwen2.5-*-Instruct's.
REAL_TEMPLATES = {
    "qwen3": (
        ROOT / "recipes/qwen-fsdp2-sft/tiny/qwen3/chat_template.jinja",
        "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5",
    ),
    "qwen2.5": (
        ROOT / "recipes/qwen-ray-sft/tiny/qwen2/chat_template.jinja",
        "cd8e9439f0570856fd70470bf8889ebd8b5d1107207f67a5efb46e342330527f",
    ),
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]
CALL = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
TOOL_ROW = {
    "messages": [  # OpenAI style: typed text parts, arguments as a JSON string, null content
        {
            "role": "user",
            "content": [{"type": "text", "text": "What is the weather"}, {"type": "text", "text": "in Paris?"}],
        },
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}],
        },
        {"role": "tool", "content": '{"temp_c": 18}'},
        {"role": "assistant", "content": "It is 18 C in Paris."},
    ],
    "tools": TOOLS,
}
TOOL_MESSAGES = [
    {"role": "user", "content": "What is the weather\nin Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": '{"temp_c": 18}'},
    {"role": "assistant", "content": "It is 18 C in Paris."},
]
CALL_TEXT = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>'


def with_template(tokenizer, template):
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer.backend_tokenizer,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        clean_up_tokenization_spaces=False,
    )
    tok.chat_template = template
    return tok


def real_template(tokenizer, name):
    path, sha = REAL_TEMPLATES[name]
    template = path.read_text()
    assert hashlib.sha256(template.encode()).hexdigest() == sha, f"{path} is not {name}'s chat template"
    return with_template(tokenizer, template)


def labelled(tok, example):
    return [tok.decode(example["input_ids"][a:b]) for a, b in spans(example["labels"])]


def test_typed_text_parts_are_joined_and_other_parts_refused():
    assert to_messages(TOOL_ROW, 1, "t.jsonl")[0] == TOOL_MESSAGES[0]
    image = {
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What is this?"},
                    {"type": "image_url", "image_url": {"url": "a.png"}},
                ],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "A cat."}]},
        ]
    }
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 3: messages\[0\]\.content\[1\] is a part of type 'image_url', but "
        r"this data path trains on text only",
    ):
        to_messages(image, 3, "t.jsonl")
    with pytest.raises(SFTDataError, match=r"row 3: messages\[0\]\.content\[0\] must be an object with 'type'"):
        to_messages(
            {"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "yo"}]}, 3, "t.jsonl"
        )


def test_tool_rows_in_openai_and_llama_factory_form():
    messages, tools = to_conversation(TOOL_ROW, 1, "t.jsonl")
    assert messages == TOOL_MESSAGES and tools == TOOLS
    glaive = {
        "conversations": [  # LLaMA-Factory's ShareGPT: tools as a JSON string of bare definitions
            {"from": "human", "value": "What is the weather\nin Paris?"},
            {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Paris"}}'},
            {"from": "observation", "value": '{"temp_c": 18}'},
            {"from": "gpt", "value": "It is 18 C in Paris."},
        ],
        "tools": json.dumps([TOOLS[0]["function"]]),
        "system": "Use tools.",
    }
    assert to_conversation(glaive, 2, "g.json") == (
        [{"role": "system", "content": "Use tools."}, *TOOL_MESSAGES],
        TOOLS,
    )
    assert to_conversation({**glaive, "tools": ""}, 2, "g.json")[1] is None


@pytest.mark.parametrize(
    "edit, message",
    [
        (
            lambda r: r["messages"][1]["tool_calls"][0]["function"].update(arguments="{city: Paris"),
            "row 5: messages[1].tool_calls[0] arguments are not valid JSON",
        ),
        (
            lambda r: r["messages"][1]["tool_calls"][0].update(function={"arguments": {}}),
            'row 5: messages[1].tool_calls[0] must be {"type": "function"',
        ),
        (
            lambda r: r["messages"].pop(1),
            "row 5: messages[1] is a tool result, but no assistant tool call comes before it",
        ),
        (
            lambda r: r.update(tools={"name": "get_weather"}),
            "row 5: field 'tools' must be a list of function definitions",
        ),
        (lambda r: r.update(tools='[{"name": '), "row 5: field 'tools' is a string but not valid JSON"),
    ],
)
def test_bad_tool_rows_name_the_row_and_field(edit, message):
    row = json.loads(json.dumps(TOOL_ROW))
    edit(row)
    with pytest.raises(SFTDataError) as err:
        to_conversation(row, 5, "t.jsonl")
    assert message in str(err.value)


def test_tool_rows_with_qwen25s_template(tokenizer):
    tok = real_template(tokenizer, "qwen2.5")
    (ex,), stats = prepare([TOOL_ROW], tok, 4096, "t.jsonl")
    text = tok.decode(ex["input_ids"])
    assert (
        text.startswith(
            "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n"
        )
        and json.dumps(TOOLS[0]) in text
    )
    assert '<|im_start|>user\n<tool_response>\n{"temp_c": 18}\n</tool_response><|im_end|>' in text
    # Loss on both assistant turns (the call and the answer), none on the tool result.
    assert labelled(tok, ex) == [CALL_TEXT, "It is 18 C in Paris.<|im_end|>"]
    assert stats.examples == 1 and stats.loss_tokens == sum(b - a for a, b in spans(ex["labels"]))


def test_tool_calls_are_counted_in_the_summary_and_the_shown_counts(tokenizer):
    from cookbook.sft.data import _field_counts as field_counts

    tok = real_template(tokenizer, "qwen2.5")
    two = {
        "messages": [
            TOOL_ROW["messages"][0],
            {"role": "assistant", "content": None, "tool_calls": [CALL, CALL]},
            {"role": "tool", "content": "18"},
            {"role": "tool", "content": "18"},
            TOOL_ROW["messages"][3],
        ],
        "tools": TOOLS,
    }
    _, stats = prepare([TOOL_ROW, {"messages": CONVERSATION, "id": 2}, two], tok, 4096, "t.jsonl")
    assert (stats.tool_call_rows, stats.tool_calls) == (2, 3)
    assert stats.ignored == {"id": 1}  # a row's own key that no format reads is counted too
    assert (
        "t.jsonl: 3 rows read, 3 examples kept (0 truncated to max_length=4096), 0 dropped, tool calls: 3 in 2 kept rows, "
        "keys not used: id (1) |" in stats.summary()
    )
    assert "  tool calls      3 in 2 kept rows" in field_counts(stats)
    merged = SFTStats.merge([stats, prepare([TOOL_ROW], tok, 4096, "u.jsonl")[1]])
    assert (merged.tool_call_rows, merged.tool_calls) == (3, 4)


def test_tool_calls_are_counted_as_training_keeps_them(tokenizer):
    """Issue 34: a tool row dropped by data.max_length (within max_dropped_fraction), or a kept row whose tool call
    lies past the cut, trains no tool call: the summary counts them apart, not with the kept ones."""
    from cookbook.sft.data import _field_counts as field_counts

    tok = real_template(tokenizer, "qwen2.5")
    chat = {"messages": CONVERSATION}
    late = {
        "messages": [
            *CONVERSATION,
            {"role": "user", "content": "The weather?"},
            TOOL_MESSAGES[1],
            TOOL_MESSAGES[2],
            TOOL_MESSAGES[3],
        ],
        "tools": TOOLS,
    }
    (tool_ex,), _ = prepare([TOOL_ROW], tok, 4096, "t.jsonl")
    first_label = spans(tool_ex["labels"])[0][0]  # cut there, TOOL_ROW keeps no labelled token: dropped
    _, dropped = prepare([chat, TOOL_ROW, chat], tok, first_label, "t.jsonl", max_dropped_fraction=0.5)
    assert (dropped.examples, dropped.dropped, dropped.dropped_rows[0][0]) == (2, 1, 2)
    assert (dropped.tool_calls, dropped.tool_call_rows, dropped.tool_calls_cut) == (0, 0, 1)
    assert "tool calls: 0 in 0 kept rows, 1 more not trained (dropped or cut at max_length)" in dropped.summary()
    assert "  tool calls      0 in 0 kept rows, 1 more not trained (dropped or cut at max_length)" in field_counts(
        dropped
    )
    (full,), _ = prepare([late], tok, 4096, "t.jsonl")
    call_start = spans(full["labels"])[2][0]  # the third labelled turn is the tool call
    (ex,), cut = prepare([late], tok, call_start, "t.jsonl")  # kept, cut before its tool call
    assert (cut.examples, cut.truncated, cut.tool_calls, cut.tool_call_rows, cut.tool_calls_cut) == (1, 1, 0, 0, 1)
    _, kept = prepare([chat, TOOL_ROW, late], tok, 4096, "t.jsonl")
    assert (kept.tool_calls, kept.tool_call_rows, kept.tool_calls_cut) == (2, 2, 0)
    assert (
        SFTStats.merge([dropped, cut, kept]).tool_calls_note() == "tool calls: 2 in 2 kept rows, 2 more not trained "
        "(dropped or cut at max_length)"
    )


def test_tool_rows_with_qwen3s_template_need_split_turns(tokenizer):
    tok = real_template(tokenizer, "qwen3")
    kwargs = {"enable_thinking": False}
    # The call turn gets an empty <think> block only while it is the last turn: not prefix-stable.
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: the chat template is not prefix-stable: .*"
        r"set data\.split_turns=true",
    ):
        prepare([TOOL_ROW], tok, 4096, "t.jsonl", kwargs)
    (call, answer), stats = prepare([TOOL_ROW], tok, 4096, "t.jsonl", kwargs, split_turns=True)
    assert (stats.rows, stats.split_rows, stats.examples, stats.example_rows) == (1, 1, 2, [1, 1])
    assert labelled(tok, call) == [CALL_TEXT] and labelled(tok, answer) == ["It is 18 C in Paris.<|im_end|>"]
    think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(call["input_ids"]).endswith(think + CALL_TEXT + "\n")
    # As the model sees it when it writes the answer: the earlier call without its <think> block.
    assert (
        f'<|im_start|>assistant\n{CALL_TEXT}\n<|im_start|>user\n<tool_response>\n{{"temp_c": 18}}\n</tool_response>'
        f"<|im_end|>\n{think}It is 18 C in Paris.<|im_end|>\n"
    ) in tok.decode(answer["input_ids"])
    assert all(json.dumps(TOOLS[0]) in tok.decode(ex["input_ids"]) for ex in (call, answer))


def test_templates_that_drop_tools_calls_or_results_are_refused(tokenizer):
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: the chat template does not render the row's tools: the "
        r"tool 'get_weather' is missing from the rendered conversation",
    ):
        prepare([TOOL_ROW], tokenizer, 4096, "t.jsonl")
    without_tools = {"messages": TOOL_ROW["messages"]}
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: the chat template does not render tool calls: messages\[1\] "
        r"calls 'get_weather' but its rendered turn is '<\|im_end\|>'",
    ):
        prepare([without_tools], tokenizer, 4096, "t.jsonl")
    no_results = with_template(
        tokenizer,
        CHATML.replace(
            "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}",
            "{%- if message['role'] != 'tool' %}{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] }}"
            "{%- for call in message.get('tool_calls', []) %}{{- call['function']['name'] }}{%- endfor %}"
            "{{- '<|im_end|>\\n' }}{%- endif %}",
        ),
    )
    with pytest.raises(SFTDataError, match=r"row 1: the chat template does not render tool results: messages\[2\]"):
        prepare([without_tools], no_results, 4096, "t.jsonl")
    # A result written JSON-quoted (Llama 3.1's template applies tojson to it) is rendered.
    quoted = with_template(
        tokenizer,
        no_results.chat_template.replace(
            "{%- if message['role'] != 'tool' %}",
            "{%- if message['role'] == 'tool' %}{{- message['content'] | tojson }}{%- else %}",
        ),
    )
    (ex,), _ = prepare([without_tools], quoted, 4096, "t.jsonl")
    assert '"{\\"temp_c\\": 18}"' in quoted.decode(ex["input_ids"])


def test_split_turns_labels_each_turn_once(tokenizer):
    ids, labels, _ = tokenize_conversation(tokenizer, CONVERSATION, 1000)
    (first, second), stats = prepare([{"messages": CONVERSATION}], tokenizer, 1000, "t", split_turns=True)
    assert (stats.split_rows, stats.examples) == (1, 2)
    assert (first["input_ids"], first["labels"]) == tokenize_conversation(tokenizer, CONVERSATION[:3], 1000)[:2]
    assert second["input_ids"] == ids and spans(second["labels"]) == spans(labels)[1:]
    assert spans(first["labels"]) == spans(labels)[:1]
    assert stats.tokens == len(first["input_ids"]) + len(ids)


# ----------------------------------------------------------------------------- rows dropped for length
def test_dropped_rows_are_counted_named_and_refused_over_the_limit(tokenizer, monkeypatch):
    rows = [{"instruction": "Say hi.", "output": "Hi!"}] * 10
    rows[3] = {"instruction": "What is the capital of France? " * 8, "output": "Paris."}
    rows[8] = {"instruction": "What is the capital of France? " * 12, "output": "Paris."}
    long4, long9 = (len(tokenize_conversation(tokenizer, to_messages(rows[i], i + 1, "t"), 10_000)[0]) for i in (3, 8))
    assert 40 < long4 < long9 - 1
    examples, stats = prepare(rows, tokenizer, 40, "train.jsonl", max_dropped_fraction=0.2)
    assert (len(examples), stats.examples, stats.truncated, stats.dropped, stats.dropped_fraction) == (8, 8, 0, 2, 0.2)
    assert stats.dropped_rows == [(4, long4), (9, long9)] and stats.example_rows == [1, 2, 3, 5, 6, 7, 8, 10]
    assert stats.summary().startswith(
        f"train.jsonl: 10 rows read, 8 examples kept (0 truncated to max_length=40), 2 dropped (cut by max_length "
        f"before any assistant token: row 9 ({long9} tokens), row 4 ({long4} tokens)) | "
    )
    with pytest.raises(SFTDataError) as err:
        prepare(rows, tokenizer, 40, "train.jsonl", max_dropped_fraction=0.1)
    assert str(err.value) == (
        f"train.jsonl: 2 of 10 rows dropped (20%, more than data.max_dropped_fraction=0.1): 2 cut by "
        f"data.max_length=40 before any assistant token, longest row 9 ({long9} tokens), row 4 ({long4} tokens): raise "
        f"data.max_length (to {long9} to keep them all, within the model's max_position_embeddings); or raise "
        f"data.max_dropped_fraction"
    )
    # with the model's positions known (sft.load_tokenizer sets them), the advice stays within them
    for limit, advice in [
        (long9, f"to {long9} to keep them all"),
        (long4, f"at most to {long4}, the model's max_position_embeddings: 1 of them are longer"),
    ]:
        monkeypatch.setattr(tokenizer, "cookbook_max_positions", limit, raising=False)
        with pytest.raises(SFTDataError, match=re.escape(f"raise data.max_length ({advice}); or raise data.max_")):
            prepare(rows, tokenizer, 40, "train.jsonl", max_dropped_fraction=0.1)
    monkeypatch.undo()
    # truncate=False drops a row that does not fit instead of cutting it (an answer that is useless when cut).
    _, stats = prepare(rows, tokenizer, long9 - 1, "t", truncate=False)
    assert (stats.examples, stats.truncated, stats.dropped_rows) == (9, 0, [(9, long9)])
    _, stats = prepare(rows, tokenizer, long9 - 1, "t")
    assert (stats.examples, stats.truncated, stats.dropped) == (10, 1, 0)


# ----------------------------------------------------------------------------- files: BOM, CRLF, line numbers
def test_bom_crlf_and_line_numbers(tmp_path):
    rows = [{"instruction": "a", "output": "b\u2028c"}, {"messages": CONVERSATION}]
    bom = b"\xef\xbb\xbf"
    (tmp_path / "d.json").write_bytes(bom + json.dumps(rows, indent=1).replace("\n", "\r\n").encode())
    # U+2028 is allowed unescaped in a JSON string; str.splitlines would break the line there.
    (tmp_path / "d.jsonl").write_bytes(bom + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows).encode())
    assert load_rows(tmp_path / "d.json") == rows
    assert load_rows(tmp_path / "d.jsonl") == rows
    (tmp_path / "bad.jsonl").write_bytes(
        bom + b'{"instruction": "a", "output": "b"}\r\n\r\n{"instruction": "\xe2\x80\xa8"}\r\n{"instruction": \r\n'
    )
    with pytest.raises(SFTDataError, match=r"bad\.jsonl line 4: not valid JSON"):  # 1-based, blank lines counted
        load_rows(tmp_path / "bad.jsonl")


def test_jsonl_row_errors_and_counts_name_the_editors_line(tmp_path, tokenizer):
    good = json.dumps({"messages": CONVERSATION[1:3]})
    bad = json.dumps({"messages": [CONVERSATION[1], {"role": "asistant", "content": "Paris."}]})
    empty = json.dumps({"instruction": "Say hi.", "output": ""})
    lines = [good] * 4 + [""] + [good] * 12 + ["  "] + [bad]  # 16 rows and two blank lines: the bad row 17 is line 19
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    rows = load_rows(tmp_path / "d.jsonl")
    assert (rows.label(5), rows.label(17), len(rows)) == ("line 6", "line 19", 17)
    with pytest.raises(SFTDataError, match=rf"^{tmp_path / 'd.jsonl'} line 19: messages\[1\]\.role is 'asistant'"):
        prepare(rows, tokenizer, 64, str(tmp_path / "d.jsonl"))
    (tmp_path / "e.jsonl").write_text("\n".join([good, "", empty, good]) + "\n")
    stats = prepare(load_rows(tmp_path / "e.jsonl"), tokenizer, 64, "e.jsonl")[1]
    assert (stats.empty_answers, stats.example_rows) == ([2], [1, 3])  # 1-based rows; messages name lines
    assert "skipped with an empty answer (lines 3)" in stats.summary()
    (tmp_path / "a.json").write_text(json.dumps([json.loads(good)] * 2 + [json.loads(bad)], indent=1))
    with pytest.raises(SFTDataError, match=r"a\.json row 3: messages\[1\]\.role is 'asistant'"):  # a JSON array
        prepare(load_rows(tmp_path / "a.json"), tokenizer, 64, str(tmp_path / "a.json"))


def test_hub_and_local_folder_rows_lose_the_bom(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "cache")
    for kind, data in (
        ("csv", b"instruction,output\r\nSay hi.,Hi!\r\n"),
        ("jsonl", b'{"instruction": "Say hi.", "output": "Hi!"}\r\n'),
    ):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / f"train.{kind}").write_bytes(b"\xef\xbb\xbf" + data)
        assert load_hub_rows(str(folder)) == [{"instruction": "Say hi.", "output": "Hi!"}]


def test_load_rows_refuses_a_table_by_its_file_type(tmp_path):
    (table := tmp_path / "rows.csv").write_text("instruction,output\nhi,there\n")
    with pytest.raises(
        SFTDataError, match=r"rows\.csv: unsupported file type '\.csv' for rows \(use \.json or \.jsonl\)$"
    ):
        load_rows(table)


def test_load_rows_names_a_folder_a_utf16_file_and_the_column_of_bad_json(tmp_path):
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    with pytest.raises(SFTDataError, match=rf"^{tmp_path} is a folder: give the data files in it"):
        load_rows(tmp_path)
    utf16 = tmp_path / "utf16.jsonl"
    utf16.write_text(json.dumps(row) + "\n", encoding="utf-16")
    with pytest.raises(SFTDataError, match=rf"^{utf16} line 1: not UTF-8 text \(.*\); save it as UTF-8$"):
        load_rows(utf16)
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(row) + "\n" + '{"messages": [{"role": "user", "content": "unterminated\n')
    with pytest.raises(
        SFTDataError,
        match=rf"^{broken} line 2: not valid JSON: Unterminated string starting at "
        rf"\(column 43\)$",
    ):  # the opening quote
        load_rows(broken)


def test_pad_token_id_falls_back_to_the_end_of_sequence_token(tokenizer):
    assert pad_token_id(tokenizer) == tokenizer.convert_tokens_to_ids("<|endoftext|>")
    no_pad = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    assert no_pad.pad_token_id is None and pad_token_id(no_pad) == tokenizer.convert_tokens_to_ids("<|im_end|>")


def test_collate_packed_rows_carry_document_offsets_and_other_rows_are_padded():
    rows = [
        {"input_ids": [5] * 6, "labels": [-100] * 6, "position_ids": [0, 1, 2, 0, 1, 0]},
        {"input_ids": [6] * 6, "labels": [-100] * 6, "position_ids": [0, 1, 2, 3, 4, 5]},
    ]
    batch = collate(rows, pad_id=0)
    assert sorted(batch) == ["cu_seq_lens", "input_ids", "labels", "position_ids"]
    assert batch["cu_seq_lens"].tolist() == [0, 3, 5, 6, 12] and batch["cu_seq_lens"].dtype == torch.int32
    assert batch["input_ids"].shape == (2, 6) and batch["input_ids"].dtype == torch.long
    assert sorted(collate(rows, pad_id=0, cu_seq_lens=False)) == ["input_ids", "labels", "position_ids"]
    padded = collate([{"input_ids": [4, 5, 6], "labels": [-100, 5, 6]}, {"input_ids": [7], "labels": [-100]}], pad_id=1)
    assert padded["input_ids"].tolist() == [[4, 5, 6] + [1] * 5, [7] + [1] * 7]  # a multiple of 8
    assert padded["attention_mask"].sum().item() == 4 and "cu_seq_lens" not in padded


def tiny_qwen3(vocab_size: int, **overrides) -> Qwen3ForCausalLM:
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        **overrides,
    )
    return Qwen3ForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32).eval()


def hand_loss(model, ids: list[int], labels: list[int]) -> tuple[float, int, int]:
    """One example alone: summed -log p(label t | tokens < t) over labelled t, their number, and how many are
    the argmax."""
    with torch.no_grad():
        logp = model(torch.tensor([ids]), use_cache=False).logits[0].double().log_softmax(-1)
    total, n, correct = 0.0, 0, 0
    for t in range(1, len(ids)):
        if labels[t] != IGNORE_INDEX:
            total -= logp[t - 1, labels[t]].item()
            n += 1
            correct += int(logp[t - 1].argmax().item() == labels[t])
    return total, n, correct


def test_token_loss_sum_and_evaluate_equal_a_hand_computation(tokenizer):
    rows = [
        {"messages": CONVERSATION},
        {"instruction": "Say hi.", "output": "Hello! How can I help you today?"},
        {"instruction": "Write a short poem.", "input": "about the sea", "output": "The sea is four."},
    ]
    examples, _ = prepare(rows, tokenizer, 512, "t")
    model = tiny_qwen3(len(tokenizer))
    hand = [hand_loss(model, ex["input_ids"], ex["labels"]) for ex in examples]
    total, n, correct = (sum(h[i] for h in hand) for i in range(3))
    pad_id = pad_token_id(tokenizer)
    packed = collate(pack(examples, 512, pad_id), pad_id)  # one row, three documents
    padded = collate(examples[:2], pad_id)
    with torch.no_grad():
        assert token_loss_sum(model, packed).item() == pytest.approx(total, rel=1e-5)
        assert token_loss_sum(model, padded).item() == pytest.approx(hand[0][0] + hand[1][0], rel=1e-5)
        sums = token_loss_sums(model, packed)
    assert (sums["tokens"].item(), sums["correct"].item()) == (n, correct) and n > 20
    assert sums["loss_sum"].item() == pytest.approx(total, rel=1e-5)
    # Unequal batches, one process: the mean over tokens, not over batches.
    seen = []
    model.train()
    result = evaluate(
        model,
        [padded, collate(examples[2:], pad_id)],
        torch.device("cpu"),
        on_batch=lambda b: seen.append(b["input_ids"].shape[0]),
        accuracy=True,
    )
    assert model.training and seen == [2, 1]
    assert result["tokens"] == n and result["loss"] == pytest.approx(total / n, rel=1e-5)
    assert result["mean_token_accuracy"] == pytest.approx(correct / n)
    assert sorted(evaluate(model, [], torch.device("cpu"))) == ["loss", "tokens"]


def _full_ce_and_grads(hidden, weight, labels, scale, softcap=None):
    """The reference, in float64: the logits of every row, F.cross_entropy summed, times `scale`, and its gradients."""
    h, w = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    logits = h @ w.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    loss = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
    (loss * scale).backward()
    return loss.detach(), h.grad, w.grad


@pytest.mark.parametrize("chunk_size", [1, 7, 16, 40, 1000])  # 7 does not divide 40 rows; 1000 > 40: one chunk
def test_chunked_linear_cross_entropy_equals_the_full_loss_and_its_gradients(chunk_size):
    torch.manual_seed(1)
    hidden, weight = torch.randn(40, 24), torch.randn(96, 24) * 0.5
    labels = torch.randint(0, 96, (40,))
    labels[7:14] = IGNORE_INDEX  # with chunk_size 7: rows 7-13 are one chunk without any label
    labels[30] = IGNORE_INDEX
    rows = int((labels != IGNORE_INDEX).sum())
    for softcap in (None, 5.0):  # Gemma 2's final_logit_softcapping
        want, want_h, want_w = _full_ce_and_grads(hidden, weight, labels, 0.37, softcap)
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        got = linear_cross_entropy_sum(h, w, labels, chunk_size, softcap=softcap)
        (got * 0.37).backward()  # the recipe scales the summed loss by world size / global tokens
        # fp32 against the float64 reference: the loss sums the rows' losses, h's gradient the 96 classes, w's the rows
        assert got.dtype == torch.float32 and got.item() == pytest.approx(want.item(), rel=fp32_sum_rtol(rows))
        assert_fp32_close(h.grad, want_h, terms=96)
        assert_fp32_close(w.grad, want_w, terms=rows)
        assert h.grad[7:14].abs().max() == 0 and h.grad[30].abs().max() == 0 and h.grad[0].abs().max() > 0
        with torch.no_grad():  # no gradients wanted: loss only
            assert linear_cross_entropy_sum(
                hidden, weight, labels, chunk_size, softcap=softcap
            ).item() == pytest.approx(want.item(), rel=fp32_sum_rtol(rows))
    all_ignored = torch.full((40,), IGNORE_INDEX)
    h = hidden.clone().requires_grad_()
    loss = linear_cross_entropy_sum(h, weight, all_ignored, chunk_size)
    loss.backward()
    assert loss.item() == 0 and h.grad.abs().max() == 0


def test_chunked_linear_cross_entropy_with_tied_weights_and_bad_input():
    """Tied weights: the embedding's gradient is the sum of the lookup's and the loss's, as with the full loss."""
    torch.manual_seed(2)
    ids, labels = torch.randint(0, 50, (30,)), torch.randint(0, 50, (30,))
    labels[::4] = IGNORE_INDEX
    grads = []
    for chunked in (False, True):  # the full loss in float64 (the reference), the chunked one in fp32
        embed = torch.nn.Embedding(50, 16)
        torch.nn.init.normal_(embed.weight, generator=torch.Generator().manual_seed(3))
        embed = embed if chunked else embed.double()
        hidden = torch.tanh(embed(ids))  # a stand-in for the decoder
        if chunked:
            loss = linear_cross_entropy_sum(hidden, embed.weight, labels, 8)
        else:
            loss = F.cross_entropy(hidden @ embed.weight.t(), labels, ignore_index=IGNORE_INDEX, reduction="sum")
        loss.backward()
        grads.append((loss.item(), embed.weight.grad))
    # the loss sums the 30 rows' losses; an embedding row's gradient sums its lookups' and the 30 rows' terms
    assert grads[1][0] == pytest.approx(grads[0][0], rel=fp32_sum_rtol(30))
    assert_fp32_close(grads[1][1], grads[0][1], terms=2 * 30)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        linear_cross_entropy_sum(torch.zeros(3, 4), torch.zeros(5, 4), torch.zeros(3, dtype=torch.long), 0)
    with pytest.raises(ValueError, match=r"got \(3, 4\), \(5, 2\) and \(3,\)"):
        linear_cross_entropy_sum(torch.zeros(3, 4), torch.zeros(5, 2), torch.zeros(3, dtype=torch.long), 2)
    with pytest.raises(ValueError, match="not gathered"):  # a ZeRO-3 partition outside the forward
        linear_cross_entropy_sum(torch.zeros(3, 4), torch.zeros(0, 4), torch.zeros(3, dtype=torch.long), 2)


@pytest.mark.parametrize("tied", [False, True])
def test_chunked_token_loss_sum_equals_the_full_one_on_a_model(tokenizer, tied):
    """The model path: logits_to_keep empty, the decoder's output caught, labelled positions only. The loss and every
    parameter's gradient equal the full loss's (packed documents, padding without labels; tied embeddings)."""
    rows = [
        {"messages": CONVERSATION},
        {"instruction": "Say hi.", "output": "Hello! How can I help you today?"},
        {"instruction": "Write a short poem.", "input": "about the sea", "output": "The sea is four."},
    ]
    examples, _ = prepare(rows, tokenizer, 512, "t")
    pad_id = pad_token_id(tokenizer)
    batch = collate(pack(examples, 96, pad_id), pad_id)  # 2 rows, the second padded
    assert batch["input_ids"].shape[0] == 2
    reference = tiny_qwen3(len(tokenizer), tie_word_embeddings=tied).train().double()  # the full loss in float64
    logits = reference(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    loss = F.cross_entropy(
        logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    loss.backward()
    full = loss.item()
    full_grads = {n: p.grad for n, p in reference.named_parameters()}
    tokens, labelled = batch["input_ids"].numel(), int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    for chunk_size in (0, 5, 4096):
        model = tiny_qwen3(len(tokenizer), tie_word_embeddings=tied).train()
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
        projected = []  # positions the head projects inside the model: all (full) or none (chunked)
        model.lm_head.register_forward_hook(lambda _m, args, _out: projected.append(args[0].shape[1]))
        loss = token_loss_sum(model, batch, chunk_size)
        loss.backward()
        assert projected == [0 if chunk_size else 96]
        assert loss.item() == pytest.approx(full, rel=fp32_sum_rtol(labelled))
        for name, p in model.named_parameters():
            assert_fp32_close(p.grad, full_grads[name], terms=tokens, msg=f"chunk_size {chunk_size}: {name}")
    with torch.no_grad():  # evaluation: no gradients computed
        assert chunked_token_loss_sum(
            tiny_qwen3(len(tokenizer), tie_word_embeddings=tied), batch, 8
        ).item() == pytest.approx(full, rel=fp32_sum_rtol(labelled))


def test_varlen_is_registered_with_transformers(tokenizer):
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    register_varlen()
    assert AttentionInterface._global_mapping["varlen"] is varlen_attention
    assert AttentionMaskInterface._global_mapping["varlen"]() is None
    with pytest.raises(ValueError, match="attention dropout"):
        varlen_attention(torch.nn.Linear(1, 1), *(torch.zeros(1, 2, 4, 8),) * 3, None, dropout=0.1)


def test_check_helpers_name_the_field_and_the_counts(tmp_path):
    check_one_step(8, 2, 2, 2)
    with pytest.raises(ConfigError, match=r"^7 training rows \(after x\) are too few for one step of 2 x 2 x 2 rows$"):
        check_one_step(7, 2, 2, 2, note=" (after x)")
    with pytest.raises(ConfigError, match="model.name_or_path: folder not found: /no/such/model"):
        load_tokenizer("/no/such/model", "/no/such/model")
    with pytest.raises(ConfigError, match=f"model.tokenizer: folder not found: {tmp_path / 'tok'}"):
        load_tokenizer(str(tmp_path / "tok"), str(ROOT / "recipes" / "qwen-fsdp2-sft" / "tiny" / "qwen3"))
    qwen3 = str(ROOT / "recipes" / "qwen-fsdp2-sft" / "tiny" / "qwen3")
    assert len(load_tokenizer(qwen3, qwen3, max_length=512)) > 0
    with pytest.raises(
        ConfigError,
        match=r"^data\.max_length=8192 is beyond the max_position_embeddings=512 of .*qwen3: "
        r"the model has no trained positions past 512; set data\.max_length to 512",
    ):
        load_tokenizer(qwen3, qwen3, max_length=8192)


THINK_ROW = {
    "messages": [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four.", "reasoning_content": "Two plus two: four."},
    ]
}


def test_reasoning_is_rendered_through_the_template_and_trained_masked_or_dropped_counted(tokenizer):
    tok = real_template(tokenizer, "qwen3")
    (ex,), st = prepare([THINK_ROW], tok, 4096, "t.jsonl", {"enable_thinking": True})
    assert labelled(tok, ex) == ["<think>\nTwo plus two: four.\n</think>\n\nIt is four.<|im_end|>"]
    assert (st.reasoning_turns, st.reasoning_dropped) == (1, 0) and "reasoning: 1 turns trained" in st.summary()
    (ctx,), st = prepare([THINK_ROW], tok, 4096, "t.jsonl", {"enable_thinking": True}, reasoning="context")
    assert ctx["input_ids"] == ex["input_ids"] and labelled(tok, ctx) == ["\n</think>\n\nIt is four.<|im_end|>"]
    (drop,), st = prepare([THINK_ROW], tok, 4096, "t.jsonl", {"enable_thinking": True}, reasoning="drop")
    assert "Two plus two" not in tok.decode(drop["input_ids"]) and st.reasoning_dropped == 1
    assert "reasoning: 1 turns dropped (data.reasoning=drop)" in st.summary()
    # Typed parts in other layouts: text under "value", a reasoning part, a tool_call part; unknown ones named.
    typed = {
        "messages": [
            {"role": "user", "content": [{"type": "text", "value": "What is two plus two?"}]},
            {
                "role": "assistant",
                "content": [
                    {"type": "reasoning", "text": "Two plus two: four."},
                    {"type": "text", "value": "It is four."},
                ],
                "weight": 1,
            },
        ]
    }
    counted = __import__("collections").Counter()
    assert to_conversation(typed, 1, "t.jsonl", counted)[0] == [
        {"role": "user", "content": "What is two plus two?"},
        {"role": "assistant", "content": "It is four.", "reasoning_content": "Two plus two: four."},
    ]
    assert counted == {"messages[].weight": 1}
    call = {
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {
                "role": "assistant",
                "content": [{"type": "tool_call", "name": "get_weather", "arguments": {"city": "Paris"}}],
            },
        ]
    }
    assert to_conversation(call, 1, "t.jsonl")[0][1]["tool_calls"] == [
        {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    ]
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 2: messages\[1\]\.content\[0\] is a part of type 'refusal'; "
        r"expected one of 'text', ",
    ):
        to_conversation(
            {
                "messages": [
                    THINK_ROW["messages"][0],
                    {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
                ]
            },
            2,
            "t.jsonl",
        )
    with pytest.raises(
        SFTDataError,
        match=r"row 2: messages\[0\]\.content\[0\] \(type 'text'\) has no string 'text' / "
        r"'value' / 'content' \(keys found: \['txt', 'type'\]\)",
    ):
        to_conversation(
            {"messages": [{"role": "user", "content": [{"type": "text", "txt": "hi"}]}, THINK_ROW["messages"][1]]},
            2,
            "t.jsonl",
        )


def test_reasoning_left_out_or_dropped_is_counted_as_training_keeps_it(tokenizer):
    """Issue 34: a turn whose reasoning data.reasoning=drop removed (or the template left out) counts only when
    training keeps it: not for an example dropped by data.max_length, nor for a turn past the cut."""
    from cookbook.sft.data import _field_counts as field_counts

    chat = {"messages": [{"role": "user", "content": "Two?"}, {"role": "assistant", "content": "Four."}]}
    (ex,), _ = prepare([THINK_ROW], tokenizer, 4096, "t.jsonl", reasoning="drop")
    first_label = spans(ex["labels"])[0][0]  # cut there, THINK_ROW keeps no labelled token: dropped
    _, st = prepare(
        [chat, THINK_ROW, chat], tokenizer, first_label, "t.jsonl", reasoning="drop", max_dropped_fraction=0.5
    )
    assert (st.examples, st.dropped, st.reasoning_dropped) == (2, 1, 0)
    assert "reasoning" not in st.summary() and "0 dropped (data.reasoning=drop)" in "\n".join(field_counts(st))
    _, st = prepare([chat, THINK_ROW], tokenizer, 4096, "t.jsonl", reasoning="drop")
    assert st.reasoning_dropped == 1 and "reasoning: 1 turns dropped (data.reasoning=drop)" in st.summary()
    st = SFTStats(max_length=4)
    st.add(1, [1, 2, 3, 4, 5, 6], [-100, 2, 3, -100, 5, 6], unrendered=[1, 4], dropped=[4])  # the second turn cut
    assert (st.examples, st.truncated, st.reasoning_unrendered, st.reasoning_dropped) == (1, 1, 1, 0)
    assert st.add(2, [1, 2, 3, 4, 5], [-100] * 4 + [5], unrendered=[4], dropped=[4]) is None
    assert (st.reasoning_unrendered, st.reasoning_dropped) == (1, 0)


def test_reasoning_a_template_cannot_render_is_refused_and_a_stray_think_tag_named(tokenizer):
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: messages\[1\] has reasoning, but the chat template has no "
        r"place for it .*set data\.reasoning=drop",
    ):
        prepare([THINK_ROW], tokenizer, 4096, "t.jsonl")
    (ex,), st = prepare([THINK_ROW], tokenizer, 4096, "t.jsonl", reasoning="drop")
    assert st.reasoning_dropped == 1 and labelled(tokenizer, ex) == ["It is four.<|im_end|>"]
    tok = real_template(tokenizer, "qwen3")
    with pytest.raises(SFTDataError, match=r"enable_thinking: false"):
        prepare([THINK_ROW], tok, 4096, "t.jsonl", {"enable_thinking": False})
    stray = {"messages": [THINK_ROW["messages"][0], {"role": "assistant", "content": "Four.</think> It is four."}]}
    with pytest.raises(
        SFTDataError,
        match=r"^t\.jsonl row 1: messages\[1\]\.content \(assistant\) holds a stray "
        r"'</think>'",
    ) as err:
        prepare([stray], tok, 4096, "t.jsonl", {"enable_thinking": False}, split_turns=True)
    assert "split_turns" not in str(err.value)
    # an inline <think> block (DeepSeek-R1-style rows) is reasoning: the same example as reasoning_content gives
    inline = {
        "messages": [
            THINK_ROW["messages"][0],
            {"role": "assistant", "content": "<think>\nTwo plus two: four.\n</think>\n\nIt is four."},
        ]
    }
    assert (
        prepare([inline], tok, 4096, "t.jsonl", {"enable_thinking": True})[0]
        == prepare([THINK_ROW], tok, 4096, "t.jsonl", {"enable_thinking": True})[0]
    )


def test_a_checkpoint_from_before_data_reasoning_resumes_at_its_default():
    from cookbook.checkpoint import config_changes
    from cookbook.sft import MAY_CHANGE

    old = {"data": {"max_length": 64}}
    assert config_changes(old, {"data": {"max_length": 64, "reasoning": "train"}}, MAY_CHANGE) == ""
    assert (
        config_changes(old, {"data": {"max_length": 64, "reasoning": "drop"}}, MAY_CHANGE)
        == "data.reasoning: None -> 'drop'"
    )
