"""Exact merge of partial attention results by their log-sum-exp.

If `(out_i, lse_i)` is attention of the same queries over disjoint KV chunks, the attention over
their union is `lse = log(sum_i exp(lse_i))` and `out = sum_i exp(lse_i - lse) * out_i`. Rows
that are fully masked in a chunk have `lse_i = -inf` and contribute nothing; rows masked in every
chunk get `out = 0`, `lse = -inf`. The merge is plain autograd arithmetic, written so that no NaN
appears in values or gradients for such rows.

Legend: B batch, H heads, S queries, D head dim.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["merge_attention"]


def merge_attention(partials: Sequence[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor]:
    """Merge `[(out_BHSD, lse_BHS), ...]` over disjoint KV chunks into one `(out, lse)`.

    The output keeps the partials' dtype; lse and the weighting are computed in float32 at least.
    """
    if not partials:
        raise ValueError("merge_attention needs at least one partial result")
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
