"""Llama 3 hyper-parameters and the public flavors.

`LlamaArgs` is the shared decoder's args (`pipekit.families.decoder.args`) under Llama's name;
flavors are named instances of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipekit.families.decoder.args import DecoderArgs, RopeScaling

__all__ = ["LLAMA_FLAVORS", "LlamaArgs", "RopeScaling", "llama_flavor"]  # RopeScaling re-exported


@dataclass(kw_only=True, frozen=True)
class LlamaArgs(DecoderArgs):
    """Shape of a Llama 3 decoder; everything a checkpoint's config.json can say about it."""


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
# 70B for context extension to 2M tokens (SlimPipe's longest Llama 70B runs): the 70B weights,
# positions up to 2**21.
LLAMA_FLAVORS["70B_2M"] = LLAMA_FLAVORS["70B"].with_updates(max_seq_len=2**21)
# The debug shape with tied embedding and output weights, as Llama 3.2 1B and 3B have.
LLAMA_FLAVORS["debug_tied"] = LLAMA_FLAVORS["debug"].with_updates(tie_embeddings=True)


def llama_flavor(name: str) -> LlamaArgs:
    """The LlamaArgs of a named flavor, with an error that lists the known names."""
    if name not in LLAMA_FLAVORS:
        raise ValueError(f"unknown Llama flavor {name!r}; known flavors: {sorted(LLAMA_FLAVORS)}")
    return LLAMA_FLAVORS[name]
