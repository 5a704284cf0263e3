"""The ``cookbook`` logger (`get_logger`): INFO lines from rank 0 only, warnings and errors from every rank with its
rank in front, to whatever ``sys.stderr`` is at the time (`configure_logging`, called by
`cookbook.dist.init_distributed`). `cookbook.dist` re-exports `get_logger`."""

from __future__ import annotations

import logging


def configure_logging(rank: int) -> None:
    """Give the ``cookbook`` logger its one handler (once per process) for this process's `rank`."""
    root = logging.getLogger("cookbook")
    if any(getattr(h, "_cookbook", False) for h in root.handlers):
        return
    handler = logging._StderrHandler()  # logging.lastResort's: writes to the sys.stderr of the time (notebooks swap it)
    handler._cookbook = True  # type: ignore[attr-defined]
    handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))

    def by_rank(record: logging.LogRecord) -> bool:  # warnings and errors from any rank, prefixed with the rank
        if record.levelno >= logging.WARNING:
            record.msg = f"[rank{rank}] {record.msg}"
            return True
        return rank == 0

    handler.addFilter(by_rank)
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    root.propagate = False


def get_logger() -> logging.Logger:
    """The ``cookbook`` logger: INFO from rank 0 only, warnings and errors from every rank."""
    return logging.getLogger("cookbook")
