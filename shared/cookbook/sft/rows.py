"""SFT rows -> chat messages: the row formats (chat, Alpaca, ShareGPT: docs/sft-data.md), data files, and errors naming
file, row and field (a JSONL row by its editor's line, others by their 1-based number: `RowList`)."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Sequence

from cookbook.errors import not_a_file
from cookbook.tabular import jsonl, read_text

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
ROLES = ("system", "user", "assistant")  # plain chat turns; "tool" (a tool's result) is accepted too
_CHAT_ROLES = {r: r for r in (*ROLES, "tool")}
_SHAREGPT_ROLES = {
    "system": "system",
    **dict.fromkeys(("human", "user"), "user"),
    **dict.fromkeys(("gpt", "assistant", "function_call"), "assistant"),
    **dict.fromkeys(("observation", "tool"), "tool"),
}


class SFTDataError(ValueError):
    """A data file, row or tokenizer is unusable for SFT; the message names the file, row and field."""


# ----------------------------------------------------------------------------- rows -> messages
def row_label(n: int | str, lines: Sequence[int] | None = None) -> str:
    """1-based row `n` as errors name it: ``"line 19"`` with `lines` (a JSONL file's), else ``"row 3"``; a str as is."""
    return n if isinstance(n, str) else f"line {lines[n - 1]}" if lines else f"row {n}"


class RowList(list):
    """Rows with `lines` (each row's line in a JSONL file, else None); `label(n)` names row `n` (`row_label`)."""

    def __init__(self, rows: Iterable[dict] = (), lines: Sequence[int] | None = None):
        super().__init__(rows)
        self.lines = list(lines) if lines else None

    def label(self, n: int) -> str:
        return row_label(n, self.lines)


def load_rows(path: str | Path, key: str = "") -> RowList:
    """A JSON array of objects, JSONL, or one row object (UTF-8; a byte-order mark and CRLF ignored) as a `RowList`.
    JSONL splits at ``\\n`` only (JSON allows U+2028 in strings), so line numbers are an editor's.
    Raises SFTDataError (a missing file named with the config `key` that gave it, if any): missing, a table's file
    type, not UTF-8, not valid JSON (with the JSONL line), empty, or a row not an object."""
    p = Path(path)
    if p.is_dir():
        raise SFTDataError(f"{p} is a folder: give the data files in it (JSON or JSONL) one by one")
    if not p.is_file():
        raise SFTDataError((f"{key}: " if key else "") + not_a_file(p, "data file"))
    if p.suffix.lower() in (".csv", ".tsv", ".parquet", ".arrow", ".xlsx", ".txt"):
        raise SFTDataError(f"{p}: unsupported file type {p.suffix!r} for rows (use .json or .jsonl)")
    text = read_text(p, SFTDataError)
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    lines = None  # each row's line: JSONL, or the line where a one-object file's object starts
    if isinstance(whole, dict):  # one object: a one-row file, or a wrapper such as {"data": [...]}
        wrapped = [k for k, v in whole.items() if isinstance(v, list) and v and all(isinstance(r, dict) for r in v)]
        if wrapped and not any(k in whole for k in ("messages", "conversations", "instruction")):
            raise SFTDataError(
                f"{p}: the file holds one JSON object whose '{wrapped[0]}' is a list of objects (keys "
                f"{sorted(whole)[:5]}); expected a JSON list of rows, or JSONL with one row per line: "
                f"write the list itself"
            )
        rows, lines = [whole], [text[: len(text) - len(text.lstrip())].count("\n") + 1]
    elif text.lstrip().startswith("["):
        rows = _json(text, f"{p}: not valid JSON")
    else:
        numbered = list(jsonl(p, text.split("\n"), SFTDataError))
        lines, rows = [n for n, _ in numbered], [row for _, row in numbered]
    if not rows:
        raise SFTDataError(f"{p}: no rows")
    rows = RowList(rows, lines)
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SFTDataError(f"{p} {rows.label(n)}: expected a JSON object, got {type(row).__name__}")
    return rows


def load_hub_rows(name: str, split: str = "train") -> RowList:
    """Rows of a Hugging Face data set (a hub id, or a folder of JSON / CSV / Parquet files), as plain dicts."""
    import datasets

    return RowList(dict(r) for r in datasets.load_dataset(name, split=split))


def _json(text: str, what: str) -> Any:
    """`text` parsed as JSON; SFTDataError ``"<what>: <the parser's error>"`` if it is not valid JSON."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise SFTDataError(f"{what}: {exc}") from None


class EmptyAnswerError(SFTDataError):
    """An assistant turn (Alpaca ``output``) is empty: `prepare` skips such rows and counts them."""


def _text(value: Any, where: str, field: str, allow_empty: bool = True, answer: bool = False) -> str:
    if not isinstance(value, str):
        raise SFTDataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise (EmptyAnswerError if answer else SFTDataError)(f"{where}: field '{field}' is empty")
    return value


_TEXT_KEYS = ("text", "value", "content")  # where a typed part keeps its text (OpenAI: text; Hugging Face: value)
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # a turn's reasoning (TRL / Qwen3, GPT-OSS, others)
_PART_KINDS = {
    **dict.fromkeys(("text", "input_text", "output_text"), "text"),
    **dict.fromkeys(("reasoning", "thinking"), "reasoning"),
    **dict.fromkeys(("tool_call", "tool_use", "function_call"), "tool_call"),
}
_IMAGE_KINDS = ("image", "image_url", "input_image", "video", "audio", "input_audio")


def _part_text(part: dict, kind: str, where: str, path: str, keys: tuple[str, ...] = _TEXT_KEYS) -> str:
    for key in (kind, *keys) if kind not in keys else keys:
        if isinstance(part.get(key), str):
            return part[key]
    raise SFTDataError(
        f"{where}: {path} (type {kind!r}) has no string {' / '.join(repr(k) for k in keys)} "
        f"(keys found: {sorted(part)})"
    )


def _parts(value: Any, where: str, field: str) -> tuple[str, list[str], list]:
    """A content (a string or typed parts) as ``(text, reasoning parts, tool-call parts)``; other parts are refused."""
    if not isinstance(value, list):
        return _text(value, where, field), [], []
    texts, reasoning, calls = [], [], []
    for k, part in enumerate(value):
        raw = part.get("type") if isinstance(part, dict) else None
        kind = _PART_KINDS.get(raw) if isinstance(raw, str) else None
        path = f"{field}[{k}]"
        if raw is None:
            raise SFTDataError(
                f'{where}: {path} must be an object with \'type\' (e.g. {{"type": "text", '
                f'"text": ...}}), got {json.dumps(part)[:60]}'
            )
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
            raise SFTDataError(
                f"{where}: {path} is a part of type {raw!r}, but this data path trains on text only: "
                f"remove the part, or use a vision-language recipe for images"
            )
        else:
            raise SFTDataError(
                f"{where}: {path} is a part of type {raw!r}; expected one of "
                f"{', '.join(repr(t) for t in _PART_KINDS)} (images: a vision-language recipe)"
            )
    return "\n".join(texts), reasoning, calls


def _tool_calls(value: Any, where: str, field: str) -> list[dict]:
    """Tool calls as ``[{"type": "function", "function": {"name", "arguments": dict}}]`` (+ ``id``)."""
    calls = value if isinstance(value, list) else [value]
    if not calls:
        raise SFTDataError(f"{where}: field '{field}' is an empty list")
    out = []
    for k, call in enumerate(calls):
        path = f"{field}[{k}]" if isinstance(value, list) else field
        fn = call.get("function", call) if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise SFTDataError(
                f'{where}: {path} must be {{"type": "function", "function": {{"name": ..., '
                f'"arguments": {{...}}}}}} (or {{"name", "arguments"}}), got {json.dumps(call)[:80]}'
            )
        args = fn.get("arguments", {})
        if isinstance(args, str):
            args = _json(args, f"{where}: {path} arguments are not valid JSON") if args.strip() else {}
        if not isinstance(args, dict):
            raise SFTDataError(f"{where}: {path} arguments must be a JSON object, got {type(args).__name__}")
        normal = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
        if isinstance(call, dict) and isinstance(call.get("id"), str):
            normal["id"] = call["id"]
        out.append(normal)
    return out


def _tools(value: Any, where: str) -> list[dict] | None:
    """A row's ``tools`` (a list, or its JSON text) as ``{"type": "function", "function": {...}}`` items, or None."""
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    if isinstance(value, str):
        value = _json(value, f"{where}: field 'tools' is a string but not valid JSON")
    if not isinstance(value, list):
        raise SFTDataError(f"{where}: field 'tools' must be a list of function definitions, got {type(value).__name__}")
    tools = []
    for k, tool in enumerate(value):
        fn = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"].strip():
            raise SFTDataError(
                f'{where}: tools[{k}] must be a function definition with a \'name\' ({{"type": "function", '
                f'"function": {{"name", "description", "parameters"}}}}), got {json.dumps(tool)[:80]}'
            )
        tools.append({"type": "function", "function": fn})
    return tools or None


def to_conversation(
    row: dict, row_number: int | str, source: str, ignored: Counter | None = None
) -> tuple[list[dict], list[dict] | None]:
    """One row (chat, Alpaca or ShareGPT) as ``(messages, tools)``: messages ``{"role", "content": str}`` (+
    ``tool_calls``, ``name``, ``tool_call_id``, ``reasoning_content``), tools ``{"type": "function", ...}`` or None;
    `row_number` (1-based, or a label: `RowList.label`) and `source` name the row; `ignored` counts unused keys.
    Raises SFTDataError: ``"<source> row <n>: ..."`` for an unknown format, role or part, a bad field, tool call or
    result, no assistant turn; `EmptyAnswerError` for an empty answer."""
    where = f"{source} {row_label(row_number)}"
    if "messages" in row:
        field, role_key, text_key, role_map = "messages", "role", "content", _CHAT_ROLES
    elif "conversations" in row:
        field, role_key, text_key, role_map = "conversations", "from", "value", _SHAREGPT_ROLES
    elif "instruction" in row and "output" in row:
        prompt = _text(row["instruction"], where, "instruction", allow_empty=False)
        extra = row.get("input") or ""
        if _text(extra, where, "input").strip():
            prompt = f"{prompt}\n\n{extra}"
        return [
            {"role": "user", "content": prompt},
            {"role": "assistant", "content": _text(row["output"], where, "output", allow_empty=False, answer=True)},
        ], None
    else:
        raise SFTDataError(
            f"{where}: unknown format, found keys {sorted(row)}; expected 'messages' (chat), "
            f"'conversations' (ShareGPT) or 'instruction' + 'output' (Alpaca)"
        )
    turns = row[field]
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
        role = role_map.get(raw) if isinstance(raw, str) else None
        if role is None:
            raise SFTDataError(f"{where}: {path}.{role_key} is {raw!r}, expected one of {', '.join(role_map)}")
        if ignored is not None:
            result_keys = ("name", "tool_call_id") if role == "tool" else ()
            used = {role_key, text_key, "tool_calls", *REASONING_KEYS, *result_keys}
            ignored.update(f"{field}[].{k}" for k in turn if k not in used)
        if raw == "function_call":  # LLaMA-Factory: the call as JSON text
            text = _text(turn[text_key], where, f"{path}.{text_key}")
            call = _json(text, f"{where}: {path}.{text_key} (a function_call) is not valid JSON")
            messages.append(
                {"role": "assistant", "content": "", "tool_calls": _tool_calls(call, where, f"{path}.{text_key}")}
            )
            continue
        if role != "assistant":
            content, reasoning, calls = _parts(turn.get(text_key), where, f"{path}.{text_key}")
            if reasoning or calls:
                raise SFTDataError(
                    f"{where}: {path}.{text_key} holds a {'reasoning' if reasoning else 'tool_call'} "
                    f"part, which only an assistant turn can have"
                )
            message = {"role": role, "content": content}
            if role == "tool":
                if not messages or not (messages[-1].get("tool_calls") or messages[-1]["role"] == "tool"):
                    raise SFTDataError(f"{where}: {path} is a tool result, but no assistant tool call comes before it")
                message.update({k: turn[k] for k in ("name", "tool_call_id") if isinstance(turn.get(k), str)})
            for key in REASONING_KEYS:
                if turn.get(key):
                    raise SFTDataError(
                        f"{where}: {path}.{key} is set on a {role} turn; only assistant turns have reasoning"
                    )
            messages.append(message)
            continue
        value = turn.get(text_key)
        content, reasoning, part_calls = ("", [], []) if value is None else _parts(value, where, f"{path}.{text_key}")
        for key in REASONING_KEYS:
            if turn.get(key) is not None:
                reasoning.insert(0, _text(turn[key], where, f"{path}.{key}"))
        own_calls = turn.get("tool_calls") or []
        calls = (own_calls if isinstance(own_calls, list) else [own_calls]) + part_calls
        message = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = _tool_calls(
                calls, where, f"{path}.tool_calls" if turn.get("tool_calls") else f"{path}.{text_key}"
            )
        elif not content.strip():
            raise EmptyAnswerError(f"{where}: field '{path}.{text_key}' is empty")
        if any(r.strip() for r in reasoning):
            message["reasoning_content"] = "\n".join(r for r in reasoning if r.strip())
        messages.append(message)
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(
            f"{where}: the conversation has no assistant turn (roles: "
            f"{', '.join(m['role'] for m in messages)}), so nothing would be trained"
        )
    if messages[0]["role"] == "assistant":
        raise SFTDataError(
            f"{where}: {field}[0] is an assistant turn; a conversation must start with a system or user turn"
        )
    return messages, tools


def to_messages(row: dict, row_number: int | str, source: str) -> list[dict]:
    """The messages of `to_conversation` (without the row's tools); see there."""
    return to_conversation(row, row_number, source)[0]
