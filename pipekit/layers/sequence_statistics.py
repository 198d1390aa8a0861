"""Losses that are functions of sums over a sequence's tokens, exact when the sequence is sliced.

A load-balancing loss is a non-linear function of statistics summed over the tokens of a
forward (the switch loss multiplies the fraction of choices per expert by the mean router
probability). The sliced pipeline runs a sequence as n slices, so a loss computed per slice is
a different loss. But every slice's forward precedes the sequence's first backward on a stage
(slices go forward in increasing order, backward in decreasing order, and the last slice's
backward needs its own forward first), so the backward can use the whole sequence's sums:

    loss_of_sums(sums_K, loss_fn, owner)

is `loss_fn(sums_K)` outside a sequence scope. Inside `sequence_scope(statistics, slice_index)`
(the pipeline stage opens one around each slice's forward and backward) each slice records its
sums under `owner` (e.g. the MoE layer), and its backward hands its sums the gradient of
`loss_fn(sum over all the sequence's slices)`: the slices' backwards together give exactly the
gradient of the whole sequence's loss, counted once. A recomputed forward (activation
checkpointing) records the same sums again, which changes nothing.

Context parallelism splits a forward's tokens over ranks instead. Inside
`statistics_group(group)` each rank's sums are added over the group before the loss (an
all-reduce in forward; the identity in backward): every rank's loss is the whole sequence's,
and each rank's backward carries that loss's gradient into its own tokens' sums, so the ranks'
gradients, summed by data parallelism, are the whole sequence's, counted once. Both compose: a
slice's sums are first added over the group.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["SequenceStatistics", "loss_of_sums", "sequence_scope", "statistics_group"]

LossOfSums = Callable[[Tensor], Tensor]


class SequenceStatistics:
    """The sums each owner recorded for each slice of one sequence (one microbatch)."""

    def __init__(self) -> None:
        self._sums: dict[object, dict[int, Tensor]] = {}

    def record(self, owner: object, slice_index: int, sums_K: Tensor) -> None:
        self._sums.setdefault(owner, {})[slice_index] = sums_K

    def total(self, owner: object) -> Tensor:
        """The sums of every slice `owner` recorded, added."""
        return torch.stack(list(self._sums[owner].values())).sum(0)


_SCOPE: ContextVar[tuple[SequenceStatistics, int] | None] = ContextVar(
    "sequence_scope", default=None
)


@contextlib.contextmanager
def sequence_scope(statistics: SequenceStatistics, slice_index: int) -> Iterator[None]:
    """Run one slice of the sequence whose statistics `statistics` collects."""
    token = _SCOPE.set((statistics, slice_index))
    try:
        yield
    finally:
        _SCOPE.reset(token)


_GROUP: ContextVar[dist.ProcessGroup | None] = ContextVar("statistics_group", default=None)


@contextlib.contextmanager
def statistics_group(group: dist.ProcessGroup | None) -> Iterator[None]:
    """Run forwards whose tokens are split over the ranks of `group` (context parallelism)."""
    token = _GROUP.set(group)
    try:
        yield
    finally:
        _GROUP.reset(token)


class _SumOverGroup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, sums_K: Tensor, group: dist.ProcessGroup) -> Tensor:
        total_K = sums_K.clone()
        dist.all_reduce(total_K, group=group)
        return total_K

    @staticmethod
    def backward(ctx, grad_K: Tensor) -> tuple[Tensor, None]:
        return grad_K, None


def loss_of_sums(sums_K: Tensor, loss_fn: LossOfSums, owner: object) -> Tensor:
    """`loss_fn(sums_K)`; inside a sequence scope, a loss whose gradient is that of
    `loss_fn` at the whole sequence's sums (its value is this slice's own, for display);
    inside a statistics group, of the sums added over the group."""
    group = _GROUP.get()
    if group is not None:
        sums_K = _SumOverGroup.apply(sums_K, group)
    scope = _SCOPE.get()
    if scope is None:
        return loss_fn(sums_K)
    statistics, slice_index = scope
    return _SequenceLoss.apply(sums_K, loss_fn, statistics, owner, slice_index)


class _SequenceLoss(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        sums_K: Tensor,
        loss_fn: LossOfSums,
        statistics: SequenceStatistics,
        owner: object,
        slice_index: int,
    ) -> Tensor:
        statistics.record(owner, slice_index, sums_K.detach())
        ctx.loss_fn, ctx.statistics, ctx.owner = loss_fn, statistics, owner
        return loss_fn(sums_K.detach())

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor | None, ...]:
        with torch.enable_grad():
            total_K = ctx.statistics.total(ctx.owner).detach().requires_grad_()
            (grad_K,) = torch.autograd.grad(ctx.loss_fn(total_K), total_K)
        return grad_loss * grad_K, None, None, None, None
