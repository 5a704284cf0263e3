"""Supervised fine-tuning (SFT) data for causal language models: rows -> chat messages ->
token ids with assistant-only labels -> packed or padded batches.

Pipeline, as a recipe uses it::

    rows = load_rows("train.jsonl")                                   # JSON list or JSONL
    examples, stats = prepare(rows, tokenizer, max_length=2048, source="train.jsonl")
    check_vocab(tokenizer, model.config.vocab_size)
    packed = pack(examples, seq_len=2048, pad_id=tokenizer.pad_token_id)   # or pad_batch(...)

Accepted row formats (`to_messages`): chat ``{"messages": [{"role", "content"}]}``, Alpaca
``{"instruction", "input", "output"}`` and ShareGPT ``{"conversations": [{"from", "value"}]}``.

Labels follow the Hugging Face convention: ``labels`` is aligned with ``input_ids`` (the model
shifts them by one), and `IGNORE_INDEX` (-100) marks tokens without loss. Only the tokens an
assistant turn adds to the rendered chat carry labels: its content and the end-of-turn token
the template writes after it (``<|im_end|>`` for ChatML), not the ``<|im_start|>assistant\\n``
header nor the newline after ``<|im_end|>``. Invalid input raises one `SFTDataError` that names
the file, the row (1-based) and the field.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import torch

IGNORE_INDEX = -100  # torch.nn.functional.cross_entropy's default ignore_index
ROLES = ("system", "user", "assistant")
_SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


class SFTDataError(ValueError):
    """A data file, row or tokenizer is unusable for SFT; the message names the file, row and field."""


# ----------------------------------------------------------------------------- rows -> messages
def load_rows(path: str | Path) -> list[dict]:
    """Read a data file: a JSON array of objects (first non-blank character ``[``), JSONL, or a
    single row object. A UTF-8 byte-order mark is ignored.

    Raises:
        SFTDataError: the file is missing, not UTF-8, not valid JSON (with the line for JSONL),
            empty, or holds a row that is not an object.
    """
    p = Path(path)
    if not p.is_file():
        raise SFTDataError(f"data file not found: {p}")
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is dropped
    except UnicodeDecodeError as exc:
        raise SFTDataError(f"{p}: not UTF-8 text: {exc}") from None
    try:
        whole = json.loads(text)
    except json.JSONDecodeError:
        whole = None
    if isinstance(whole, dict):  # one object: a one-row file, or a wrapper such as {"data": [...]}
        if not any(k in whole for k in ("messages", "conversations", "instruction")):
            raise SFTDataError(f"{p}: the file holds one JSON object (keys {sorted(whole)[:5]}); expected a JSON "
                               f"list of rows, or JSONL with one row per line")
        rows = [whole]
    elif text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{p}: not valid JSON: {exc}") from None
    else:
        rows = []
        for line_no, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise SFTDataError(f"{p} line {line_no}: not valid JSON: {exc.msg}") from None
    if not rows:
        raise SFTDataError(f"{p}: no rows")
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise SFTDataError(f"{p} row {n}: expected a JSON object, got {type(row).__name__}")
    return rows


class EmptyAnswerError(SFTDataError):
    """An assistant turn (Alpaca ``output``) is empty: `prepare` skips such rows and counts them."""


def _text(value: Any, where: str, field: str, allow_empty: bool = True, answer: bool = False) -> str:
    if not isinstance(value, str):
        raise SFTDataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}")
    if not allow_empty and not value.strip():
        raise (EmptyAnswerError if answer else SFTDataError)(f"{where}: field '{field}' is empty")
    return value


def to_messages(row: dict, row_number: int, source: str) -> list[dict]:
    """Convert one data row to chat messages ``[{"role": "system"|"user"|"assistant", "content": str}]``.

    Formats:
        chat: ``{"messages": [{"role", "content"}, ...]}``; other message keys are dropped.
        Alpaca: ``{"instruction", "input" (optional, may be empty), "output"}`` -> one user turn
            (instruction, plus ``"\\n\\n" + input`` when input is not empty) and one assistant turn.
        ShareGPT: ``{"conversations": [{"from": "system"|"human"|"gpt", "value"}, ...]}``
            ("user" and "assistant" are accepted as ``from`` too).

    Args:
        row: one object of the data file.
        row_number: its 1-based position in the file, for messages.
        source: the file name (or data set name), for messages.

    Raises:
        SFTDataError: ``"<source> row <n>: ..."`` for an unknown format (listing the keys found
            and expected), an unknown role, a non-string or empty field, an empty assistant
            turn (`EmptyAnswerError`, which `prepare` skips and counts), or a conversation
            without an assistant turn.
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
                {"role": "assistant", "content": _text(row["output"], where, "output", allow_empty=False, answer=True)}]
    else:
        raise SFTDataError(f"{where}: unknown format, found keys {sorted(row)}; expected 'messages' (chat), "
                           f"'conversations' (ShareGPT) or 'instruction' + 'output' (Alpaca)")
    if not isinstance(turns, list) or not turns:
        raise SFTDataError(f"{where}: field '{field}' must be a non-empty list of turns")
    messages = []
    for i, turn in enumerate(turns):
        path = f"{field}[{i}]"
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise SFTDataError(f"{where}: {path} must be an object with '{role_key}' and '{text_key}'")
        raw = turn[role_key]
        role = None if not isinstance(raw, str) else role_map.get(raw) if role_map else raw if raw in ROLES else None
        if role is None:
            allowed = ", ".join(role_map or ROLES)
            raise SFTDataError(f"{where}: {path}.{role_key} is {raw!r}, expected one of {allowed}")
        content = _text(turn[text_key], where, f"{path}.{text_key}", allow_empty=role != "assistant",
                        answer=role == "assistant")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: the conversation has no assistant turn (roles: "
                           f"{', '.join(m['role'] for m in messages)}), so nothing would be trained")
    if messages[0]["role"] == "assistant":
        raise SFTDataError(f"{where}: {field}[0] is an assistant turn; a conversation must start with a "
                           f"system or user turn")
    return messages


