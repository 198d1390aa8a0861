"""Exact merge of partial attention results by their log-sum-exp.

If `(out_i, lse_i)` is attention of the same queries over disjoint KV chunks, the attention over
their union is `lse = log(sum_i exp(lse_i))` and `out = sum_i exp(lse_i - lse) * out_i`. Rows
that are fully masked in a chunk have `lse_i = -inf` and contribute nothing; rows masked in every
chunk get `out = 0`, `lse = -inf`. The merge is plain autograd arithmetic, written so that no NaN
appears in values or gradients for such rows.

Attention sinks (a learned logit per head in the softmax's denominator, with no value) are one
more partial: `(out = 0, lse = sink_h)`, merged exactly once, by whoever merges the last
partials of a query block (`merge_attention(..., sinks_H=...)`). Code that differentiates by
the ring identity (each chunk's kernel backward with the merged out and lse) stays exact when
the merged out and lse include the sink, and takes the sink's own gradient from
`sink_gradient`.

Legend: B batch, H heads, S queries, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["check_sinks", "merge_attention", "sink_gradient"]


def check_sinks(sinks_H: Tensor | None, q_BHSD: Tensor) -> None:
    """ValueError unless `sinks_H` (if given) has one logit per query head of `q_BHSD`."""
    if sinks_H is not None and tuple(sinks_H.shape) != (q_BHSD.shape[1],):
        raise ValueError(
            f"attention sinks of shape {tuple(sinks_H.shape)} do not fit {q_BHSD.shape[1]} "
            "query heads: give one logit per head (under tensor parallelism, this rank's heads)"
        )


def sink_gradient(
    grad_out_BHSD: Tensor, out_BHSD: Tensor, lse_BHS: Tensor, sinks_H: Tensor
) -> Tensor:
    """dL/dsink of a merged result that counted the sinks: the sink's probability times the
    value it adds (zero) minus the output, `-sum_{b,s} exp(sink - lse) (dO . O)`."""
    weight_BHS = torch.exp(sinks_H.to(lse_BHS.dtype).view(1, -1, 1) - lse_BHS)
    moved_BHS = (grad_out_BHSD.to(lse_BHS.dtype) * out_BHSD.to(lse_BHS.dtype)).sum(-1)
    return -(weight_BHS * moved_BHS).sum((0, 2)).to(sinks_H.dtype)


def merge_attention(
    partials: Sequence[tuple[Tensor, Tensor]], sinks_H: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Merge `[(out_BHSD, lse_BHS), ...]` over disjoint KV chunks into one `(out, lse)`, with
    the attention sinks `sinks_H` (one logit per head) counted once if given.

    The output keeps the partials' dtype; lse and the weighting are computed in float32 at least.
    """
    if not partials:
        raise ValueError("merge_attention needs at least one partial result")
    if sinks_H is not None:
        out_BHSD, lse_BHS = partials[0]
        sink_lse_BHS = sinks_H.to(lse_BHS.dtype).view(1, -1, 1).expand_as(lse_BHS)
        partials = [*partials, (torch.zeros_like(out_BHSD), sink_lse_BHS)]
    if len(partials) == 1:
        return partials[0]
    out_dtype = partials[0][0].dtype
    stat_dtype = torch.promote_types(partials[0][1].dtype, torch.float32)
    lse_NBHS = torch.stack([lse.to(stat_dtype) for _, lse in partials])
    # The row maximum only stabilises the exponentials; lse does not depend on it, so no gradient.
    row_max_BHS = lse_NBHS.detach().amax(dim=0)
    row_max_BHS = torch.where(torch.isfinite(row_max_BHS), row_max_BHS, 0.0)
    sum_exp_BHS = torch.exp(lse_NBHS - row_max_BHS).sum(dim=0)
    has_keys_BHS = sum_exp_BHS > 0
    lse_BHS = torch.where(
        has_keys_BHS,
        row_max_BHS + torch.log(torch.where(has_keys_BHS, sum_exp_BHS, 1.0)),
        float("-inf"),
    )
    finite_lse_BHS = torch.where(has_keys_BHS, lse_BHS, 0.0)
    out_BHSD = sum(
        torch.exp(lse_i - finite_lse_BHS).unsqueeze(-1) * out_i.to(stat_dtype)
        for out_i, lse_i in zip((o for o, _ in partials), lse_NBHS, strict=True)
    )
    return out_BHSD.to(out_dtype), lse_BHS
