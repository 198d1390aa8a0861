"""gpt-oss: the shared decoder with biased grouped-query attention and attention sinks,
alternating sliding-window and full layers, and mixtures of experts in every layer."""

from __future__ import annotations

from torch import nn

from pipekit.attention.patterns import AttentionPattern
from pipekit.families.decoder.model import DecoderLM
from pipekit.families.gpt_oss.args import GptOssArgs
from pipekit.layers import GroupedQueryAttention

__all__ = ["GptOss"]


class GptOss(DecoderLM):
    """Token embedding, attention with sinks (sliding window on even layers), MoE blocks of
    biased experts, final RMSNorm, output projection."""

    args: GptOssArgs

    def build_attention(self, layer_id: int) -> nn.Module:
        args = self.args
        window = AttentionPattern(window=args.sliding_window)
        return GroupedQueryAttention(
            args.dim,
            args.n_heads,
            args.num_kv_heads,
            args.per_head_dim,
            pattern=window if args.is_sliding_layer(layer_id) else None,
            sinks=True,
            bias=True,
        )