# ----------------------------------------------------------------------------- messages -> tokens
def _require_chat_template(tokenizer) -> None:
    try:
        tokenizer.get_chat_template()
    except ValueError as exc:
        raise SFTDataError(f"the tokenizer ({type(tokenizer).__name__}) has no usable chat template: set "
                           f"tokenizer.chat_template or use a chat/instruct model's tokenizer ({exc})") from None


def _render(tokenizer, messages: list[dict], add_generation_prompt: bool, kwargs: dict | None) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=add_generation_prompt,
                                              return_dict=False, **(kwargs or {})))


def _unstable(tokenizer, full: list[int], part: list[int], what: str) -> SFTDataError:
    j = next((k for k, (a, b) in enumerate(zip(full, part)) if a != b), min(len(full), len(part)))
    got, want = tokenizer.decode(part[j:j + 8]), tokenizer.decode(full[j:j + 8])
    return SFTDataError(
        f"the chat template is not prefix-stable: {what} rendered differs from the whole "
        f"conversation at token {j} ({got!r} vs {want!r}), so assistant turns cannot be located by rendering "
        f"prefixes. Templates that rewrite earlier turns do this (Qwen3's adds a <think> block to the assistant "
        f"turn after the last user turn only); use single-turn rows or set a prefix-stable tokenizer.chat_template")


