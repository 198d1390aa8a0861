"""Model building blocks shared by every model: norms, RoPE, SwiGLU, attention layer."""

from pipekit.layers.attention import GroupedQueryAttention
from pipekit.layers.norms import RMSNorm
from pipekit.layers.rope import RopeScaling, RotaryEmbedding, apply_rotary, rope_inverse_frequencies
from pipekit.layers.swiglu import FeedForward

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "apply_rotary",
    "rope_inverse_frequencies",
]
