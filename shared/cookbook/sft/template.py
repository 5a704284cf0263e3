"""SFT messages -> token ids with assistant-only labels through the tokenizer's chat template; reasoning and tools."""

from __future__ import annotations

import json
from bisect import bisect_left
from collections import Counter
from typing import Collection

from cookbook.sft.rows import IGNORE_INDEX, SFTDataError, EmptyAnswerError, row_label, to_conversation
from cookbook.sft.stats import SFTStats


def _chat_template(tokenizer, required: bool = False) -> str:
    """The tokenizer's chat template; ``""`` if it has none, or with `required` SFTDataError."""
    try:
        return tokenizer.get_chat_template()
    except ValueError as exc:
        if not required:
            return ""
        raise SFTDataError(
            f"the tokenizer ({type(tokenizer).__name__}) has no usable chat template: set "
            f"tokenizer.chat_template or use a chat/instruct model's tokenizer ({exc})"
        ) from None


def _render(
    tokenizer, messages: list[dict], prompt: bool, kwargs: dict | None, tools: list[dict] | None, tokenize: bool = True
) -> list[int] | str:
    """`messages` through the chat template, with the generation prompt if `prompt`: token ids, or the text."""
    from jinja2.exceptions import TemplateError

    try:
        out = tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=tokenize, return_dict=False, add_generation_prompt=prompt, **(kwargs or {})
        )
    except (TemplateError, TypeError) as exc:  # the template's raise_exception, or e.g. str + None in Jinja
        raise SFTDataError(f"the chat template cannot render this conversation: {type(exc).__name__}: {exc}") from None
    return list(out) if tokenize else out


def _unstable(tokenizer, full: list[int], part: list[int], what: str, split_turns: bool = False) -> SFTDataError:
    j = next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
    got, want = tokenizer.decode(part[j : j + 8]), tokenizer.decode(full[j : j + 8])
    advice = (
        "use single-turn rows, set data.split_turns=true (one example per assistant turn, each as the model sees it "
        "when it writes that turn), or set a prefix-stable tokenizer.chat_template"
    )
    if split_turns:
        advice = (
            "data.split_turns is already true, so the turn being labelled itself renders differently as the last "
            "turn and inside the conversation: check that row's text for template markup, or set a prefix-stable "
            "tokenizer.chat_template"
        )
    return SFTDataError(
        f"the chat template is not prefix-stable: {what} rendered differs from the whole "
        f"conversation at token {j} ({got!r} vs {want!r}), so assistant turns cannot be located by rendering "
        f"prefixes. Templates that rewrite earlier turns do this (Qwen3's adds a <think> block to the assistant "
        f"turn after the last user turn only); {advice}"
    )


def _inline_reasoning(template: str, messages: list[dict]) -> list[dict]:
    """Messages with an assistant turn's inline ``<think>...</think>`` prefix moved to ``reasoning_content`` (a chat
    `template` with ``<think>`` blocks). Raises SFTDataError: a stray ``<think>`` / ``</think>`` in an assistant turn."""
    if "</think>" not in template:
        return messages
    out = []
    for i, m in enumerate(messages):
        text = m["content"] if m["role"] == "assistant" else ""
        if "<think>" in text or "</think>" in text:
            head, sep, tail = text.lstrip().partition("</think>")
            stray = "<think>" in head[7:] or "<think>" in tail or "</think>" in tail
            if not (sep and head.startswith("<think>")) or stray:
                raise SFTDataError(
                    f"messages[{i}].content (assistant) holds a stray '</think>' or '<think>', which "
                    f"the chat template reads as the edge of a reasoning block (it would move text "
                    f"out of the turn): put the reasoning in 'reasoning_content' (or the content as "
                    f"'<think>reasoning</think>answer') and remove the stray tag"
                )
            if m.get("reasoning_content"):
                raise SFTDataError(
                    f"messages[{i}] has both 'reasoning_content' and a <think> block in its content: keep one"
                )
            m = {**m, "content": tail.lstrip("\n"), "reasoning_content": head[7:].strip("\n")}
            if not m["reasoning_content"].strip():
                del m["reasoning_content"]
        out.append(m)
    return out


