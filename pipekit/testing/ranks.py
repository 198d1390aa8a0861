"""Run a function on N gloo ranks on localhost: the one multi-process helper of pipekit's tests,
of `python -m pipekit.check` and of your own parity tests (CPU, no launcher needed).

Children are forked, so they inherit the already imported torch: a 2-rank group costs well under
a second, not the seconds of fresh interpreters. Ranks meet through a FileStore in a fresh
temporary folder rather than a TCPStore: no port to probe, so concurrent groups cannot collide,
and the parent starts no store thread (forking while a TCPStore server thread runs left a child
stuck connecting in about one 4-rank run in three). gloo picks its own ephemeral ports. Each rank
runs with one intra-op thread: ranks do not oversubscribe a small machine's cores, and a forked
child never enters the OpenMP pool the parent may have started. A rank that raises or dies fails
the call at once with its traceback; a rank that dies (a native abort in gloo's I/O thread, a
segfault) fails it with the end of its own standard error, where the C++ message and
`faulthandler`'s Python stacks of every thread are (each rank writes its standard error to a
file and copies it to the real one before it reports), and a rank that hangs past the timeout
fails it with its threads' stacks.
"""

from __future__ import annotations

import faulthandler
import functools
import multiprocessing as mp
import os
import pickle
import shutil
import signal
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["RankFailedError", "run_on_ranks"]

_GRACE_AFTER_FAILURE_S = 2.0
"""How long the other ranks may take to report once one rank has failed."""
_STDERR_TAIL_CHARS = 16000
"""How much of a dead or hung rank's standard error its failure message quotes."""
_DUMP_WAIT_S = 2.0
"""How long a hung rank may take to dump its stacks."""


class RankFailedError(RuntimeError):
    """A rank raised, died, or did not finish in time; the message holds its traceback."""


