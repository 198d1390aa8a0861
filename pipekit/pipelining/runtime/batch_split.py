"""The two-level split of a batch: microbatches along rows, slices along the sequence.

Slices are equal unless `slice_bounds` says where they start and end (equal-cost slicing,
`pipekit.pipelining.schedules.slice_bounds`).

A batch is a TensorDict with batch dims `[B, S]` (tokens, labels, positions, document ids), so
one indexing expression cuts every field consistently: slice j of microbatch i keeps its own
positions (RoPE) and document ids (masks against the cached slices).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from tensordict import TensorDict

__all__ = ["split_into_units"]


def split_into_units(
    batch: TensorDict,
    num_microbatches: int,
    num_slices: int,
    slice_bounds: Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> list[TensorDict]:
    """Units in `unit_index` order: slice 0..n-1 of microbatch 0, then of microbatch 1, ...;
    `slice_bounds`: the n + 1 token offsets of the slices (default: n equal slices), or one
    such tuple per microbatch (slices cut by each microbatch's own documents)."""
    if len(batch.batch_size) != 2:
        raise ValueError(f"expected a batch with dims [batch, sequence], got {batch.batch_size}")
    rows, length = batch.batch_size
    if rows % num_microbatches:
        raise ValueError(
            f"the local batch of {rows} sequences does not split into microbatches="
            f"{num_microbatches}; make the local batch a multiple of microbatches"
        )
    if slice_bounds is None:
        if length % num_slices:
            raise ValueError(
                f"sequence length {length} does not split into num_slices={num_slices} equal "
                "slices; make seq_len a multiple of num_slices"
            )
        slice_bounds = range(0, length + 1, length // num_slices)
    per_microbatch = [
        tuple(bounds)
        for bounds in (
            slice_bounds if _is_nested(slice_bounds) else [slice_bounds] * num_microbatches
        )
    ]
    if len(per_microbatch) != num_microbatches:
        raise ValueError(
            f"{len(per_microbatch)} sets of slice bounds for microbatches={num_microbatches}; "
            "give one per microbatch"
        )
    for bounds in per_microbatch:
        if len(bounds) != num_slices + 1 or bounds[0] != 0 or bounds[-1] != length:
            raise ValueError(
                f"slice_bounds={bounds} do not cut a {length}-token sequence into "
                f"num_slices={num_slices} slices; give {num_slices + 1} offsets from 0 to {length}"
            )
    mb_rows = rows // num_microbatches
    return [
        batch[microbatch * mb_rows : (microbatch + 1) * mb_rows, start:end]
        for microbatch, bounds in enumerate(per_microbatch)
        for start, end in itertools.pairwise(bounds)
    ]


def _is_nested(bounds: Sequence[int] | Sequence[Sequence[int]]) -> bool:
    """Whether `bounds` holds one tuple of offsets per microbatch."""
    return len(bounds) > 0 and not isinstance(bounds[0], int)
