"""``train.py --show-examples N``: the first N training examples as the model sees them, labelled spans marked, and
what the data pipeline kept, cut and dropped, per field."""

from __future__ import annotations

from itertools import groupby
from pathlib import Path
from typing import Any, Sequence

from cookbook.sft.rows import IGNORE_INDEX
from cookbook.sft.stats import REASONING_DONE, SFTStats

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
        f"{stats.reasoning_unrendered} left out by the chat template, {stats.reasoning_dropped} dropped "
        f"(data.reasoning=drop)",
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
    from cookbook.sft.data import prepare_sources

    parts = prepare_sources(
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
