"""Pipeline-aware activation offload: the schedule says which units' backward is far away.

Under 1F1B-like schedules the first ranks hold the most units at their peak (p - rank
microbatches under 1F1B, n + 2(p - 1 - rank) slices under SlimPipe's), although only the
unit whose backward is next needs its activations. This feature moves part of each unit's
saved activations off the device after its forward and brings them back one action ahead of
its backward, on the ranks and at the ratios `offload_plan` decides (the plan's `RELOAD`
actions sit in the schedule's lists like any other: `schedule.pipeline_order`). Losses and
gradients are bit-for-bit those of the run without offload: the bytes come back unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager

from pipekit.attention.context import AttentionContext
from pipekit.memory.offload import ActivationOffloader
from pipekit.memory.offload_store import OffloadStore
from pipekit.pipelining.actions import Action
from pipekit.pipelining.features.offload_plan import RELOAD, RankOffload, plan_rank_offload
from pipekit.pipelining.runtime.extension import PipelineExtension

__all__ = ["PipelineActivationOffload"]


class PipelineActivationOffload(PipelineExtension):
    """Offloads this rank's far-from-backward units at its ratio into `store`."""

    name = "activation_offload"
    action_types = (RELOAD,)

    def __init__(self, rank: int, ratios: Sequence[float], store: OffloadStore) -> None:
        self.rank, self.ratios = rank, tuple(ratios)
        self.offloader = ActivationOffloader(store)
        self.plans: dict[int, RankOffload] = {}
        self._saving: set[tuple[int, int]] = set()

    def prepare(self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int) -> None:
        """Every rank's offloaded units and reloads (the other ranks' for their lists)."""
        if len(self.ratios) != len(actions_by_rank):
            raise ValueError(
                f"activation offload has {len(self.ratios)} ratios for {len(actions_by_rank)} "
                "pipeline ranks; give one per rank"
            )
        self.plans = {
            rank: plan_rank_offload(actions, self.ratios[rank])
            for rank, actions in actions_by_rank.items()
        }

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """The reloads, one action ahead of each offloaded unit's backward."""
        return {rank: list(plan.reloads) for rank, plan in self.plans.items()}

    def forward_scope(
        self, stage_index: int, unit: int, training: bool
    ) -> AbstractContextManager[None]:
        """A training forward saves through the offloader's hooks."""
        if not training:
            return contextlib.nullcontext()
        self._saving.add((stage_index, unit))
        return self.offloader.saving((stage_index, unit))

    def after_forward(self, stage_index: int, unit: int, context: AttentionContext) -> None:
        """Offload the unit if the plan says its backward is far away; else let it be."""
        key = (stage_index, unit)
        if key not in self._saving:
            return
        self._saving.discard(key)
        if key in self.plans[self.rank].offloaded:
            self.offloader.offload(key, self.ratios[self.rank])
        else:
            self.offloader.discard(key)

    def run_action(self, action: Action, context: object) -> None:
        """A `RELOAD`: bring the unit's activations back before its backward."""
        self.offloader.reload((action.stage_index, action.microbatch_index))

    def end_step(self) -> None:
        self.offloader.clear()
        self._saving.clear()
