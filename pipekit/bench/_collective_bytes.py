"""Bytes a rank sends through torch's functional collectives (what DTensor redistributes and
FSDP2 communicates with), for the benches that hold communication to a formula.

Ring algorithms: an all-gather of shards of N bytes in all sends (t-1)/t N per rank, a
reduce-scatter of N bytes the same, an all-reduce twice that.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

__all__ = ["count_collective_bytes"]


def count_collective_bytes(sent: list[int], ranks: int) -> None:
    """Wrap torch's functional collectives in this process so that each call adds the bytes
    this rank sends to `sent[0]`. For a bench's rank only: the wrappers stay until it exits."""
    from pipekit._torch_private import functional_collectives as funcol

    share = (ranks - 1) / ranks

    def counted(name: str, bytes_sent: Callable[[Tensor], float]) -> None:
        original = getattr(funcol, name)

        def wrapper(tensor, *args, **kwargs):
            sent[0] += int(bytes_sent(tensor))
            return original(tensor, *args, **kwargs)

        setattr(funcol, name, wrapper)

    counted("all_gather_single", lambda t: t.nbytes * (ranks - 1))  # its input is one shard
    counted("all_gather_tensor", lambda t: t.nbytes * (ranks - 1))
    counted("reduce_scatter_single", lambda t: t.nbytes * share)
    counted("reduce_scatter_tensor", lambda t: t.nbytes * share)
    counted("all_reduce", lambda t: 2 * t.nbytes * share)