def run_on_ranks(
    fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 60.0
) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; return the per-rank results.

    The default process group exists while `fn` runs and is destroyed after it. Results must be
    picklable. The first rank to fail terminates the others and raises `RankFailedError`.
    """
    store_folder = tempfile.mkdtemp(prefix="pipekit-ranks-")
    parent_threads = _thread_count()
    ctx = mp.get_context("fork")
    processes, connections = [], []
    for rank in range(world_size):
        parent_end, child_end = ctx.Pipe(duplex=False)
        process = ctx.Process(
            target=_child,
            args=(child_end, store_folder, fn, rank, world_size, args, timeout),
            # not daemons: a rank may start processes of its own (DataLoader workers); every
            # rank is ended below whatever happens
        )
        process.start()
        child_end.close()
        processes.append(process)
        connections.append(parent_end)
    try:
        return _collect(processes, connections, timeout, store_folder, parent_threads)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
        shutil.rmtree(store_folder, ignore_errors=True)


def _collect(
    processes: list[mp.process.BaseProcess],
    connections: list[Connection],
    timeout: float,
    folder: str,
    parent_threads: int,
) -> list[Any]:
    """Wait for every rank's report; raise once one fails, dies, or the deadline passes.

    A rank that dies is reported with the number of threads its parent ran when it forked: a
    fork copies only the calling thread, so a parent with other threads (a data library's pool,
    a loader's queue feeders) may hand a child state that another thread held half-changed.
    After the first failure the other ranks get a short grace period to report theirs, since the
    rank that reports first is often only the peer of the one that raised (gloo "connection
    closed"); the error lists every failure that arrived.
    """
    results: dict[int, Any] = {}
    failures: dict[int, str] = {}
    pending = dict(enumerate(connections))
    deadline = time.monotonic() + timeout
    while pending:
        sentinels = [processes[rank].sentinel for rank in pending]
        ready = wait([*pending.values(), *sentinels], timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            break
        for rank, connection in list(pending.items()):
            if connection not in ready and processes[rank].sentinel not in ready:
                continue
            del pending[rank]
            try:
                status, payload = pickle.loads(connection.recv_bytes())
            except EOFError:
                processes[rank].join()
                exit_code = processes[rank].exitcode
                failures[rank] = (
                    f"died with exit code {exit_code} before reporting a result (forked from a "
                    f"process running {parent_threads} threads); the end of its standard "
                    f"error:\n{_stderr_tail(folder, rank)}"
                )
                continue
            if status == "error":
                failures[rank] = f"failed:\n{payload}"
            else:
                results[rank] = payload
        if failures:
            deadline = min(deadline, time.monotonic() + _GRACE_AFTER_FAILURE_S)
    if failures:
        raise RankFailedError("\n".join(f"rank {r} {why}" for r, why in sorted(failures.items())))
    if pending:
        stacks = "\n".join(
            f"rank {rank}'s threads:\n{_stacks_of(processes[rank], folder, rank)}"
            for rank in sorted(pending)
        )
        raise RankFailedError(
            f"ranks {sorted(pending)} did not finish within {timeout:.0f} s; "
            f"a collective is probably waiting for a rank that never calls it\n{stacks}"
        )
    return [results[rank] for rank in range(len(processes))]


def _thread_count() -> int:
    """The OS threads of this process (Python's own count where /proc is missing)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _stacks_of(process: mp.process.BaseProcess, folder: str, rank: int) -> str:
    """Where a hung rank is: `faulthandler` dumps its threads' Python stacks on SIGUSR1."""
    logged = _stderr_size(folder, rank)
    if process.pid is None or not process.is_alive():
        return _stderr_tail(folder, rank)
    os.kill(process.pid, signal.SIGUSR1)
    deadline = time.monotonic() + _DUMP_WAIT_S
    while time.monotonic() < deadline and _stderr_size(folder, rank) == logged:
        time.sleep(0.05)  # the dump arrives within milliseconds unless the rank is frozen
    return _stderr_tail(folder, rank)


def _stderr_path(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.stderr")


def _stderr_size(folder: str, rank: int) -> int:
    try:
        return os.path.getsize(_stderr_path(folder, rank))
    except OSError:  # not created yet
        return 0


def _stderr_tail(folder: str, rank: int) -> str:
    """The last characters a rank wrote to its standard error (empty if it wrote none)."""
    try:
        with open(_stderr_path(folder, rank), "rb") as log:
            log.seek(0, os.SEEK_END)
            log.seek(max(0, log.tell() - _STDERR_TAIL_CHARS))
            return log.read().decode(errors="replace")
    except OSError:
        return ""


def _child(
    connection: Connection,
    folder: str,
    fn: Callable[..., Any],
    rank: int,
    world_size: int,
    args: tuple[Any, ...],
    timeout: float,
) -> None:
    """Body of one rank: run `fn` in the group, copy its standard error to the real one, then
    send back its result or traceback (after the copy: the caller's stderr holds a rank's output
    once `run_on_ranks` returns)."""
    exit_code = 0
    real_stderr = os.dup(2)
    log = os.open(_stderr_path(folder, rank), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(log, 2)
    # Python's own writes too (a test runner may have pointed sys.stderr elsewhere).
    sys.stderr = open(2, "w", buffering=1, errors="backslashreplace", closefd=False)  # noqa: SIM115
    faulthandler.enable(file=sys.stderr, all_threads=True)
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        try:
            # Plain pickle, not the connection's torch-aware one: that shares tensors by file
            # descriptors served by this process, which exits right after sending.
            run = functools.partial(fn, rank, world_size, *args)
            report = pickle.dumps(("ok", _in_group(folder, rank, world_size, timeout, run)))
        except BaseException:
            exit_code = 1
            report = pickle.dumps(("error", traceback.format_exc()))
        sys.stderr.flush()
        _copy_to(real_stderr, _stderr_path(folder, rank))
        connection.send_bytes(report)
    finally:
        connection.close()
        # Skip the parent's atexit handlers (pytest's among them) that the fork copied.
        os._exit(exit_code)


def _in_group(
    folder: str, rank: int, world_size: int, timeout: float, run: Callable[[], Any]
) -> Any:
    """`run()` with the default gloo group up; the group ends after it."""
    torch.set_num_threads(1)
    store = dist.FileStore(os.path.join(folder, "store"), world_size)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout)
    )
    try:
        result = run()
        if dist.is_initialized():
            # A rank that exits while a peer is still connecting the last subgroup it created
            # makes that peer fail with "connection closed by peer".
            dist.barrier()
        return result
    finally:
        if dist.is_initialized():  # `fn` may have ended the group itself
            dist.destroy_process_group()


def _copy_to(descriptor: int, path: str) -> None:
    """Append a rank's logged standard error to the real one, as it would have appeared."""
    with open(path, "rb") as log:
        while chunk := log.read(1 << 16):
            os.write(descriptor, chunk)
