"""A rank-0 progress bar for the step loop, on a terminal only.

`ProgressBar` draws a tqdm bar (https://tqdm.github.io/) with the step count, the rate, the elapsed time
and the time left (tqdm's estimate), and, after each log line, the window's loss and throughput:

.. code-block:: text

    12:04:31 step 40/300 | loss 1.2345 | lr 4.80e-05 | ... | eta 14 s
    train  13%|█▍        | 40/300 [00:02<00:14, 18.10step/s, loss=1.2345, tok/s/gpu=12,345]

It is drawn only when the stream (``sys.stderr``, where the ``cookbook`` log lines go) is a terminal: in CI,
in a file or behind a pipe nothing of it is written and the log lines are exactly as without it. While it is
drawn, the ``cookbook`` logger's lines are written above it (``tqdm.write``) so that the bar stays on the last
line. ``TQDM_DISABLE=1`` turns it off on a terminal too (tqdm's own switch).
"""

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
    """Stands in for a stream handler while a bar is drawn: the same filters and format, written with
    ``tqdm.write`` so that the line lands above the bar."""

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
    """A tqdm bar of optimizer steps, drawn on `stream` only when it is a terminal (`is_terminal`).

    Args:
        total: the run's total steps (``None``: unknown, no ETA).
        initial: the steps already done (a resumed run starts there; the rate counts this run's steps).
        stream: where the bar goes (default ``sys.stderr``, as the log lines).
        unit: what one device is, for the throughput (``gpu`` or ``rank``).

    Every method does nothing when the bar is not drawn (`active` is ``False``).
    """

    def __init__(self, total: int | None, initial: int = 0, stream: IO | None = None, unit: str = "gpu"):
        self.stream = sys.stderr if stream is None else stream
        self.unit = unit
        self.bar = None
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

    @property
    def active(self) -> bool:
        """Whether the bar is drawn."""
        return self.bar is not None

    def advance(self, step: int) -> None:
        """Move the bar to `step` (steps completed)."""
        if self.bar is not None and step > self.bar.n:
            self.bar.update(step - self.bar.n)

    def show(self, rec: Mapping[str, float]) -> None:
        """Show a train record's loss and throughput (``tokens_per_s_per_device``, else
        ``samples_per_s_per_device``) after the bar, and move it to the record's step."""
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
