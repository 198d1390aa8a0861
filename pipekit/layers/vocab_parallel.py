"""Vocabulary parallelism: the embedding, output layer and cross-entropy split by vocab rows.

Each rank of a process group (or a 1-D DeviceMesh) holds the rows `[vocab_start, vocab_end)` of
the embedding / output matrix. The cross-entropy runs on the logit shards and exchanges per-row
statistics only: one all-reduce (MAX) of the row maxima, then one fused all-reduce (SUM) of
(target logit, sum of exponentials); its backward needs no collective (SlimPipe §4.3, the
vocabulary-parallel cross-entropy of Megatron-LM's tensor parallelism). See docs/vocab_parallel.md.

Shape legend: B batch, S sequence, D model dim, V this rank's vocabulary shard (`vocab_end -
vocab_start` rows), `Vfull` the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from pipekit.layers.init import trunc_normal_

__all__ = [
    "GroupLike",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "dtensor_shard_sizes",
    "vocab_parallel_cross_entropy",
    "vocab_shard_range",
]

GroupLike = dist.ProcessGroup | DeviceMesh | None
"""A process group, a 1-D DeviceMesh, or None for the default group (one rank if none exists)."""


# ---------------------------------------------------------------------------------------------
# Groups and shards


def _process_group(group: GroupLike) -> dist.ProcessGroup | None:
    """The ProcessGroup behind `group` (None stays None: the default group)."""
    if isinstance(group, DeviceMesh):
        if group.ndim != 1:
            raise ValueError(
                f"a DeviceMesh with {group.ndim} dims was given; vocabulary parallelism needs a "
                f"1-D mesh: pass one dim, e.g. mesh['pp']"
            )
        return group.get_group()
    return group


def _rank_and_size(group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) in `group`; a single rank when no default group exists."""
    if group is None and not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _shard_sizes(vocab_size: int, world: int, shard_sizes: Sequence[int] | None) -> list[int]:
    """Rows per rank: the given sizes checked, or as even as possible (the first ranks +1)."""
    if shard_sizes is not None:
        sizes = [int(size) for size in shard_sizes]
        if len(sizes) != world:
            raise ValueError(
                f"shard_sizes={sizes} has {len(sizes)} entries for a group of {world} ranks; "
                "give one size per rank"
            )
        if sum(sizes) != vocab_size or min(sizes) < 1:
            raise ValueError(
                f"shard_sizes={sizes} must be positive and sum to vocab_size={vocab_size} "
                f"(they sum to {sum(sizes)})"
            )
        return sizes
    if vocab_size < world:
        raise ValueError(
            f"vocab_size={vocab_size} is smaller than the group's {world} ranks; every rank "
            "needs at least one vocabulary row: use a smaller group"
        )
    base, extra = divmod(vocab_size, world)
    return [base + (1 if rank < extra else 0) for rank in range(world)]


def dtensor_shard_sizes(vocab_size: int, world: int | Sequence[int]) -> list[int]:
    """Rows per rank as DTensor's `Shard(0)` cuts them (`torch.chunk`: `ceil(V / world)` each,
    the last rank the rest), so a shard can be saved and resharded as a DTensor. `world` may
    give several mesh dims (`(pp, tp)`): `Shard(0)` on each, in order, the ranks listed in mesh
    order (a pipeline rank's rows split again over its tp ranks)."""
    sizes = [vocab_size]
    for ranks in (world,) if isinstance(world, int) else world:
        sizes = [piece for size in sizes for piece in _chunk_sizes(size, ranks)]
    if min(sizes) < 1:
        raise ValueError(
            f"vocab_size={vocab_size} split as DTensor's Shard(0) over {world} ranks leaves "
            f"rank(s) {[r for r, s in enumerate(sizes) if s < 1]} without rows (sizes {sizes}); "
            "pad the vocabulary to a multiple of the group size"
        )
    return sizes


