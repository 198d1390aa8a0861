"""How an MoE layer runs its experts: which exchange, how many partitions, which restore.

A model builds every MoE layer with a single-process `ExpertExecution` (one rank, n = 1, no
buffer sharing). `pipekit.moe.expert_parallel.apply_expert_parallel` swaps in one over the ep
group, from outside the model, with the configured partitions and memory-reuse strategy:

- `partitions`: an int, or "auto" for Algorithm 1 (`GranularitySearch`), whose trials run the
  real pipeline, forward and backward, on the call's own tokens with detached copies, and take
  the slowest rank's time so every rank picks the same n;
- `memory_reuse`: "none", "S1".."S4", or "auto" for the strategy of lowest Eq. 10 cost, from
  speeds measured once on every rank (`measure_speeds`).

Ranks must agree on n and the strategy: they decide how many collectives run.
"""

from __future__ import annotations

import dataclasses
import time

import torch
import torch.distributed as dist
from torch import Tensor
from torch.autograd.graph import saved_tensors_hooks

from pipekit.moe.activations import ExpertActivation
from pipekit.moe.dispatch_plan import plan_partitions
from pipekit.moe.expert_tensors import ExpertBiases, ExpertWeights
from pipekit.moe.granularity import GranularitySearch
from pipekit.moe.pipelined import ExpertPipeline, pipelined_experts
from pipekit.moe.restore import (
    ExpertShape,
    Offloader,
    RestoreStrategy,
    choose_restore_strategy,
    measure_speeds,
    restore_strategy,
)
from pipekit.moe.routing import Routing, split_experts
from pipekit.moe.token_exchange import LocalExchange, TokenExchange

__all__ = ["ExpertExecution", "check_partitions"]

_TRIAL_REPEATS = 2


def check_partitions(partitions: int | str) -> None:
    """ValueError unless `partitions` is an int >= 1 or "auto"; the config checks
    `[moe] partitions` with it too, before launch."""
    if not (partitions == "auto" or (isinstance(partitions, int) and partitions >= 1)):
        raise ValueError(
            f"partitions={partitions!r} must be a positive integer or 'auto' (Algorithm 1)"
        )


