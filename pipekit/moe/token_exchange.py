"""The expert-parallel all-to-all: variable-size blocks of rows, started now, waited on later.

`start(rows, send_splits, recv_splits)` sends `send_splits[r]` consecutive rows to rank r and
returns a `PendingRows` whose `wait()` gives the `sum(recv_splits)` rows received, grouped by
source rank. Starting before waiting is what lets the pipelined MoE overlap a partition's
transfer with another partition's expert compute.

- `LocalExchange`: one rank, no communication (a single-process MoE).
- `CollectiveExchange`: `all_to_all_single(async_op=True)` on the ep group (NCCL on CUDA runs it
  on its own stream; gloo on its worker thread).
- `PacedExchange`: the same transfers, run in order on one worker thread, each held until
  `seconds_per_byte x bytes` has passed since it started. This emulates a slower link; the
  bench's `--comm-ratio` uses it, never the trainer. The data still really moves, and compute
  still overlaps it: the worker sleeps without holding the GIL.

Every collective of an exchange, including `exchange_counts`, goes through one queue, so all
ranks issue them in the same order.
"""

from __future__ import annotations

import abc
import math
import time
from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveExchange",
    "LocalExchange",
    "PacedExchange",
    "PendingRows",
    "TokenExchange",
    "link_rows",
]


def link_rows(send_splits: list[int], recv_splits: list[int], rank: int) -> int:
    """Rows one all-to-all moves over `rank`'s link: all but its block to itself, in the
    busier direction (a full-duplex link)."""
    return max(sum(send_splits) - send_splits[rank], sum(recv_splits) - recv_splits[rank])


class PendingRows:
    """Rows in flight; `wait()` returns them once they have arrived."""

    def __init__(self, rows: Tensor, work: dist.Work | Future | None = None) -> None:
        self._rows = rows
        self._work = work

    def wait(self) -> Tensor:
        if isinstance(self._work, Future):
            self._work.result()
        elif self._work is not None:
            self._work.wait()
        self._work = None
        return self._rows


class TokenExchange(abc.ABC):
    """All-to-all among the `size` ranks that hold the experts."""

    size: int = 1
    rank: int = 0

    @abc.abstractmethod
    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        """`send_counts[..., r, :]` goes to rank r; returns the same shape indexed by source."""

    @abc.abstractmethod
    def start(
        self,
        rows: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: Tensor | None = None,
    ) -> PendingRows:
        """Send `rows` in blocks of `send_splits`; receive into `out` (or a new tensor)."""


class LocalExchange(TokenExchange):
    """A single rank: every row stays where it is."""

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        return send_counts

    def start(
        self,
        rows: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: Tensor | None = None,
    ) -> PendingRows:
        if out is None:
            return PendingRows(rows)
        out.copy_(rows)
        return PendingRows(out)


class CollectiveExchange(TokenExchange):
    """`all_to_all_single` on a process group, asynchronous."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        return self._run_counts(send_counts)

    def _run_counts(self, send_counts: Tensor) -> Tensor:
        # [..., R, E] -> [R, ..., E] so that each rank's block is contiguous, and back.
        send_RXE = send_counts.movedim(-2, 0).contiguous()
        recv_RXE = torch.empty_like(send_RXE)
        dist.all_to_all_single(recv_RXE, send_RXE, group=self.group)
        return recv_RXE.movedim(0, -2)

    def _receive_buffer(self, rows: Tensor, recv_splits: list[int], out: Tensor | None) -> Tensor:
        total = sum(recv_splits)
        if out is None:
            return rows.new_empty(total, *rows.shape[1:])
        return out[:total]

    def start(
        self,
        rows: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: Tensor | None = None,
    ) -> PendingRows:
        received = self._receive_buffer(rows, recv_splits, out)
        work = dist.all_to_all_single(
            received, rows.contiguous(), recv_splits, send_splits, group=self.group, async_op=True
        )
        return PendingRows(received, work)


class PacedExchange(CollectiveExchange):
    """`CollectiveExchange` over an emulated link of `seconds_per_byte` (bench only)."""

    def __init__(self, group: dist.ProcessGroup, seconds_per_byte: float) -> None:
        super().__init__(group)
        self.seconds_per_byte = seconds_per_byte
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="paced-all-to-all")

    def exchange_counts(self, send_counts: Tensor) -> Tensor:
        return self._worker.submit(self._run_counts, send_counts).result()

    def start(
        self,
        rows: Tensor,
        send_splits: list[int],
        recv_splits: list[int],
        out: Tensor | None = None,
    ) -> PendingRows:
        received = self._receive_buffer(rows, recv_splits, out)
        rows = rows.contiguous()
        row_bytes = math.prod(rows.shape[1:]) * rows.element_size()
        duration = (
            link_rows(send_splits, recv_splits, self.rank) * row_bytes * self.seconds_per_byte
        )

        def transfer() -> None:
            started = time.perf_counter()
            dist.all_to_all_single(received, rows, recv_splits, send_splits, group=self.group)
            remaining = started + duration - time.perf_counter()
            if remaining > 0:
                time.sleep(remaining)

        return PendingRows(received, self._worker.submit(transfer))