def _chunk_sizes(rows: int, ranks: int) -> list[int]:
    chunk = -(-rows // ranks)
    return [max(0, min(chunk, rows - rank * chunk)) for rank in range(ranks)]


def vocab_shard_range(
    vocab_size: int, rank: int, world: int, *, shard_sizes: Sequence[int] | None = None
) -> tuple[int, int]:
    """Rows `[start, end)` of the vocabulary that `rank` of `world` ranks holds.

    Without `shard_sizes` the split is as even as possible, the first `vocab_size % world` ranks
    holding one row more (vocab 10 over 4 ranks: 3, 3, 2, 2 rows). `shard_sizes` gives the rows
    of every rank explicitly; they must be positive and sum to `vocab_size`.
    """
    if not 0 <= rank < world:
        raise ValueError(
            f"rank={rank} is outside a group of world={world} ranks; use 0..{world - 1}"
        )
    sizes = _shard_sizes(vocab_size, world, shard_sizes)
    start = sum(sizes[:rank])
    return start, start + sizes[rank]


def _all_reduce(tensor: Tensor, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> None:
    """In-place all-reduce over `group`; nothing to do for a single rank without a group."""
    if group is None and not dist.is_initialized():
        return
    dist.all_reduce(tensor, op=op, group=group)


# ---------------------------------------------------------------------------------------------
# Autograd pieces for the replicated regions


class _SumAcrossRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) the partial results. Backward: identity.

    The ranks then compute the same (replicated) loss from the sum, so each one's gradient with
    respect to its partial equals the gradient with respect to the sum: no collective needed.
    """

    @staticmethod
    def forward(ctx, partial: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.mark_dirty(partial)
        _all_reduce(partial, dist.ReduceOp.SUM, group)
        return partial

    @staticmethod
    def backward(ctx, grad_total: Tensor) -> tuple[Tensor, None]:
        return grad_total, None


class _SumGradAcrossRanks(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (sum) the gradient.

    Put in front of a replicated input that each rank multiplies by its own shard: the input's
    full gradient is the sum of the ranks' partial gradients.
    """

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad_partial: Tensor) -> tuple[Tensor, None]:
        grad_total = grad_partial.clone(memory_format=torch.contiguous_format)
        _all_reduce(grad_total, dist.ReduceOp.SUM, ctx.group)
        return grad_total, None


# ---------------------------------------------------------------------------------------------
# Modules


class _VocabShard(nn.Module):
    """The shard bookkeeping the embedding and the output layer share."""

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        group: GroupLike,
        shard_sizes: Sequence[int] | None,
    ) -> None:
        super().__init__()
        self.group = _process_group(group)
        rank, world = _rank_and_size(self.group)
        self.vocab_size, self.dim = vocab_size, dim
        self.vocab_start, self.vocab_end = vocab_shard_range(
            vocab_size, rank, world, shard_sizes=shard_sizes
        )

    @property
    def vocab_shard(self) -> int:
        """Rows held by this rank."""
        return self.vocab_end - self.vocab_start

    @torch.no_grad()
    def load_full_weight(self, full_weight_VfullD: Tensor) -> None:
        """Copy this rank's rows of the full `[vocab_size, dim]` matrix into `weight`."""
        expected = (self.vocab_size, self.dim)
        if tuple(full_weight_VfullD.shape) != expected:
            raise ValueError(
                f"full weight of shape {tuple(full_weight_VfullD.shape)} given; expected "
                f"{expected} = (vocab_size, dim)"
            )
        self.weight.copy_(full_weight_VfullD[self.vocab_start : self.vocab_end])

    def extra_repr(self) -> str:
        return (
            f"vocab_size={self.vocab_size}, dim={self.dim}, "
            f"rows=[{self.vocab_start}, {self.vocab_end})"
        )


