"""Units: the runtime's "microbatch" index of one slice of one microbatch.

torch's pipelining runtime knows only microbatch indices. pipekit numbers slice j of
microbatch i as unit `i * num_slices + j`, so the runtime runs units without knowing about
slices, and every schedule, stage and tool converts with the two functions here.
"""

from __future__ import annotations

__all__ = ["unit_index", "unit_microbatch_and_slice"]


def unit_index(microbatch: int, slice_index: int, num_slices: int) -> int:
    """The runtime's "microbatch" index of slice `slice_index` of microbatch `microbatch`."""
    return microbatch * num_slices + slice_index


def unit_microbatch_and_slice(unit: int, num_slices: int) -> tuple[int, int]:
    """Inverse of `unit_index`."""
    return divmod(unit, num_slices)
