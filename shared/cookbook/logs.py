"""The ``cookbook`` logger (`get_logger`): INFO lines from rank 0 only, warnings and errors from every rank with its
rank in front, to whatever ``sys.stderr`` is at the time (`configure_logging`, called by
`cookbook.dist.init_distributed`). `cookbook.dist` re-exports `get_logger`."""

from __future__ import annotations

import logging
import sys


class _RankFilter(logging.Filter):
    def __init__(self, rank: int):
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        # Warnings and errors from any rank get through, prefixed with the rank.
        if record.levelno >= logging.WARNING:
            record.msg = f"[rank{self.rank}] {record.msg}"
            return True
        return self.rank == 0


class _StderrHandler(logging.StreamHandler):
    """A stream handler that writes to whatever ``sys.stderr`` is when a record is emitted, not the one
    that was current when the handler was made (notebooks and test runners replace ``sys.stderr``)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def configure_logging(rank: int) -> None:
    """Give the ``cookbook`` logger its one handler (once per process) for this process's `rank`."""
    root = logging.getLogger("cookbook")
    if any(getattr(h, "_cookbook", False) for h in root.handlers):
        return
    handler = _StderrHandler()
    handler._cookbook = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
    handler.addFilter(_RankFilter(rank))
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def get_logger() -> logging.Logger:
    """The ``cookbook`` logger: INFO from rank 0 only, warnings and errors from every rank."""
    return logging.getLogger("cookbook")