def check_tools_rendered(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None,
    text: str = "",
    kwargs: dict | None = None,
    turns: dict[int, str] | None = None,
) -> None:
    """Refuse (`SFTDataError`) a template that drops tools, calls (`turns`: index -> text; None: `text`) or results."""
    turns = {i: text for i, m in enumerate(messages) if m.get("tool_calls")} if turns is None else turns
    needed = tools or any(m["role"] == "tool" for m in messages)  # the whole text is read for tools and results
    text = _render(tokenizer, messages, False, kwargs, tools, tokenize=False) if needed else ""
    for name in (tool["function"]["name"] for tool in tools or ()):
        if name not in text:
            raise SFTDataError(
                f"the chat template does not render the row's tools: the tool {name!r} is missing from "
                f"the rendered conversation (a template that ignores tools=). Use a tokenizer whose "
                f"template renders tools (Qwen2.5's and Qwen3's do) or remove 'tools' from the rows"
            )
    for i, rendered in turns.items():
        for name in (call["function"]["name"] for call in messages[i].get("tool_calls", ())):
            if name not in rendered:
                raise SFTDataError(
                    f"the chat template does not render tool calls: messages[{i}] calls {name!r} but "
                    f"its rendered turn is {rendered[:80]!r} (a template that ignores tool_calls). Use "
                    f"a tokenizer whose template renders tool calls (Qwen2.5's and Qwen3's do)"
                )
    for i, m in enumerate(messages):
        result = m["content"].strip() if m["role"] == "tool" else ""
        forms = (result, json.dumps(result, ensure_ascii=False)[1:-1], json.dumps(result)[1:-1])  # as written, escaped
        if result and not any(form in text for form in forms):
            raise SFTDataError(
                f"the chat template does not render tool results: messages[{i}] (role tool) is missing "
                f"from the rendered conversation"
            )


def _covering(tokenizer, ids: list[int], start: int, stop: int, text: str) -> int:
    """The smallest ``end`` in ``(start, stop]`` whose decoded ``ids[start:end]`` contains `text` (binary search)."""
    covers = range(start + 1, stop)
    return start + 1 + bisect_left(covers, True, key=lambda end: text in tokenizer.decode(ids[start:end]))


