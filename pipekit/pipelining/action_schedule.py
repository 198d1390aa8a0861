"""The one way pipekit runs an action list: torch's runtime, with units as its microbatches.

`SlicedPipelineSchedule` (lists from SlimPipe's rule) and `UserPipelineSchedule` (lists a user
wrote) differ only in where the lists come from. Both hand torch's `_PipelineScheduleRuntime` the
compute-only lists; its lowering adds the sends and receives, FSDP unshard/reshard and gradient
reduction. Losses are normalised by the global label-token count, so no gradient scaling.

With context exchange (`exchange=`), the plan is made over all ranks' lists and the stages
wrap the attention of the units that lend or serve (`pipekit.pipelining.context_exchange`).

With vocabulary parallelism (`vocab=`), the lists also get every unit's output pass
(`pipekit.pipelining.output_passes`), run by pipekit's handler on the ranks without the last stage
and inside the last stage's loss function on its rank.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch.distributed as dist
from torch import Tensor

from pipekit.pipelining._torch_runtime import (
    Action,
    PipelineScheduleRuntime,
    insert_after_compute,
    register_action_function,
)
from pipekit.pipelining.output_passes import OUTPUT_PASS, with_output_passes
from pipekit.pipelining.stage import SlicedPipelineStage, check_stage_slices
from pipekit.train.loss import token_sum_cross_entropy

if TYPE_CHECKING:
    from pipekit.pipelining.context_exchange import PipelineContextExchange
    from pipekit.pipelining.vocab_parallel import PipelineVocabParallel

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
        vocab: PipelineVocabParallel | None = None,
        exchange: PipelineContextExchange | None = None,
    ) -> None:
        check_stage_slices(stages, num_slices)
        actions = {rank: list(actions_by_rank[rank]) for rank in sorted(actions_by_rank)}
        for name, helper in (
            ("PipelineVocabParallel", vocab),
            ("PipelineContextExchange", exchange),
        ):
            if helper is not None and any(
                helper.group is (stage.group or dist.group.WORLD) for stage in stages
            ):
                raise ValueError(
                    f"give {name} a process group of its own (e.g. dist.new_group over the "
                    "pipeline ranks): its messages must not queue behind the stages' sends (an "
                    "NCCL send blocks until received)"
                )
        if exchange is not None:
            exchange.prepare(actions, num_slices)
            for stage in stages:
                stage.context_exchange = exchange
        if vocab is not None:
            loss_fn = vocab.stage_loss
        super().__init__(
            list(stages), num_microbatches * num_slices, loss_fn=loss_fn, scale_grads=False
        )
        self.num_microbatches, self.num_slices = num_microbatches, num_slices
        if vocab is None:
            self.pipeline_order = dict(actions)
            self._prepare_schedule_with_comms(actions)
            return
        # With exchange, the passes sit at lockstep cuts: a cut then never separates a lender
        # from its server (they belong to one moment).
        placed = with_output_passes(actions, num_slices, lockstep=exchange is not None)
        self.pipeline_order = dict(placed)
        self._prepare_schedule_with_comms(
            {
                rank: [a for a in acts if a.computation_type != OUTPUT_PASS]
                for rank, acts in placed.items()
            }
        )
        for rank, acts in placed.items():
            if rank == vocab.last_rank:  # its share runs inside the last stage's loss function
                continue
            extra, computed = [], 0
            for action in acts:
                if action.computation_type == OUTPUT_PASS:
                    extra.append((computed, action))
                else:
                    computed += 1
            self.pipeline_order_with_comms[rank] = insert_after_compute(
                self.pipeline_order_with_comms[rank], extra
            )
        register_action_function(self, OUTPUT_PASS, vocab.run_output_pass)
