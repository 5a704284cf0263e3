"""Supervised fine-tuning (SFT) data for causal language models: rows -> chat messages ->
token ids with assistant-only labels -> packed or padded batches.

Pipeline, as a recipe uses it::

    rows = load_rows("train.jsonl")                                   # JSON list or JSONL
    examples, stats = prepare(rows, tokenizer, max_length=2048, source="train.jsonl",
                              max_dropped_fraction=0.1)
    check_vocab(tokenizer, model.config.vocab_size)
    packed = pack(examples, seq_len=2048, pad_id=tokenizer.pad_token_id)   # or pad_batch(...)

Accepted row formats (`to_conversation`): chat ``{"messages": [{"role", "content"}], "tools": [...]}``
(OpenAI style: typed text parts with ``text`` or ``value``, reasoning and tool-call parts, ``tool_calls``,
``tool`` results; an assistant turn's ``reasoning_content`` / ``thinking`` / ``reasoning``), Alpaca
``{"instruction", "input", "output"}`` and ShareGPT ``{"conversations": [{"from", "value"}], "tools": ...}``
(LLaMA-Factory style, with ``function_call`` / ``observation`` turns).

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` (the model
shifts them by one), and `IGNORE_INDEX` (-100) marks tokens without loss. Only the tokens an
assistant turn adds to the rendered chat carry labels: its content (and tool calls) and the
end-of-turn token the template writes after it (``<|im_end|>`` for ChatML), not the
``<|im_start|>assistant\\n`` header nor the newline after ``<|im_end|>``; tool results carry none.
Invalid input raises one `SFTDataError` that names the file, the row (1-based) and the field.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

from cookbook.tabular import not_utf8

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
ROLES = ("system", "user", "assistant")  # plain chat turns; "tool" (a tool's result) is accepted too
_CHAT_ROLES = (*ROLES, "tool")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                   "function_call": "assistant", "observation": "tool", "tool": "tool"}


class SFTDataError(ValueError):
    """A data file, row or tokenizer is unusable for SFT; the message names the file, row and field."""


# ----------------------------------------------------------------------------- rows -> messages
def load_rows(path: str | Path) -> list[dict]:
    """Read a data file: a JSON array of objects (first non-blank character ``[``), JSONL, or a
    single row object. A UTF-8 byte-order mark is ignored, and so are CRLF line ends.

    JSONL lines are split at ``\\n`` only (not at the other line breaks `str.splitlines` knows,
    such as U+2028, which JSON allows unescaped inside strings), so line numbers are an editor's.

    Raises:
        SFTDataError: the file is missing, not UTF-8, not valid JSON (with the 1-based line for
            JSONL), empty, or holds a row that is not an object.
    """
    p = Path(path)
    if p.is_dir():
        raise SFTDataError(f"{p} is a folder: give the data files in it (JSON or JSONL) one by one")
    if not p.is_file():
        raise SFTDataError(f"data file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as exc:
        raise SFTDataError(str(not_utf8(p, exc))) from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):  # one object: a one-row file, or a wrapper such as {"data": [...]}
        wrapped = [k for k, v in whole.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if wrapped and not any(k in whole for k in ("messages", "conversations", "instruction")):
            raise SFTDataError(f"{p}: the file holds one JSON object whose '{wrapped[0]}' is a list of objects (keys "
                               f"{sorted(whole)[:5]}); expected a JSON list of rows, or JSONL with one row per line: "
                               f"write the list itself")
        rows = [whole]
    elif text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{p}: not valid JSON: {exc}") from None
    else:
        rows = []
        for line_no, line in enumerate(text.split("\n"), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SFTDataError(f"{p} line {line_no}: not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not rows:
        raise SFTDataError(f"{p}: no rows")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SFTDataError(f"{p} row {n}: expected a JSON object, got {type(row).__name__}")
    return rows


def load_hub_rows(name: str, split: str = "train") -> list[dict]:
    """Rows of a Hugging Face data set (a hub id, or a local folder of JSON / JSONL / CSV / Parquet
    files) through `datasets.load_dataset`, as plain dicts. `datasets` drops a UTF-8 byte-order
    mark itself (its JSON and CSV readers; checked in datasets 5.2)."""
    import datasets

    return [dict(r) for r in datasets.load_dataset(name, split=split)]


class EmptyAnswerError(SFTDataError):
    """An assistant turn (Alpaca ``output``) is empty: `prepare` skips such rows and counts them."""


def _text(value: Any, where: str, field: str, allow_empty: bool = True, answer: bool = False) -> str:
    if not isinstance(value, str):
        raise SFTDataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise (EmptyAnswerError if answer else SFTDataError)(f"{where}: field '{field}' is empty")
    return value


TEXT_KEYS = ("text", "value", "content")  # where a typed part keeps its text (OpenAI: text; Hugging Face / others: value)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # a turn's reasoning (TRL / Qwen3, GPT-OSS, others)
_PART_KINDS = {"text": "text", "input_text": "text", "output_text": "text", "reasoning": "reasoning",
               "thinking": "reasoning", "tool_call": "tool_call", "tool_use": "tool_call", "function_call": "tool_call"}
_IMAGE_KINDS = ("image", "image_url", "input_image", "video", "audio", "input_audio")


def _part_text(part: dict, kind: str, where: str, path: str, keys: tuple[str, ...] = TEXT_KEYS) -> str:
    for key in (kind, *keys) if kind not in keys else keys:
        if isinstance(part.get(key), str):
            return part[key]
    raise SFTDataError(f"{where}: {path} (type {kind!r}) has no string {' / '.join(repr(k) for k in keys)} "
                       f"(keys found: {sorted(part)})")


def _parts(value: Any, where: str, field: str) -> tuple[str, list[str], list]:
    """A message's content: a string, or a list of typed parts. Returns ``(text, reasoning, calls)``: text
    parts (``{"type": "text", "text" | "value": ...}``) joined with ``"\\n"`` (as vLLM's OpenAI server does),
    reasoning parts (``{"type": "reasoning" | "thinking", ...}``) and tool-call parts (``{"type": "tool_call" |
    "tool_use", ...}``, checked by `_tool_calls`). Any other part (an image) is refused, naming it."""
    if not isinstance(value, list):
        return _text(value, where, field), [], []
    texts, reasoning, calls = [], [], []
    for k, part in enumerate(value):
        raw = part.get("type") if isinstance(part, dict) else None
        kind = _PART_KINDS.get(raw) if isinstance(raw, str) else None
        path = f"{field}[{k}]"
        if raw is None:
            raise SFTDataError(f"{where}: {path} must be an object with 'type' (e.g. {{\"type\": \"text\", "
                               f"\"text\": ...}}), got {json.dumps(part)[:60]}")
        if kind == "text":
            texts.append(_part_text(part, "text", where, path))
        elif kind == "reasoning":
            reasoning.append(_part_text(part, raw, where, path, (raw, "reasoning", "text", "value", "content")))
        elif kind == "tool_call":
            call = {k2: v for k2, v in part.items() if k2 != "type"}
            if "input" in call and "arguments" not in call:  # Anthropic's tool_use: name + input
                call["arguments"] = call.pop("input")
            calls.append(call.get("tool_call", call))
        elif raw in _IMAGE_KINDS:
            raise SFTDataError(f"{where}: {path} is a part of type {raw!r}, but this data path trains on text only: "
                               f"remove the part, or use a vision-language recipe for images")
        else:
            raise SFTDataError(f"{where}: {path} is a part of type {raw!r}; expected one of "
                               f"{', '.join(repr(t) for t in _PART_KINDS)} (images: a vision-language recipe)")
    return "\n".join(texts), reasoning, calls


def _content(value: Any, where: str, field: str) -> str:
    """The text of `_parts` (reasoning and tool-call parts refused): system, user and tool turns."""
    text, reasoning, calls = _parts(value, where, field)
    if reasoning or calls:
        raise SFTDataError(f"{where}: {field} holds a {'reasoning' if reasoning else 'tool_call'} part, which only an "
                           f"assistant turn can have")
    return text


def _tool_calls(value: Any, where: str, field: str) -> list[dict]:
    """OpenAI-style tool calls, normalised to ``[{"type": "function", "function": {"name": str,
    "arguments": dict}}]`` (plus ``id`` when given). ``arguments`` may be a JSON string (OpenAI's
    API sends one); it is parsed, as chat templates expect a mapping (Qwen2.5's and Llama 3.1's
    apply ``tojson`` to it, which would quote a string a second time)."""
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise SFTDataError(f"{where}: field '{field}' is an empty list")
    out = []
    for k, call in enumerate(calls):
        path = f"{field}[{k}]" if isinstance(value, list) else field
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise SFTDataError(f"{where}: {path} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                               f"\"arguments\": {{...}}}}}} (or {{\"name\", \"arguments\"}}), got {json.dumps(call)[:80]}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except json.JSONDecodeError as exc:
                raise SFTDataError(f"{where}: {path} arguments are not valid JSON: {exc}") from None
        if not isinstance(args, dict):
            raise SFTDataError(f"{where}: {path} arguments must be a JSON object, got {type(args).__name__}")
        normal = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            normal["id"] = call["id"]
        out.append(normal)
    return out


def _tools(value: Any, where: str) -> list[dict] | None:
    """A row's ``tools``: a list (or a JSON string of a list, as LLaMA-Factory stores it) of JSON-schema
    function definitions, normalised to ``{"type": "function", "function": {...}}``; None if empty."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{where}: field 'tools' is a string but not valid JSON: {exc}") from None
    if not isinstance(value, list):
        raise SFTDataError(f"{where}: field 'tools' must be a list of function definitions, got {type(value).__name__}")
    tools = []
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise SFTDataError(f"{where}: tools[{k}] must be a function definition with a 'name' ({{\"type\": \"function\", "
                               f"\"function\": {{\"name\", \"description\", \"parameters\"}}}}), got {json.dumps(tool)[:80]}")
        tools.append({"type": "function", "function": fn})
    return tools or None


def to_conversation(row: dict, row_number: int, source: str,
                    ignored: Counter | None = None) -> tuple[list[dict], list[dict] | None]:
    """Convert one data row to chat messages and the tools its prompt declares.

    Formats:
        chat: ``{"messages": [{"role": "system"|"user"|"assistant"|"tool", "content"}, ...], "tools": [...]}``.
            ``content`` is a string or a list of typed parts (``{"type": "text", "text": ...}``; text
            parts are joined with ``"\\n"``, other parts are refused). An assistant message may carry
            ``tool_calls`` (OpenAI: ``[{"type": "function", "function": {"name", "arguments"}}]``,
            arguments a mapping or a JSON string) and then may have empty or null content; a ``tool``
            message is a tool's result (``name`` and ``tool_call_id`` are kept). An assistant turn's reasoning
            (``reasoning_content``, ``thinking`` or ``reasoning``, and reasoning parts) is kept as
            ``reasoning_content``; tool-call parts join ``tool_calls``. Other keys are not used: they are
            counted in `ignored` (``"messages[].weight"``) when it is given.
        Alpaca: ``{"instruction", "input" (optional, may be empty), "output"}`` -> one user turn
            (instruction, plus ``"\\n\\n" + input`` when input is not empty) and one assistant turn.
        ShareGPT / LLaMA-Factory: ``{"conversations": [{"from", "value"}, ...], "system": str, "tools": str | list}``,
            ``from`` one of system, human, gpt (user and assistant too), ``function_call`` (an assistant
            tool call; value the JSON ``{"name", "arguments"}`` or a list of them) and ``observation``
            (a tool result). ``system`` (optional) becomes the first message.
        ``tools`` (chat and ShareGPT, optional): a list of JSON-schema function definitions (or that
            list as a JSON string), normalised to ``{"type": "function", "function": {...}}``.

    Args:
        row: one object of the data file.
        row_number: its 1-based position in the file, for messages.
        source: the file name (or data set name), for messages.
        ignored: a Counter that gets one count per key of a turn that is not used.

    Returns:
        ``(messages, tools)``: messages are ``{"role", "content": str}`` (+ ``tool_calls`` / ``name`` /
        ``tool_call_id`` / ``reasoning_content``); tools is None when the row declares none.

    Raises:
        SFTDataError: ``"<source> row <n>: ..."`` for an unknown format (listing the keys found
            and expected), an unknown role, a non-string or empty field, a non-text content part,
            a malformed tool call or tool definition, a tool result that follows no tool call, an
            empty assistant turn (`EmptyAnswerError`, which `prepare` skips and counts), or a
            conversation without an assistant turn.
    """
    where = f"{source} row {row_number}"
    if "messages" in row:
        turns, role_key, text_key, field, role_map = row["messages"], "role", "content", "messages", None
    elif "conversations" in row:
        turns, role_key, text_key, field, role_map = row["conversations"], "from", "value", "conversations", _SHAREGPT_ROLES
    elif "instruction" in row and "output" in row:
        prompt = _text(row["instruction"], where, "instruction", allow_empty=False)
        extra = row.get("input") or ""
        if _text(extra, where, "input").strip():
            prompt = f"{prompt}\n\n{extra}"
        return [{"role": "user", "content": prompt},
                {"role": "assistant", "content": _text(row["output"], where, "output", allow_empty=False, answer=True)}], None
    else:
        raise SFTDataError(f"{where}: unknown format, found keys {sorted(row)}; expected 'messages' (chat), "
                           f"'conversations' (ShareGPT) or 'instruction' + 'output' (Alpaca)")
    if not isinstance(turns, list) or not turns:
        raise SFTDataError(f"{where}: field '{field}' must be a non-empty list of turns")
    tools = _tools(row.get("tools"), where)
    messages = []
    if field == "conversations" and row.get("system"):
        messages.append({"role": "system", "content": _text(row["system"], where, "system")})
    for i, turn in enumerate(turns):
        path = f"{field}[{i}]"
        if not isinstance(turn, dict) or role_key not in turn or (text_key not in turn and "tool_calls" not in turn):
            raise SFTDataError(f"{where}: {path} must be an object with '{role_key}' and '{text_key}'")
        raw = turn[role_key]
        role = None if not isinstance(raw, str) else role_map.get(raw) if role_map else raw if raw in _CHAT_ROLES else None
        if role is None:
            allowed = ", ".join(role_map or _CHAT_ROLES)
            raise SFTDataError(f"{where}: {path}.{role_key} is {raw!r}, expected one of {allowed}")
        if ignored is not None:
            used = {role_key, text_key, "tool_calls", *REASONING_KEYS, *(("name", "tool_call_id") if role == "tool" else ())}
            ignored.update(f"{field}[].{k}" for k in turn if k not in used)
        if raw == "function_call":  # LLaMA-Factory: the call as JSON text
            try:
                call = json.loads(_text(turn[text_key], where, f"{path}.{text_key}"))
            except json.JSONDecodeError as exc:
                raise SFTDataError(f"{where}: {path}.{text_key} (a function_call) is not valid JSON: {exc}") from None
            messages.append({"role": "assistant", "content": "",
                             "tool_calls": _tool_calls(call, where, f"{path}.{text_key}")})
            continue
        if role != "assistant":
            content = _content(turn.get(text_key), where, f"{path}.{text_key}")
            message = {"role": role, "content": content}
            if role == "tool":
                if not messages or not (messages[-1].get("tool_calls") or messages[-1]["role"] == "tool"):
                    raise SFTDataError(f"{where}: {path} is a tool result, but no assistant tool call comes before it")
                message.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
            for key in REASONING_KEYS:
                if turn.get(key):
                    raise SFTDataError(f"{where}: {path}.{key} is set on a {role} turn; only assistant turns have "
                                       f"reasoning")
            messages.append(message)
            continue
        value = turn.get(text_key)
        content, reasoning, part_calls = ("", [], []) if value is None else _parts(value, where, f"{path}.{text_key}")
        for key in REASONING_KEYS:
            if turn.get(key) is not None:
                reasoning.insert(0, _text(turn[key], where, f"{path}.{key}"))
        calls = ([*(turn["tool_calls"] if isinstance(turn["tool_calls"], list) else [turn["tool_calls"]])]
                 if turn.get("tool_calls") else []) + part_calls
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = _tool_calls(calls, where, f"{path}.tool_calls" if turn.get("tool_calls")
                                                else f"{path}.{text_key}")
        elif not content.strip():
            raise EmptyAnswerError(f"{where}: field '{path}.{text_key}' is empty")
        if any(r.strip() for r in reasoning):
            message["reasoning_content"] = "\n".join(r for r in reasoning if r.strip())
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: the conversation has no assistant turn (roles: "
                           f"{', '.join(m['role'] for m in messages)}), so nothing would be trained")
    if messages[0]["role"] == "assistant":
        raise SFTDataError(f"{where}: {field}[0] is an assistant turn; a conversation must start with a "
                           f"system or user turn")
    return messages, tools


def to_messages(row: dict, row_number: int, source: str) -> list[dict]:
    """The messages of `to_conversation` (without the row's tools); see there."""
    return to_conversation(row, row_number, source)[0]


# ----------------------------------------------------------------------------- messages -> tokens
def _require_chat_template(tokenizer) -> None:
    try:
        tokenizer.get_chat_template()
    except ValueError as exc:
        raise SFTDataError(f"the tokenizer ({type(tokenizer).__name__}) has no usable chat template: set "
                           f"tokenizer.chat_template or use a chat/instruct model's tokenizer ({exc})") from None


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None,
            tools: list[dict] | None = None, tokenize: bool = True) -> list[int] | str:
    from jinja2.exceptions import TemplateError

    try:
        out = tokenizer.apply_chat_template(messages, tools=tools, tokenize=tokenize,
                                            add_generation_prompt=add_generation_prompt, return_dict=False,
                                            **(kwargs or {}))
    except (TemplateError, TypeError) as exc:  # the template's raise_exception, or e.g. str + None in Jinja
        raise SFTDataError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") from None
    return list(out) if tokenize else out


