"""What passes between a layer's expert module and what runs its experts: the tuples of a
rank's expert tensors, and the runner's one method (`ExpertExecution` is the runner; the
module names only this protocol, so the runner may build on the module's functions)."""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from pipekit.moe.activations import ExpertActivation
from pipekit.moe.routing import Routing

__all__ = ["ExpertBiases", "ExpertRunner", "ExpertWeights"]

ExpertWeights = tuple[Tensor, Tensor | None, Tensor]
"""(w1_EFD, w3_EFD, w2_EDF); w3_EFD is None for a plain (non-gated) activation."""
ExpertBiases = tuple[Tensor, Tensor | None, Tensor]
"""(b1_EF, b3_EF, b2_ED) of experts with biases; b3_EF is None for a plain activation."""


class ExpertRunner(Protocol):
    """Runs the experts of one MoE layer for a routing decision."""

    def run(
        self,
        x_TD: Tensor,
        routing: Routing,
        weights: ExpertWeights,
        activation: ExpertActivation,
        *,
        biases: ExpertBiases | None = None,
    ) -> Tensor: ...
