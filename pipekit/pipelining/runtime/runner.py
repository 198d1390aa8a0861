"""`PipelineRunner`: one rank's stages and schedule, and the step that feeds them a batch.

`make_schedule` turns a schedule-registry entry into the object torch's runtime runs: the
entry's action lists through `ActionListSchedule` (SlimPipe's, a user's, or torch's lists when a
feature needs pipekit's runtime), or torch's own class for a featureless torch schedule (the
baseline, exactly as torch runs it). `PipelineRunner.step` performs the two-level split itself
(torch's `step()` can only split along the batch) and drives `_step_microbatches` with one entry
per unit. The loss of each unit is its token-sum cross-entropy over the global label-token
count, so the units' losses add up to the unsliced loss and no gradient scaling is needed
(`scale_grads=False`). MoE auxiliary losses are functions of the whole microbatch's statistics
(each stage runs a microbatch's slices in one sequence scope), so each counts once per
microbatch: they are scaled by 1/microbatches, and a sliced step equals the unsliced one.

Legend: B batch, S sequence.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor, nn

from pipekit.checkpoint.local_shards import RowShard
from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.pipelining._torch_runtime import (
    PipelineSchedule,
    get_schedule_class,
    is_single_stage_schedule,
)
from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.action_runtime import (
    ActionListSchedule,
    SlicedPipelineSchedule,
    UserPipelineSchedule,
)
from pipekit.pipelining.runtime.batch_split import split_into_units
from pipekit.pipelining.runtime.extension import LossFn, PipelineExtension
from pipekit.pipelining.runtime.measured_choice import MeasuredChoice
from pipekit.pipelining.runtime.stage import SlicedPipelineStage
from pipekit.pipelining.runtime.unit_step import run_unit_step
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.slice_layout import SliceLayout

__all__ = ["PipelineRunner", "RunnerLayout", "make_schedule"]


def make_schedule(
    schedule_name: str,
    stages: Sequence[SlicedPipelineStage],
    num_microbatches: int,
    num_slices: int = 1,
    loss_fn: LossFn = token_sum_cross_entropy,
    *,
    actions_by_rank: Mapping[int, Sequence[Action | None]] | None = None,
    extensions: Sequence[PipelineExtension] = (),
) -> PipelineSchedule:
    """The runnable schedule `schedule_name` (a registry entry) over this rank's stages, built
    for `num_slices`. A "user" schedule takes every rank's compute-only `actions_by_rank`."""
    entry = get_schedule(schedule_name)
    if (entry.actions is None) != (actions_by_rank is not None):
        raise ValueError(
            f"pass actions_by_rank exactly for a schedule given by its lists ({schedule_name!r})"
        )
    shape = ScheduleShape(stages[0].group_size, num_microbatches, num_slices, len(stages))
    entry.check(shape, sliced_only=[ext.name for ext in extensions if ext.sliced_only])
    if actions_by_rank is not None:
        return UserPipelineSchedule(
            stages, actions_by_rank, num_microbatches, num_slices, loss_fn, extensions
        )
    if entry.name == "sliced":  # the public class, the one users build by hand
        return SlicedPipelineSchedule(stages, num_microbatches, num_slices, loss_fn, extensions)
    if entry.torch_class is not None and not extensions:
        schedule_class = get_schedule_class(entry.torch_class)
        if is_single_stage_schedule(schedule_class):
            return schedule_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
        return schedule_class(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)
    assert entry.actions is not None
    return ActionListSchedule(
        stages, entry.actions(shape), num_microbatches, num_slices, loss_fn, extensions
    )


@dataclass
class RunnerLayout:
    """One slice layout of a rank's pipeline: stages over the rank's modules, and a schedule."""

    schedule: PipelineSchedule
    stages: list[SlicedPipelineStage]
    slices: SliceLayout


