"""MPipeMoE: dispatch, expert compute and combine of n token partitions, overlapped.

Forward, for partitions p = 0..n-1 (S dispatch, C compute, R combine; the paper's Fig. 4b):

    S0 | wait S0, start S1, C0, start R0 | wait S1, start S2, C1, start R1, finish R0 | ...

so partition p+1's dispatch and partition p-1's combine are in flight while partition p's
experts compute; S and R alternate on the link (Fig. 7a). The backward is the same pipeline with
the gradient of the output dispatched, the expert backward, and the input gradient combined.

Memory reuse (the paper's Sec. III-D): with a sharing strategy every partition writes T_DI,
T_M and T_DO into the same buffers (two for tensors in flight, one for T_M), so they take
`B/n` rows instead of `B`. The backward then restores T_DI and T_M per `RestoreStrategy`.
"none" keeps every partition's tensors. All strategies give the same gradients. The backward
works partition by partition: its temporaries (the paper's gradient buffers) are `B/n` rows
with or without sharing, freed as each partition ends, so it allocates no shared buffers.

The expert math is `pipekit.moe.experts`', for the layer's activation: T_M holds K = 2 tensors
per row (gate and up) for a gated expert, 1 (gate) for a plain one. Expert biases, when the
experts have them, are inputs of the node like the weights: T_M holds the biased gate and up
(a recomputed T_M adds them again), and their gradients accumulate over partitions as the
weights' do.

One autograd node covers the whole layer's expert part; every tensor it keeps for backward goes
through `save_for_backward`, so saved-tensor hooks (memory tracking, activation checkpointing)
see them.

Legend: T tokens, D model dim, F expert hidden dim, A assignments, L local experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.profiler import record_function

from pipekit.moe.activations import ExpertActivation
from pipekit.moe.dispatch_plan import PartitionPlan
from pipekit.moe.experts import (
    ExpertBiases,
    ExpertGrads,
    expert_backward,
    expert_middle,
    expert_output,
)
from pipekit.moe.restore import Offloader, RestoreStrategy
from pipekit.moe.token_exchange import PendingRows, TokenExchange

__all__ = ["ExpertPipeline", "pipelined_experts"]


@dataclass(frozen=True)
class ExpertPipeline:
    """Everything about one call that is not a differentiable tensor."""

    plans: list[PartitionPlan]
    token_index_A: Tensor
    """Token of each assignment, in plan order (the plans' token indices, concatenated)."""
    exchange: TokenExchange
    strategy: RestoreStrategy
    offloader: Offloader
    activation: ExpertActivation

    def max_received_rows(self) -> int:
        return max(plan.received_rows for plan in self.plans)

    def max_sent_rows(self) -> int:
        return max(plan.token_index_A.numel() for plan in self.plans)


def pipelined_experts(
    x_TD: Tensor,
    weight_A: Tensor,
    w1_EFD: Tensor,
    w3_EFD: Tensor | None,
    w2_EDF: Tensor,
    pipeline: ExpertPipeline,
    biases: ExpertBiases | None = None,
) -> Tensor:
    """Sum over each token's assignments of weight x expert(token); `weight_A` in plan order,
    `w3_EFD` None for a plain (non-gated) activation, `biases` None for bias-free experts."""
    b1_EF, b3_EF, b2_ED = (None, None, None) if biases is None else biases
    return _PipelinedExperts.apply(
        x_TD, weight_A, w1_EFD, w3_EFD, w2_EDF, b1_EF, b3_EF, b2_ED, pipeline
    )


def _biases(
    b1_EF: Tensor | None, b3_EF: Tensor | None, b2_ED: Tensor | None
) -> ExpertBiases | None:
    """The autograd node's bias inputs as one tuple again (None: bias-free experts)."""
    return None if b1_EF is None else (b1_EF, b3_EF, b2_ED)


class _Buffers:
    """Shared partition buffers, or fresh tensors per partition when sharing is off."""

    def __init__(self, template: Tensor, rows: int, width: int, copies: int, share: bool) -> None:
        self._share = share
        self._template = template
        self._width = width
        self._buffers = [template.new_empty(rows, width) for _ in range(copies)] if share else []

    def get(self, partition: int, rows: int) -> Tensor | None:
        """Rows for `partition` (None: let the producer allocate)."""
        if not self._share:
            return None
        return self._buffers[partition % len(self._buffers)][:rows]


def _to_expert_major(received: Tensor, plan: PartitionPlan, out: Tensor | None) -> Tensor:
    if plan.to_expert_major is None:
        return received
    return torch.index_select(received, 0, plan.to_expert_major, out=out)


def _to_source_major(rows: Tensor, plan: PartitionPlan, out: Tensor | None) -> Tensor:
    if plan.to_expert_major is None:
        return rows if out is None else out.copy_(rows)
    out = torch.empty_like(rows) if out is None else out
    return out.index_copy_(0, plan.to_expert_major, rows)


def _gather(
    source: Tensor, index: Tensor, out: Tensor | None, scale: Tensor | None = None
) -> Tensor:
    rows = torch.index_select(source, 0, index, out=out)
    return rows if scale is None else rows.mul_(scale[:, None])


class _PipelinedExperts(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, x_TD, weight_A, w1_EFD, w3_EFD, w2_EDF, b1_EF, b3_EF, b2_ED, pipeline: ExpertPipeline
    ):
        plans, exchange, strategy = pipeline.plans, pipeline.exchange, pipeline.strategy
        biases = _biases(b1_EF, b3_EF, b2_ED)
        share = strategy.shares_buffers
        dim, hidden = x_TD.shape[1], w1_EFD.shape[1]
        activation, middles = pipeline.activation, pipeline.activation.middle_tensors
        received_rows, sent_rows = pipeline.max_received_rows(), pipeline.max_sent_rows()
        send_buffers = _Buffers(x_TD, sent_rows, dim, 2, share)
        receive_buffers = _Buffers(x_TD, received_rows, dim, 2, share)
        dispatched_buffer = _Buffers(x_TD, received_rows, dim, 1, share)
        middle_buffer = _Buffers(x_TD, middles * received_rows, hidden, 1, share)
        output_buffers = _Buffers(x_TD, received_rows, dim, 2, share)
        combined_AD = x_TD.new_empty(pipeline.token_index_A.numel(), dim)  # T_O

        def start_dispatch(p: int) -> PendingRows:
            plan = plans[p]
            rows = _gather(x_TD, plan.token_index_A, send_buffers.get(p, len(plan.token_index_A)))
            out = receive_buffers.get(p, plan.received_rows)
            return exchange.start(rows, plan.send_splits, plan.recv_splits, out=out)

        kept_inputs, kept_middles = [], []
        combines: list[PendingRows] = []
        dispatch = start_dispatch(0)
        for p, plan in enumerate(plans):
            with record_function(f"moe: partition {p + 1}/{len(plans)} forward"):
                received = dispatch.wait()
                pipeline.offloader.fence()  # pending host copies still read the shared buffers
                if p + 1 < len(plans):
                    dispatch = start_dispatch(p + 1)
                rows = plan.received_rows
                dispatched = _to_expert_major(received, plan, dispatched_buffer.get(p, rows))
                middle_buffer_rows = middle_buffer.get(p, middles * rows)
                middle = expert_middle(
                    dispatched,
                    w1_EFD,
                    w3_EFD,
                    plan.local_counts_L,
                    out=None
                    if middle_buffer_rows is None
                    else middle_buffer_rows.view(middles, rows, hidden),
                    biases=biases,
                )
                for restore, tensor, kept in (
                    (strategy.dispatched_input, dispatched, kept_inputs),
                    (strategy.middle, middle, kept_middles),
                ):
                    if restore == "keep":
                        kept.append(tensor)
                    elif restore == "offload":
                        kept.append(pipeline.offloader.offload(tensor))
                expert_output_rows = expert_output(
                    middle, w2_EDF, plan.local_counts_L, activation, biases
                )
                if p >= 2:  # its send buffer is about to be reused
                    combines[p - 2].wait()
                send = _to_source_major(expert_output_rows, plan, output_buffers.get(p, rows))
                combines.append(
                    exchange.start(
                        send, plan.recv_splits, plan.send_splits, out=combined_AD[plan.assignments]
                    )
                )
        for combine in combines:
            combine.wait()
        out_TD = torch.zeros_like(x_TD)
        out_TD.index_add_(0, pipeline.token_index_A, combined_AD * weight_A[:, None])

        ctx.pipeline = pipeline
        ctx.kept = (len(kept_inputs), len(kept_middles))
        ctx.save_for_backward(
            x_TD,
            weight_A,
            w1_EFD,
            w3_EFD,
            w2_EDF,
            b1_EF,
            b3_EF,
            b2_ED,
            combined_AD,
            *kept_inputs,
            *kept_middles,
        )
        return out_TD

    @staticmethod
    def backward(ctx, grad_out_TD):
        pipeline: ExpertPipeline = ctx.pipeline
        plans, exchange, strategy = pipeline.plans, pipeline.exchange, pipeline.strategy
        x_TD, weight_A, w1_EFD, w3_EFD, w2_EDF, b1_EF, b3_EF, b2_ED, combined_AD, *kept = (
            ctx.saved_tensors
        )
        kept_inputs, kept_middles = kept[: ctx.kept[0]], kept[ctx.kept[0] :]
        weights, biases = (w1_EFD, w3_EFD, w2_EDF), _biases(b1_EF, b3_EF, b2_ED)
        grad_out_TD = grad_out_TD.contiguous()
        grad_weight_A = (grad_out_TD[pipeline.token_index_A] * combined_AD).sum(-1)
        grads = ExpertGrads.zeros_like(*weights, biases)
        grad_x_TD = torch.zeros_like(x_TD)

        def start_transfers(p: int) -> tuple[PendingRows, PendingRows | None]:
            plan = plans[p]
            grad_rows = _gather(
                grad_out_TD, plan.token_index_A, None, scale=weight_A[plan.assignments]
            )
            grad = exchange.start(grad_rows, plan.send_splits, plan.recv_splits)
            if strategy.dispatched_input != "communicate":
                return grad, None
            input_rows = _gather(x_TD, plan.token_index_A, None)
            return grad, exchange.start(input_rows, plan.send_splits, plan.recv_splits)

        returns: list[tuple[PartitionPlan, PendingRows]] = []
        transfers = start_transfers(0)
        for p, plan in enumerate(plans):
            with record_function(f"moe: partition {p + 1}/{len(plans)} backward"):
                grad_received = transfers[0].wait()
                input_received = None if transfers[1] is None else transfers[1].wait()
                if p + 1 < len(plans):
                    transfers = start_transfers(p + 1)
                grad_expert_output = _to_expert_major(grad_received, plan, None)
                if strategy.dispatched_input == "communicate":
                    dispatched = _to_expert_major(input_received, plan, None)
                elif strategy.dispatched_input == "offload":
                    dispatched = pipeline.offloader.restore(kept_inputs[p])
                else:
                    dispatched = kept_inputs[p]
                if strategy.middle == "recompute":
                    middle = expert_middle(
                        dispatched, w1_EFD, w3_EFD, plan.local_counts_L, biases=biases
                    )
                elif strategy.middle == "offload":
                    middle = pipeline.offloader.restore(kept_middles[p])
                else:
                    middle = kept_middles[p]
                grad_dispatched = expert_backward(
                    dispatched,
                    middle,
                    grad_expert_output,
                    weights,
                    plan.local_counts_L,
                    grads,
                    pipeline.activation,
                )
                if p >= 2:
                    _accumulate(grad_x_TD, *returns[p - 2])
                send = _to_source_major(grad_dispatched, plan, None)
                returns.append((plan, exchange.start(send, plan.recv_splits, plan.send_splits)))
        for plan, pending in returns[max(0, len(plans) - 2) :]:
            _accumulate(grad_x_TD, plan, pending)
        return (
            grad_x_TD,
            grad_weight_A,
            grads.w1_EFD,
            grads.w3_EFD,
            grads.w2_EDF,
            grads.b1_EF,
            grads.b3_EF,
            grads.b2_ED,
            None,
        )


def _accumulate(grad_x_TD: Tensor, plan: PartitionPlan, pending: PendingRows) -> None:
    grad_x_TD.index_add_(0, plan.token_index_A, pending.wait())
