"""Llama-MoE: the Llama decoder with `pipekit.moe.MoE` in place of some dense FFNs.

Everything else (attention, norms, RoPE, init seeded by module name, stage splitting) is the
dense model's; the shared decoder builds an MoE FFN in the layers `LlamaMoEArgs` make MoE, so a
dense checkpoint's names map onto it one to one except for the experts.
"""

from __future__ import annotations

from pipekit.families.llama.model import Llama

__all__ = ["LlamaMoE"]


class LlamaMoE(Llama):
    """A Llama whose MoE layers (`args.is_moe_layer`) route each token to `top_k` experts."""
