"""The pieces a model family's tensor-parallel plan is made of (`ModelSpec.tensor_parallel_plan`).

Every family splits its blocks the same way (Megatron's split), whatever its modules are
called: the inputs of attention and of a dense FFN become one replicated DTensor before their
column-split projections (`gathered_input`), the projections that return to the residual stream
are split by input columns (`row_split`), and an MoE layer routes each rank's own tokens
(`routes_own_tokens`). With sequence parallelism the residual stream is a DTensor sharded on the
sequence (dim 1) between them (`residual_layout`), and the norms are `SequenceParallel`.

Gathering once per attention or FFN, rather than letting each projection gather its own input,
matters for the backward: the projections' input gradients then add up as partial sums, and
one reduce-scatter (or all-reduce) per layer sums them, not one per projection.
"""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    PrepareModuleInput,
    PrepareModuleInputOutput,
    RowwiseParallel,
)
from torch.distributed.tensor.placement_types import Placement

__all__ = ["gathered_input", "residual_layout", "routes_own_tokens", "row_split"]


def residual_layout(sequence_parallel: bool) -> Placement:
    """The residual stream between the projections: sharded on the sequence, or whole."""
    return Shard(1) if sequence_parallel else Replicate()


def gathered_input(sequence_parallel: bool, other_args: int = 0) -> PrepareModuleInput:
    """For attention or a dense FFN: its first argument (the residual stream, normed) as one
    replicated DTensor; `other_args` positional arguments after it pass unchanged."""
    passed = (None,) * other_args
    return PrepareModuleInput(
        input_layouts=(residual_layout(sequence_parallel), *passed),
        desired_input_layouts=(Replicate(), *passed),
    )


def row_split(sequence_parallel: bool) -> RowwiseParallel:
    """A projection back to the residual stream, split by input columns: its partial outputs
    are reduce-scattered onto the sequence (a DTensor), or all-reduced (a plain tensor)."""
    return RowwiseParallel(
        output_layouts=residual_layout(sequence_parallel), use_local_output=not sequence_parallel
    )


def routes_own_tokens() -> PrepareModuleInputOutput:
    """An MoE layer under sequence parallelism (expert-TP 1): it takes and returns a rank's own
    tokens as plain tensors, so routing, dispatch and the experts see no DTensor; expert
    parallelism and FSDP2 make the experts and router data parallel over the ranks that hold
    tokens, tp included."""
    return PrepareModuleInputOutput(
        input_layouts=(Shard(1),),
        desired_input_layouts=(Shard(1),),
        use_local_input=True,
        output_layouts=(Shard(1),),
        desired_output_layouts=(Shard(1),),
        use_local_output=False,
    )
