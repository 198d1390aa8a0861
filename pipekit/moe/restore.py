"""MPipeMoE's memory-reuse strategies (Table II) and the cost model that picks one (Eq. 10).

With shared partition buffers the next partition overwrites T_DI (dispatched input) and T_M
(middle activation), which the backward needs. Each is restored one of two ways:

| strategy | T_DI        | T_M       |
|----------|-------------|-----------|
| none     | kept        | kept      |  (no sharing: every partition keeps its own tensors)
| S1       | offload     | offload   |
| S2       | communicate | offload   |
| S3       | offload     | recompute |
| S4       | communicate | recompute |

"offload" copies to host memory in the forward and back in the backward; "communicate" runs
the dispatch all-to-all again from T_I; "recompute" runs the gate/up GEMMs again from T_DI.

Eq. 10 costs a strategy as the slowest of three streams (compute, communication, memory copy),
each its work `Q` times a unit volume over its speed. `Q` is derived here from the expert's
shape instead of copied: for the paper's two-matrix FFN with H = 4M it is Table II exactly
(`test_workloads_reproduce_table_ii`); a gated (SwiGLU, GeGLU) expert has 3 GEMMs forward and 2
middle tensors, a plain GELU expert is the paper's form (`ExpertActivation` gives both).

On CPU, host memory is the device's memory: offloading saves nothing there (the copy is kept
for correctness), so the CPU memory saving of buffer sharing is measured with S4.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from pipekit.moe.grouped_mm import grouped_matmul
from pipekit.moe.token_exchange import TokenExchange

__all__ = [
    "MEMORY_REUSE_CHOICES",
    "RESTORE_STRATEGIES",
    "ExpertShape",
    "HardwareSpeeds",
    "Offloader",
    "RestoreStrategy",
    "choose_restore_strategy",
    "measure_speeds",
    "restore_cost",
    "restore_strategy",
    "strategy_workload",
]


@dataclass(frozen=True)
class RestoreStrategy:
    """How T_DI and T_M come back for the backward when partition buffers are shared."""

    name: str
    dispatched_input: str
    """"keep", "offload" or "communicate"."""
    middle: str
    """"keep", "offload" or "recompute"."""

    @property
    def shares_buffers(self) -> bool:
        return self.name != "none"


RESTORE_STRATEGIES: dict[str, RestoreStrategy] = {
    strategy.name: strategy
    for strategy in (
        RestoreStrategy("none", "keep", "keep"),
        RestoreStrategy("S1", "offload", "offload"),
        RestoreStrategy("S2", "communicate", "offload"),
        RestoreStrategy("S3", "offload", "recompute"),
        RestoreStrategy("S4", "communicate", "recompute"),
    )
}

MEMORY_REUSE_CHOICES: tuple[str, ...] = (*RESTORE_STRATEGIES, "auto")
"""`memory_reuse`'s choices: a strategy of Table II, or "auto" (Eq. 10 picks one)."""


def restore_strategy(name: str) -> RestoreStrategy:
    if name not in RESTORE_STRATEGIES:
        raise ValueError(
            f"unknown memory-reuse strategy {name!r}; known: {sorted(RESTORE_STRATEGIES)} "
            "or 'auto' (Eq. 10 picks one)"
        )
    return RESTORE_STRATEGIES[name]


@dataclass(frozen=True)
class ExpertShape:
    """What Eq. 10 needs of a layer: B tokens per partition, M, H, and the expert's form.

    The defaults are the paper's two-matrix FFN (a plain GELU expert); a gated expert (SwiGLU,
    GeGLU) has `forward_gemms=3` and `middle_tensors=2` (gate and up).
    """

    tokens: int
    dim: int
    hidden: int
    element_size: int = 4
    forward_gemms: int = 2
    middle_tensors: int = 1


def strategy_workload(
    strategy: RestoreStrategy, shape: ExpertShape
) -> tuple[tuple[float, float, float], tuple[float, float, float]]:
    """(Q_fw, Q_bw): [GEMMs, all-to-alls, copies in units of B x M] of the forward and backward.

    The backward runs two GEMMs per forward GEMM; recomputing T_M repeats the forward GEMMs
    that produce it (all but the last); re-communicating T_DI is one more all-to-all; copying
    T_DI is one unit and T_M `middle_tensors x H / M` units, each way.
    """
    copies = 0.0
    if strategy.dispatched_input == "offload":
        copies += 1
    if strategy.middle == "offload":
        copies += shape.middle_tensors * shape.hidden / shape.dim
    gemms = shape.forward_gemms
    forward = (gemms, 2, copies)
    backward = (
        2 * gemms + (gemms - 1 if strategy.middle == "recompute" else 0),
        2 + (1 if strategy.dispatched_input == "communicate" else 0),
        copies,
    )
    return forward, backward


