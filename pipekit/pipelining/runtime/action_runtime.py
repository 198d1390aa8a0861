"""The one way pipekit runs action lists: torch's runtime, with units as its microbatches.

`ActionListSchedule` hands torch's `_PipelineScheduleRuntime` every rank's compute-only lists;
its lowering adds the sends and receives, FSDP unshard/reshard and gradient reduction. The
pipeline's extensions (`runtime.extension`) see the lists first, may add actions of their own
types (placed after a given number of this rank's compute actions, once the sends before them
are posted) and wrap each stage's attention. Losses are normalised by the global label-token
count, so no gradient scaling.

`SlicedPipelineSchedule` (SlimPipe's lists) and `UserPipelineSchedule` (lists a user wrote) only
say where the lists come from.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor

from pipekit.layers.loss import count_label_tokens, token_sum_cross_entropy
from pipekit.pipelining._torch_runtime import (
    PipelineScheduleRuntime,
    lower_schedule,
    register_action_function,
)
from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.batch_split import split_into_units
from pipekit.pipelining.runtime.extension import LossFn, PipelineExtension
from pipekit.pipelining.runtime.stage import SlicedPipelineStage, check_stage_slices
from pipekit.pipelining.runtime.unit_step import run_unit_step
from pipekit.pipelining.schedules.check import ScheduleError
from pipekit.pipelining.schedules.sliced import sliced_pipeline_actions

__all__ = ["ActionListSchedule", "SlicedPipelineSchedule", "UserPipelineSchedule"]


class ActionListSchedule(PipelineScheduleRuntime):
    """Runs given compute-only action lists (every rank's) over this rank's stages.

    torch's `n_microbatches` is the number of units, `num_microbatches * num_slices`.
    """

    def __init__(
        self,
        stages: Sequence[SlicedPipelineStage],
        actions_by_rank: Mapping[int, Sequence[Action | None]],
        num_microbatches: int,
        num_slices: int = 1,
        loss_fn: LossFn = token_sum_cross_entropy,
        extensions: Sequence[PipelineExtension] = (),
    ) -> None:
        check_stage_slices(stages, num_slices)
        actions = {
            rank: [action for action in actions_by_rank[rank] if action is not None]
            for rank in sorted(actions_by_rank)
        }
        stage_groups = {id(stage.group or dist.group.WORLD) for stage in stages}
        for extension in extensions:
            if extension.group is not None and id(extension.group) in stage_groups:
                raise ValueError(
                    f"give {extension.name} a process group of its own (e.g. dist.new_group over "
                    "the pipeline ranks): its messages must not queue behind the stages' sends "
                    "(an NCCL send blocks until received)"
                )
            extension.prepare(actions, num_slices)
            loss_fn = extension.loss_fn(loss_fn)
        for stage in stages:
            stage.extensions = tuple(extensions)
        super().__init__(
            list(stages), num_microbatches * num_slices, loss_fn=loss_fn, scale_grads=False
        )
        self.num_microbatches, self.num_slices = num_microbatches, num_slices
        self.sliced_stages, self.extensions = list(stages), list(extensions)
        extra: dict[int, list[tuple[int, Action]]] = {rank: [] for rank in actions}
        for extension in extensions:
            for rank, placed in extension.extra_actions(actions, num_slices).items():
                extra[rank] += placed
            for action_type in extension.action_types:
                register_action_function(self, action_type, extension.run_action)
        ordered = {  # stable: list order kept
            rank: sorted(placed, key=lambda entry: entry[0]) for rank, placed in extra.items()
        }
        lower_schedule(self, actions, ordered)
        self.pipeline_order = {
            rank: _merged(compute, ordered[rank]) for rank, compute in actions.items()
        }

    def step(
        self,
        *args: Tensor,
        target: Tensor | None = None,
        losses: list[Tensor] | None = None,
        **kwargs: Tensor,
    ) -> None:
        """One training step in torch's calling convention, over the whole local batch: token
        ids `[B, S]` as the argument on the rank with the first stage (nothing elsewhere),
        `positions=` (and `document_ids=` for packed documents) `[B, S]` on every rank,
        `target=` labels `[B, S]` on the rank with the last stage. The schedule cuts the batch
        into microbatches x slices itself (torch's `step()` splits the batch dim only); each
        unit's loss, over the batch's label-token count, is appended to `losses` on the last
        stage's rank, so they sum to the batch's mean token loss. Gradients accumulate."""
        if "positions" not in kwargs:
            raise ValueError("step(...) needs positions= [B, S] on every rank")
        fields = dict(kwargs)
        if args:
            fields["tokens"] = args[0]
        if target is not None:
            fields["labels"] = target
        batch = TensorDict(fields, batch_size=kwargs["positions"].shape[:2])
        units = split_into_units(batch, self.num_microbatches, self.num_slices)
        normaliser = count_label_tokens(target) if target is not None else 1.0
        unit_losses = run_unit_step(
            self, self.sliced_stages, self.extensions, units, normaliser, self.num_microbatches
        )
        if losses is not None:
            losses.extend(unit_losses)


def _merged(compute: Sequence[Action], extra: Sequence[tuple[int, Action]]) -> list[Action]:
    """`compute` with each `(k, action)` of `extra` after its k-th action."""
    merged: list[Action] = []
    pending = list(extra)
    for done, action in enumerate(compute):
        while pending and pending[0][0] == done:
            merged.append(pending.pop(0)[1])
        merged.append(action)
    return merged + [action for _, action in pending]


class SlicedPipelineSchedule(ActionListSchedule):
    """SlimPipe's sliced 1F1B (interleaved when a rank holds several stages): each sequence of
    a microbatch is cut into `num_slices` slices, which run 1F1B with their backward in
    reverse order over the stages' chunked KV caches. Built like torch's schedules, from this
    rank's stages (`SlicedPipelineStage`), and run with torch's `step()` convention; it is the
    class `build_pipeline` builds for `pipeline_schedule = "sliced"`."""

    def __init__(
        self,
        stages: Sequence[SlicedPipelineStage],
        n_microbatches: int,
        num_slices: int,
        loss_fn: LossFn = token_sum_cross_entropy,
        extensions: Sequence[PipelineExtension] = (),
    ) -> None:
        num_ranks = stages[0].group_size
        actions = sliced_pipeline_actions(num_ranks, n_microbatches, num_slices, len(stages))
        super().__init__(stages, actions, n_microbatches, num_slices, loss_fn, extensions)


class UserPipelineSchedule(ActionListSchedule):
    """Runs user action lists (all ranks') with torch's runtime; this rank's stages must be those
    the lists place on it. Check the lists first (`plan_pipeline` does, or
    `schedules.check.check_schedule`): unchecked lists can deadlock or fail mid-step."""

    def __init__(
        self,
        stages: Sequence[SlicedPipelineStage],
        actions_by_rank: Mapping[int, Sequence[Action | None]],
        num_microbatches: int,
        num_slices: int = 1,
        loss_fn: LossFn = token_sum_cross_entropy,
        extensions: Sequence[PipelineExtension] = (),
    ) -> None:
        rank, num_ranks = stages[0].group_rank, stages[0].group_size
        if len(actions_by_rank) != num_ranks:
            raise ScheduleError(
                f"the schedule has lists for {len(actions_by_rank)} ranks, the pipeline group "
                f"has {num_ranks} ranks"
            )
        held = sorted(stage.stage_index for stage in stages)
        placed = sorted({a.stage_index for a in actions_by_rank[rank] if a is not None})
        if held != placed:
            raise ScheduleError(
                f"rank {rank} holds stages {held} but the schedule runs stages {placed} on it; "
                f"build this rank's stages with stage_indices={placed}"
            )
        super().__init__(stages, actions_by_rank, num_microbatches, num_slices, loss_fn, extensions)