def _unstable(tokenizer, full: list[int], part: list[int], what: str, split_turns: bool = False) -> SFTDataError:
    j = next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
    got, want = tokenizer.decode(part[j:j + 8]), tokenizer.decode(full[j:j + 8])
    advice = ("data.split_turns is already true, so the turn being labelled itself renders differently as the last "
              "turn and inside the conversation: check that row's text for template markup, or set a prefix-stable "
              "tokenizer.chat_template") if split_turns else (
        "use single-turn rows, set data.split_turns=true (one example per assistant turn, each as the model sees it "
        "when it writes that turn), or set a prefix-stable tokenizer.chat_template")
    return SFTDataError(
        f"the chat template is not prefix-stable: {what} rendered differs from the whole "
        f"conversation at token {j} ({got!r} vs {want!r}), so assistant turns cannot be located by rendering "
        f"prefixes. Templates that rewrite earlier turns do this (Qwen3's adds a <think> block to the assistant "
        f"turn after the last user turn only); {advice}")


def reasoning_field(tokenizer) -> str | None:
    """The message key the tokenizer's chat template reads a turn's reasoning from: ``"reasoning_content"``
    (Qwen3, DeepSeek-R1, TRL), ``"thinking"`` (GPT-OSS harmony), or None when the template reads neither."""
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        return None
    return next((k for k in ("reasoning_content", "thinking") if k in template), None)


