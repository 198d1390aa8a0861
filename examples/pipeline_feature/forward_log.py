"""A pipeline feature written outside pipekit: every rank logs the forwards it runs.

It uses the seams a feature of your own has: a `PipelineExtension` (runtime hooks), one entry
in the feature table with a rule, a part of the plan and a build, and an action type of its
own that the schedule runs. Turn it on with

    [parallelism]
    pipeline_features = ["forward_log"]

in a job whose `[model] module` imports this module (or import it before planning).

At planning it lists, per rank, the (stage, unit) forwards the schedule places there; at run
time it records the forwards the rank really ran, and its `CLOSE` action, placed after the
rank's last compute action, checks that every planned forward ran exactly once this step.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from enum import Enum

from pipekit.attention.context import AttentionContext
from pipekit.pipelining import (
    FORWARD,
    Action,
    FeatureBuilding,
    FeaturePlanning,
    PipelineExtension,
    PipelineFeature,
    register_pipeline_feature,
)

__all__ = ["ForwardLog"]

Forwards = dict[int, list[tuple[int, int]]]
"""Per pipeline rank, its forwards as (stage, unit), in schedule order."""


class LogComputation(str, Enum):
    """The feature's own action type, beside torch's computation types."""

    CLOSE = "CLOSE"


def planned_forwards(actions_by_rank: Mapping[int, Sequence[Action | None]]) -> Forwards:
    """The forwards each rank's compute-only list runs."""
    return {
        rank: [
            (action.stage_index, action.microbatch_index or 0)
            for action in actions
            if action is not None and action.computation_type == FORWARD
        ]
        for rank, actions in actions_by_rank.items()
    }


class ForwardLog(PipelineExtension):
    """Records this rank's forwards and checks them against the plan at each step's end."""

    name = "forward_log"
    action_types = (LogComputation.CLOSE,)
    sliced_only = True  # it logs slices' passes

    def __init__(self, planned: list[tuple[int, int]]) -> None:
        self.planned = planned
        self.ran: list[tuple[int, int]] = []
        self.closed_steps = 0

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        self.ran.append((stage_index, unit))

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """`CLOSE` after every rank's last compute action."""
        return {
            rank: [(len(actions) - 1, Action(0, LogComputation.CLOSE, None))]
            for rank, actions in actions_by_rank.items()
            if actions
        }

    def run_action(self, action: Action, context: object) -> None:
        if sorted(self.ran) != sorted(self.planned) or len(set(self.ran)) != len(self.ran):
            raise RuntimeError(f"forward_log: ran {self.ran}, planned {self.planned}")
        self.closed_steps += 1
        self.ran = []


def _check(planning: FeaturePlanning) -> None:
    if planning.num_slices < 2:
        raise ValueError(
            f"forward_log logs slices: num_slices >= 2, not {planning.num_slices}; set "
            "num_slices or drop forward_log from pipeline_features"
        )


def _plan(planning: FeaturePlanning) -> Forwards:
    return planned_forwards(planning.actions_by_rank)


def _build(building: FeatureBuilding) -> ForwardLog:
    return ForwardLog(building.feature_plan[building.pipeline_rank])


register_pipeline_feature(
    PipelineFeature("forward_log", ForwardLog, _build, check=_check, plan=_plan),
    replace=True,  # importing the module twice (tests, reloads) registers the same feature
)
