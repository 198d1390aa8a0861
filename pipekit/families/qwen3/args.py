"""Qwen3 hyper-parameters (dense and MoE) and the public flavors.

Qwen3 is a pre-norm decoder like Llama with three differences that matter here: an RMSNorm over
each head's queries and keys before RoPE (QK-norm), a head dim that need not be dim / heads, and
tied embeddings on the small sizes. Qwen3-MoE puts a mixture of experts (no shared expert) in
its MoE layers; with `norm_topk_prob` the router renormalises the top-k of a softmax over all
experts, which equals a softmax over the top-k logits (`topk_softmax`), and without it keeps the
top-k softmax probabilities as they are (`softmax_topk`).
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.families.decoder.args import DecoderArgs, MoEFields, RopeScaling
from pipekit.moe import MoEArgs

__all__ = [
    "QWEN3_FLAVORS",
    "QWEN3_MOE_FLAVORS",
    "Qwen3Args",
    "Qwen3MoEArgs",
    "qwen3_flavor",
    "qwen3_moe_flavor",
]


@dataclass(kw_only=True, frozen=True)
class Qwen3Args(DecoderArgs):
    """Shape of a Qwen3 decoder (defaults: Qwen3-8B's)."""

    dim: int = 4096
    n_layers: int = 36
    n_heads: int = 32
    n_kv_heads: int | None = 8
    head_dim: int | None = 128
    vocab_size: int = 151936
    ffn_dim: int = 12288
    norm_eps: float = 1e-6
    rope_theta: float = 1e6
    rope_scaling: RopeScaling | None = None
    """Qwen3's published sizes use plain RoPE."""
    max_seq_len: int = 40960


@dataclass(kw_only=True, frozen=True)
class Qwen3MoEArgs(MoEFields, Qwen3Args):
    """A Qwen3 decoder whose every `moe_every`-th FFN is a mixture of experts."""


QWEN3_FLAVORS: dict[str, Qwen3Args] = {
    # CPU-sized, byte vocabulary (256 + BOS + EOS); head_dim 64 is not dim / heads (32).
    "debug": Qwen3Args(
        dim=128,
        n_layers=4,
        n_heads=4,
        n_kv_heads=2,
        head_dim=64,
        vocab_size=258,
        ffn_dim=384,
        rope_theta=10000.0,
        max_seq_len=8192,
    ),
    "0.6B": Qwen3Args(dim=1024, n_layers=28, n_heads=16, ffn_dim=3072, tie_embeddings=True),
    "8B": Qwen3Args(),
}
# The debug shape with tied embedding and output weights, as the small Qwen3s have.
QWEN3_FLAVORS["debug_tied"] = QWEN3_FLAVORS["debug"].with_updates(tie_embeddings=True)

QWEN3_MOE_FLAVORS: dict[str, Qwen3MoEArgs] = {
    # CPU-sized: every layer MoE, 8 experts top-2 (ep = 2 gives 4 per rank).
    "debug": Qwen3MoEArgs(
        **vars(QWEN3_FLAVORS["debug"]),
        moe=MoEArgs(num_experts=8, top_k=2, load_balance_weight=0.01),
        expert_ffn_dim=128,
    ),
    # Qwen3-30B-A3B: 48 layers, 128 experts of width 768, top-8, renormalised.
    "30B-A3B": Qwen3MoEArgs(
        dim=2048,
        n_layers=48,
        n_heads=32,
        n_kv_heads=4,
        ffn_dim=6144,
        moe=MoEArgs(num_experts=128, top_k=8, load_balance_weight=0.001),
        expert_ffn_dim=768,
    ),
}


def qwen3_flavor(name: str) -> Qwen3Args:
    """The Qwen3Args of a named flavor, with an error that lists the known names."""
    if name not in QWEN3_FLAVORS:
        raise ValueError(f"unknown Qwen3 flavor {name!r}; known flavors: {sorted(QWEN3_FLAVORS)}")
    return QWEN3_FLAVORS[name]


def qwen3_moe_flavor(name: str) -> Qwen3MoEArgs:
    """The Qwen3MoEArgs of a named flavor, with an error that lists the known names."""
    if name not in QWEN3_MOE_FLAVORS:
        raise ValueError(
            f"unknown Qwen3-MoE flavor {name!r}; known flavors: {sorted(QWEN3_MOE_FLAVORS)}"
        )
    return QWEN3_MOE_FLAVORS[name]