def _inline_reasoning(tokenizer, messages: list[dict]) -> list[dict]:
    """Messages with an assistant turn's inline ``<think>...</think>`` prefix (DeepSeek-R1-style data) moved to
    ``reasoning_content``, for templates with ``<think>`` blocks (Qwen3's splits it so itself).

    Raises:
        SFTDataError: a stray ``<think>`` / ``</think>`` elsewhere in an assistant turn (the template would move
            text out of the turn).
    """
    try:
        template = tokenizer.get_chat_template()
    except ValueError:
        return messages
    if "</think>" not in template:
        return messages
    out = []
    for i, m in enumerate(messages):
        text = m["content"] if m["role"] == "assistant" else ""
        if "<think>" in text or "</think>" in text:
            head, sep, tail = text.lstrip().partition("</think>")
            if not (head.startswith("<think>") and sep and "<think>" not in head[7:] and "</think>" not in tail
                    and "<think>" not in tail):
                raise SFTDataError(f"messages[{i}].content (assistant) holds a stray '</think>' or '<think>', which "
                                   f"the chat template reads as the edge of a reasoning block (it would move text "
                                   f"out of the turn): put the reasoning in 'reasoning_content' (or the content as "
                                   f"'<think>reasoning</think>answer') and remove the stray tag")
            if m.get("reasoning_content"):
                raise SFTDataError(f"messages[{i}] has both 'reasoning_content' and a <think> block in its content: "
                                   f"keep one")
            m = {**m, "content": tail.lstrip("\n"), "reasoning_content": head[7:].strip("\n")}
            if not m["reasoning_content"].strip():
                del m["reasoning_content"]
        out.append(m)
    return out