class ExpertExecution:
    """Runs the experts of one MoE layer for a routing decision."""

    def __init__(
        self,
        exchange: TokenExchange | None = None,
        partitions: int | str = 1,
        memory_reuse: str = "none",
        tensor_parallel: int = 1,
    ) -> None:
        check_partitions(partitions)
        self.tensor_parallel = tensor_parallel
        """Expert tensor parallelism: each expert is this many pieces on the exchange's ranks
        (`split_experts`), each a slice of its hidden dim."""
        if memory_reuse != "auto":
            restore_strategy(memory_reuse)  # validates the name
        self.exchange = exchange or LocalExchange()
        self.partitions = partitions
        self.memory_reuse = memory_reuse
        self.granularity = GranularitySearch(self._trial) if partitions == "auto" else None
        self._strategy: RestoreStrategy | None = None
        self._trial_inputs: tuple | None = None

    def run(
        self,
        x_TD: Tensor,
        routing: Routing,
        weights: ExpertWeights,
        activation: ExpertActivation,
        *,
        biases: ExpertBiases | None = None,
    ) -> Tensor:
        """Sum over each token's assignments of weight x expert(token), the experts being
        `weights` (w3 None when `activation` is plain) and `biases` (None: none) under
        `activation`; under expert tensor parallelism each assignment goes to every piece of
        its expert."""
        w1_EFD = weights[0]
        routing = self.routing_of_pieces(routing)
        if w1_EFD.shape[0] * self.exchange.size != routing.num_experts:
            raise ValueError(
                f"this rank holds {w1_EFD.shape[0]} experts on {self.exchange.size} "
                f"expert-parallel ranks, but the router has {routing.num_experts}; shard the "
                "experts with apply_expert_parallel over the same ep group"
            )
        batch_tokens = self._agreed_batch_tokens(x_TD)
        partitions = self._partitions(batch_tokens, x_TD, routing, weights, biases, activation)
        strategy = self._restore_strategy(batch_tokens, x_TD, w1_EFD, activation, partitions)
        return self._run(x_TD, routing, weights, biases, activation, partitions, strategy)

    def routing_of_pieces(self, routing: Routing) -> Routing:
        """What the exchange's ranks run: under expert tensor parallelism each assignment
        once per piece of its expert (`split_experts`), else `routing` itself."""
        return split_experts(routing, self.tensor_parallel)

    def _run(
        self,
        x_TD: Tensor,
        routing: Routing,
        weights: ExpertWeights,
        biases: ExpertBiases | None,
        activation: ExpertActivation,
        partitions: int,
        strategy: RestoreStrategy,
    ) -> Tensor:
        plans, order_A = plan_partitions(routing, partitions, self.exchange)
        pipeline = ExpertPipeline(
            plans=plans,
            token_index_A=routing.token_index_A[order_A],
            exchange=self.exchange,
            strategy=strategy,
            offloader=Offloader(x_TD.device),
            activation=activation,
        )
        # Routers score in float32; experts and combine run in the activations' dtype.
        weight_A = routing.weight_A[order_A].to(x_TD.dtype)
        weights = _cast(weights, x_TD.dtype)
        biases = None if biases is None else _cast(biases, x_TD.dtype)
        return pipelined_experts(x_TD, weight_A, *weights, pipeline, biases)

    def _agreed_batch_tokens(self, x_TD: Tensor) -> int:
        """This call's B; the largest rank's when a choice depends on it (ranks must agree)."""
        automatic = self.granularity is not None or (
            self.memory_reuse == "auto" and self._strategy is None
        )
        if not automatic:
            return x_TD.shape[0]
        return int(self._max_over_ranks(x_TD.shape[0], torch.int64, x_TD.device))

    def _max_over_ranks(self, value: float, dtype: torch.dtype, device: torch.device) -> float:
        """`value`'s maximum over the ep group (on the activations' device: NCCL has no CPU)."""
        tensor = torch.tensor([value], dtype=dtype, device=device)
        if self.exchange.size > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self.exchange.group)
        return tensor.item()

    def _partitions(
        self,
        batch_tokens: int,
        x_TD: Tensor,
        routing: Routing,
        weights: ExpertWeights,
        biases: ExpertBiases | None,
        activation: ExpertActivation,
    ) -> int:
        if self.granularity is None:
            return self.partitions
        self._trial_inputs = (batch_tokens, x_TD, routing, weights, biases, activation)
        try:
            return self.granularity.search(batch_tokens)
        finally:
            self._trial_inputs = None

    def _trial(self, batch_tokens: int, partitions: int) -> float:
        """Seconds of one forward + backward with `partitions`, the slowest rank's."""
        agreed_tokens, x_TD, routing, weights, biases, activation = self._trial_inputs
        strategy = self._restore_strategy(agreed_tokens, x_TD, weights[0], activation, partitions)
        x_TD, weights = x_TD.detach().requires_grad_(), _detached(weights)
        biases = None if biases is None else _detached(biases)
        detached = dataclasses.replace(routing, weight_A=routing.weight_A.detach())
        best = float("inf")
        # The trial's own backward must not unpack through the hooks of an enclosing activation
        # checkpoint (that would recompute the block inside its forward): identity hooks.
        with torch.enable_grad(), saved_tensors_hooks(lambda t: t, lambda t: t):
            for _ in range(_TRIAL_REPEATS):
                _synchronize(x_TD.device)
                started = time.perf_counter()
                out_TD = self._run(
                    x_TD, detached, weights, biases, activation, partitions, strategy
                )
                out_TD.sum().backward()
                _synchronize(x_TD.device)
                best = min(best, time.perf_counter() - started)
        return self._max_over_ranks(best, torch.float64, x_TD.device)

    def _restore_strategy(
        self,
        batch_tokens: int,
        x_TD: Tensor,
        w1_EFD: Tensor,
        activation: ExpertActivation,
        partitions: int,
    ) -> RestoreStrategy:
        if self.memory_reuse != "auto":
            return restore_strategy(self.memory_reuse)
        if self._strategy is None:
            hidden, dim = w1_EFD.shape[1], w1_EFD.shape[2]
            tokens = max(1, batch_tokens // partitions)
            speeds = measure_speeds(self.exchange, tokens, dim, hidden, x_TD.dtype, x_TD.device)
            shape = ExpertShape(
                tokens,
                dim,
                hidden,
                x_TD.element_size(),
                forward_gemms=activation.forward_gemms,
                middle_tensors=activation.middle_tensors,
            )
            self._strategy = choose_restore_strategy(speeds, shape)
        return self._strategy


def _cast(tensors: tuple[Tensor | None, ...], dtype: torch.dtype) -> tuple[Tensor | None, ...]:
    return tuple(None if tensor is None else tensor.to(dtype) for tensor in tensors)


def _detached(tensors: tuple[Tensor | None, ...]) -> tuple[Tensor | None, ...]:
    """Leaf copies of `tensors` for a trial, whose backward must not reach the real ones."""
    return tuple(None if tensor is None else tensor.detach().requires_grad_() for tensor in tensors)


def _synchronize(device: torch.device) -> None:
    """Wait for queued GPU work, so host timers measure it (nothing to wait for on CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
