"""The one way pipekit runs an action list: torch's runtime, with units as its microbatches.

`SlicedPipelineSchedule` (lists from SlimPipe's rule) and `UserPipelineSchedule` (lists a user
wrote) differ only in where the lists come from. Both hand torch's `_PipelineScheduleRuntime` the
compute-only lists; its lowering adds the sends and receives, FSDP unshard/reshard and gradient
reduction. Losses are normalised by the global label-token count, so no gradient scaling.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from torch import Tensor

from pipekit.pipelining._torch_runtime import Action, PipelineScheduleRuntime
from pipekit.pipelining.stage import SlicedPipelineStage, check_stage_slices
from pipekit.train.loss import token_sum_cross_entropy

__all__ = ["ActionListSchedule", "LossFn"]

LossFn = Callable[..., Tensor]
"""`loss_fn(output, target, normaliser=...)`: the unit's token-sum loss over `normaliser`."""


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
    ) -> None:
        check_stage_slices(stages, num_slices)
        actions = {rank: list(actions_by_rank[rank]) for rank in sorted(actions_by_rank)}
        super().__init__(
            list(stages), num_microbatches * num_slices, loss_fn=loss_fn, scale_grads=False
        )
        self.num_microbatches, self.num_slices = num_microbatches, num_slices
        self.pipeline_order = dict(actions)
        self._prepare_schedule_with_comms(actions)