def _check_tools_rendered(tokenizer, messages: list[dict], tools: list[dict] | None, kwargs: dict | None,
                          turns: dict[int, str]) -> None:
    """Refuse a template that silently drops the row's tools, its tool calls or tool results: each
    tool name must appear in the rendered conversation, each call's name in its assistant turn's
    labelled text (`turns`: message index -> that text), each non-empty tool result in the text, as
    it is or JSON-quoted (Llama 3.1's template writes ``content | tojson``)."""
    text = _render(tokenizer, messages, False, kwargs, tools, tokenize=False) if tools or any(
        m["role"] == "tool" for m in messages) else ""
    for tool in tools or ():
        name = tool["function"]["name"]
        if name not in text:
            raise SFTDataError(f"the chat template does not render the row's tools: the tool {name!r} is missing from "
                               f"the rendered conversation (a template that ignores tools=). Use a tokenizer whose "
                               f"template renders tools (Qwen2.5's and Qwen3's do) or remove 'tools' from the rows")
    for i, rendered in turns.items():
        for call in messages[i].get("tool_calls", ()):
            name = call["function"]["name"]
            if name not in rendered:
                raise SFTDataError(f"the chat template does not render tool calls: messages[{i}] calls {name!r} but "
                                   f"its rendered turn is {rendered[:80]!r} (a template that ignores tool_calls). Use "
                                   f"a tokenizer whose template renders tool calls (Qwen2.5's and Qwen3's do)")
    for i, m in enumerate(messages):
        result = m["content"].strip() if m["role"] == "tool" else ""
        if result and not any(form in text for form in (result, json.dumps(result, ensure_ascii=False)[1:-1],
                                                         json.dumps(result)[1:-1])):
            raise SFTDataError(f"the chat template does not render tool results: messages[{i}] (role tool) is missing "
                               f"from the rendered conversation")


