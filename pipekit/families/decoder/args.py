"""Hyper-parameters of the built-in decoder families (Llama, Qwen3, and their MoE forms).

`DecoderArgs` holds everything a Llama-style config.json can say about a pre-norm decoder with
grouped-query attention, RoPE and SwiGLU FFNs; a family subclasses it (new fields, other
defaults). `MoEFields` adds mixture-of-experts FFNs in every k-th layer. The RoPE frequency
scaling of Llama 3.1 is a separate small dataclass so that "no scaling" is `None`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from pipekit.layers.rope import RopeScaling
from pipekit.moe import MoEArgs

__all__ = ["DecoderArgs", "MoEFields", "RopeScaling"]  # RopeScaling re-exported


@dataclass(kw_only=True, frozen=True)
class DecoderArgs:
    """Shape of a decoder; everything a Llama-style config.json can say about it (defaults:
    Llama 3.1 8B)."""

    dim: int = 4096
    """Model (hidden) dimension D."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Number of query heads."""
    n_kv_heads: int | None = None
    """Number of key/value heads (grouped-query attention); None means n_heads."""
    head_dim: int | None = None
    """Per-head dimension; None means dim // n_heads."""
    vocab_size: int = 128256
    """Number of token ids."""
    ffn_dim: int = 14336
    """Hidden size of the SwiGLU feed-forward network."""
    norm_eps: float = 1e-5
    """Epsilon of every RMSNorm."""
    rope_theta: float = 500000.0
    """RoPE base."""
    rope_scaling: RopeScaling | None = field(default_factory=RopeScaling)
    """Llama 3.1 frequency scaling, or None for plain RoPE."""
    max_seq_len: int = 131072
    """Longest context the model is meant for (recorded in exported configs)."""
    tie_embeddings: bool = False
    """Whether the output projection shares the token embedding's weight."""
    mtp_depth: int = 0
    """Multi-token prediction modules after the last block (DeepSeek-V3's D); 0 = none."""
    mtp_loss_weight: float = 0.3
    """lambda: the extra loss is lambda / D x the depths' summed cross-entropies."""

    def __post_init__(self) -> None:
        kind = type(self).__name__
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{kind}.{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads <= 0 or self.n_heads % self.num_kv_heads:
            raise ValueError(
                f"{kind}: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}; choose n_kv_heads among the divisors of n_heads"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"{kind}: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "set head_dim explicitly or change n_heads"
            )
        if self.mtp_depth < 0 or self.mtp_loss_weight < 0:
            raise ValueError(
                f"{kind}: mtp_depth={self.mtp_depth} and mtp_loss_weight={self.mtp_loss_weight} "
                "must be >= 0"
            )
        if self.per_head_dim % 2:
            raise ValueError(f"{kind}: head_dim={self.per_head_dim} must be even for RoPE")

    @property
    def num_kv_heads(self) -> int:
        """n_kv_heads with its default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def per_head_dim(self) -> int:
        """head_dim with its default resolved."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def with_updates(self, **changes: object) -> DecoderArgs:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


@dataclass(kw_only=True, frozen=True)
class MoEFields:
    """Mixture-of-experts FFNs in every `moe_every`-th layer (layers k-1, 2k-1, ...; every layer
    for k = 1). Experts have `expert_ffn_dim` hidden units, by default `ffn_dim`, so an expert
    is a copy of a dense FFN (upcycling); granular upcycling makes each expert one of G pieces
    of it (`ffn_dim / G`). Mix in before a family's args: `class FamilyMoEArgs(MoEFields,
    FamilyArgs)`."""

    moe: MoEArgs = field(default_factory=MoEArgs)
    """Experts, router and auxiliary losses of every MoE layer."""
    moe_every: int = 1
    """Every k-th layer (layers k-1, 2k-1, ...) is MoE; 1 makes all layers MoE."""
    expert_ffn_dim: int | None = None
    """Hidden units of each expert; None: `ffn_dim`."""

    if TYPE_CHECKING:  # the decoder args this is mixed into
        n_layers: int
        ffn_dim: int

    def __post_init__(self) -> None:
        super().__post_init__()  # type: ignore[misc]  # the decoder args' checks
        name = type(self).__name__
        if not 1 <= self.moe_every <= self.n_layers:
            raise ValueError(
                f"{name}.moe_every={self.moe_every} must be between 1 and n_layers="
                f"{self.n_layers} (at least one MoE layer)"
            )
        if self.expert_ffn_dim is not None and self.expert_ffn_dim < 1:
            raise ValueError(f"{name}.expert_ffn_dim={self.expert_ffn_dim} must be positive")

    @property
    def moe_ffn_dim(self) -> int:
        """Hidden units of each expert."""
        return self.ffn_dim if self.expert_ffn_dim is None else self.expert_ffn_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id % self.moe_every == self.moe_every - 1
