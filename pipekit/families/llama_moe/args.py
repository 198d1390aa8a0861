"""Llama-MoE hyper-parameters: a Llama shape plus which layers are MoE and how they route.

`moe_every = k` makes layers k-1, 2k-1, ... MoE (every layer for k = 1, as in Mixtral); the
others keep the dense SwiGLU FFN of `ffn_dim` (`pipekit.families.decoder.args.MoEFields`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.families.decoder.args import MoEFields
from pipekit.families.llama.args import LLAMA_FLAVORS, LlamaArgs
from pipekit.moe import MoEArgs

__all__ = ["LLAMA_MOE_FLAVORS", "LlamaMoEArgs", "llama_moe_flavor"]


@dataclass(kw_only=True, frozen=True)
class LlamaMoEArgs(MoEFields, LlamaArgs):
    """A Llama 3 decoder whose every `moe_every`-th FFN is a mixture of experts."""


LLAMA_MOE_FLAVORS: dict[str, LlamaMoEArgs] = {
    # CPU-sized: 4 layers, MoE in layers 1 and 3, 8 experts top-2 (ep = 2 gives 4 per rank).
    "debug": LlamaMoEArgs(
        **{**vars(LLAMA_FLAVORS["debug"]), "ffn_dim": 256},
        moe=MoEArgs(num_experts=8, top_k=2, load_balance_weight=0.01, z_loss_weight=0.001),
        moe_every=2,
    ),
    # CPU-sized in Mixtral's layout (every layer MoE, 4 experts top-2), so it exports to
    # Hugging Face; configs/debug_moe_sliced_pp.toml trains it.
    "debug_mixtral": LlamaMoEArgs(
        **{**vars(LLAMA_FLAVORS["debug"]), "ffn_dim": 256},
        moe=MoEArgs(num_experts=4, top_k=2, load_balance_weight=0.01, z_loss_weight=0.001),
        moe_every=1,
    ),
    # CPU-sized with DeepSeek-V3's MoE: 8 routed experts in 4 groups (a token's from the best 2),
    # sigmoid routing with bias balancing instead of an auxiliary loss, one shared expert, and a
    # small sequence-wise balance loss; configs/debug_moe_balanced.toml trains it.
    "debug_balanced": LlamaMoEArgs(
        **{**vars(LLAMA_FLAVORS["debug"]), "ffn_dim": 256},
        moe=MoEArgs(
            num_experts=8,
            top_k=2,
            router="sigmoid_topk",
            num_groups=4,
            topk_groups=2,
            routed_scaling=2.5,
            bias_update_rate=1e-3,
            num_shared_experts=1,
            load_balance="sequence",
            load_balance_weight=1e-4,
        ),
        moe_every=2,
    ),
    # Mixtral 8x7B's shape.
    "8x7B": LlamaMoEArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        vocab_size=32000,
        ffn_dim=14336,
        rope_theta=1e6,
        rope_scaling=None,
        max_seq_len=32768,
        moe=MoEArgs(num_experts=8, top_k=2),
    ),
    # Llama 3 8B upcycled to 8 experts, top-2, capacity factor 4 (Llama 3 meets MoE).
    "8B_e8t2": LlamaMoEArgs(
        **vars(LLAMA_FLAVORS["8B"]),
        moe=MoEArgs(num_experts=8, top_k=2, capacity_factor=4.0),
    ),
}

# Mixtral 8x7B for context extension to 4M tokens (SlimPipe's longest run): positions up to 2**22.
LLAMA_MOE_FLAVORS["8x7B_4M"] = LLAMA_MOE_FLAVORS["8x7B"].with_updates(max_seq_len=2**22)


def llama_moe_flavor(name: str) -> LlamaMoEArgs:
    """The LlamaMoEArgs of a named flavor, with an error that lists the known names."""
    if name not in LLAMA_MOE_FLAVORS:
        raise ValueError(
            f"unknown Llama-MoE flavor {name!r}; known flavors: {sorted(LLAMA_MOE_FLAVORS)}"
        )
    return LLAMA_MOE_FLAVORS[name]
