"""Multi-head latent attention (MLA, "DeepSeek-V2: A Strong, Economical, and Efficient
Mixture-of-Experts Language Model"), computed two exact ways.

Each token's keys and values come from one compressed latent `c` (`kv_lora_rank` wide, after
`kv_norm`) and one RoPE key `k_rope` shared by all heads (`qk_rope_head_dim` wide):
`[k_nope | v] = wkv_b c` per head and `k = [k_nope | k_rope]`. Queries come from their own
low-rank path (`wq_a`, `q_norm`, `wq_b`) or one projection (`wq`) when `q_lora_rank` is None.

- `cache="expanded"`: attention over the per-head keys and values, as training usually runs
  MLA. pipekit's attention kernels take one head dim for keys and values, so the values are
  zero-padded to the key head dim (the padded columns give zeros and are dropped).
- `cache="latent"`: the up-projections are absorbed, as DeepSeek's decoding does: each head's
  query becomes `[q_nope W_uk | q_rope]`, and every head attends to the one latent key
  `[c | k_rope]`, which is also the value (its RoPE part's output is dropped); the latent
  output goes through `W_uv` per head. The attention context therefore sees one kv head of
  `kv_lora_rank + qk_rope_head_dim` and the same tensor as keys and values, so a KV cache,
  context exchange and context parallelism keep and move the latent, not `2 x heads x head_dim`
  per token. The price is attention arithmetic: scores and outputs are that wide per head.

Both give the same function of the weights (a test holds them equal in float64).

Legend: B batch, S sequence, D model dim, H heads, N no-RoPE query/key dim, R RoPE dim,
V value dim, L latent (kv_lora_rank), Q query rank, C = L + R.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipekit.attention.context import AttentionContext, attend
from pipekit.attention.patterns import AttentionPattern
from pipekit.layers.init import trunc_normal_
from pipekit.layers.norms import RMSNorm
from pipekit.layers.rope import apply_rotary

__all__ = ["LATENT_ATTENTION_CACHES", "MultiHeadLatentAttention"]

LATENT_ATTENTION_CACHES = ("expanded", "latent")
"""What a latent attention layer hands its attention context: per-head K/V or the latent."""


class MultiHeadLatentAttention(nn.Module):
    """MLA with decoupled RoPE; `cache` picks the expanded or the absorbed (latent) form."""

    def __init__(
        self,
        dim: int,
        n_heads: int,
        *,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        norm_eps: float = 1e-6,
        softmax_scale_factor: float = 1.0,
        cache: str = "expanded",
        pattern: AttentionPattern | None = None,
    ) -> None:
        super().__init__()
        if cache not in LATENT_ATTENTION_CACHES:
            raise ValueError(
                f"MultiHeadLatentAttention: cache={cache!r} is not one of {LATENT_ATTENTION_CACHES}"
            )
        self.n_heads, self.cache, self.pattern = n_heads, cache, pattern
        self.kv_lora_rank = kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        self.scale = qk_head_dim**-0.5 * softmax_scale_factor
        if q_lora_rank is None:
            self.wq = nn.Linear(dim, n_heads * qk_head_dim, bias=False)
            self.wq_a = self.q_norm = self.wq_b = None
        else:
            self.wq = None
            self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
            self.q_norm = RMSNorm(q_lora_rank, norm_eps)
            self.wq_b = nn.Linear(q_lora_rank, n_heads * qk_head_dim, bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, norm_eps)
        self.wkv_b = nn.Linear(kv_lora_rank, n_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(n_heads * v_head_dim, dim, bias=False)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        """Truncated-normal projections, unit norms; `output_std` for wo (depth scaling)."""
        for linear in (self.wq, self.wq_a, self.wq_b, self.wkv_a, self.wkv_b):
            if linear is not None:
                trunc_normal_(linear.weight, init_std)
        for norm in (self.q_norm, self.kv_norm):
            if norm is not None:
                norm.reset_parameters()
        trunc_normal_(self.wo.weight, init_std if output_std is None else output_std)

    def _queries(self, x_BSD: Tensor) -> Tensor:
        if self.wq is not None:
            return self.wq(x_BSD)
        return self.wq_b(self.q_norm(self.wq_a(x_BSD)))

    def forward(
        self,
        x_BSD: Tensor,
        rope_cos_sin: tuple[Tensor, Tensor],
        layer_id: str,
        context: AttentionContext | None = None,
    ) -> Tensor:
        batch, seq_len, _ = x_BSD.shape
        cos_BSF, sin_BSF = rope_cos_sin
        queries = self._queries(x_BSD)
        if queries.shape[-1] != self.n_heads * (self.nope_dim + self.rope_dim):
            raise ValueError(
                f"MultiHeadLatentAttention: the query projection gives {queries.shape[-1]} "
                f"features, not {self.n_heads} heads x {self.nope_dim + self.rope_dim}: its "
                "heads were split (tensor parallelism), which it does not support; use tp = 1"
            )
        q_BSHX = queries.view(batch, seq_len, self.n_heads, -1)
        q_nope_BSHN, q_rope_BSHR = q_BSHX.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope_BSHR = apply_rotary(q_rope_BSHR, cos_BSF, sin_BSF)
        latent_BSL, k_rope_BSR = self.wkv_a(x_BSD).split([self.kv_lora_rank, self.rope_dim], -1)
        latent_BSL = self.kv_norm(latent_BSL)
        k_rope_BS1R = apply_rotary(k_rope_BSR.unsqueeze(2), cos_BSF, sin_BSF)
        if self.cache == "latent":
            out_BSHV = self._latent_attention(
                q_nope_BSHN, q_rope_BSHR, latent_BSL, k_rope_BS1R, layer_id, context
            )
        else:
            out_BSHV = self._expanded_attention(
                q_nope_BSHN, q_rope_BSHR, latent_BSL, k_rope_BS1R, layer_id, context
            )
        return self.wo(out_BSHV.flatten(2))

    def _expanded_attention(
        self,
        q_nope_BSHN: Tensor,
        q_rope_BSHR: Tensor,
        latent_BSL: Tensor,
        k_rope_BS1R: Tensor,
        layer_id: str,
        context: AttentionContext | None,
    ) -> Tensor:
        batch, seq_len, heads, _ = q_nope_BSHN.shape
        kv_BSHX = self.wkv_b(latent_BSL).view(batch, seq_len, heads, -1)
        k_nope_BSHN, v_BSHV = kv_BSHX.split([self.nope_dim, self.v_dim], dim=-1)
        q_BSHK = torch.cat([q_nope_BSHN, q_rope_BSHR], dim=-1)
        k_BSHK = torch.cat([k_nope_BSHN, k_rope_BS1R.expand(-1, -1, heads, -1)], dim=-1)
        # one head dim for q, k and v: pad the narrower side with zeros (scores and kept
        # outputs unchanged)
        width = max(q_BSHK.shape[-1], self.v_dim)
        q_BSHK, k_BSHK = (F.pad(t, (0, width - t.shape[-1])) for t in (q_BSHK, k_BSHK))
        v_BSHK = F.pad(v_BSHV, (0, width - self.v_dim))
        out_BHSK = _attend(context, layer_id, q_BSHK, k_BSHK, v_BSHK, self.scale, self.pattern)
        return out_BHSK.transpose(1, 2)[..., : self.v_dim]

    def _latent_attention(
        self,
        q_nope_BSHN: Tensor,
        q_rope_BSHR: Tensor,
        latent_BSL: Tensor,
        k_rope_BS1R: Tensor,
        layer_id: str,
        context: AttentionContext | None,
    ) -> Tensor:
        w_BHXL = self.wkv_b.weight.view(1, self.n_heads, -1, self.kv_lora_rank)
        w_uk_1HNL, w_uv_1HVL = w_BHXL.split([self.nope_dim, self.v_dim], dim=2)
        # absorb W_uk into the queries: q_nope . (W_uk c) = (q_nope W_uk) . c
        q_latent_BSHL = torch.einsum("bshn,xhnl->bshl", q_nope_BSHN, w_uk_1HNL)
        q_BSHC = torch.cat([q_latent_BSHL, q_rope_BSHR], dim=-1)
        kv_BS1C = torch.cat([latent_BSL.unsqueeze(2), k_rope_BS1R], dim=-1)
        out_BHSC = _attend(context, layer_id, q_BSHC, kv_BS1C, kv_BS1C, self.scale, self.pattern)
        out_latent_BHSL = out_BHSC[..., : self.kv_lora_rank]
        # absorb W_uv into the outputs: sum_t p_t (W_uv c_t) = W_uv (sum_t p_t c_t)
        return torch.einsum("bhsl,xhvl->bshv", out_latent_BHSL, w_uv_1HVL)


def _attend(
    context: AttentionContext | None,
    layer_id: str,
    q_BSHK: Tensor,
    k_BSGK: Tensor,
    v_BSGK: Tensor,
    scale: float,
    pattern: AttentionPattern | None,
) -> Tensor:
    """`attend` on `[B, S, heads, dim]` projections. Keys that are their own values (the latent
    form) reach the context as one tensor, which the KV cache and exchanges keep once."""
    k_BGSK = k_BSGK.transpose(1, 2)
    v_BGSK = k_BGSK if v_BSGK is k_BSGK else v_BSGK.transpose(1, 2)
    return attend(context, layer_id, q_BSHK.transpose(1, 2), k_BGSK, v_BGSK, scale, pattern)
