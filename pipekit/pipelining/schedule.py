"""`SlicedPipelineSchedule`, torch's schedules as baselines, and one step function for both.

The sliced schedule is torch's `_PipelineScheduleRuntime` fed with SlimPipe's action lists
(`pipekit.pipelining.actions`); the runtime lowers them to sends and receives, adds FSDP
unshard/reshard and gradient-reduction actions, and runs them. `PipelineRunner.step` performs the
two-level split itself (torch's `step()` can only split along the batch) and drives
`_step_microbatches` with one entry per unit. The loss of each unit is its token-sum
cross-entropy over the global label-token count, so the units' losses add up to the unsliced
mean and no gradient scaling is needed (`scale_grads=False`).

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from tensordict import TensorDict
from torch import Tensor

from pipekit.pipelining._torch_runtime import (
    Action,
    PipelineSchedule,
    get_schedule_class,
    run_units,
)
from pipekit.pipelining.action_schedule import ActionListSchedule, LossFn
from pipekit.pipelining.actions import sliced_pipeline_actions
from pipekit.pipelining.context_exchange import PipelineContextExchange
from pipekit.pipelining.split import split_into_units
from pipekit.pipelining.stage import SlicedPipelineStage
from pipekit.pipelining.torch_actions import (
    SINGLE_STAGE_SCHEDULES,
    TORCH_SCHEDULES,
    V_SHAPED_SCHEDULES,
    torch_schedule_actions,
)
from pipekit.pipelining.user_schedule import UserPipelineSchedule
from pipekit.pipelining.vocab_parallel import PipelineVocabParallel
from pipekit.train.loss import token_sum_cross_entropy

__all__ = [
    "SINGLE_STAGE_SCHEDULES",
    "TORCH_SCHEDULES",
    "V_SHAPED_SCHEDULES",
    "PipelineRunner",
    "SlicedPipelineSchedule",
    "build_pipeline_runner",
]


class SlicedPipelineSchedule(ActionListSchedule):
    """SlimPipe's sliced 1F1B (interleaved when a rank holds several stages)."""

    def __init__(
        self,
        stages: Sequence[SlicedPipelineStage],
        num_microbatches: int,
        num_slices: int,
        loss_fn: LossFn = token_sum_cross_entropy,
        vocab: PipelineVocabParallel | None = None,
        exchange: PipelineContextExchange | None = None,
    ) -> None:
        num_ranks = stages[0].group_size
        actions = sliced_pipeline_actions(num_ranks, num_microbatches, num_slices, len(stages))
        super().__init__(stages, actions, num_microbatches, num_slices, loss_fn, vocab, exchange)


