"""The vocabulary of pipeline schedules: an `Action` (`stage_index`, `computation_type`,
`microbatch_index`) and its computation types, with torch's check of a set of compute lists.

These are torch's own types, so pipekit's action lists run on torch's runtime unchanged; this is
their public home (schedules, features, tools and users import them here), while the private
torch names they come from stay behind `pipelining._torch_runtime`.
"""

from __future__ import annotations

from pipekit.pipelining._torch_runtime import (
    BACKWARD,
    FORWARD,
    INPUT_BACKWARD,
    WEIGHT_BACKWARD,
    Action,
    ComputationType,
    validate_actions,
)

__all__ = [
    "BACKWARD",
    "FORWARD",
    "INPUT_BACKWARD",
    "WEIGHT_BACKWARD",
    "Action",
    "ComputationType",
    "validate_actions",
]
