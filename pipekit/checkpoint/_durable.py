"""fsync for files and folders: what atomic checkpoint publication (write, rename) relies on."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_path"]


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a folder's entry list (so a rename in it survives a power loss)."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)
