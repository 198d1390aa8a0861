"""Console logging of a training job: every line says which rank wrote it.

`setup_logging(rank)` sends pipekit's records to the console: on rank 0 everything from INFO
up (progress, metrics, checkpoints) to stdout; on every rank warnings to stderr, so the first
rank to see a problem says so. Each line starts with `[rank R]`.
"""

from __future__ import annotations

import logging
import sys

__all__ = ["setup_logging"]

_HANDLER_MARK = "_pipekit_console"


class _BelowWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def setup_logging(rank: int, level: int = logging.INFO) -> None:
    """Configure the `pipekit` logger for this rank (again after a rank change: idempotent)."""
    logger = logging.getLogger("pipekit")
    for handler in [h for h in logger.handlers if getattr(h, _HANDLER_MARK, False)]:
        logger.removeHandler(handler)
    formatter = logging.Formatter(f"[rank {rank}] %(message)s")
    warnings = logging.StreamHandler(sys.stderr)
    warnings.setLevel(logging.WARNING)
    handlers: list[logging.Handler] = [warnings]
    if rank == 0:
        progress = logging.StreamHandler(sys.stdout)
        progress.addFilter(_BelowWarning())
        handlers.append(progress)
    for handler in handlers:
        handler.setFormatter(formatter)
        setattr(handler, _HANDLER_MARK, True)
        logger.addHandler(handler)
    logger.setLevel(level)
    logger.propagate = False
