"""Model building blocks shared by every model: norms, RoPE, SwiGLU, attention layer, and the
vocabulary-parallel embedding, output layer and cross-entropy."""

from pipekit.layers.attention import GroupedQueryAttention
from pipekit.layers.head_values import HeadValues
from pipekit.layers.norms import RMSNorm
from pipekit.layers.rope import (
    RopeScaling,
    RotaryEmbedding,
    YarnScaling,
    apply_rotary,
    rope_inverse_frequencies,
)
from pipekit.layers.swiglu import FeedForward
from pipekit.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelOutput,
    vocab_parallel_cross_entropy,
    vocab_shard_range,
)

__all__ = [
    "FeedForward",
    "GroupedQueryAttention",
    "HeadValues",
    "RMSNorm",
    "RopeScaling",
    "RotaryEmbedding",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "YarnScaling",
    "apply_rotary",
    "rope_inverse_frequencies",
    "vocab_parallel_cross_entropy",
    "vocab_shard_range",
]
