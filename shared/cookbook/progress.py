"""A rank-0 tqdm progress bar for the step loop, drawn only when ``sys.stderr`` is a terminal (elsewhere the log
lines are exactly as without it); the ``cookbook`` logger writes above it; ``TQDM_DISABLE=1`` turns it off."""

from __future__ import annotations

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


class _AboveBar(logging.Handler):
    """Stands in for a stream handler while a bar is drawn: the same filters and format, written above the bar."""

    def __init__(self, inner: logging.Handler, bar):
        super().__init__(inner.level)
        self.inner, self.bar = inner, bar

    def filter(self, record: logging.LogRecord) -> bool:  # the inner handler's filters (rank 0 only, rank prefix)
        return bool(self.inner.filter(record))

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.bar.write(self.inner.format(record), file=self.bar.fp)
        except Exception:  # noqa: BLE001 - as logging.Handler.emit: never raise from a log call
            self.handleError(record)


class ProgressBar:
    """A tqdm bar of optimizer steps on ``sys.stderr``, drawn only on a terminal; `total` None: no ETA; `initial`:
    steps already done; `unit`: ``gpu`` or ``rank``."""

    def __init__(self, total: int | None, initial: int = 0, unit: str = "gpu"):
        self.stream, self.unit, self.bar = sys.stderr, unit, None
        self._swapped: list[tuple[logging.Handler, logging.Handler]] = []
        if not is_terminal(self.stream):
            return
        from tqdm import tqdm

        try:
            columns = os.get_terminal_size(self.stream.fileno()).columns
        except (AttributeError, OSError, ValueError):
            columns = 0
        width = {"dynamic_ncols": True} if columns > 0 else {"ncols": 100, "nrows": 24}  # a size-less terminal
        bar = tqdm(total=total, initial=initial, unit="step", desc="train", file=self.stream, smoothing=0.1, **width)
        if bar.disable:  # TQDM_DISABLE=1
            return
        self.bar = bar
        log = logging.getLogger("cookbook")
        for handler in list(log.handlers):
            if isinstance(handler, logging.StreamHandler) and handler.stream is self.stream:
                above = _AboveBar(handler, bar)
                log.removeHandler(handler)
                log.addHandler(above)
                self._swapped.append((handler, above))

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
        log = logging.getLogger("cookbook")
        for handler, above in self._swapped:
            log.removeHandler(above)
            log.addHandler(handler)
        self._swapped = []
        self.bar.close()
        self.bar = None
