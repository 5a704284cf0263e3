"""SFT data sets: rows -> labelled examples (`prepare`, `load_examples`), packed or padded rows, batches, and what
``--show-examples`` prints (`show_data`). ``labels`` is aligned with ``input_ids`` (the model shifts them);
`IGNORE_INDEX` (-100) marks tokens without loss."""

from __future__ import annotations

from collections import Counter
from itertools import groupby
from pathlib import Path
from typing import Any, Sequence

import torch

from cookbook.sft.rows import IGNORE_INDEX, EmptyAnswerError, SFTDataError, load_hub_rows, load_rows
from cookbook.sft.stats import REASONING_DONE, SFTStats
from cookbook.sft.template import _chat_template, _encode, template_conversation


def prepare(
    rows: Sequence[dict],
    tokenizer,
    max_length: int,
    source: str,
    chat_template_kwargs: dict | None = None,
    *,
    max_dropped_fraction: float | None = None,
    split_turns: bool = False,
    truncate: bool = True,
    reasoning: str = "train",
) -> tuple[list[dict], SFTStats]:
    """`template_conversation` + `tokenize_conversation` over a data set: ``(examples, stats)``, examples
    ``{"input_ids", "labels"}`` in row order (those with no label, and rows with an empty answer, counted, not kept).
    `max_dropped_fraction`: `SFTStats.check_dropped`; `split_turns`: one example per assistant turn; `truncate`
    False drops over-long examples; `reasoning`: ``"train"``, ``"context"`` (no loss) or ``"drop"``.
    Raises SFTDataError: no chat template; ``"<source> row <n>: ..."`` for a bad row; too many dropped."""
    if reasoning not in ("train", "context", "drop"):
        raise ValueError(f"reasoning must be train, context or drop, got {reasoning!r}")
    _chat_template(tokenizer, required=True)
    lines, examples, ignored = getattr(rows, "lines", None), [], Counter()
    stats = SFTStats(source, max_length, truncate, len(rows), reasoning=reasoning, lines=lines)
    stats.max_positions = getattr(tokenizer, "cookbook_max_positions", None)  # set by `load_tokenizer`
    for n, row in enumerate(rows, 1):
        dropped: list[int] = []  # the turns whose reasoning data.reasoning=drop removed
        try:
            messages, tools = template_conversation(
                row, stats.label(n), source, tokenizer, stats, ignored, chat_template_kwargs, reasoning, dropped
            )
        except EmptyAnswerError:  # e.g. a few rows of tatsu-lab/alpaca: nothing to learn from them
            stats.empty_answers.append(n)
            continue
        ends = [i + 1 for i, m in enumerate(messages) if m["role"] == "assistant"] if split_turns else [len(messages)]
        stats.split_rows += len(ends) > 1
        for end in ends:
            try:
                ids, labels, counts = _encode(
                    tokenizer, messages[:end], chat_template_kwargs, tools, split_turns, reasoning, dropped
                )
            except SFTDataError as exc:
                raise SFTDataError(f"{source} {stats.label(n)}: {exc}") from None
            example = stats.add(n, ids, labels, **counts)
            examples += [example] if example is not None else []
    stats.ignored = dict(ignored)
    if max_dropped_fraction is not None:
        stats.check_dropped(max_dropped_fraction)
    return examples, stats


