"""Float64 dense softmax attention: the reference every attention kernel is tested against."""

from __future__ import annotations

import torch
from torch import Tensor

from pipekit.attention.masks import MaskMod


def dense_allowed(mask: MaskMod | None, batch: int, heads: int, q_len: int, kv_len: int) -> Tensor:
    """The mask evaluated entry by entry (plain loops, no broadcasting tricks)."""
    allowed = torch.ones(batch, heads, q_len, kv_len, dtype=torch.bool)
    if mask is None:
        return allowed
    for b in range(batch):
        for h in range(heads):
            for q in range(q_len):
                for k in range(kv_len):
                    allowed[b, h, q, k] = bool(
                        mask(torch.tensor(b), torch.tensor(h), torch.tensor(q), torch.tensor(k))
                    )
    return allowed


def reference_attention(
    q_BHSD: Tensor,
    k_BGKD: Tensor,
    v_BGKD: Tensor,
    allowed: Tensor,
    scale: float,
    sinks_H: Tensor | None = None,
    bias_BHSK: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """`(out, lse)` by materialising the scores; fully masked rows give out 0, lse -inf.
    `sinks_H`: one more score per row and head, of that value, whose value vector is zero.
    `bias_BHSK`: added to every score (broadcast)."""
    heads, kv_heads = q_BHSD.shape[1], k_BGKD.shape[1]
    k_BHKD = k_BGKD.repeat_interleave(heads // kv_heads, dim=1)
    v_BHKD = v_BGKD.repeat_interleave(heads // kv_heads, dim=1)
    scores = (q_BHSD @ k_BHKD.transpose(-1, -2)) * scale
    if bias_BHSK is not None:
        scores = scores + bias_BHSK
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks_H is not None:
        sink_BHS1 = sinks_H.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, sink_BHS1.to(scores.dtype)], dim=-1)
    lse_BHS = scores.logsumexp(dim=-1)
    finite_lse = torch.where(torch.isfinite(lse_BHS), lse_BHS, 0.0)
    probs = torch.exp(scores - finite_lse.unsqueeze(-1))
    if sinks_H is not None:
        probs = probs[..., :-1]
    return probs @ v_BHKD, lse_BHS


def alibi_bias(slopes_H: Tensor, q_tokens_S: Tensor, kv_tokens_K: Tensor) -> Tensor:
    """ALiBi written out, `[1, H, S, K]`: minus each head's slope times the tokens' distance."""
    distance_SK = (q_tokens_S[:, None] - kv_tokens_K[None, :]).abs()
    return -slopes_H.view(1, -1, 1, 1) * distance_SK.to(slopes_H.dtype)
