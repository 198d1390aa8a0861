"""Grouped-query self-attention layer: projections, RoPE, and a call into the attention context.

The layer owns weights and its `AttentionPattern` (causal by default; a sliding window for a
local layer); how the pattern is honoured (packed documents, a KV cache, chunks on other ranks)
is the context's business (`pipekit.attention.context`).

Legend: B batch, S sequence, D model dim, H query heads, G kv heads, K head dim, F = K/2.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.attention.context import AttentionContext, attend
from pipekit.attention.patterns import AttentionPattern
from pipekit.layers.init import trunc_normal_
from pipekit.layers.rope import apply_rotary

__all__ = ["GroupedQueryAttention"]


class GroupedQueryAttention(nn.Module):
    """`wo(attention(rope(wq x), rope(wk x), wv x))` with `n_kv_heads` dividing `n_heads`;
    the queries see what `pattern` allows (None: causal); `bias` gives the projections biases
    (gpt-oss, Qwen2). With `sinks`, each head has a learned
    attention sink: one more logit in its softmax's denominator, with no value (gpt-oss), which
    every attention context counts once."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        n_kv_heads: int,
        head_dim: int,
        pattern: AttentionPattern | None = None,
        sinks: bool = False,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.pattern = pattern
        self.sinks = nn.Parameter(torch.empty(n_heads)) if sinks else None
        self.wq = nn.Linear(dim, n_heads * head_dim, bias=bias)
        self.wk = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wv = nn.Linear(dim, n_kv_heads * head_dim, bias=bias)
        self.wo = nn.Linear(n_heads * head_dim, dim, bias=bias)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Truncated-normal init, zero biases; `output_std` for wo lets deep models scale it
        down."""
        for linear in (self.wq, self.wk, self.wv):
            trunc_normal_(linear.weight, init_std)
        trunc_normal_(self.wo.weight, init_std if output_std is None else output_std)
        for linear in (self.wq, self.wk, self.wv, self.wo):
            if linear.bias is not None:
                nn.init.zeros_(linear.bias)
        if self.sinks is not None:
            nn.init.zeros_(self.sinks)

    def transform_qk(self, q_BSHK: Tensor, k_BSGK: Tensor) -> tuple[Tensor, Tensor]:
        """Queries and keys per head, before RoPE: unchanged here; a subclass adds what its
        family does there (e.g. Qwen3's per-head RMSNorm)."""
        return q_BSHK, k_BSGK

    def forward(
        self,
        x_BSD: Tensor,
        rope_cos_sin: tuple[Tensor, Tensor],
        layer_id: str,
        context: AttentionContext | None = None,
    ) -> Tensor:
        batch, seq_len, _ = x_BSD.shape
        cos_BSF, sin_BSF = rope_cos_sin
        # heads by count of what the projections return: under tensor parallelism, this rank's
        q_BSHK = self.wq(x_BSD).view(batch, seq_len, -1, self.head_dim)
        k_BSGK = self.wk(x_BSD).view(batch, seq_len, -1, self.head_dim)
        v_BSGK = self.wv(x_BSD).view(batch, seq_len, -1, self.head_dim)
        q_BSHK, k_BSGK = self.transform_qk(q_BSHK, k_BSGK)
        q_BHSK = apply_rotary(q_BSHK, cos_BSF, sin_BSF).transpose(1, 2)
        k_BGSK = apply_rotary(k_BSGK, cos_BSF, sin_BSF).transpose(1, 2)
        v_BGSK = v_BSGK.transpose(1, 2)
        scale = self.head_dim**-0.5
        # under tensor parallelism the sinks are sharded with the heads: this rank's heads'
        sinks_H = self.sinks.to_local() if isinstance(self.sinks, DTensor) else self.sinks
        out_BSD = _attend_merging_heads(
            context, layer_id, q_BHSK, k_BGSK, v_BGSK, scale, self.pattern, sinks_H
        )
        return self.wo(out_BSD)


@torch.compiler.disable  # compiled blocks run attention eagerly (pipekit.train.compile)
def _attend_merging_heads(
    context: AttentionContext | None,
    layer_id: str,
    q_BHSK: Tensor,
    k_BGSK: Tensor,
    v_BGSK: Tensor,
    scale: float,
    pattern: AttentionPattern | None,
    sinks_H: Tensor | None = None,
) -> Tensor:
    """`attend`, with the heads merged into `[B, S, H*K]` before returning: contexts return
    different memory layouts (kernels, merges, exchanges), and a contiguous result gives the
    compiled code after attention one stride pattern, hence one graph."""
    out_BHSK = attend(context, layer_id, q_BHSK, k_BGSK, v_BGSK, scale, pattern, sinks_H)
    return out_BHSK.transpose(1, 2).flatten(2)
