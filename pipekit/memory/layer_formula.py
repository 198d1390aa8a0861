"""Bytes a Llama-style transformer layer keeps for its backward, per token, by option.

In the manner of Korthikanti et al. ("Reducing Activation Recomputation in Large Transformer
Models", 34·s·b·h bytes per layer for GPT in fp16), adjusted for pipekit's layer: RMSNorm,
grouped-query attention with a flash kernel (no score matrix; its output and one float32
log-sum-exp per query head), and a SwiGLU FFN. With D the model dim, H query heads, G kv heads,
K the head dim, F the FFN dim and e bytes per activation element, per token:

- attention (every option without checkpointing): q, k, v (the kernel's inputs, after RoPE):
  `(H + 2G) K e`; its output `H K e`, which is also the output projection's input (flash
  kernels return it in `[B, S, H, K]` memory, so joining the heads is a view), and its
  log-sum-exp `4 H`.
- a norm, plain (autograd ops): its input, the normalised input and its output (which the next
  projections save as their input): `3 D e`, and `1/rms` `4`; memory-efficient: its output
  only (shared with the projections) and `4`.
- the FFN: gate and up `2 F e`, the down projection's input `F e`, and the swish `F e` unless
  the SwiGLU recomputes it (memory-efficient).
- `full` checkpointing: the layer's input, `D e`; `every_k`: the average of full and none over
  k layers; `selective` (keep matmuls and attention): the input, every projection's output
  (`(2 D + (H + 2G) K + 2 F) e`) and the attention kernel's output and log-sum-exp (a causal
  sequence is one kernel call; pipekit's CPU kernel splits into tiles only masks that need a
  dense one, such as packed documents, and then keeps one output per tile).

The residual stream itself is not kept: the residual additions save nothing, and a
memory-efficient norm saves its output rather than its input.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "LAYER_OPTIONS",
    "LayerShape",
    "saved_bytes_by_part",
    "saved_bytes_per_token",
]

LAYER_OPTIONS = ("plain", "efficient", "selective", "full", "every_k")
_FLOAT32 = 4


@dataclass(frozen=True)
class LayerShape:
    """The sizes that decide a layer's saved bytes."""

    dim: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn_dim: int


def saved_bytes_per_token(
    shape: LayerShape,
    option: str,
    element_bytes: int,
    every: int = 2,
) -> float:
    """Bytes per token one layer keeps for its backward under `option` (`LAYER_OPTIONS`;
    every option but `plain` uses the memory-efficient norm and SwiGLU); `every` is k of
    `every_k`."""
    return sum(saved_bytes_by_part(shape, option, element_bytes, every).values())


def saved_bytes_by_part(
    shape: LayerShape,
    option: str,
    element_bytes: int,
    every: int = 2,
) -> dict[str, float]:
    """`saved_bytes_per_token` split by the part of the layer that allocates what is kept
    (`pipekit.memory.layer_parts`): "attention", "norms", "mlp" and "other" (the residual
    stream: the block's input, which a checkpointed block keeps, and the norms' inputs, which
    plain norms keep)."""
    d, h, g, k, f, e = (shape.dim, shape.heads, shape.kv_heads, shape.head_dim,
                        shape.ffn_dim, element_bytes)  # fmt: skip
    kernel_output = h * k * e + _FLOAT32 * h  # the attention output and its log-sum-exp

    def uncheckpointed(efficient: bool) -> dict[str, float]:
        # a plain norm keeps its input too: the residual stream, allocated outside it
        norm = (d if efficient else 2 * d) * e + _FLOAT32
        return {
            "attention": (h + 2 * g) * k * e + kernel_output,
            "norms": 2 * norm,
            "mlp": (3 if efficient else 4) * f * e,
            "other": 0.0 if efficient else 2 * d * e,
        }

    if option in ("plain", "efficient"):
        return uncheckpointed(efficient=option == "efficient")
    if option == "full":
        return {"attention": 0.0, "norms": 0.0, "mlp": 0.0, "other": d * e}
    if option == "every_k":
        parts = {
            part: (every - 1) * kept / every
            for part, kept in uncheckpointed(efficient=True).items()
        }
        return parts | {"other": d * e / every}
    if option == "selective":  # projection outputs (wo's and w2's: d each) and kernel outputs
        return {
            "attention": ((h + 2 * g) * k + d) * e + kernel_output,
            "norms": 0.0,
            "mlp": (2 * f + d) * e,
            "other": d * e,
        }
    raise ValueError(f"layer option {option!r}: choose one of {', '.join(LAYER_OPTIONS)}")
