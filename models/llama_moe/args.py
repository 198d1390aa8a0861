"""Llama-MoE hyper-parameters: a Llama shape plus which layers are MoE and how they route.

`moe_every = k` makes layers k-1, 2k-1, ... MoE (every layer for k = 1, as in Mixtral); the
others keep the dense SwiGLU FFN of `ffn_dim`. Experts have `expert_ffn_dim` hidden units, by
default `ffn_dim`, so an expert is a copy of a Llama FFN (upcycling); granular upcycling makes
each expert one of G pieces of it (`ffn_dim / G`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from models.llama.args import LLAMA_FLAVORS, LlamaArgs
from pipekit.moe import MoEArgs

__all__ = ["LLAMA_MOE_FLAVORS", "LlamaMoEArgs", "llama_moe_flavor"]


@dataclass(kw_only=True, frozen=True)
class LlamaMoEArgs(LlamaArgs):
    """A Llama 3 decoder whose every `moe_every`-th FFN is a mixture of experts."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    """Experts, router and auxiliary losses of every MoE layer."""
    moe_every: int = 1
    """Every k-th layer (layers k-1, 2k-1, ...) is MoE; 1 makes all layers MoE."""
    expert_ffn_dim: int | None = None
    """Hidden units of each expert; None: `ffn_dim`."""

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(
                f"LlamaMoEArgs.moe_every={self.moe_every} must be between 1 and "
                f"n_layers={self.n_layers} (at least one MoE layer)"
            )
        if self.expert_ffn_dim is not None and self.expert_ffn_dim < 1:
            raise ValueError(f"LlamaMoEArgs.expert_ffn_dim={self.expert_ffn_dim} must be positive")

    @property
    def moe_ffn_dim(self) -> int:
        """Hidden units of each expert."""
        return self.ffn_dim if self.expert_ffn_dim is None else self.expert_ffn_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id % self.moe_every == self.moe_every - 1


LLAMA_MOE_FLAVORS: dict[str, LlamaMoEArgs] = {
    # CPU-sized: 4 layers, MoE in layers 1 and 3, 8 experts top-2 (ep = 2 gives 4 per rank).
    "debug": LlamaMoEArgs(
        **{**vars(LLAMA_FLAVORS["debug"]), "ffn_dim": 256},
        moe=MoEArgs(num_experts=8, top_k=2, load_balance_weight=0.01, z_loss_weight=0.001),
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


def llama_moe_flavor(name: str) -> LlamaMoEArgs:
    """The LlamaMoEArgs of a named flavor, with an error that lists the known names."""
    if name not in LLAMA_MOE_FLAVORS:
        raise ValueError(
            f"unknown Llama-MoE flavor {name!r}; known flavors: {sorted(LLAMA_MOE_FLAVORS)}"
        )
    return LLAMA_MOE_FLAVORS[name]
