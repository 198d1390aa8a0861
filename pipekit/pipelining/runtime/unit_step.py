"""One pipeline step over units (microbatch x slice): the part of a step that the runner and
the public schedules' torch-style `step()` share.

torch's `step()` splits its inputs along the batch only, so pipekit cuts a batch into units
itself (`split_into_units`) and drives the schedule's `_step_microbatches` with one entry per
unit (`run_units`), around the features' step hooks. Each unit's loss is its token-sum
cross-entropy over the batch's label-token count, so the units' losses add up to the batch's
loss with no gradient scaling, and MoE auxiliary losses count once per microbatch (weight
1/microbatches).

Legend: B batch, S sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

from pipekit.moe.aux_loss import aux_loss_scale, current_aux_loss_scale
from pipekit.pipelining._torch_runtime import PipelineSchedule, run_units
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.runtime.stage import SlicedPipelineStage

__all__ = ["run_unit_step"]


def run_unit_step(
    schedule: PipelineSchedule,
    stages: Sequence[SlicedPipelineStage],
    extensions: Sequence[PipelineExtension],
    units: list[TensorDict],
    num_label_tokens: Tensor | float,
    num_microbatches: int,
) -> list[Tensor]:
    """Forward and backward of `units` (each with tokens, labels, positions and optionally
    document_ids, `[rows, slice]`) on this rank's `stages`; the units' losses on the rank with
    the last stage (detached), else an empty list. Gradients accumulate into `.grad`."""
    if not torch.is_grad_enabled():
        raise RuntimeError("a pipeline step needs gradients; do not call it in no_grad")
    has_first = any(stage.is_first for stage in stages)
    has_last = any(stage.is_last for stage in stages)
    for stage in stages:
        stage.has_backward = True
        stage.clear_runtime_states()
    arg_units = [(unit["tokens"],) if has_first else () for unit in units]
    for extension in extensions:
        arg_units = extension.begin_step(units, num_label_tokens) or arg_units
    kwarg_units = [_stage_kwargs(unit) for unit in units]
    targets = [unit["labels"] for unit in units] if has_last else None
    losses: list[Tensor] = []
    with aux_loss_scale(current_aux_loss_scale() / num_microbatches):
        run_units(
            schedule, arg_units, kwarg_units, targets, losses, {"normaliser": num_label_tokens}
        )
    for extension in extensions:
        extension.end_step()
    for stage in stages:
        stage.clear_runtime_states()
    # Detached: the losses' graphs reach the KV cache, which must not outlive the step.
    return [loss.detach() for loss in losses] if has_last else []


def _stage_kwargs(unit: TensorDict) -> dict[str, Tensor]:
    kwargs = {"positions": unit["positions"]}
    if "document_ids" in unit:
        kwargs["document_ids"] = unit["document_ids"]
    return kwargs
