"""DeepSeek-V3: the shared decoder with multi-head latent attention, whose RoPE covers only
each head's decoupled RoPE part (`qk_rope_head_dim`)."""

from __future__ import annotations

from torch import nn

from pipekit.families.decoder.model import DecoderLM
from pipekit.families.deepseek_v3.args import DeepSeekV3Args
from pipekit.layers import RotaryEmbedding
from pipekit.layers.latent_attention import MultiHeadLatentAttention

__all__ = ["DeepSeekV3"]


class DeepSeekV3(DecoderLM):
    """Token embedding, MLA with YaRN RoPE, dense SwiGLU then MoE blocks (shared and routed
    experts), final RMSNorm, output projection."""

    args: DeepSeekV3Args

    def build_rope(self) -> RotaryEmbedding:
        args = self.args
        return RotaryEmbedding(args.qk_rope_head_dim, args.rope_theta, args.rope_scaling)

    def build_attention(self, layer_id: int) -> nn.Module:
        args = self.args
        return MultiHeadLatentAttention(
            args.dim,
            args.n_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
            norm_eps=args.norm_eps,
            softmax_scale_factor=args.softmax_scale_factor,
            cache=args.attention_cache,
        )
