"""Attention-logit soft-capping (Gemma 2): scores become `cap · tanh(s / cap)` before the
softmax, as an attention kernel for one (query block, KV chunk) pair.

`SoftcapBackend` computes a chunk's `(out, lse)` and, given the *merged* `(out, lse)`, its
gradients (the ring identity), so a soft-capped layer merges across KV-cache slices, context-
parallel ranks and exchange peers exactly like any other. The kernel materialises one chunk's
scores (`[B, H, S, K]` in the statistics dtype): the CPU flash kernel has no score hook, and
FlexAttention's `score_mod` is the faster path on CUDA that this does not use yet. The softmax
Jacobian is the usual one taken at the capped scores; the cap adds the factor `1 - tanh²(s/cap)`
on the way back to the raw scores.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipekit.attention._tiles import evaluate_mask
from pipekit.attention.masks import MaskMod

__all__ = ["SoftcapBackend"]


def _expand(kv_BGKD: Tensor, heads: int) -> Tensor:
    return kv_BGKD.repeat_interleave(heads // kv_BGKD.shape[1], dim=1)


def _reduce(grad_BHKD: Tensor, kv_heads: int) -> Tensor:
    return grad_BHKD.unflatten(1, (kv_heads, -1)).sum(2)


class SoftcapBackend:
    """The soft-capped kernel: `softmax(cap · tanh(q kᵀ · scale / cap)) v` over the allowed
    keys, with its `(out, lse)` and ring-identity backward (see the module docstring)."""

    lse_has_grad = False

    def __init__(self, cap: float) -> None:
        if cap <= 0:
            raise ValueError(f"SoftcapBackend: cap={cap} must be positive")
        self.cap, self.name = cap, f"softcap({cap:g})"

    def _capped_scores(
        self, q_BHSD: Tensor, k_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """(capped scores with -inf where masked, tanh(s / cap)) in the statistics dtype."""
        stat_dtype = torch.promote_types(q_BHSD.dtype, torch.float32)
        scores_BHSK = (q_BHSD.to(stat_dtype) @ _expand(k_BGKD, q_BHSD.shape[1]).to(stat_dtype)
                       .transpose(-1, -2)) * scale  # fmt: skip
        tanh_BHSK = torch.tanh(scores_BHSK / self.cap)
        capped_BHSK = self.cap * tanh_BHSK
        if mask is not None:
            batch, heads, queries, _ = q_BHSD.shape
            allowed = evaluate_mask(
                mask, batch, heads, slice(0, queries), slice(0, k_BGKD.shape[2]), q_BHSD.device
            )
            capped_BHSK = capped_BHSK.masked_fill(~allowed, float("-inf"))
        return capped_BHSK, tanh_BHSK

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """`(out_BHSD, lse_BHS)` of the chunk; rows with no allowed key give 0 and -inf."""
        capped_BHSK, _ = self._capped_scores(q_BHSD, k_BGKD, mask, scale)
        lse_BHS = torch.logsumexp(capped_BHSK, dim=-1)
        probs_BHSK = torch.exp(capped_BHSK - lse_BHS.unsqueeze(-1)).nan_to_num(0.0)
        out_BHSD = probs_BHSK @ _expand(v_BGKD, q_BHSD.shape[1]).to(probs_BHSK.dtype)
        return out_BHSD.to(q_BHSD.dtype), lse_BHS

    def backward_chunk(
        self,
        grad_out_BHSD: Tensor,
        q_BHSD: Tensor,
        k_BGKD: Tensor,
        v_BGKD: Tensor,
        out_BHSD: Tensor,
        lse_BHS: Tensor,
        mask: MaskMod | None,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """The chunk's dQ, dK, dV given the merged `out` and `lse` of every chunk."""
        heads, kv_heads = q_BHSD.shape[1], k_BGKD.shape[1]
        capped_BHSK, tanh_BHSK = self._capped_scores(q_BHSD, k_BGKD, mask, scale)
        stat_dtype = capped_BHSK.dtype
        lse_BHS = lse_BHS.to(stat_dtype).masked_fill(torch.isneginf(lse_BHS), float("inf"))
        probs_BHSK = torch.exp(capped_BHSK - lse_BHS.unsqueeze(-1))
        grad_out = grad_out_BHSD.to(stat_dtype)
        k_BHKD, v_BHKD = (_expand(t, heads).to(stat_dtype) for t in (k_BGKD, v_BGKD))
        grad_v_BHKD = probs_BHSK.transpose(-1, -2) @ grad_out
        row_BHS1 = (grad_out * out_BHSD.to(stat_dtype)).sum(-1, keepdim=True)
        grad_capped_BHSK = probs_BHSK * (grad_out @ v_BHKD.transpose(-1, -2) - row_BHS1)
        grad_scores_BHSK = grad_capped_BHSK * (1 - tanh_BHSK.square()) * scale
        grad_q_BHSD = grad_scores_BHSK @ k_BHKD
        grad_k_BHKD = grad_scores_BHSK.transpose(-1, -2) @ q_BHSD.to(stat_dtype)
        return (
            grad_q_BHSD.to(q_BHSD.dtype),
            _reduce(grad_k_BHKD, kv_heads).to(k_BGKD.dtype),
            _reduce(grad_v_BHKD, kv_heads).to(v_BGKD.dtype),
        )
