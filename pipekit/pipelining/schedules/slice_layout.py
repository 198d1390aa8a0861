"""`SliceLayout`: how a pipeline cuts every sequence into slices, held once.

The plan, the runner's layouts and the features that depend on slices (context parallelism,
context exchange) read one value instead of keeping their own count: the bounds of the
slices in the whole sequence, the context-parallel ranks sharing each slice, and how the
bounds were cut.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

__all__ = ["SliceLayout"]


@dataclass(frozen=True)
class SliceLayout:
    """`bounds`: token offsets, from 0 to the sequence length, where the slices of a whole
    sequence start and end (before context parallelism splits each slice over
    `context_parallel` ranks); `slicing`: how they were cut (`slice_bounds.SLICINGS`)."""

    bounds: tuple[int, ...]
    context_parallel: int = 1
    slicing: str = "equal_length"

    def __post_init__(self) -> None:
        steps = list(itertools.pairwise(self.bounds))
        if len(self.bounds) < 2 or self.bounds[0] != 0 or any(end <= start for start, end in steps):
            raise ValueError(
                f"slice bounds {self.bounds} must rise from 0 to the sequence length, one "
                "slice at least"
            )
        uneven = [end - start for start, end in steps if (end - start) % self.context_parallel]
        if uneven:
            raise ValueError(
                f"slices of {uneven} tokens do not split over context_parallel="
                f"{self.context_parallel} ranks; choose bounds that are multiples of it"
            )

    @property
    def num_slices(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of one sequence in each slice, per context-parallel rank."""
        return tuple(
            (end - start) // self.context_parallel for start, end in itertools.pairwise(self.bounds)
        )

    @property
    def rank_bounds(self) -> tuple[int, ...]:
        """Token offsets of the slices in the sequence one context-parallel rank holds (its
        share of every slice, in slice order): what the runner cuts."""
        return tuple(itertools.accumulate(self.lengths, initial=0))

    @property
    def fractions(self) -> tuple[float, ...]:
        """`bounds` as fractions of the sequence (for `CostModel.slice_bounds`)."""
        return tuple(bound / self.bounds[-1] for bound in self.bounds)

    @property
    def longest(self) -> int:
        """Tokens of one sequence in the longest slice, per context-parallel rank."""
        return max(self.lengths)

    @property
    def label(self) -> str:
        """The layout in a few words, for logs."""
        return f"num_slices={self.num_slices} {self.slicing}"