@dataclass
class PipelineRunner:
    """One rank's share of a pipeline: its stages, the schedule, and how batches are cut
    (`layout`, the one the last step ran)."""

    layout: RunnerLayout
    num_microbatches: int
    extensions: list[PipelineExtension] = field(default_factory=list)
    """The pipeline's features (vocabulary parallelism, context exchange, ...)."""
    model: nn.Module | None = None
    """This rank's model: every module of its stages (and vocabulary shards) under the whole
    model's names, for the optimizer, checkpoints and gradient clipping."""
    layouts: list[RunnerLayout] = field(default_factory=list)
    """Slice layouts a measured choice times (`num_slices` or `slicing = "auto"`), over the
    same modules (`layout` is one of them). From the step after the choice, only the chosen
    one is kept."""
    layout_choice: MeasuredChoice[int] | None = None
    """Which of `layouts` runs each step, and what it chose (None: one layout planned)."""

    @property
    def schedule(self) -> PipelineSchedule:
        return self.layout.schedule

    @schedule.setter
    def schedule(self, schedule: PipelineSchedule) -> None:
        """Replace the current layout's schedule (an ablation's, say)."""
        self.layout.schedule = schedule

    @property
    def stages(self) -> list[SlicedPipelineStage]:
        return self.layout.stages

    @property
    def num_slices(self) -> int:
        return self.layout.slices.num_slices

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank feeds token ids in (holds stage 0)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss (holds the last stage)."""
        return any(stage.is_last for stage in self.stages)

    def extension(self, name: str) -> PipelineExtension | None:
        """The feature named `name`, if the pipeline has it."""
        return next((ext for ext in self.extensions if ext.name == name), None)

    def row_sharded_parameters(self) -> dict[str, RowShard]:
        """Parameters this rank holds only some rows of (for checkpoints and export)."""
        rows: dict[str, RowShard] = {}
        for extension in self.extensions:
            rows |= extension.row_sharded_parameters()
        return rows

    def row_shard_dims(self) -> tuple[str, ...]:
        """The mesh dims the rows of `row_sharded_parameters` are split over (the pipeline
        ranks when no extension splits rows)."""
        dims = [ext.row_shard_dims() for ext in self.extensions if ext.row_sharded_parameters()]
        return dims[0] if dims else ("pp",)

    def duplicate_parameters(self) -> list[nn.Parameter]:
        """Copies of parameters counted elsewhere (tied weights): gradient norms skip them."""
        return [param for ext in self.extensions for param in ext.duplicate_parameters()]

    def tensor_split_parameters(self) -> tuple[list[nn.Parameter], dist.ProcessGroup] | None:
        """Plain parameters split over the tp ranks (vocabulary rows), and that group: gradient
        norms add them over it."""
        splits = [split for ext in self.extensions if (split := ext.tensor_split_parameters())]
        if len(splits) > 1:
            raise RuntimeError("two pipeline features split plain parameters over tp")
        return splits[0] if splits else None

    def _microbatch_bounds(self, batch: TensorDict) -> list[tuple[int, ...]]:
        """Each microbatch's slices cut by its own documents (every rank computes the same
        from the same batch; under context parallelism the deal made them, `cp_slice`), told
        to the stages before they run; returns them as this rank's token offsets."""
        slices = self.layout.slices
        cp = slices.context_parallel
        if cp > 1:
            if batch.get("cp_slice", None) is None:
                raise ValueError(
                    "slices cut per microbatch under context parallelism come with the batch "
                    "(cp_slice); shard it with ContextParallelRanks given the plan's slice_cut"
                )
            counts = [
                torch.bincount(part[0], minlength=slices.num_slices).tolist()
                for part in batch["cp_slice"].tensor_split(self.num_microbatches)
            ]
            local = [tuple(itertools.accumulate(each, initial=0)) for each in counts]
            whole = [tuple(bound * cp for bound in each) for each in local]
        else:
            document_ids_BS = batch.get("document_ids", None)
            parts = (
                [None] * self.num_microbatches
                if document_ids_BS is None
                else document_ids_BS.tensor_split(self.num_microbatches)
            )  # uneven rows are refused by `split_into_units`, before any stage runs
            whole = local = [slices.microbatch_bounds(part) for part in parts]
        for stage in self.stages:
            stage.use_microbatch_bounds(whole)
        return local

    def step(self, batch: TensorDict, num_label_tokens: Tensor | float) -> Tensor | None:
        """Forward and backward of the whole batch `[B, S]` (tokens, labels, positions,
        document_ids); returns the loss (sum over units) on the rank with the last stage, else
        None. Gradients accumulate into the stage modules' `.grad`; MoE auxiliary losses count
        once per microbatch, with weight 1/microbatches (times any enclosing
        `aux_loss_scale`)."""
        choice = self.layout_choice
        timing = choice if choice is not None and choice.chosen_index is None else None
        if choice is not None and len(self.layouts) > 1:
            self._use_layout(choice.current_index)
            if timing is None:  # chosen: the other layouts' buffers go
                self.layouts = [self.layouts[choice.current_index]]
        if timing is not None:
            timing.begin_step()
        slices = self.layout.slices
        bounds = slices.rank_bounds
        if slices.per_microbatch:
            bounds = self._microbatch_bounds(batch)
        units = split_into_units(batch, self.num_microbatches, slices.num_slices, bounds)
        losses = run_unit_step(
            self.schedule,
            self.stages,
            self.extensions,
            units,
            num_label_tokens,
            self.num_microbatches,
        )
        if timing is not None:
            timing.end_step()
        return torch.stack(losses).sum() if self.has_last_stage else None

    def _use_layout(self, index: int) -> None:
        self.layout = self.layouts[index]
