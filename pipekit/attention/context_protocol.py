"""What every attention context is (`AttentionContext`): the one method an attention layer
calls, in a module of its own so the context-parallel kernels that build contexts can name it
without importing the contexts."""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from torch import Tensor

from pipekit.attention.patterns import AttentionPattern

__all__ = ["AttentionContext"]


@runtime_checkable
class AttentionContext(Protocol):
    """Computes a layer's attention output from its projected, rotated q, k, v, seeing what
    `pattern` allows (None: causal; its score bias's per-head values bound to it, see
    `attend`), with the layer's attention sinks (one logit per query head, counted once in the
    softmax's denominator) if it has them."""

    def attend(
        self,
        layer_id: str,
        q_BHSD: Tensor,
        k_BGSD: Tensor,
        v_BGSD: Tensor,
        scale: float,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> Tensor: ...
