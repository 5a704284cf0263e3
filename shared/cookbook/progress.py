"""A rank-0 tqdm progress bar for the step loop, drawn only when ``sys.stderr`` is a terminal (elsewhere the log
lines are exactly as without it); the ``cookbook`` logger writes above it; ``TQDM_DISABLE=1`` turns it off."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from typing import IO, Mapping


def is_terminal(stream: IO | None) -> bool:
    """Whether `stream` is an interactive terminal (``isatty()``; a ``TERM=dumb`` terminal does not count)."""
    try:
        return bool(stream is not None and stream.isatty()) and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


class ProgressBar:
    """A tqdm bar of optimizer steps on ``sys.stderr``, drawn only on a terminal; `total` None: no ETA; `initial`:
    steps already done; `unit`: ``gpu`` or ``rank``."""

    def __init__(self, total: int | None, initial: int = 0, unit: str = "gpu"):
        self.stream, self.unit, self.bar = sys.stderr, unit, None
        self._above = contextlib.ExitStack()
        if not is_terminal(self.stream):
            return
        from tqdm import tqdm
        from tqdm.contrib.logging import logging_redirect_tqdm

        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        width = {"dynamic_ncols": True} if columns > 0 else {"ncols": 100, "nrows": 24}  # a size-less terminal
        bar = tqdm(total=total, initial=initial, unit="step", desc="train", file=self.stream, smoothing=0.1, **width)
        if bar.disable:  # TQDM_DISABLE=1
            return
        self.bar = bar
        # the log lines above the bar: its stream handlers' format and filters (rank prefix) kept, put back on close
        self._above.enter_context(logging_redirect_tqdm([logging.getLogger("cookbook")]))

    def advance(self, step: int) -> None:
        """Move the bar to `step` (steps completed)."""
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def show(self, rec: Mapping[str, float]) -> None:
        """Show a train record's loss and throughput after the bar, and move it to the record's step."""
        if self.bar is None:
            return
        post = {"loss": f"{rec['loss']:.4f}"}
        if "tokens_per_s_per_device" in rec:
            post[f"tok/s/{self.unit}"] = f"{rec['tokens_per_s_per_device']:,.0f}"
        else:
            post[f"samples/s/{self.unit}"] = f"{rec['samples_per_s_per_device']:.1f}"
        self.bar.set_postfix(post, refresh=False)
        self.advance(int(rec["step"]))
        self.bar.refresh()

    def close(self) -> None:
        """Leave the bar as it is on its line and give the log lines their handler back."""
        if self.bar is None:
            return
        self._above.close()
        self.bar.close()
        self.bar = None
