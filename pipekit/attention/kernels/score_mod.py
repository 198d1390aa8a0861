"""Score modifications: what a layer's `AttentionPattern` does to the scores it allows, and the
kernel that computes attention with them.

A pattern may add a bias to each score by the query's head and the two tokens' indices in the
sequence (ALiBi: `-m_h · |i - j|`, "Train Short, Test Long: Attention with Linear Biases
Enables Input Length Extrapolation"; or any elementwise rule), then soft-cap it (Gemma 2:
`c · tanh(s / c)`). Per query block and KV chunk, the pattern's mask comes with the chunk's
`score_mod` in FlexAttention's form, `(score, b, h, q_idx, kv_idx) -> score` with block-local
indices (`ScoredMask`): FlexAttention applies it in its kernel, and `ScoreModKernel` evaluates
it on broadcast index grids. The bias depends on token indices only, never on which block,
slice, rank or exchange peer computes a pair, so every merge by log-sum-exp stays exact.

Head values: the bias reads one value per query head of the call (ALiBi's slope), handed to
the kernel with the mask, so a rank that holds some of the heads (tensor parallelism, Ulysses)
passes its own heads' values (`pipekit.layers.HeadValues` splits them with the heads).

`ScoreModKernel` materialises one chunk's scores (`[B, H, S, K]` in the statistics dtype): the
CPU flash kernel has no score hook, so the `cpu` backend runs chunks whose scores a pattern
modifies here. It returns `(out, lse)` and, given the *merged* `(out, lse)`, the chunk's
gradients (the ring identity); the score modification's own derivative comes from autograd on
the elementwise `score_mod`, so one kernel serves every modification.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from pipekit.attention.kernels._tiles import evaluate_mask, index_grids
from pipekit.attention.masks import MaskMod

__all__ = [
    "ALIBI",
    "ScoreBiasRule",
    "ScoreMod",
    "ScoreModKernel",
    "ScoredMask",
    "alibi_slopes",
    "split_score_mod",
    "token_score_mod",
]

ScoreMod = Callable[[Tensor, Tensor, Tensor, Tensor, Tensor], Tensor]
"""`(score, b, h, q_idx, kv_idx) -> score` (FlexAttention's convention, block-local indices)."""

ScoreBiasRule = Callable[[Tensor, Tensor, Tensor], Tensor]
"""`(head_value, q_token, kv_token) -> bias`: the additive bias of a score from its query head's
value and the two tokens' indices in the sequence (broadcast tensors; elementwise ops and
advanced indexing only, so it runs under FlexAttention's vmap and on broadcast index grids)."""

ALIBI = "alibi"
"""The built-in score bias: `-m_h · |q_token - kv_token|`, the head values being the slopes."""


def alibi_slopes(n_heads: int) -> list[float]:
    """ALiBi's slope of each of `n_heads` heads: `2^(-8i/n)` for `i = 1..n` when `n` is a
    power of two; otherwise the slopes of the largest power of two `p` below `n`, then every
    other slope of `2p`'s sequence for the remaining heads (as the paper does)."""
    if not isinstance(n_heads, int) or n_heads < 1:
        raise ValueError(f"alibi_slopes: n_heads={n_heads!r} must be a positive int")

    def geometric(count: int) -> list[float]:
        return [2.0 ** (-8.0 * i / count) for i in range(1, count + 1)]

    power = 1 << (n_heads.bit_length() - 1)
    return geometric(power) + geometric(2 * power)[0::2][: n_heads - power]


def _bias(rule: str | ScoreBiasRule, value: Tensor, q_token: Tensor, kv_token: Tensor) -> Tensor:
    if rule == ALIBI:
        return -value * (q_token - kv_token).abs().to(value.dtype)
    assert callable(rule)
    return rule(value, q_token, kv_token)


def token_score_mod(
    q_tokens_S: Tensor,
    kv_tokens_K: Tensor,
    score_bias: str | ScoreBiasRule | None,
    bias_H: Tensor | None,
    softcap: float | None,
) -> ScoreMod:
    """The score_mod of a query block against a KV chunk, given each row's token index in the
    sequence (1-D): `score_bias` (with the heads' values `bias_H`) added, then `softcap`.
    The head values are cast to the score's dtype first, so every rank and peer that computes
    a pair computes the same bias."""

    def modify(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        if score_bias is not None:
            assert bias_H is not None
            value = bias_H[h].to(score.dtype)
            bias = _bias(score_bias, value, q_tokens_S[q_idx], kv_tokens_K[kv_idx])
            score = score + bias.to(score.dtype)
        if softcap is not None:
            score = softcap * torch.tanh(score / softcap)
        return score

    return modify


class ScoredMask:
    """A chunk's mask_mod (called like one) with the `score_mod` of the scores it allows: what
    an `AttentionPattern` that modifies scores gives the kernels. `heads`: how many query heads
    the score_mod's head values cover (None: it reads none)."""

    __slots__ = ("heads", "mask", "score_mod")

    def __init__(self, mask: MaskMod, score_mod: ScoreMod, heads: int | None = None) -> None:
        self.mask, self.score_mod, self.heads = mask, score_mod, heads

    def __call__(self, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return self.mask(b, h, q_idx, kv_idx)


def split_score_mod(mask: MaskMod | None, heads: int) -> tuple[MaskMod | None, ScoreMod | None]:
    """`(mask_mod, score_mod)` of a chunk's mask for `heads` query heads (score_mod None: the
    scores are not modified); ValueError when its head values do not fit the heads."""
    if not isinstance(mask, ScoredMask):
        return mask, None
    if mask.heads is not None and mask.heads != heads:
        raise ValueError(
            f"score bias: {mask.heads} head values (bias_H) do not fit {heads} query heads: "
            "give one value per head of the call (under tensor parallelism, this rank's heads: "
            "pipekit.layers.HeadValues splits them with the heads)"
        )
    return mask.mask, mask.score_mod


def _expand(kv_BGKD: Tensor, heads: int) -> Tensor:
    return kv_BGKD.repeat_interleave(heads // kv_BGKD.shape[1], dim=1)


def _reduce(grad_BHKD: Tensor, kv_heads: int) -> Tensor:
    return grad_BHKD.unflatten(1, (kv_heads, -1)).sum(2)


class ScoreModKernel:
    """Attention of one query block over one KV chunk whose scores are modified by the mask's
    score_mod (`ScoredMask`; a plain mask runs unmodified): `softmax(mod(q kᵀ · scale)) v` over
    the allowed keys, with its `(out, lse)` and ring-identity backward (see the module
    docstring)."""

    name = "score_mod"
    lse_has_grad = False
    work_block = 1
    """Dense over the chunk it is given: the calling kernel's tiles set the work."""

    @staticmethod
    def _scores(
        q_BHSD: Tensor, k_BGKD: Tensor, mask: MaskMod | None, scale: float, differentiable: bool
    ) -> tuple[Tensor, Tensor]:
        """(raw scores, modified scores with -inf where masked) in the statistics dtype; with
        `differentiable` the raw scores are a leaf the modified ones are a function of."""
        batch, heads, queries, _ = q_BHSD.shape
        keys, device = k_BGKD.shape[2], q_BHSD.device
        mask_mod, score_mod = split_score_mod(mask, heads)
        stat_dtype = torch.promote_types(q_BHSD.dtype, torch.float32)
        with torch.no_grad():
            raw_BHSK = (q_BHSD.to(stat_dtype) @ _expand(k_BGKD, heads).to(stat_dtype)
                        .transpose(-1, -2)) * scale  # fmt: skip
        raw_BHSK.requires_grad_(differentiable)
        scores_BHSK = raw_BHSK
        rows, cols = slice(0, queries), slice(0, keys)
        if score_mod is not None:
            scores_BHSK = score_mod(raw_BHSK, *index_grids(batch, heads, rows, cols, device))
        if mask_mod is not None:
            allowed = evaluate_mask(mask_mod, batch, heads, rows, cols, device)
            scores_BHSK = scores_BHSK.masked_fill(~allowed, float("-inf"))
        return raw_BHSK, scores_BHSK

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """`(out_BHSD, lse_BHS)` of the chunk; rows with no allowed key give 0 and -inf."""
        with torch.no_grad():
            _, scores_BHSK = self._scores(q_BHSD, k_BGKD, mask, scale, differentiable=False)
            lse_BHS = torch.logsumexp(scores_BHSK, dim=-1)
            probs_BHSK = torch.exp(scores_BHSK - lse_BHS.unsqueeze(-1)).nan_to_num(0.0)
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
        with torch.enable_grad():
            raw_BHSK, scores_BHSK = self._scores(q_BHSD, k_BGKD, mask, scale, differentiable=True)
        stat_dtype = raw_BHSK.dtype
        with torch.no_grad():
            lse_BHS = lse_BHS.to(stat_dtype).masked_fill(torch.isneginf(lse_BHS), float("inf"))
            probs_BHSK = torch.exp(scores_BHSK.detach() - lse_BHS.unsqueeze(-1))
            grad_out = grad_out_BHSD.to(stat_dtype)
            k_BHKD, v_BHKD = (_expand(t, heads).to(stat_dtype) for t in (k_BGKD, v_BGKD))
            grad_v_BHKD = probs_BHSK.transpose(-1, -2) @ grad_out
            row_BHS1 = (grad_out * out_BHSD.to(stat_dtype)).sum(-1, keepdim=True)
            grad_scores_BHSK = probs_BHSK * (grad_out @ v_BHKD.transpose(-1, -2) - row_BHS1)
        # back through the score_mod (elementwise) and the mask to the raw scores
        (grad_raw_BHSK,) = torch.autograd.grad(scores_BHSK, raw_BHSK, grad_scores_BHSK)
        with torch.no_grad():
            grad_raw_BHSK = grad_raw_BHSK * scale
            grad_q_BHSD = grad_raw_BHSK @ k_BHKD
            grad_k_BHKD = grad_raw_BHSK.transpose(-1, -2) @ q_BHSD.to(stat_dtype)
        return (
            grad_q_BHSD.to(q_BHSD.dtype),
            _reduce(grad_k_BHKD, kv_heads).to(k_BGKD.dtype),
            _reduce(grad_v_BHKD, kv_heads).to(v_BGKD.dtype),
        )