def pack(examples: Sequence[dict], seq_len: int, pad_id: int) -> list[dict]:
    """Pack examples into rows of exactly `seq_len` tokens (next-fit, in order; documents never split), each document's
    ``position_ids`` from 0 and the padding a last document without labels. Pass no ``attention_mask`` and
    ``use_cache=False`` (docs/notes.md#packed-rows-and-transformers-attention-masks-transformers-524).
    Raises SFTDataError: an example is longer than `seq_len` or empty, or labels its first token."""
    groups: list[list[tuple[list, list]]] = [[]]
    for k, ex in enumerate(examples):
        ids, labels = list(ex["input_ids"]), list(ex["labels"])
        if not 0 < len(ids) <= seq_len or len(labels) != len(ids):
            raise SFTDataError(
                f"example {k}: {len(ids)} tokens and {len(labels)} labels; packing needs "
                f"1..{seq_len} of each (truncate with max_length <= seq_len)"
            )
        if labels[0] != IGNORE_INDEX:
            raise SFTDataError(
                f"example {k}: its first token has a label, so in a packed row it would be trained "
                f"as the continuation of the previous document"
            )
        if sum(len(i) for i, _ in groups[-1]) + len(ids) > seq_len:
            groups.append([])
        groups[-1].append((ids, labels))
    rows = []
    for group in filter(None, groups):
        pad = seq_len - sum(len(i) for i, _ in group)
        group.append(([pad_id] * pad, [IGNORE_INDEX] * pad))
        ids, labels = [t for i, _ in group for t in i], [t for _, lb in group for t in lb]
        positions = [p for i, _ in group for p in range(len(i))]
        rows.append({"input_ids": ids, "labels": labels, "position_ids": positions})
    return rows


