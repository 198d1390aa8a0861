"""The two-level split of a batch: microbatches along rows, slices along the sequence.

A batch is a TensorDict with batch dims `[B, S]` (tokens, labels, positions, document ids), so
one indexing expression cuts every field consistently: slice j of microbatch i keeps its own
positions (RoPE) and document ids (masks against the cached slices).
"""

from __future__ import annotations

from tensordict import TensorDict

__all__ = ["split_into_units"]


def split_into_units(batch: TensorDict, num_microbatches: int, num_slices: int) -> list[TensorDict]:
    """Units in `unit_index` order: slice 0..n-1 of microbatch 0, then of microbatch 1, ..."""
    if len(batch.batch_size) != 2:
        raise ValueError(f"expected a batch with dims [batch, sequence], got {batch.batch_size}")
    rows, length = batch.batch_size
    if rows % num_microbatches:
        raise ValueError(
            f"the local batch of {rows} sequences does not split into microbatches="
            f"{num_microbatches}; make the local batch a multiple of microbatches"
        )
    if length % num_slices:
        raise ValueError(
            f"sequence length {length} does not split into num_slices={num_slices} equal slices; "
            "make seq_len a multiple of num_slices"
        )
    mb_rows, slice_length = rows // num_microbatches, length // num_slices
    return [
        batch[
            microbatch * mb_rows : (microbatch + 1) * mb_rows,
            slice_index * slice_length : (slice_index + 1) * slice_length,
        ]
        for microbatch in range(num_microbatches)
        for slice_index in range(num_slices)
    ]