class VocabParallelEmbedding(_VocabShard):
    """Embedding whose rows `[vocab_start, vocab_end)` live on this rank, as `weight [V, D]`.

    `forward(ids_BS)` looks up the ids this rank holds (the others give zero rows) and, with
    `reduce=True`, sums the results over the group so every rank holds the full embedding. The
    backward needs no collective as long as the ranks compute the same loss from it: each
    rank's weight gradient is then the gradient of its own rows.

    `reduce=False` returns this rank's partial sum instead, for callers that reduce elsewhere
    (e.g. `dist.reduce` onto the first pipeline stage); they must then hand every rank the
    gradient of the reduced embedding (e.g. a broadcast from that stage) in backward.
    """

    def __init__(
        self,
        vocab_size: int,
        dim: int,
        group: GroupLike = None,
        shard_sizes: Sequence[int] | None = None,
        *,
        reduce: bool = True,
    ) -> None:
        super().__init__(vocab_size, dim, group, shard_sizes)
        self.reduce = reduce
        self.weight = nn.Parameter(torch.empty(self.vocab_shard, dim))
        self.reset_parameters()

    def reset_parameters(self, init_std: float = 1.0, output_std: float | None = None) -> None:
        """Normal(0, init_std) rows (nn.Embedding's init); `load_full_weight` copies a full
        matrix."""
        nn.init.normal_(self.weight, std=init_std)

    def forward(self, ids_BS: Tensor) -> Tensor:
        local_ids_BS = ids_BS - self.vocab_start
        outside_BS = (local_ids_BS < 0) | (local_ids_BS >= self.vocab_shard)
        rows_BSD = nn.functional.embedding(local_ids_BS.masked_fill(outside_BS, 0), self.weight)
        partial_BSD = rows_BSD.masked_fill(outside_BS.unsqueeze(-1), 0.0)
        if not self.reduce:
            return partial_BSD
        return _SumAcrossRanks.apply(partial_BSD, self.group)