def pad_batch(examples: Sequence[dict], pad_id: int, pad_to_multiple_of: int = 1) -> dict[str, torch.Tensor]:
    """Right-pad to one batch (int64, width a multiple of `pad_to_multiple_of`) with an ``attention_mask``."""
    longest = max(len(ex["input_ids"]) for ex in examples)
    width = -(-longest // pad_to_multiple_of) * pad_to_multiple_of
    out = {
        k: torch.full((len(examples), width), v, dtype=torch.long)
        for k, v in (("input_ids", pad_id), ("attention_mask", 0), ("labels", IGNORE_INDEX))
    }
    for b, ex in enumerate(examples):
        n = len(ex["input_ids"])
        out["input_ids"][b, :n] = torch.tensor(ex["input_ids"], dtype=torch.long)
        out["labels"][b, :n] = torch.tensor(ex["labels"], dtype=torch.long)
        out["attention_mask"][b, :n] = 1
    return out


def load_examples(cfg: Any, tokenizer, seed: int) -> tuple[list[dict], list[dict], SFTStats]:
    """Train and eval examples and the train `SFTStats` for a data section `cfg` (`DataConfig`); without eval files a
    seeded ``eval_fraction`` of each train file is held out. Raises SFTDataError: see `load_rows` and `prepare`."""
    eval_files, limit = getattr(cfg, "eval_files", []), cfg.max_dropped_fraction
    train, evals, parts = [], [], []
    for examples, st in _prepare_sources(
        cfg, tokenizer, cfg.train_files, "data.train_files", max_dropped_fraction=limit
    ):
        if not eval_files and cfg.eval_fraction > 0:
            kept, held = hold_out(len(examples), cfg.eval_fraction, seed)
            evals += [examples[i] for i in held]
            examples = [examples[i] for i in kept]
        train += examples
        parts.append(st)
    for f in eval_files:
        evals += _prepare_sources(cfg, tokenizer, [f], "data.eval_files", max_dropped_fraction=limit)[0][0]
    return train, evals, SFTStats.merge(parts)


def _prepare_sources(
    cfg: Any, tokenizer, files: Sequence[str], key: str = "", **options
) -> list[tuple[list[dict], SFTStats]]:
    """`prepare` of each of `files` (none: the hub data set ``cfg.hub_id``; `key`: the config key that names them)
    with data section `cfg`'s settings."""
    kwargs = dict(cfg.chat_template_kwargs) or None
    options = dict(split_turns=cfg.split_turns, reasoning=getattr(cfg, "reasoning", "train")) | options
    sources = [(f, load_rows(f, key)) for f in files] or [(cfg.hub_id, load_hub_rows(cfg.hub_id))]
    return [prepare(rows, tokenizer, cfg.max_length, source, kwargs, **options) for source, rows in sources]


def hold_out(n: int, fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """``(train, held out)`` indices of `n` items, in order: a seeded `fraction` (at least one) held out."""
    order, n_eval = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist(), max(1, int(n * fraction))
    return sorted(order[n_eval:]), sorted(order[:n_eval])


def shard_for_eval(rows: list[dict], rank: int, world_size: int) -> list[dict]:
    """This rank's evaluation rows, padded with label-free copies so that every rank runs as many forward passes."""
    if not rows:
        return []
    mine, filler = rows[rank::world_size], {**rows[0], "labels": [IGNORE_INDEX] * len(rows[0]["labels"])}
    return mine + [filler] * (-(-len(rows) // world_size) - len(mine))


def pad_token_id(tokenizer) -> int:
    """The tokenizer's pad token id, else its end-of-sequence id. Raises ValueError: it has neither."""
    for pad_id in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if pad_id is not None:
            return pad_id
    raise ValueError("the tokenizer has neither a pad token nor an end-of-sequence token: set tokenizer.pad_token")


def training_rows(cfg: Any, tokenizer, seed: int) -> tuple[list[dict], list[dict], SFTStats]:
    """`load_examples`, then with ``cfg.packing`` each list packed into rows of ``cfg.max_length`` tokens (`pack`)."""
    train, evals, stats = load_examples(cfg, tokenizer, seed)
    if cfg.packing:
        pad_id = pad_token_id(tokenizer)
        train, evals = pack(train, cfg.max_length, pad_id), pack(evals, cfg.max_length, pad_id)
    return train, evals, stats


def collate(rows: Sequence[dict], pad_id: int, cu_seq_lens: bool = True) -> dict[str, torch.Tensor]:
    """A DataLoader's ``collate_fn`` for SFT rows: packed rows stacked as ``input_ids``, ``labels``, ``position_ids``
    (B, L) int64 (with `cu_seq_lens`, also the (documents + 1,) int32 offsets for ``varlen`` attention); other rows
    right-padded to a multiple of 8 with an ``attention_mask``. Raises ValueError: `rows` is empty."""
    if not rows:
        raise ValueError("collate: no rows")
    if "position_ids" not in rows[0]:
        return pad_batch(rows, pad_id, pad_to_multiple_of=8)
    batch = {k: torch.tensor([r[k] for r in rows], dtype=torch.long) for k in ("input_ids", "labels", "position_ids")}
    if cu_seq_lens:
        flat = batch["position_ids"].flatten()
        starts = torch.nonzero(flat == 0).flatten()
        batch["cu_seq_lens"] = torch.cat([starts, torch.tensor([flat.numel()])]).to(torch.int32)
    return batch


# ----------------------------------------------------------------------------- --show-examples
_OPEN, _CLOSE = "[[", "]]"  # around the labelled tokens (those in the loss)


def _decode(tokenizer, ids: list[int], repeat: int = 4) -> str:
    """`ids` decoded, a run of one special token `repeat` times or more (image placeholders) written ``<tok> x N``."""
    out, plain = [], []
    for tok, run in groupby(ids):
        n = len(list(run))
        if n >= repeat and tokenizer.decode([tok]).startswith("<"):
            out, plain = [*out, tokenizer.decode(plain), f"{tokenizer.decode([tok])} x {n}"], []
        else:
            plain += [tok] * n
    return "".join(out) + tokenizer.decode(plain)


def _render_example(example: dict, tokenizer) -> str:
    """The decoded ``input_ids`` of one example, each run of labelled tokens between ``[[`` and ``]]``."""
    out = []
    for on, run in groupby(zip(example["input_ids"], example["labels"]), key=lambda t: t[1] != IGNORE_INDEX):
        text = _decode(tokenizer, [i for i, _ in run])
        out.append(f"{_OPEN}{text}{_CLOSE}" if on else text)
    return "".join(out)


def _field_counts(stats: SFTStats) -> list[str]:
    """Lines of kept / truncated / dropped counts per field of one source's `SFTStats`."""
    limit = f"max_length={stats.max_length}"
    why, cut = f"longer than {limit}, dropped rather than cut", ""
    if stats.truncate:
        why, cut = "no labelled token left after the cut", f"{stats.truncated} truncated to {limit}, "
    return [
        f"  rows            {stats.rows} read"
        + (f", {stats.split_rows} split into one example per answer" if stats.split_rows else ""),
        f"  examples        {stats.examples} kept, {cut}{stats.dropped} dropped"
        + (f" ({why}: {stats.longest_dropped(3)})" if stats.dropped else ""),
        f"  answers         {len(stats.empty_answers)} empty (row skipped), {len(stats.unanswered)} rows end in a "
        f"tool call with no answer (skipped), {len(stats.call_endings)} tool calls after the last answer (not trained)",
        f"  tool calls      {stats.tool_calls_note()[len('tool calls: ') :]}",
        f"  reasoning       {stats.reasoning_turns} turns {REASONING_DONE[stats.reasoning]}, "
        f"{stats.reasoning_unrendered} left out by the chat template"
        + (f", {stats.reasoning_dropped} dropped (data.reasoning=drop)" if stats.reasoning == "drop" else ""),
        f"  keys not used   {', '.join(f'{k}: {n}' for k, n in sorted(stats.ignored.items())) or 'none'}",
        f"  tokens          {stats.tokens:,}, {stats.loss_tokens:,} labelled ({stats.loss_fraction:.1%})",
    ]


def show_examples(parts: Sequence[tuple[list[dict], SFTStats]], tokenizer, n: int) -> str:
    """The text `--show-examples` prints: per ``(examples, stats)`` of `parts`, `n` examples and `_field_counts`."""
    out = [f"labelled tokens (in the loss) are between {_OPEN} and {_CLOSE}"]
    for examples, stats in parts:
        name = Path(stats.source).name or stats.source
        for k, ex in enumerate(examples[:n]):
            row = stats.label(stats.example_rows[k]) if k < len(stats.example_rows) else "row ?"
            n_loss = sum(label != IGNORE_INDEX for label in ex["labels"])
            out += [
                "",
                f"--- {name} example {k + 1} of {len(examples)} ({row}, {len(ex['input_ids'])} tokens, "
                f"{n_loss} labelled)",
                _render_example(ex, tokenizer),
            ]
        out += ["", f"--- {name}: counts per field", *_field_counts(stats)]
    return "\n".join(out)


def refusal(stats: SFTStats, max_dropped_fraction: float) -> str:
    """``""``, or the line training would refuse these data with (`SFTStats.check_dropped`)."""
    try:
        stats.check_dropped(max_dropped_fraction)
    except ValueError as exc:
        return f"  training would refuse this source: {exc}"
    return ""


def show_data(cfg, tokenizer, n: int) -> str:
    """`show_examples` for a recipe's ``data`` section, each source tokenized as `load_examples` does, before the
    held-out split (said in a last line) and packing; a source training would refuse is shown with the refusal."""
    parts = _prepare_sources(
        cfg, tokenizer, cfg.train_files, "data.train_files", truncate=getattr(cfg, "truncate", True)
    )
    notes = [refusal(st, cfg.max_dropped_fraction) for _, st in parts] + [held_out_note(cfg)]
    return show_examples(parts, tokenizer, n) + "".join(f"\n{x}" for x in notes if x)


def held_out_note(cfg: Any) -> str | None:
    """The last line of a ``--show-examples`` before a seeded ``data.eval_fraction`` split, or ``None``."""
    if getattr(cfg, "eval_fraction", 0) > 0 and not getattr(cfg, "eval_files", []):
        return (
            f"data.eval_fraction={cfg.eval_fraction:g}: a seeded share of each file's examples is held out for "
            f"evaluation; the examples above are before that split"
        )
    return None