def _torch_schedule(
    name: str, stages: Sequence[SlicedPipelineStage], num_microbatches: int, loss_fn: LossFn
) -> PipelineSchedule:
    schedule_class = get_schedule_class(name)
    if name in SINGLE_STAGE_SCHEDULES:
        if len(stages) != 1:
            raise ValueError(
                f"pipeline_schedule={name!r} runs one stage per rank; set stages_per_rank=1"
            )
        return schedule_class(stages[0], num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_class(list(stages), num_microbatches, loss_fn=loss_fn, scale_grads=False)


@dataclass
class PipelineRunner:
    """One rank's share of a pipeline: its stages, the schedule, and how batches are cut."""

    schedule: PipelineSchedule
    stages: list[SlicedPipelineStage]
    num_microbatches: int
    num_slices: int
    vocab: PipelineVocabParallel | None = None
    """This rank's vocabulary shards when the pipeline is vocabulary-parallel."""

    @property
    def has_first_stage(self) -> bool:
        """Whether this rank feeds token ids in (holds stage 0)."""
        return any(stage.is_first for stage in self.stages)

    @property
    def has_last_stage(self) -> bool:
        """Whether this rank computes the loss (holds the last stage)."""
        return any(stage.is_last for stage in self.stages)

    def step(self, batch: TensorDict, num_label_tokens: Tensor | float) -> Tensor | None:
        """Forward and backward of the whole batch `[B, S]` (tokens, labels, positions,
        document_ids); returns the loss (sum over units) on the rank with the last stage, else
        None. Gradients accumulate into the stage modules' `.grad`."""
        if not torch.is_grad_enabled():
            raise RuntimeError("PipelineRunner.step needs gradients; do not call it in no_grad")
        units = split_into_units(batch, self.num_microbatches, self.num_slices)
        for stage in self.stages:
            stage.has_backward = True
            stage.clear_runtime_states()
        if self.vocab is not None:
            stage_inputs = self.vocab.begin_step(units, num_label_tokens)
            arg_units = [(embedded,) for embedded in stage_inputs] or [() for _ in units]
        else:
            arg_units = [(unit["tokens"],) if self.has_first_stage else () for unit in units]
        kwarg_units = [_stage_kwargs(unit) for unit in units]
        targets = [unit["labels"] for unit in units] if self.has_last_stage else None
        losses: list[Tensor] = []
        run_units(
            self.schedule, arg_units, kwarg_units, targets, losses, {"normaliser": num_label_tokens}
        )
        if self.vocab is not None:
            self.vocab.end_step()
        for stage in self.stages:
            stage.clear_runtime_states()
        if not self.has_last_stage:
            return None
        # Detached: the losses' graphs reach the KV cache, which must not outlive the step.
        return torch.stack([loss.detach() for loss in losses]).sum()


def _stage_kwargs(unit: TensorDict) -> dict[str, Tensor]:
    kwargs = {"positions": unit["positions"]}
    if "document_ids" in unit:
        kwargs["document_ids"] = unit["document_ids"]
    return kwargs


def build_pipeline_runner(
    schedule_name: str,
    stages: Sequence[SlicedPipelineStage],
    num_microbatches: int,
    num_slices: int = 1,
    loss_fn: LossFn = token_sum_cross_entropy,
    *,
    actions_by_rank: Mapping[int, Sequence[Action | None]] | None = None,
    vocab: PipelineVocabParallel | None = None,
    exchange: PipelineContextExchange | None = None,
) -> PipelineRunner:
    """`"sliced"`, one of `TORCH_SCHEDULES`, or `"user"` (every rank's compute-only
    `actions_by_rank`, see `pipekit.pipelining.user_schedule`) over this rank's stages (built
    for `num_slices`). With `vocab` (stages built with `StageShapes(vocab_parallel=True)`), the
    embedding, output layer and loss are vocabulary-parallel across the pipeline ranks; torch's
    schedules then run as their action lists with the output passes placed in them. With
    `exchange`, the sliced or user schedule's passes exchange attention context
    (`pipekit.pipelining.context_exchange`)."""
    if (schedule_name == "user") != (actions_by_rank is not None):
        raise ValueError(
            "pass actions_by_rank exactly when schedule_name='user' (a user-defined schedule)"
        )
    if exchange is not None and schedule_name not in ("sliced", "user"):
        raise ValueError(
            f"context exchange needs sliced passes; pipeline_schedule={schedule_name!r} runs "
            "whole microbatches (use 'sliced' or set context_exchange = false)"
        )
    if schedule_name == "user":
        schedule: PipelineSchedule = UserPipelineSchedule(
            stages, actions_by_rank, num_microbatches, num_slices, loss_fn, vocab, exchange
        )
    elif schedule_name == "sliced":
        schedule = SlicedPipelineSchedule(
            stages, num_microbatches, num_slices, loss_fn, vocab, exchange
        )
    elif schedule_name in TORCH_SCHEDULES:
        if num_slices != 1:
            raise ValueError(
                f"num_slices={num_slices} needs pipeline_schedule='sliced'; torch's "
                f"{schedule_name!r} runs whole microbatches (set num_slices=1)"
            )
        if vocab is None:
            schedule = _torch_schedule(schedule_name, stages, num_microbatches, loss_fn)
        else:
            torch_lists = torch_schedule_actions(
                schedule_name, stages[0].group_size, num_microbatches, len(stages)
            )
            schedule = ActionListSchedule(stages, torch_lists, num_microbatches, 1, loss_fn, vocab)
    else:
        raise ValueError(
            f"pipeline_schedule={schedule_name!r} is not known; choose 'sliced', 'user' or one "
            f"of {', '.join(repr(name) for name in TORCH_SCHEDULES)}"
        )
    return PipelineRunner(schedule, list(stages), num_microbatches, num_slices, vocab)