class VocabParallelOutput(_VocabShard):
    """Output projection onto this rank's vocabulary shard: `h_BSD @ weight.T (+ bias) -> logits
    [B, S, V]`.

    `weight=` shares another module's shard (tied embeddings: pass `embedding.weight`, the same
    Parameter object, whose gradients from both uses then add up). `bias=True` gives the shard
    its rows of a `[vocab_size]` bias too (an `nn.Linear(dim, vocab_size, bias=True)` head), cut
    like the weight's rows and added to this shard's logits; a tied weight keeps its own bias.

    The hidden states are replicated on the ranks, and each rank's matmul gives only part of
    their gradient (`d h = d logits_shard @ weight`): the full gradient is the sum over ranks.
    `reduce_input_grad=True` (the default) inserts an identity whose backward all-reduces it over
    the group (the one collective of the output layer's backward). Pass False when the caller
    sums it itself, e.g. reduces it onto the one pipeline stage that produced the hidden states.
    """

    def __init__(
        self,
        dim: int,
        vocab_size: int,
        group: GroupLike = None,
        shard_sizes: Sequence[int] | None = None,
        weight: nn.Parameter | None = None,
        *,
        bias: bool = False,
        reduce_input_grad: bool = True,
    ) -> None:
        super().__init__(vocab_size, dim, group, shard_sizes)
        self.reduce_input_grad = reduce_input_grad
        bias_V = nn.Parameter(torch.zeros(self.vocab_shard)) if bias else None
        self.register_parameter("bias", bias_V)  # None: no bias, as nn.Linear(bias=False)
        if weight is None:
            self.weight = nn.Parameter(torch.empty(self.vocab_shard, dim))
            self.reset_parameters()
        else:
            if tuple(weight.shape) != (self.vocab_shard, dim):
                raise ValueError(
                    f"weight of shape {tuple(weight.shape)} given; this rank's shard holds rows "
                    f"[{self.vocab_start}, {self.vocab_end}) so it needs ({self.vocab_shard}, "
                    f"{dim}): build both modules with the same vocab_size, group and shard_sizes"
                )
            self.weight = weight

    def reset_parameters(
        self, init_std: float | None = None, output_std: float | None = None
    ) -> None:
        """Truncated normal rows, std `dim**-0.5` by default (a shared weight is reset too),
        and a zero bias."""
        trunc_normal_(self.weight, self.dim**-0.5 if init_std is None else init_std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    @torch.no_grad()
    def load_full_bias(self, full_bias_Vfull: Tensor) -> None:
        """Copy this rank's entries of the full `[vocab_size]` bias into `bias`."""
        if self.bias is None:
            raise ValueError(
                "this output shard was built without a bias; build it with bias=True to load one"
            )
        if tuple(full_bias_Vfull.shape) != (self.vocab_size,):
            raise ValueError(
                f"full bias of shape {tuple(full_bias_Vfull.shape)} given; expected "
                f"({self.vocab_size},) = (vocab_size,)"
            )
        self.bias.copy_(full_bias_Vfull[self.vocab_start : self.vocab_end])

    def forward(self, h_BSD: Tensor) -> Tensor:
        if self.reduce_input_grad:
            h_BSD = _SumGradAcrossRanks.apply(h_BSD, self.group)
        return nn.functional.linear(h_BSD, self.weight, self.bias)


# ---------------------------------------------------------------------------------------------
# Cross-entropy


def _statistics_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for half types and float32; float64 stays float64."""
    return torch.promote_types(dtype, torch.float32)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy (+ z-loss) of sharded logits; see `vocab_parallel_cross_entropy`."""

    @staticmethod
    def forward(
        ctx,
        logits_NV: Tensor,
        labels_N: Tensor,
        row_weight_N: Tensor,
        group: dist.ProcessGroup | None,
        vocab_start: int,
        z_loss_weight: float,
    ) -> Tensor:
        vocab_shard = logits_NV.shape[-1]
        # The one float32 copy of the shard: shifted, exponentiated, then the softmax, in place.
        shifted_NV = logits_NV.to(_statistics_dtype(logits_NV.dtype), copy=True)
        # 1. the global row maximum, for stable exponentials
        max_N = shifted_NV.max(dim=-1).values
        _all_reduce(max_N, dist.ReduceOp.MAX, group)
        shifted_NV.sub_(max_N.unsqueeze(-1))
        # 2. this shard's part of (target logit - max, sum of exp(logit - max))
        local_labels_N = labels_N - vocab_start
        in_shard_N = (local_labels_N >= 0) & (local_labels_N < vocab_shard)
        local_labels_N = local_labels_N.masked_fill(~in_shard_N, 0)
        target_N = shifted_NV.gather(-1, local_labels_N.unsqueeze(-1)).squeeze(-1)
        target_N = target_N.masked_fill(~in_shard_N, 0.0)
        exp_NV = shifted_NV.exp_()
        statistics_N2 = torch.stack([target_N, exp_NV.sum(dim=-1)], dim=-1)
        # 3. one fused all-reduce of both
        _all_reduce(statistics_N2, dist.ReduceOp.SUM, group)
        target_N, sum_exp_N = statistics_N2.unbind(-1)
        log_sum_exp_N = sum_exp_N.log()
        loss_N = log_sum_exp_N - target_N  # = logsumexp - target logit
        log_z_N = log_sum_exp_N + max_N  # logsumexp of the full row
        if z_loss_weight:
            loss_N = loss_N + z_loss_weight * log_z_N.square()
        loss_N = loss_N * row_weight_N
        # What backward needs: softmax of the shard, in place of the exponentials.
        softmax_NV = exp_NV.div_(sum_exp_N.unsqueeze(-1))
        grad_scale_N = row_weight_N
        if z_loss_weight:
            grad_scale_N = grad_scale_N * (1.0 + 2.0 * z_loss_weight * log_z_N)
        ctx.save_for_backward(softmax_NV, local_labels_N, in_shard_N, row_weight_N, grad_scale_N)
        ctx.logits_dtype = logits_NV.dtype
        return loss_N

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_loss_N: Tensor):
        softmax_NV, local_labels_N, in_shard_N, row_weight_N, grad_scale_N = ctx.saved_tensors
        # d loss_n / d z_i = w_n [(1 + 2 z logZ_n) softmax_i - onehot_i]; edited in place: the
        # softmax is not needed again (a second backward fails torch's saved-tensor check).
        grad_NV = softmax_NV.mul_((grad_loss_N * grad_scale_N).unsqueeze(-1))
        onehot_grad_N = (grad_loss_N * row_weight_N).masked_fill(~in_shard_N, 0.0)
        grad_NV.scatter_add_(-1, local_labels_N.unsqueeze(-1), -onehot_grad_N.unsqueeze(-1))
        return grad_NV.to(ctx.logits_dtype), None, None, None, None, None