def _covering(tokenizer, ids: list[int], start: int, stop: int, text: str) -> int:
    """The smallest ``end`` in ``(start, stop]`` whose decoded ``ids[start:end]`` contains `text` (binary search)."""
    lo, hi = start + 1, stop
    while lo < hi:
        mid = (lo + hi) // 2
        if text in tokenizer.decode(ids[start:mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _encode(tokenizer, messages: list[dict], kwargs: dict | None, tools: list[dict] | None,
            last_turn_only: bool, reasoning: str = "train") -> tuple[list[int], list[int], dict[str, int]]:
    """Untruncated ``(input_ids, labels, counts)`` of `tokenize_conversation`; with `last_turn_only`, only the
    last assistant turn is labelled (and only its prefixes need to be stable). `reasoning` ``"context"`` masks
    each labelled turn from its start through its reasoning. ``counts``: ``reasoning`` (labelled turns whose
    reasoning the template rendered) and ``reasoning_unrendered`` (those whose reasoning it left out)."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    full = _render(tokenizer, messages, False, kwargs, tools)
    labels = [IGNORE_INDEX] * len(full)
    assistant = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns, counts = {}, {"reasoning": 0, "reasoning_unrendered": 0}
    for i in assistant[-1:] if last_turn_only else assistant:
        if i == 0:
            raise SFTDataError("messages[0] is an assistant turn; a conversation must start with a system or user turn")
        before = _render(tokenizer, messages[:i], True, kwargs, tools)
        through = _render(tokenizer, messages[: i + 1], False, kwargs, tools)
        for part, what in ((before, f"messages[:{i}] + generation prompt"), (through, f"messages[:{i + 1}]")):
            if full[: len(part)] != part:
                raise _unstable(tokenizer, full, part, what, last_turn_only)
        start, stop = len(before), len(through)
        end = stop
        while end > start and not tokenizer.decode(full[end - 1 : end]).strip():
            end -= 1
        if end > start and full[end - 1] in special:
            stop = end  # trailing whitespace after the end-of-turn token
        labels[start:stop] = full[start:stop]
        thought = next((messages[i][k] for k in ("reasoning_content", "thinking") if messages[i].get(k)), "").strip()
        if thought:
            if thought in tokenizer.decode(full[start:stop]):
                counts["reasoning"] += 1
                if reasoning == "context":
                    labels[start:_covering(tokenizer, full, start, stop, thought)] = \
                        [IGNORE_INDEX] * (_covering(tokenizer, full, start, stop, thought) - start)
            else:
                counts["reasoning_unrendered"] += 1
        if messages[i].get("tool_calls"):
            turns[i] = tokenizer.decode(full[start:stop])
    _check_tools_rendered(tokenizer, messages, tools, kwargs, turns)
    return full, labels, counts


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int,
                          chat_template_kwargs: dict | None = None,
                          tools: list[dict] | None = None) -> tuple[list[int], list[int], bool]:
    """Render `messages` with the tokenizer's chat template; label only the assistant turns.

    Incremental-prefix method: for assistant message ``i``, the tokens it adds are those between
    the rendering of ``messages[:i]`` with ``add_generation_prompt=True`` (which ends in the
    assistant header) and the rendering of ``messages[:i+1]``. Both renderings must be prefixes
    of the rendering of the whole conversation, which is what is trained on. Whitespace-only
    tokens after the turn's last special token (the ``"\\n"`` after ``<|im_end|>``) get no label.
    Assistant turns that call tools are labelled like any other; tool results are not.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: from `to_conversation`; the first is not an assistant turn.
        max_length: tokens kept (the rest is cut off the end).
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}`` for
            Qwen3, whose generation prompt then ends in an empty ``<think>`` block (not labelled).
        tools: function definitions passed to the template as ``tools=`` (from `to_conversation`).

    Returns:
        ``(input_ids, labels, truncated)``: two lists of equal length <= max_length, labels
        `IGNORE_INDEX` outside assistant turns; ``truncated`` if tokens were cut.

    Raises:
        SFTDataError: the tokenizer has no chat template; the template fails on the conversation,
            is not prefix-stable, or drops its tools, tool calls or tool results.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _require_chat_template(tokenizer)
    full, labels, _ = _encode(tokenizer, messages, chat_template_kwargs, tools, last_turn_only=False)
    return full[:max_length], labels[:max_length], len(full) > max_length


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise `SFTDataError` if the tokenizer can emit ids the model's embedding has no row for.

    ``len(tokenizer)`` counts added tokens; ``vocab_size`` is ``model.config.vocab_size``
    (it may be larger than the tokenizer: Qwen3 pads its embedding to 151936 rows for 151669 tokens).
    """
    if len(tokenizer) > vocab_size:
        raise SFTDataError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
                           f"ids >= {vocab_size} have no embedding; use the model's own tokenizer")


def _rows_list(numbers: Sequence[int], shown: int = 5) -> str:
    return ", ".join(map(str, numbers[:shown])) + (", ..." if len(numbers) > shown else "")


@dataclass
class SFTStats:
    """What `prepare` did to a data set (one source, or several merged with `merge`). An example is
    a row, or with ``split_turns`` one assistant turn of a row. Token counts are after truncation,
    of kept examples."""

    source: str = ""
    max_length: int = 0
    truncate: bool = True  # False: examples longer than max_length were dropped, not cut
    rows: int = 0  # rows read
    examples: int = 0  # examples kept
    truncated: int = 0  # kept examples cut to max_length
    dropped: int = 0  # examples cut before their first labelled token (not kept)
    dropped_rows: list[tuple[int, int]] = field(default_factory=list)  # (1-based row, tokens before the cut) of those
    empty_answers: list[int] = field(default_factory=list)  # 1-based numbers of rows skipped for an empty answer
    unanswered: list[int] = field(default_factory=list)  # rows not kept: they end in a tool call, with no answer to label
    call_endings: list[int] = field(default_factory=list)  # rows kept up to their last answer; a tool call after it not trained
    example_rows: list[int] = field(default_factory=list)  # the 1-based row of each kept example, in order
    split_rows: int = 0  # rows with several assistant turns split into one example per turn
    tool_call_rows: int = 0  # rows (of those read, with an answer) whose assistant turns make tool calls
    tool_calls: int = 0  # the tool calls of those rows
    tokens: int = 0
    loss_tokens: int = 0  # tokens with a label
    reasoning: str = "train"  # data.reasoning: train (in the loss), context (rendered, no loss), drop
    reasoning_turns: int = 0  # labelled assistant turns whose reasoning was rendered
    reasoning_unrendered: int = 0  # assistant turns whose reasoning the chat template left out (earlier turns)
    reasoning_dropped: int = 0  # assistant turns whose reasoning data.reasoning=drop removed
    ignored: dict[str, int] = field(default_factory=dict)  # keys of rows / turns not used -> how many had them
    unrendered_why: str = ("it renders only the reasoning of the turns after the last user turn: data.split_turns=true "
                           "keeps every turn's")
    parts: list[SFTStats] = field(default_factory=list)  # per-source stats of a merge

    @property
    def loss_fraction(self) -> float:
        """Fraction (0-1) of tokens that carry a label."""
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    @property
    def dropped_fraction(self) -> float:
        """Fraction (0-1) of examples not kept: cut before their answer, or with an empty answer."""
        lost = self.dropped + len(self.empty_answers) + len(self.unanswered)
        return lost / (self.examples + lost) if self.examples + lost else 0.0

    def longest_dropped(self, n: int = 5) -> str:
        """``"row 12 (812 tokens), row 7 (640 tokens)"``: the `n` rows with the longest dropped examples."""
        longest: dict[int, int] = {}
        for row, tokens in self.dropped_rows:
            longest[row] = max(tokens, longest.get(row, 0))
        worst = sorted(longest.items(), key=lambda rt: (-rt[1], rt[0]))[:n]
        return ", ".join(f"row {r} ({t} tokens)" for r, t in worst)

    def as_dict(self) -> dict[str, Any]:
        out = {k: v for k, v in asdict(self).items() if k not in ("parts", "example_rows")}
        return {**out, "loss_fraction": self.loss_fraction, "dropped_fraction": self.dropped_fraction}

    @classmethod
    def merge(cls, parts: Sequence[SFTStats]) -> SFTStats:
        """Totals over several sources; `summary` then reports each source."""
        total = cls(source=" + ".join(p.source for p in parts), max_length=max((p.max_length for p in parts), default=0),
                    truncate=all(p.truncate for p in parts), parts=list(parts))
        for key in ("rows", "examples", "truncated", "dropped", "split_rows", "tool_call_rows", "tool_calls", "tokens",
                    "loss_tokens",
                    "reasoning_turns", "reasoning_unrendered", "reasoning_dropped"):
            setattr(total, key, sum(getattr(p, key) for p in parts))
        total.unanswered = [r for p in parts for r in p.unanswered]
        total.call_endings = [r for p in parts for r in p.call_endings]
        total.reasoning = parts[0].reasoning if parts else "train"
        total.unrendered_why = parts[0].unrendered_why if parts else total.unrendered_why
        total.ignored = dict(sum((Counter(p.ignored) for p in parts), Counter()))
        return total

    def reasoning_note(self) -> str:
        """``"reasoning: 12 turns trained, 3 left out by the chat template (earlier turns)"``; ``""`` without any."""
        done = {"train": "trained", "context": "in context (no loss)", "drop": "dropped"}[self.reasoning]
        items = [f"{self.reasoning_turns} turns {done}"] if self.reasoning_turns else []
        if self.reasoning_unrendered:
            items.append(f"{self.reasoning_unrendered} left out by the chat template ({self.unrendered_why})")
        if self.reasoning_dropped:
            items.append(f"{self.reasoning_dropped} turns dropped (data.reasoning=drop)")
        return f"reasoning: {', '.join(items)}" if items else ""

    def count_tool_calls(self, messages: Sequence[dict]) -> None:
        """Count one row's tool calls (its messages' ``tool_calls``) in `tool_call_rows` and `tool_calls`."""
        calls = sum(len(m.get("tool_calls") or ()) for m in messages)
        self.tool_call_rows += calls > 0
        self.tool_calls += calls

    def tool_calls_note(self) -> str:
        """``"tool calls: 5 in 3 rows"``."""
        return f"tool calls: {self.tool_calls} in {self.tool_call_rows} rows"

    def _drop_reason(self, limit: str) -> str:
        return f"cut by {limit} before any assistant token" if self.truncate else f"longer than {limit}, dropped rather than cut"

    def _counts(self) -> str:
        split = f" ({self.split_rows} split into one example per assistant turn)" if self.split_rows else ""
        cut = f" ({self.truncated} truncated to max_length={self.max_length})" if self.truncate else ""
        text = (f"{Path(self.source).name or 'data'}: {self.rows} rows read{split}, {self.examples} examples kept{cut}, "
                f"{self.dropped} dropped")
        if self.dropped:
            limit = "max_length" if self.truncate else f"max_length={self.max_length}"
            text += f" ({self._drop_reason(limit)}: {self.longest_dropped(3)})"
        if self.empty_answers:
            text += f", {len(self.empty_answers)} skipped with an empty answer (rows {_rows_list(self.empty_answers)})"
        if self.unanswered:
            text += (f", {len(self.unanswered)} skipped as they end in a tool call with no answer to label (rows "
                     f"{_rows_list(self.unanswered)})")
        if self.call_endings:
            text += (f", {len(self.call_endings)} end in a tool call after their last answer, not trained (rows "
                     f"{_rows_list(self.call_endings)})")
        if self.tool_calls:
            text += f", {self.tool_calls_note()}"
        if self.reasoning_note():
            text += f", {self.reasoning_note()}"
        if self.ignored:
            text += ", keys not used: " + ", ".join(f"{k} ({n})" for k, n in sorted(self.ignored.items()))
        return text

    def summary(self) -> str:
        """One line: per source, rows read, examples kept, truncated, dropped (and why, naming the
        longest rows); then tokens and the share with loss."""
        counts = "; ".join(p._counts() for p in self.parts) if self.parts else self._counts()
        return f"{counts} | {self.tokens:,} tokens, {self.loss_fraction:.1%} with loss"

    def check_dropped(self, max_dropped_fraction: float) -> None:
        """Raise `SFTDataError` if more than `max_dropped_fraction` (0-1) of the examples were not kept,
        naming the longest dropped rows and what to change."""
        if self.dropped_fraction <= max_dropped_fraction:
            return
        lost = self.dropped + len(self.empty_answers) + len(self.unanswered)
        unit = "examples (one per assistant turn)" if self.split_rows else "rows"
        why = []
        if self.dropped:
            longest = max(t for _, t in self.dropped_rows)
            why.append(f"{self.dropped} {self._drop_reason(f'data.max_length={self.max_length}')}, longest "
                       f"{self.longest_dropped()}: raise data.max_length (to {longest} to keep them all)")
        if self.empty_answers:
            why.append(f"{len(self.empty_answers)} with an empty answer (rows {_rows_list(self.empty_answers)}): check "
                       f"the answer field")
        if self.unanswered:
            why.append(f"{len(self.unanswered)} end in a tool call with no answer to label (rows "
                       f"{_rows_list(self.unanswered)}): only answers carry labels; add the tool result and the answer")
        raise SFTDataError(f"{self.source}: {lost} of {self.examples + lost} {unit} dropped ({self.dropped_fraction:.0%}, "
                           f"more than data.max_dropped_fraction={max_dropped_fraction:g}): {'; '.join(why)}; or raise "
                           f"data.max_dropped_fraction")


def prepare(rows: Sequence[dict], tokenizer, max_length: int, source: str,
            chat_template_kwargs: dict | None = None, *, max_dropped_fraction: float | None = None,
            split_turns: bool = False, truncate: bool = True, reasoning: str = "train") -> tuple[list[dict], SFTStats]:
    """`to_conversation` + `tokenize_conversation` (see there for the arguments) over a data set.

    Args:
        max_dropped_fraction: refuse (`SFTStats.check_dropped`) when more than this share (0-1) of
            the examples is not kept; None: no limit.
        split_turns: a row with several assistant turns becomes one example per assistant turn,
            each the conversation up to that turn with only that turn labelled: what the model saw
            when it wrote the turn, for templates that rewrite earlier turns (Qwen3). Costs about
            ``turns / 2`` times the tokens of the whole conversation.
        truncate: False: an example longer than `max_length` is dropped (counted as cut before its
            answer) instead of cut, for answers that are useless when cut (a JSON object).
        reasoning: an assistant turn's reasoning (``reasoning_content``), rendered through the template's own
            field (`reasoning_field`): ``"train"`` in the loss, ``"context"`` rendered without loss, ``"drop"``
            removed; counted in the stats either way (and turns whose reasoning the template leaves out).

    Returns:
        ``(examples, stats)``: examples are ``{"input_ids": list[int], "labels": list[int]}``, in
        row order, without the ones that truncation left with no labelled token (counted in
        ``stats.dropped`` with their row and length: they cost compute and, alone in a batch, make
        a mean loss 0/0) and without rows whose answer is empty (their numbers in
        ``stats.empty_answers``).

    Raises:
        SFTDataError: the tokenizer has no chat template (once, before any row); a row is invalid
            or its rendering not prefix-stable (``"<source> row <n>: ..."``); a row has reasoning the
            template has no place for (or Qwen3's ``enable_thinking: false`` would replace it); too many
            examples dropped (see `max_dropped_fraction`).
    """
    if reasoning not in ("train", "context", "drop"):
        raise ValueError(f"reasoning must be train, context or drop, got {reasoning!r}")
    _require_chat_template(tokenizer)
    stats, examples = SFTStats(source=source, max_length=max_length, truncate=truncate, rows=len(rows),
                               reasoning=reasoning), []
    ignored = Counter()
    for n, row in enumerate(rows, 1):
        try:
            messages, tools = template_conversation(row, n, source, tokenizer, stats, ignored, chat_template_kwargs,
                                                    reasoning)
        except EmptyAnswerError:  # e.g. a few rows of tatsu-lab/alpaca: nothing to learn from them
            stats.empty_answers.append(n)
            continue
        ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"] if split_turns else [len(messages)]
        stats.split_rows += len(ends) > 1
        for end in ends:
            try:
                ids, labels, counts = _encode(tokenizer, messages[:end], chat_template_kwargs, tools,
                                              last_turn_only=split_turns, reasoning=reasoning)
            except SFTDataError as exc:
                raise SFTDataError(f"{source} row {n}: {exc}") from None
            stats.reasoning_turns += counts["reasoning"]
            stats.reasoning_unrendered += counts["reasoning_unrendered"]
            n_loss = sum(label != IGNORE_INDEX for label in labels[:max_length])
            if n_loss == 0 or (len(ids) > max_length and not truncate):
                stats.dropped += 1
                stats.dropped_rows.append((n, len(ids)))
                continue
            stats.truncated += len(ids) > max_length
            examples.append({"input_ids": ids[:max_length], "labels": labels[:max_length]})
            stats.example_rows.append(n)
            stats.examples += 1
            stats.tokens += min(len(ids), max_length)
            stats.loss_tokens += n_loss
    stats.ignored = dict(ignored)
    if max_dropped_fraction is not None:
        stats.check_dropped(max_dropped_fraction)
    return examples, stats


def template_conversation(row: dict, row_number: int, source: str, tokenizer, stats: SFTStats,
                          ignored: Counter | None = None, chat_template_kwargs: dict | None = None,
                          reasoning: str = "train") -> tuple[list[dict], list[dict] | None]:
    """`to_conversation` made ready for `tokenizer`'s chat template, as `prepare` does: an inline ``<think>``
    block moved to ``reasoning_content``, each turn's reasoning under the key the template reads (`reasoning_field`)
    or removed with ``reasoning="drop"`` (counted in ``stats.reasoning_dropped``), the row's tool calls counted
    (`SFTStats.count_tool_calls`), keys its format does not read counted in `ignored` (``"id"``, ``"messages[].weight"``). `tokenizer` None: the reasoning stays as ``reasoning_content``, unchecked.

    Raises:
        EmptyAnswerError: the row's answer is empty (the caller skips and counts it).
        SFTDataError: ``"<source> row <n>: ..."``: see `to_conversation`; reasoning the template has no place
            for (or ``enable_thinking: false``); a stray ``<think>`` tag.
    """
    if ignored is not None:  # the row's own keys that its format does not read
        used = (("messages", "tools") if "messages" in row else ("conversations", "system", "tools")
                if "conversations" in row else ("instruction", "input", "output"))
        ignored.update(k for k in row if k not in used)
    try:
        messages, tools = to_conversation(row, row_number, source, ignored)
        if tokenizer is not None:
            messages = _inline_reasoning(tokenizer, messages)
            messages = _place_reasoning(messages, reasoning, reasoning_field(tokenizer), chat_template_kwargs, stats)
        elif reasoning == "drop":
            messages = _place_reasoning(messages, reasoning, None, None, stats)
    except EmptyAnswerError:
        raise
    except SFTDataError as exc:
        raise SFTDataError(str(exc) if str(exc).startswith(source) else f"{source} row {row_number}: {exc}") from None
    stats.count_tool_calls(messages)
    return messages, tools


def check_tools_rendered(tokenizer, messages: list[dict], tools: list[dict] | None, text: str,
                         chat_template_kwargs: dict | None = None) -> None:
    """Refuse a chat template that leaves out the row's tools, tool calls or tool results (`text`: the rendered
    conversation, in which each call's name must appear).

    Raises:
        SFTDataError: naming what the template dropped.
    """
    calls = {i: text for i, m in enumerate(messages) if m.get("tool_calls")}
    _check_tools_rendered(tokenizer, messages, tools, chat_template_kwargs, calls)


def _place_reasoning(messages: list[dict], reasoning: str, target: str | None, kwargs: dict | None,
                     stats: SFTStats) -> list[dict]:
    """Messages with each assistant turn's ``reasoning_content`` under the template's own key `target` (or
    removed for ``reasoning="drop"``, counted in ``stats.reasoning_dropped``).

    Raises:
        SFTDataError: a turn has reasoning but the template reads no reasoning field, or its
            ``enable_thinking`` is false (Qwen3 then writes an empty ``<think>`` block in its place).
    """
    out = []
    for i, m in enumerate(messages):
        if "reasoning_content" not in m:
            out.append(m)
            continue
        m = dict(m)
        thought = m.pop("reasoning_content")
        if reasoning == "drop":
            stats.reasoning_dropped += 1
        elif target is None:
            raise SFTDataError(f"messages[{i}] has reasoning, but the chat template has no place for it (it reads "
                               f"neither 'reasoning_content' nor 'thinking'): set data.reasoning=drop to train "
                               f"without it (counted in the data summary), or use a template that renders reasoning")
        elif (kwargs or {}).get("enable_thinking") is False:
            raise SFTDataError(f"messages[{i}] has reasoning, but data.chat_template_kwargs has enable_thinking: "
                               f"false, which makes the template write an empty reasoning block: set it to true "
                               f"to keep the reasoning, or data.reasoning=drop to train without it")
        else:
            m[target] = thought
        out.append(m)
    return out


# ----------------------------------------------------------------------------- batches
def pack(examples: Sequence[dict], seq_len: int, pad_id: int) -> list[dict]:
    """Pack examples into rows of exactly `seq_len` tokens (next-fit, in order: a document goes
    into the current row if it fits, else starts a new one; documents are never split).

    Layout of a row (lists of ints, each `seq_len` long)::

        input_ids     d0 d0 d0 d0 | d1 d1 d1 | pad pad
        labels        -100 .. a a | -100 .. a | -100 -100
        position_ids  0  1  2  3  | 0  1  2  | 0   1

    Padding at the end of a row is its own document (position ids from 0, labels -100).
    Labels are not shifted (the model shifts them). The first label of every document must be
    `IGNORE_INDEX` (true for `prepare`'s output: chat templates start with a non-assistant
    turn), so no token is ever trained to predict the next document's first token.

    Document boundaries live only in ``position_ids``; pass no ``attention_mask``. In
    transformers 5.x (checked in 5.24, ``masking_utils`` / ``modeling_flash_attention_utils``):

    - ``sdpa``, ``eager``, ``flex_attention``: ``create_causal_mask`` finds documents with
      ``find_packed_sequence_indices`` (a new one wherever a position id is not the previous +1)
      and builds a block-diagonal causal mask, per batch row, ONLY if ``attention_mask`` is None
      and there is no cache: call ``model(..., use_cache=False)``. With the config default
      ``use_cache=True`` the model creates a DynamicCache even in training (unless gradient
      checkpointing is on) and silently attends across documents.
    - ``flash_attention_2``/``_3``: the varlen kernel, with ``cu_seqlens`` at every position id 0,
      but only for batch size 1 (``_is_packed_sequence``): flatten a micro-batch to shape
      ``(1, B * seq_len)``; with batch > 1 it attends across documents.

    Raises:
        SFTDataError: an example is longer than `seq_len` or empty, or labels its first token.
    """
    rows: list[dict] = []
    row: dict[str, list[int]] = {"input_ids": [], "labels": [], "position_ids": []}

    def flush() -> None:
        pad = seq_len - len(row["input_ids"])
        rows.append({"input_ids": row["input_ids"] + [pad_id] * pad, "labels": row["labels"] + [IGNORE_INDEX] * pad,
                     "position_ids": row["position_ids"] + list(range(pad))})

    for k, ex in enumerate(examples):
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        if not 0 < len(ids) <= seq_len or len(labels) != len(ids):
            raise SFTDataError(f"example {k}: {len(ids)} tokens and {len(labels)} labels; packing needs "
                               f"1..{seq_len} of each (truncate with max_length <= seq_len)")
        if labels[0] != IGNORE_INDEX:
            raise SFTDataError(f"example {k}: its first token has a label, so in a packed row it would be trained "
                               f"as the continuation of the previous document")
        if len(row["input_ids"]) + len(ids) > seq_len:
            flush()
            row = {"input_ids": [], "labels": [], "position_ids": []}
        row["input_ids"] += ids
        row["labels"] += labels
        row["position_ids"] += list(range(len(ids)))
    if row["input_ids"]:
        flush()
    return rows


def pad_batch(examples: Sequence[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad examples to one batch (for unpacked training).

    Returns:
        ``input_ids``, ``attention_mask`` (1 real, 0 padding) and ``labels`` (`IGNORE_INDEX` on
        padding): int64 tensors of shape (batch, L), L the longest example rounded up to a
        multiple of `pad_to_multiple_of`.
    """
    longest = max(len(ex["input_ids"]) for ex in examples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    out = {k: torch.full((len(examples), width), v, dtype=torch.long)
           for k, v in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX))}
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        out["input_ids"][b, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        out["labels"][b, :n] = torch.tensor(ex["labels"], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
    return out


def load_examples(cfg: Any, tokenizer, seed: int) -> tuple[list[dict], list[dict], SFTStats]:
    """Tokenized train and eval examples (``input_ids``, ``labels``: assistant tokens only) and the train
    statistics, for a recipe's data section.

    Args:
        cfg: any object with ``train_files`` (JSON / JSONL; empty: the ``hub_id`` data set's train split),
            ``eval_files`` (optional), ``hub_id``, ``eval_fraction``, ``max_length``, ``chat_template_kwargs``,
            ``max_dropped_fraction``, ``split_turns`` and ``reasoning`` (see `prepare`).
        tokenizer: a tokenizer with a chat template.
        seed: seeds the held-out split: without eval files, a seeded ``eval_fraction`` of each train
            file is held out for evaluation.

    Raises:
        SFTDataError: see `load_rows` and `prepare` (each file is checked against ``max_dropped_fraction``).
    """
    kwargs = dict(cfg.chat_template_kwargs) or None
    options = dict(max_dropped_fraction=cfg.max_dropped_fraction, split_turns=cfg.split_turns,
                   reasoning=getattr(cfg, "reasoning", "train"))
    eval_files = getattr(cfg, "eval_files", [])
    sources = [(f, load_rows(f)) for f in cfg.train_files] or [(cfg.hub_id, load_hub_rows(cfg.hub_id))]
    train, evals, parts = [], [], []
    for source, rows in sources:
        examples, st = prepare(rows, tokenizer, cfg.max_length, source, kwargs, **options)
        if not eval_files and cfg.eval_fraction > 0:
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
            n_eval = max(1, int(len(examples) * cfg.eval_fraction))
            evals += [examples[i] for i in sorted(order[:n_eval])]
            examples = [examples[i] for i in sorted(order[n_eval:])]
        train += examples
        parts.append(st)
    for f in eval_files:
        evals += prepare(load_rows(f), tokenizer, cfg.max_length, f, kwargs, **options)[0]
    return train, evals, SFTStats.merge(parts)


def shard_for_eval(rows: list[dict], rank: int, world_size: int) -> list[dict]:
    """This rank's evaluation rows, padded with label-free copies so that every rank runs the same
    number of forward passes: sharded models run collectives in every forward (FSDP all-gathers,
    expert all-to-alls), so a rank that stopped early would leave the others waiting forever."""
    if not rows:
        return []
    mine = rows[rank::world_size]
    target = -(-len(rows) // world_size)
    filler = {**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}
    return mine + [filler] * (target - len(mine))
