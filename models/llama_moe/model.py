"""Llama-MoE: the Llama decoder with `pipekit.moe.MoE` in place of some dense FFNs.

Everything else (attention, norms, RoPE, init seeded by module name, stage splitting) is the
dense model's; only the chosen blocks' `feed_forward` differs, so a dense checkpoint's names
map onto it one to one except for the experts.
"""

from __future__ import annotations

from models.llama.model import Llama
from models.llama_moe.args import LlamaMoEArgs
from pipekit.moe import MoE

__all__ = ["LlamaMoE"]


class LlamaMoE(Llama):
    """A Llama whose MoE layers (`args.is_moe_layer`) route each token to `top_k` experts."""

    def __init__(self, args: LlamaMoEArgs) -> None:
        super().__init__(args)
        for key, block in self.layers.items():
            if args.is_moe_layer(int(key)):
                block.feed_forward = MoE(args.dim, args.moe_ffn_dim, args.moe)
