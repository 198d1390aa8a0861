"""Llama 3 hyper-parameters and the public flavors.

One dataclass describes every Llama 3.x shape; flavors are named instances of it. The RoPE
frequency scaling of Llama 3.1 is a separate small dataclass so that "no scaling" is `None`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pipekit.layers.rope import RopeScaling

__all__ = ["LLAMA_FLAVORS", "LlamaArgs", "RopeScaling", "llama_flavor"]  # RopeScaling re-exported


@dataclass(kw_only=True, frozen=True)
class LlamaArgs:
    """Shape of a Llama 3 decoder; everything a checkpoint's config.json can say about it."""

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

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "vocab_size", "ffn_dim", "max_seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"LlamaArgs.{name}={getattr(self, name)} must be positive")
        if self.num_kv_heads <= 0 or self.n_heads % self.num_kv_heads:
            raise ValueError(
                f"LlamaArgs: n_heads={self.n_heads} must be a multiple of "
                f"n_kv_heads={self.n_kv_heads}; choose n_kv_heads among the divisors of n_heads"
            )
        if self.head_dim is None and self.dim % self.n_heads:
            raise ValueError(
                f"LlamaArgs: dim={self.dim} is not divisible by n_heads={self.n_heads}; "
                "set head_dim explicitly or change n_heads"
            )
        if self.per_head_dim % 2:
            raise ValueError(f"LlamaArgs: head_dim={self.per_head_dim} must be even for RoPE")

    @property
    def num_kv_heads(self) -> int:
        """n_kv_heads with its default resolved."""
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def per_head_dim(self) -> int:
        """head_dim with its default resolved."""
        return self.dim // self.n_heads if self.head_dim is None else self.head_dim

    def with_updates(self, **changes: object) -> LlamaArgs:
        """A copy with some fields changed (validated again)."""
        return replace(self, **changes)


_LLAMA31_SCALING = RopeScaling(factor=8.0)
_LLAMA32_SCALING = RopeScaling(factor=32.0)

LLAMA_FLAVORS: dict[str, LlamaArgs] = {
    # Small enough that a CPU training step takes milliseconds; vocab = 256 bytes + BOS + EOS.
    "debug": LlamaArgs(
        dim=128,
        n_layers=4,
        n_heads=8,
        n_kv_heads=4,
        vocab_size=258,
        ffn_dim=384,
        rope_theta=10000.0,
        rope_scaling=None,
        max_seq_len=8192,
        tie_embeddings=False,
    ),
    "1B": LlamaArgs(
        dim=2048,
        n_layers=16,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "3B": LlamaArgs(
        dim=3072,
        n_layers=28,
        n_heads=24,
        n_kv_heads=8,
        ffn_dim=8192,
        rope_scaling=_LLAMA32_SCALING,
        tie_embeddings=True,
    ),
    "8B": LlamaArgs(
        dim=4096,
        n_layers=32,
        n_heads=32,
        n_kv_heads=8,
        ffn_dim=14336,
        rope_scaling=_LLAMA31_SCALING,
    ),
    "70B": LlamaArgs(
        dim=8192,
        n_layers=80,
        n_heads=64,
        n_kv_heads=8,
        ffn_dim=28672,
        rope_scaling=_LLAMA31_SCALING,
    ),
}
# The debug shape with tied embedding and output weights, as Llama 3.2 1B and 3B have.
LLAMA_FLAVORS["debug_tied"] = LLAMA_FLAVORS["debug"].with_updates(tie_embeddings=True)


def llama_flavor(name: str) -> LlamaArgs:
    """The LlamaArgs of a named flavor, with an error that lists the known names."""
    if name not in LLAMA_FLAVORS:
        raise ValueError(f"unknown Llama flavor {name!r}; known flavors: {sorted(LLAMA_FLAVORS)}")
    return LLAMA_FLAVORS[name]