def _encode(
    tokenizer,
    messages: list[dict],
    kwargs: dict | None,
    tools: list[dict] | None,
    last_turn_only: bool,
    reasoning: str = "train",
    dropped: Collection[int] = (),
) -> tuple[list[int], list[int], dict[str, list]]:
    """Untruncated ``(input_ids, labels, counts)`` of `tokenize_conversation`; `last_turn_only`: the last assistant turn
    labelled only; `reasoning` ``"context"`` masks reasoning. ``counts``: starts of labelled turns whose reasoning was
    rendered, ``unrendered``, ``dropped`` (turns in `dropped`); ``calls``: ``(start, tool calls)`` of those with calls."""
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    full = _render(tokenizer, messages, False, kwargs, tools)
    labels, assistant = [IGNORE_INDEX] * len(full), [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    turns, counts = {}, {"reasoning": [], "unrendered": [], "dropped": [], "calls": []}
    for i in assistant[-1:] if last_turn_only else assistant:
        if i == 0:
            raise SFTDataError("messages[0] is an assistant turn; a conversation must start with a system or user turn")
        before = _render(tokenizer, messages[:i], True, kwargs, tools)
        through = _render(tokenizer, messages[: i + 1], False, kwargs, tools)
        for part, what in ((before, f"messages[:{i}] + generation prompt"), (through, f"messages[:{i + 1}]")):
            if full[: len(part)] != part:
                raise _unstable(tokenizer, full, part, what, last_turn_only)
        start, stop, end = len(before), len(through), len(through)
        while end > start and not tokenizer.decode(full[end - 1 : end]).strip():
            end -= 1
        if end > start and full[end - 1] in special:
            stop = end  # trailing whitespace after the end-of-turn token
        labels[start:stop] = full[start:stop]
        thought = next((messages[i][k] for k in ("reasoning_content", "thinking") if messages[i].get(k)), "").strip()
        if thought:
            if thought in tokenizer.decode(full[start:stop]):
                counts["reasoning"].append(start)
                if reasoning == "context":
                    cover = _covering(tokenizer, full, start, stop, thought)
                    labels[start:cover] = [IGNORE_INDEX] * (cover - start)
            else:
                counts["unrendered"].append(start)
        if i in dropped:
            counts["dropped"].append(start)
        if messages[i].get("tool_calls"):
            turns[i] = tokenizer.decode(full[start:stop])
            counts["calls"].append((start, len(messages[i]["tool_calls"])))
    check_tools_rendered(tokenizer, messages, tools, kwargs=kwargs, turns=turns)
    return full, labels, counts


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> tuple[list[int], list[int], bool]:
    """Render `messages` with the chat template (`tools` as ``tools=``) and label only the assistant turns:
    ``(input_ids, labels, truncated)``, at most `max_length` long. Turn ``i`` lies between the renderings of
    ``messages[:i]`` with the generation prompt and of ``messages[:i+1]``, both prefixes of the whole conversation's.
    Raises SFTDataError: no chat template; the template fails, is not prefix-stable, drops tools, calls or results."""
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _chat_template(tokenizer, required=True)
    full, labels, _ = _encode(tokenizer, messages, chat_template_kwargs, tools, last_turn_only=False)
    return full[:max_length], labels[:max_length], len(full) > max_length


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise `SFTDataError` if ``len(tokenizer)`` exceeds `vocab_size` (larger is fine: Qwen3 pads its embedding)."""
    if len(tokenizer) > vocab_size:
        raise SFTDataError(
            f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
            f"ids >= {vocab_size} have no embedding; use the model's own tokenizer"
        )


def template_conversation(
    row: dict,
    row_number: int | str,
    source: str,
    tokenizer,
    stats: SFTStats,
    ignored: Counter | None = None,
    chat_template_kwargs: dict | None = None,
    reasoning: str = "train",
    dropped: list[int] | None = None,
) -> tuple[list[dict], list | None]:
    """`to_conversation` made ready for `tokenizer`'s template (None: reasoning left as ``reasoning_content``): inline
    ``<think>`` moved, reasoning under the template's key or dropped (counted in `stats`, or its turns appended to
    `dropped`), unused keys counted in `ignored`. Raises EmptyAnswerError; SFTDataError: see `to_conversation`."""
    if ignored is not None:  # the row's own keys that its format does not read
        formats = {"messages": ("tools",), "conversations": ("system", "tools"), "instruction": ("input", "output")}
        field = next((k for k in formats if k in row), "instruction")
        ignored.update(k for k in row if k != field and k not in formats[field])
    removed = [] if dropped is None else dropped
    try:
        messages, tools = to_conversation(row, row_number, source, ignored)
        if tokenizer is not None or reasoning == "drop":
            messages = _place_reasoning(messages, reasoning, tokenizer, chat_template_kwargs, removed)
    except EmptyAnswerError:
        raise
    except SFTDataError as exc:
        raise SFTDataError(
            str(exc) if str(exc).startswith(source) else f"{source} {row_label(row_number)}: {exc}"
        ) from None
    stats.reasoning_dropped += len(removed) if dropped is None else 0
    return messages, tools


def _place_reasoning(
    messages: list[dict], reasoning: str, tokenizer, kwargs: dict | None, dropped: list[int]
) -> list[dict]:
    """`_inline_reasoning`, then each turn's ``reasoning_content`` under the key `tokenizer`'s template reads
    (``reasoning_content`` or ``thinking``), or removed (its index appended to `dropped`). Raises SFTDataError: see
    `_inline_reasoning`; reasoning, but the template reads none or ``enable_thinking`` is false."""
    template = _chat_template(tokenizer) if tokenizer is not None else ""
    target = next((k for k in ("reasoning_content", "thinking") if k in template), None)
    out = [dict(m) for m in _inline_reasoning(template, messages)]
    for i, m in enumerate(out):
        if "reasoning_content" not in m:
            continue
        thought = m.pop("reasoning_content")
        if reasoning == "drop":
            dropped.append(i)
        elif target is None:
            raise SFTDataError(
                f"messages[{i}] has reasoning, but the chat template has no place for it (it reads "
                f"neither 'reasoning_content' nor 'thinking'): set data.reasoning=drop to train "
                f"without it (counted in the data summary), or use a template that renders reasoning"
            )
        elif (kwargs or {}).get("enable_thinking") is False:
            raise SFTDataError(
                f"messages[{i}] has reasoning, but data.chat_template_kwargs has enable_thinking: "
                f"false, which makes the template write an empty reasoning block: set it to true "
                f"to keep the reasoning, or data.reasoning=drop to train without it"
            )
        else:
            m[target] = thought
    return out
