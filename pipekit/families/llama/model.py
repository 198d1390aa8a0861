"""Llama 3: the shared decoder (`pipekit.families.decoder.model`) as it is, under Llama's name."""

from __future__ import annotations

from pipekit.families.decoder.model import DecoderLM, TransformerBlock

__all__ = ["Llama", "TransformerBlock"]


class Llama(DecoderLM):
    """Token embedding, grouped-query attention with RoPE and SwiGLU blocks, final RMSNorm,
    output projection (optionally tied to the embedding)."""
