"""One job per output folder: an exclusive lock held for the life of the job's rank 0.

Two jobs writing one folder would delete each other's checkpoint saves in progress (each save
first removes the temporary folders of interrupted ones) and interleave their metrics. Rank 0
takes an advisory `flock` on `<output_dir>/.pipekit.lock` before any process group exists and
keeps it until the process ends; the operating system drops it when the process dies, however
it dies, so a killed job never leaves the folder locked. The file names the holder (host and
pid) for the refusal. Locks on network file systems are only as good as the file system's
`flock`.
"""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path
from typing import IO

__all__ = ["OutputFolderInUse", "lock_output_dir"]

LOCK_FILE = ".pipekit.lock"

_held: list[IO[str]] = []
"""The open lock files of this process (closing one would release its lock)."""


class OutputFolderInUse(RuntimeError):
    """Another running job holds the output folder."""


def lock_output_dir(output_dir: str | os.PathLike[str]) -> None:
    """Take `output_dir`'s lock for the rest of this process, or raise OutputFolderInUse
    naming the job that holds it."""
    folder = Path(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    handle = (folder / LOCK_FILE).open("a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise OutputFolderInUse(
            f"job.output_dir={str(folder)!r} is in use by a running job ({holder}); wait for "
            "it to end, or choose another job.output_dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    handle.flush()
    _held.append(handle)
