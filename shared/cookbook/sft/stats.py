"""`SFTStats`: what `prepare` did to a data set (rows read, examples kept, cut, dropped, and why)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Sequence

from cookbook.sft.rows import IGNORE_INDEX, SFTDataError, row_label

REASONING_DONE = {"train": "trained", "context": "in context (no loss)", "drop": "dropped"}  # data.reasoning's words


@dataclass
class SFTStats:
    """What `prepare` did to a data set (one source, or several merged with `merge`). An example is a row, or with
    ``split_turns`` one assistant turn of a row. Token counts are after truncation, of kept examples."""

    source: str = ""
    max_length: int = 0
    truncate: bool = True  # False: examples longer than max_length were dropped, not cut
    rows: int = 0  # rows read
    examples: int = 0  # examples kept
    truncated: int = 0  # kept examples cut to max_length
    dropped: int = 0  # examples cut before their first labelled token (not kept)
    dropped_rows: list[tuple[int, int]] = field(default_factory=list)  # (1-based row, tokens before the cut) of those
    empty_answers: list[int] = field(default_factory=list)  # 1-based numbers of rows skipped for an empty answer
    unanswered: list[int] = field(default_factory=list)  # rows not kept: they end in a tool call, no answer to label
    call_endings: list[int] = field(default_factory=list)  # rows kept up to their last answer (a tool call follows)
    example_rows: list[int] = field(default_factory=list)  # the 1-based row of each kept example, in order
    split_rows: int = 0  # rows with several assistant turns split into one example per turn
    tool_call_rows: int = 0  # rows whose kept examples hold tool calls
    tool_calls: int = 0  # the tool calls of kept examples, before max_length
    tool_calls_cut: int = 0  # the tool calls of examples dropped, or after the max_length cut of a kept one
    tokens: int = 0
    loss_tokens: int = 0  # tokens with a label
    reasoning: str = "train"  # data.reasoning: train (in the loss), context (rendered, no loss), drop
    max_positions: int | None = None  # the model's max_position_embeddings, if known: the bound of data.max_length
    reasoning_turns: int = 0  # labelled assistant turns of kept examples whose reasoning was rendered
    reasoning_unrendered: int = 0  # labelled turns of kept examples whose reasoning the chat template left out
    reasoning_dropped: int = 0  # labelled turns of kept examples whose reasoning data.reasoning=drop removed
    ignored: dict[str, int] = field(default_factory=dict)  # keys of rows / turns not used -> how many had them
    unrendered_why: str = (
        "it renders only the reasoning of the turns after the last user turn: data.split_turns=true keeps every turn's"
    )
    parts: list[SFTStats] = field(default_factory=list)  # per-source stats of a merge
    lines: list[int] | None = field(default=None, repr=False)  # each row's line in a JSONL file (`RowList.lines`)
    _call_row: int = field(default=0, repr=False)  # the last row counted in tool_call_rows

    def label(self, n: int) -> str:
        return row_label(n, self.lines)

    def _rows_list(self, numbers: Sequence[int], shown: int = 5) -> str:
        """``"rows 3, 5"`` or ``"lines 4, 7, ..."``: the first `shown` of 1-based rows `numbers`."""
        named = [self.lines[n - 1] for n in numbers[:shown]] if self.lines else numbers[:shown]
        more = ", ..." if len(numbers) > shown else ""
        return f"{'lines' if self.lines else 'rows'} {', '.join(map(str, named))}{more}"

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
        """``"row 12 (812 tokens), row 7 (640 tokens)"`` (``line`` for JSONL): the `n` longest dropped rows."""
        longest: dict[int, int] = {}
        for row, tokens in self.dropped_rows:
            longest[row] = max(tokens, longest.get(row, 0))
        worst = sorted(longest.items(), key=lambda rt: (-rt[1], rt[0]))[:n]
        return ", ".join(f"{self.label(r)} ({t} tokens)" for r, t in worst)

    @classmethod
    def merge(cls, parts: Sequence[SFTStats]) -> SFTStats:
        """Totals over several sources; `summary` then reports each one."""
        total = cls(
            source=" + ".join(p.source for p in parts),
            max_length=max((p.max_length for p in parts), default=0),
            truncate=all(p.truncate for p in parts),
            parts=list(parts),
        )
        for key in (f.name for f in fields(cls) if f.type == "int" and f.name not in ("max_length", "_call_row")):
            setattr(total, key, sum(getattr(p, key) for p in parts))  # the counts
        total.unanswered = [r for p in parts for r in p.unanswered]
        total.call_endings = [r for p in parts for r in p.call_endings]
        total.reasoning = parts[0].reasoning if parts else "train"
        total.unrendered_why = parts[0].unrendered_why if parts else total.unrendered_why
        total.ignored = dict(sum((Counter(p.ignored) for p in parts), Counter()))
        return total

    def _reasoning_note(self) -> str:
        """``"reasoning: 12 turns trained, 3 left out by the chat template (earlier turns)"``; ``""`` without any."""
        items = [f"{self.reasoning_turns} turns {REASONING_DONE[self.reasoning]}"] if self.reasoning_turns else []
        if self.reasoning_unrendered:
            items.append(f"{self.reasoning_unrendered} left out by the chat template ({self.unrendered_why})")
        if self.reasoning_dropped:
            items.append(f"{self.reasoning_dropped} turns dropped (data.reasoning=drop)")
        return f"reasoning: {', '.join(items)}" if items else ""

    def add(
        self,
        n: int,
        ids: list[int],
        labels: list[int],
        calls: Sequence[tuple[int, int]] = (),
        reasoning: Sequence[int] = (),
        unrendered: Sequence[int] = (),
        dropped: Sequence[int] = (),
    ) -> dict | None:
        """Count an example of 1-based row `n` (untruncated `ids`, `labels`); return it cut to `max_length`, or None if
        dropped (no label left; too long, not truncating). `calls`: ``(start of a turn, its tool calls)``; `reasoning`,
        `unrendered`, `dropped`: starts of labelled turns whose reasoning was rendered, left out, removed."""
        full, cut, ids, labels = len(ids), len(ids) > self.max_length, ids[: self.max_length], labels[: self.max_length]
        n_loss = sum(label != IGNORE_INDEX for label in labels)
        if n_loss == 0 or (cut and not self.truncate):
            self.dropped += 1
            self.dropped_rows.append((n, full))
            self.tool_calls_cut += sum(k for _, k in calls)
            return None
        self.reasoning_turns += sum(start < self.max_length for start in reasoning)
        self.reasoning_unrendered += sum(start < self.max_length for start in unrendered)
        self.reasoning_dropped += sum(start < self.max_length for start in dropped)
        kept = sum(k for start, k in calls if start < self.max_length)
        self.tool_calls += kept
        self.tool_calls_cut += sum(k for _, k in calls) - kept
        if kept and self._call_row != n:
            self.tool_call_rows, self._call_row = self.tool_call_rows + 1, n
        self.example_rows.append(n)
        self.truncated, self.examples, self.tokens = self.truncated + cut, self.examples + 1, self.tokens + len(ids)
        self.loss_tokens += n_loss
        return {"input_ids": ids, "labels": labels}

    def tool_calls_note(self) -> str:
        """``"tool calls: 5 in 3 kept rows"`` (``", 2 more not trained (dropped or cut at max_length)"`` when some
        were)."""
        cut = f", {self.tool_calls_cut} more not trained (dropped or cut at max_length)" if self.tool_calls_cut else ""
        return f"tool calls: {self.tool_calls} in {self.tool_call_rows} kept rows{cut}"

    def _drop_reason(self, limit: str) -> str:
        if self.truncate:
            return f"cut by {limit} before any assistant token"
        return f"longer than {limit}, dropped rather than cut"

    def _counts(self) -> str:
        split = f" ({self.split_rows} split into one example per assistant turn)" if self.split_rows else ""
        cut = f" ({self.truncated} truncated to max_length={self.max_length})" if self.truncate else ""
        text = (
            f"{Path(self.source).name or 'data'}: {self.rows} rows read{split}, {self.examples} examples kept{cut}, "
            f"{self.dropped} dropped"
        )
        if self.dropped:
            limit = "max_length" if self.truncate else f"max_length={self.max_length}"
            text += f" ({self._drop_reason(limit)}: {self.longest_dropped(3)})"
        if self.empty_answers:
            text += f", {len(self.empty_answers)} skipped with an empty answer ({self._rows_list(self.empty_answers)})"
        if self.unanswered:
            text += (
                f", {len(self.unanswered)} skipped as they end in a tool call with no answer to label ("
                f"{self._rows_list(self.unanswered)})"
            )
        if self.call_endings:
            text += (
                f", {len(self.call_endings)} end in a tool call after their last answer, not trained ("
                f"{self._rows_list(self.call_endings)})"
            )
        if self.tool_calls or self.tool_calls_cut:
            text += f", {self.tool_calls_note()}"
        if self._reasoning_note():
            text += f", {self._reasoning_note()}"
        if self.ignored:
            text += ", keys not used: " + ", ".join(f"{k} ({n})" for k, n in sorted(self.ignored.items()))
        return text

    def summary(self) -> str:
        """One line: per source, rows read, examples kept, truncated, dropped (and why); tokens, the share with loss."""
        counts = "; ".join(p._counts() for p in self.parts) if self.parts else self._counts()
        return f"{counts} | {self.tokens:,} tokens, {self.loss_fraction:.1%} with loss"

    def check_dropped(self, max_dropped_fraction: float) -> None:
        """Raise `SFTDataError` naming the longest rows and what to change if over `max_dropped_fraction` is lost."""
        if self.dropped_fraction <= max_dropped_fraction:
            return
        lost = self.dropped + len(self.empty_answers) + len(self.unanswered)
        unit = "examples (one per assistant turn)" if self.split_rows else "rows"
        why = []
        if self.dropped:
            longest, limit = max(t for _, t in self.dropped_rows), self.max_positions
            if limit is None:
                advice = f"to {longest} to keep them all, within the model's max_position_embeddings"
            elif longest > limit:
                over = sum(t > limit for _, t in self.dropped_rows)
                advice = f"at most to {limit}, the model's max_position_embeddings: {over} of them are longer"
            else:
                advice = f"to {longest} to keep them all"
            why.append(
                f"{self.dropped} {self._drop_reason(f'data.max_length={self.max_length}')}, longest "
                f"{self.longest_dropped()}: raise data.max_length ({advice})"
            )
        if self.empty_answers:
            why.append(
                f"{len(self.empty_answers)} with an empty answer ({self._rows_list(self.empty_answers)}): check "
                f"the answer field"
            )
        if self.unanswered:
            why.append(
                f"{len(self.unanswered)} end in a tool call with no answer to label ("
                f"{self._rows_list(self.unanswered)}): only answers carry labels; add the tool result and the answer"
            )
        raise SFTDataError(
            f"{self.source}: {lost} of {self.examples + lost} {unit} dropped ({self.dropped_fraction:.0%}, "
            f"more than data.max_dropped_fraction={max_dropped_fraction:g}): {'; '.join(why)}; or raise "
            f"data.max_dropped_fraction"
        )