def vocab_parallel_cross_entropy(
    logits_shard_BSV: Tensor,
    labels_BS: Tensor,
    group: GroupLike = None,
    *,
    vocab_start: int,
    vocab_size: int | None = None,
    ignore_index: int = -100,
    loss_mask_BS: Tensor | None = None,
    z_loss_weight: float = 0.0,
    reduction: Literal["sum", "none"] = "sum",
) -> Tensor:
    """Cross-entropy of the full vocabulary, computed from this rank's logit shard.

    `logits_shard_BSV` holds the logits of vocabulary rows `[vocab_start, vocab_start + V)`
    (any leading dims; `labels_BS` has the same ones). The statistics are computed in float32
    (float64 stays float64): one all-reduce (MAX) of the row maxima, then one all-reduce (SUM)
    of a stacked (target logit, sum of exponentials) per row. Rows whose label is
    `ignore_index`, or whose `loss_mask_BS` is 0, contribute 0; a fractional mask weighs the row.
    `z_loss_weight > 0` adds `z_loss_weight * logsumexp(row)**2` per row.

    Returns the token sum (`reduction="sum"`, pipekit's convention: divide by the global count
    of label tokens) or the per-row losses (`"none"`), in the statistics dtype, equal on every
    rank. The backward needs no collective: it returns this shard's `softmax - onehot` gradient.
    The gradient of the hidden states that produced the logits is then partial on each rank and
    must be summed over the group (`VocabParallelOutput(reduce_input_grad=True)` does it).

    `vocab_size`, when given, lets the shard's range be checked. Label values are not checked
    (that would cost a device sync): a label outside `[0, vocab_size)` other than
    `ignore_index` reads a target logit of 0.
    """
    if tuple(labels_BS.shape) != tuple(logits_shard_BSV.shape[:-1]):
        raise ValueError(
            f"labels of shape {tuple(labels_BS.shape)} do not match the logits' leading dims "
            f"{tuple(logits_shard_BSV.shape[:-1])} (logits {tuple(logits_shard_BSV.shape)}); "
            "give one label per logit row"
        )
    if loss_mask_BS is not None and tuple(loss_mask_BS.shape) != tuple(labels_BS.shape):
        raise ValueError(
            f"loss_mask of shape {tuple(loss_mask_BS.shape)} does not match the labels' "
            f"{tuple(labels_BS.shape)}; give one mask value per label"
        )
    vocab_shard = logits_shard_BSV.shape[-1]
    if vocab_start < 0:
        raise ValueError(
            f"vocab_start={vocab_start} must be >= 0: pass the shard's first vocabulary row, "
            "e.g. output.vocab_start"
        )
    if vocab_size is not None and vocab_start + vocab_shard > vocab_size:
        raise ValueError(
            f"vocab_start={vocab_start} with a shard of {vocab_shard} rows ends past "
            f"vocab_size={vocab_size}; pass the shard's first vocabulary row, e.g. "
            "output.vocab_start"
        )
    if reduction not in ("sum", "none"):
        raise ValueError(f"reduction={reduction!r} is not supported; use 'sum' or 'none'")
    if z_loss_weight < 0:
        raise ValueError(f"z_loss_weight={z_loss_weight} must be >= 0")

    stats_dtype = _statistics_dtype(logits_shard_BSV.dtype)
    row_weight_BS = (labels_BS != ignore_index).to(stats_dtype)
    if loss_mask_BS is not None:
        row_weight_BS = row_weight_BS * loss_mask_BS.to(stats_dtype)
    loss_N = _VocabParallelCrossEntropy.apply(
        logits_shard_BSV.reshape(-1, vocab_shard),
        labels_BS.reshape(-1),
        row_weight_BS.reshape(-1),
        _process_group(group),
        vocab_start,
        float(z_loss_weight),
    )
    if reduction == "sum":
        return loss_N.sum()
    return loss_N.view(labels_BS.shape)