@dataclass(frozen=True)
class HardwareSpeeds:
    """Measured speeds: GEMM FLOP/s, all-to-all bytes/s per rank, host copy bytes/s."""

    compute_flops: float
    communication_bytes: float
    copy_bytes: float
    communication_slowdown: float = 1.0
    """mu: the fraction of its speed communication keeps while computing runs beside it."""
    copy_slowdown: float = 1.0
    """eta: the same for memory copies."""


def restore_cost(strategy: RestoreStrategy, speeds: HardwareSpeeds, shape: ExpertShape) -> float:
    """Eq. 10 in seconds, forward plus backward: each pass costs its slowest stream."""
    gemm_flops = 2 * shape.tokens * shape.hidden * shape.dim  # v_0,comp (Eq. 7), as FLOPs
    unit_bytes = shape.tokens * shape.dim * shape.element_size  # v_0,comm = v_0,mem (Eq. 8, 9)
    total = 0.0
    for gemms, all_to_alls, copies in strategy_workload(strategy, shape):
        total += max(
            gemms * gemm_flops / speeds.compute_flops,
            all_to_alls * unit_bytes / (speeds.communication_slowdown * speeds.communication_bytes),
            copies * unit_bytes / (speeds.copy_slowdown * speeds.copy_bytes),
        )
    return total


def choose_restore_strategy(speeds: HardwareSpeeds, shape: ExpertShape) -> RestoreStrategy:
    """The sharing strategy (S1-S4) of lowest Eq. 10 cost; ties go to the lower number."""
    candidates = [strategy for strategy in RESTORE_STRATEGIES.values() if strategy.shares_buffers]
    return min(candidates, key=lambda strategy: restore_cost(strategy, speeds, shape))


def _seconds(run, repeats: int = 3) -> float:
    run()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return max(best, 1e-9)


def measure_speeds(
    exchange: TokenExchange,
    tokens: int,
    dim: int,
    hidden: int,
    dtype: torch.dtype,
    device: torch.device,
) -> HardwareSpeeds:
    """Time one GEMM, one all-to-all and one host copy of these shapes on every rank.

    Every rank keeps the slowest rank's figures (an all-reduce MIN over the exchange's group),
    so all ranks pick the same strategy and issue the same collectives.
    """
    rows = torch.randn(tokens, dim, dtype=dtype, device=device)
    weight = torch.randn(1, dim, hidden, dtype=dtype, device=device)
    gemm = _seconds(lambda: grouped_matmul(rows, weight, [tokens]))
    splits = [tokens // exchange.size] * exchange.size
    splits[-1] += tokens - sum(splits)
    all_to_all = _seconds(lambda: exchange.start(rows, splits, splits).wait())
    offloader = Offloader(device)
    copy = _seconds(lambda: offloader.restore(offloader.offload(rows)))
    nbytes = rows.numel() * rows.element_size()
    speeds = torch.tensor(  # on the device: an NCCL group cannot reduce CPU tensors
        [2 * tokens * dim * hidden / gemm, nbytes / all_to_all, nbytes / copy],
        dtype=torch.float64,
        device=device,
    )
    if exchange.size > 1:
        dist.all_reduce(speeds, op=dist.ReduceOp.MIN, group=exchange.group)
    return HardwareSpeeds(*speeds.tolist())


class Offloader:
    """Copies activations to host memory and back.

    On CUDA: pinned host buffers, copies on a side stream that overlap compute and
    communication; `fence()` makes the compute stream wait for pending device-to-host copies
    before it overwrites the buffer they read. On CPU the "host copy" is a plain copy in the same
    memory: correct, but it saves nothing.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def offload(self, tensor: Tensor) -> Tensor:
        """A host copy of `tensor` (pending on CUDA until the side stream reaches it)."""
        if self._stream is None:
            return tensor.clone()
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)
        return host

    def restore(self, host: Tensor) -> Tensor:
        """`host` back on the device, ready for the compute stream."""
        if self._stream is None:
            return host
        with torch.cuda.stream(self._stream):
            restored = host.to(self.device, non_blocking=True)
        current = torch.cuda.current_stream(self.device)
        current.wait_stream(self._stream)
        restored.record_stream(current)
        return restored

    def fence(self) -> None:
        if self._stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._stream)