def tokenize_conversation(tokenizer, messages: list[dict], max_length: int,
                          chat_template_kwargs: dict | None = None) -> tuple[list[int], list[int], bool]:
    """Render `messages` with the tokenizer's chat template; label only the assistant turns.

    Incremental-prefix method: for assistant message ``i``, the tokens it adds are those between
    the rendering of ``messages[:i]`` with ``add_generation_prompt=True`` (which ends in the
    assistant header) and the rendering of ``messages[:i+1]``. Both renderings must be prefixes
    of the rendering of the whole conversation, which is what is trained on. Whitespace-only
    tokens after the turn's last special token (the ``"\\n"`` after ``<|im_end|>``) get no label.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template.
        messages: from `to_messages`; the first is not an assistant turn.
        max_length: tokens kept (the rest is cut off the end).
        chat_template_kwargs: extra template variables, e.g. ``{"enable_thinking": False}`` for
            Qwen3, whose generation prompt then ends in an empty ``<think>`` block (not labelled).

    Returns:
        ``(input_ids, labels, truncated)``: two lists of equal length <= max_length, labels
        `IGNORE_INDEX` outside assistant turns; ``truncated`` if tokens were cut.

    Raises:
        SFTDataError: the tokenizer has no chat template; the template is not prefix-stable.
    """
    if max_length < 1:
        raise ValueError(f"max_length must be >= 1, got {max_length}")
    _require_chat_template(tokenizer)
    special = {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    full = _render(tokenizer, messages, False, chat_template_kwargs)
    labels = [IGNORE_INDEX] * len(full)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise SFTDataError("messages[0] is an assistant turn; a conversation must start with a system or user turn")
        before = _render(tokenizer, messages[:i], True, chat_template_kwargs)
        through = _render(tokenizer, messages[: i + 1], False, chat_template_kwargs)
        for part, what in ((before, f"messages[:{i}] + generation prompt"), (through, f"messages[:{i + 1}]")):
            if full[: len(part)] != part:
                raise _unstable(tokenizer, full, part, what)
        start, stop = len(before), len(through)
        end = stop
        while end > start and not tokenizer.decode(full[end - 1 : end]).strip():
            end -= 1
        if end > start and full[end - 1] in special:
            stop = end  # trailing whitespace after the end-of-turn token
        labels[start:stop] = full[start:stop]
    return full[:max_length], labels[:max_length], len(full) > max_length


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise `SFTDataError` if the tokenizer can emit ids the model's embedding has no row for.

    ``len(tokenizer)`` counts added tokens; ``vocab_size`` is ``model.config.vocab_size``
    (it may be larger than the tokenizer: Qwen3 pads its embedding to 151936 rows for 151669 tokens).
    """
    if len(tokenizer) > vocab_size:
        raise SFTDataError(f"the tokenizer has {len(tokenizer)} tokens but the model's vocab_size is {vocab_size}: "
                           f"ids >= {vocab_size} have no embedding; use the model's own tokenizer")


@dataclass
class SFTStats:
    """What `prepare` did to a data set. Token counts are after truncation, of kept examples."""

    rows: int = 0  # rows read
    examples: int = 0  # examples kept
    truncated: int = 0  # rows cut to max_length
    dropped: int = 0  # rows with no labelled token left after truncation (not kept)
    empty_answers: list[int] = field(default_factory=list)  # 1-based numbers of rows skipped for an empty answer
    tokens: int = 0
    loss_tokens: int = 0  # tokens with a label

    @property
    def loss_fraction(self) -> float:
        """Fraction (0-1) of tokens that carry a label."""
        return self.loss_tokens / self.tokens if self.tokens else 0.0

    def as_dict(self) -> dict[str, float]:
        return {**asdict(self), "loss_fraction": self.loss_fraction}

    def summary(self) -> str:
        empty = ""
        if self.empty_answers:
            shown = ", ".join(map(str, self.empty_answers[:5])) + (", ..." if len(self.empty_answers) > 5 else "")
            empty = f", {len(self.empty_answers)} skipped with an empty answer (rows {shown})"
        return (f"{self.rows} rows -> {self.examples} examples ({self.truncated} truncated, {self.dropped} dropped "
                f"without labels{empty}) | {self.tokens} tokens, {self.loss_fraction:.1%} with loss")


def prepare(rows: Sequence[dict], tokenizer, max_length: int, source: str,
            chat_template_kwargs: dict | None = None) -> tuple[list[dict], SFTStats]:
    """`to_messages` + `tokenize_conversation` (see there for the arguments) over a data set.

    Returns:
        ``(examples, stats)``: examples are ``{"input_ids": list[int], "labels": list[int]}``, in
        row order, without the rows that truncation left with no labelled token (counted in
        ``stats.dropped``: they cost compute and, alone in a batch, make a mean loss 0/0) and
        without rows whose answer is empty (their numbers in ``stats.empty_answers``).

    Raises:
        SFTDataError: the tokenizer has no chat template (once, before any row); a row is
            invalid or its rendering not prefix-stable (``"<source> row <n>: ..."``).
    """
    _require_chat_template(tokenizer)
    stats, examples = SFTStats(rows=len(rows)), []
    for n, row in enumerate(rows, 1):
        try:
            messages = to_messages(row, n, source)
        except EmptyAnswerError:  # e.g. a few rows of tatsu-lab/alpaca: nothing to learn from them
            stats.empty_answers.append(n)
            continue
        try:
            ids, labels, truncated = tokenize_conversation(tokenizer, messages, max_length, chat_template_kwargs)
        except SFTDataError as exc:
            raise SFTDataError(f"{source} row {n}: {exc}") from None
        stats.truncated += truncated
        n_loss = sum(label != IGNORE_INDEX for label in labels)
        if n_loss == 0:
            stats.dropped += 1
            continue
        examples.append({"input_ids": ids, "labels": labels})
        stats.examples += 1
        stats.tokens += len(ids)
        stats.loss_tokens += n_loss
    return examples, stats


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
            ``eval_files``, ``hub_id``, ``eval_fraction``, ``max_length`` and ``chat_template_kwargs``.
        tokenizer: a tokenizer with a chat template.
        seed: seeds the held-out split: without eval files, a seeded ``eval_fraction`` of each train
            file is held out for evaluation.
    """
    kwargs = dict(cfg.chat_template_kwargs) or None
    sources = [(f, load_rows(f)) for f in cfg.train_files]
    if not sources:
        import datasets

        sources = [(cfg.hub_id, [dict(r) for r in datasets.load_dataset(cfg.hub_id, split="train")])]
    train, evals, stats = [], [], SFTStats()
    for source, rows in sources:
        examples, st = prepare(rows, tokenizer, cfg.max_length, source, kwargs)
        if not cfg.eval_files and cfg.eval_fraction > 0:
            order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
            n_eval = max(1, int(len(examples) * cfg.eval_fraction))
            evals += [examples[i] for i in sorted(order[:n_eval])]
            examples = [examples[i] for i in sorted(order[n_eval:])]
        train += examples
        for key in ("rows", "examples", "truncated", "dropped", "tokens", "loss_tokens", "empty_answers"):
            setattr(stats, key, getattr(stats, key) + getattr(st, key))
    for f in cfg.eval_files:
        evals += prepare(load_rows(f), tokenizer, cfg.max_length, f, kwargs)[0]
    return train, evals, stats


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
