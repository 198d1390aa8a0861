"""Qwen3 (dense and MoE): the shared decoder with Qwen3's attention, whose queries and keys are
RMS-normalised per head before RoPE (QK-norm)."""

from __future__ import annotations

from torch import Tensor, nn

from pipekit.families.decoder.model import DecoderLM
from pipekit.families.qwen3.args import Qwen3Args
from pipekit.layers import GroupedQueryAttention, RMSNorm

__all__ = ["Qwen3", "Qwen3Attention", "Qwen3MoE"]


class Qwen3Attention(GroupedQueryAttention):
    """Grouped-query attention with an RMSNorm over each head's queries (`q_norm`) and keys
    (`k_norm`), one weight of `head_dim` shared by the heads."""

    def __init__(
        self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, norm_eps: float
    ) -> None:
        super().__init__(dim, n_heads, n_kv_heads, head_dim)
        self.q_norm = RMSNorm(head_dim, norm_eps)
        self.k_norm = RMSNorm(head_dim, norm_eps)

    def reset_parameters(self, init_std: float = 0.02, output_std: float | None = None) -> None:
        super().reset_parameters(init_std, output_std)
        self.q_norm.reset_parameters()
        self.k_norm.reset_parameters()

    def transform_qk(self, q_BSHK: Tensor, k_BSGK: Tensor) -> tuple[Tensor, Tensor]:
        return self.q_norm(q_BSHK), self.k_norm(k_BSGK)


class Qwen3(DecoderLM):
    """Token embedding, QK-normed grouped-query attention with RoPE and SwiGLU (or MoE) blocks,
    final RMSNorm, output projection (tied to the embedding on the small sizes)."""

    args: Qwen3Args

    def build_attention(self, layer_id: int) -> nn.Module:
        args = self.args
        return Qwen3Attention(
            args.dim, args.n_heads, args.num_kv_heads, args.per_head_dim, args.norm_eps
        )


class Qwen3MoE(Qwen3):
    """A Qwen3 whose MoE layers (`args.is_moe_layer`) route each token to `top_k` experts."""
