"""`python -m pipekit.bench moe --ep 2 --tokens 8192 --dim 1024 --hidden 4096 --experts 8
--comm-ratio 1.0`: MPipeMoE's pipelined all-to-all and memory reuse, measured on `ep` ranks.

One expert-parallel MoE layer (SwiGLU experts, top-k Mixtral router, float32), forward and
backward of `--tokens` tokens per rank, for n = 1, 2, 4, 8 and "auto" (Algorithm 1, timed after
its trials):

- **native**: the all-to-all over gloo on loopback, as it is;
- **emulated link**: the same transfers, each held on a worker thread until it has taken the time
  a link would (`PacedExchange`). The link's speed is set so that at n = 1 a step's four
  all-to-alls take `--comm-ratio` x its expert compute time (measured on this machine first).
  R = 1 is MPipeMoE's regime (an A100 with 200 Gb/s InfiniBand at these shapes); the overlap is
  real: expert compute runs while the worker waits.

Step time is the slowest rank's, median of `--repeats` after a warm-up; no buffer sharing
(PipeMoE), so it isolates the pipelining. Peak memory is the peak of live tensor bytes during a
step (`PeakTensorMemory`: activations and temporary buffers) plus the model states it runs
beside (parameters, gradients, Adam's two moments), without and with shared partition buffers
(S4: re-communicate T_DI, recompute T_M), next to Eq. 6's prediction for a SwiGLU expert. On CPU
offloading saves nothing (host memory is the same memory), so S1-S3 are not measured here.

RESULT: pipelined_speedup (best n vs n = 1, emulated link), native_speedup (the same natively),
memory_saving (measured: S4 at the best emulated n against n = 1 without reuse), eq6 (predicted,
same n) and sharing_saving (S4 against no sharing at the same n: the activation half of Eq. 6).
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from pipekit.bench._pipeline_launch import run_ranks
from pipekit.bench.report import print_result, print_table
from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.moe import MoE, MoEArgs
from pipekit.moe.dispatch_plan import plan_partitions
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.expert_parallel import apply_expert_parallel
from pipekit.moe.experts import ExpertGrads, expert_backward, expert_middle, expert_output
from pipekit.moe.memory_model import reuse_saving_ratio
from pipekit.moe.token_exchange import (
    CollectiveExchange,
    PacedExchange,
    TokenExchange,
    link_rows,
)

_MIB = 2**20
_FAIR_TUNABLES = "glibc.malloc.mmap_max=0"
_ALL_TO_ALLS_PER_STEP = 4  # dispatch and combine, forward and backward


def _max_over_ranks(value: float) -> float:
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return float(tensor)


def _build(spec: dict[str, Any], rank: int) -> tuple[MoE, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    args = MoEArgs(num_experts=spec["experts"], top_k=spec["top_k"], load_balance_weight=0.0)
    moe = MoE(spec["dim"], spec["hidden"], args)
    moe.reset_parameters(0.02, 0.02)
    generator = torch.Generator().manual_seed(100 + rank)
    x_TD = torch.randn(spec["tokens"], spec["dim"], generator=generator)
    grad_TD = torch.randn(spec["tokens"], spec["dim"], generator=generator)
    return moe, x_TD, grad_TD


def _step(moe: MoE, x_TD: torch.Tensor, grad_TD: torch.Tensor) -> None:
    x_TD = x_TD.clone().requires_grad_()
    moe(x_TD).backward(grad_TD)


def _timed_steps(moe: MoE, x_TD, grad_TD, repeats: int) -> float:
    _step(moe, x_TD, grad_TD)  # warm-up (and Algorithm 1's trials for "auto")
    samples = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        _step(moe, x_TD, grad_TD)
        samples.append(_max_over_ranks(time.perf_counter() - started))
    return statistics.median(samples)


def _link_calibration(moe: MoE, x_TD: torch.Tensor, exchange: TokenExchange) -> tuple[float, int]:
    """(Seconds of a step's expert compute, bytes a step sends over the link), max over ranks."""
    routing = moe.router(x_TD)
    (plan,), _ = plan_partitions(routing, 1, exchange)
    weights = tuple(w.detach() for w in moe.experts.local_weights())
    w1_EFD, w3_EFD, w2_EDF = weights
    activation = moe.experts.activation
    counts_L = plan.local_counts_L
    rows_AD = torch.randn(plan.received_rows, x_TD.shape[1])

    def compute() -> None:
        middle_KAF = expert_middle(rows_AD, w1_EFD, w3_EFD, counts_L)
        out_AD = expert_output(middle_KAF, w2_EDF, counts_L, activation)
        grads = ExpertGrads.zeros_like(*weights)
        expert_backward(rows_AD, middle_KAF, out_AD, weights, counts_L, grads, activation)

    compute()  # warm-up
    samples = []
    for _ in range(3):
        started = time.perf_counter()
        compute()
        samples.append(time.perf_counter() - started)
    seconds = min(samples)  # the least disturbed run: the link must not absorb noise
    remote_rows = link_rows(plan.send_splits, plan.recv_splits, exchange.rank)
    step_bytes = _ALL_TO_ALLS_PER_STEP * remote_rows * x_TD.shape[1] * x_TD.element_size()
    return _max_over_ranks(seconds), int(_max_over_ranks(step_bytes))


def _peak_step_bytes(moe: MoE, x_TD, grad_TD) -> dict[str, int]:
    """Model states, and the peak of the tensors one step allocates on top of them."""
    optimizer = torch.optim.Adam(moe.parameters(), lr=1e-6)
    _step(moe, x_TD, grad_TD)
    optimizer.step()  # Adam's moments exist from here on
    optimizer.zero_grad(set_to_none=False)
    states = [*moe.parameters(), *(p.grad for p in moe.parameters())]
    states += [t for state in optimizer.state.values() for t in state.values() if t.dim()]
    model_state_bytes = sum(
        (t.to_local() if hasattr(t, "to_local") else t).untyped_storage().nbytes() for t in states
    )
    with PeakTensorMemory() as memory:
        _step(moe, x_TD, grad_TD)
    return {"model_states": model_state_bytes, "step_peak": memory.peak_bytes}


def _rank_worker(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    mesh = init_device_mesh("cpu", (num_ranks,), mesh_dim_names=("ep",))
    moe, x_TD, grad_TD = _build(spec, rank)
    apply_expert_parallel(moe, mesh)
    native = CollectiveExchange(mesh.get_group())
    compute_s, step_bytes = _link_calibration(moe, x_TD, native)
    seconds_per_byte = spec["comm_ratio"] * compute_s / max(step_bytes, 1)
    links = {"native": native, "emulated": PacedExchange(mesh.get_group(), seconds_per_byte)}
    times: dict[str, dict[str, float]] = {name: {} for name in links}
    chosen: dict[str, int] = {}
    for name, exchange in links.items():
        for partitions in [*spec["partitions"], "auto"]:
            moe.execution = ExpertExecution(exchange, partitions, "none")
            times[name][str(partitions)] = _timed_steps(moe, x_TD, grad_TD, spec["repeats"])
            if partitions == "auto":
                chosen[name] = next(iter(moe.execution.granularity.cache_table.values()))
    memory: dict[str, dict[str, int]] = {}
    for partitions in spec["partitions"]:
        for strategy in ("none", "S4"):
            moe.execution = ExpertExecution(native, partitions, strategy)
            memory[f"{partitions}/{strategy}"] = _peak_step_bytes(moe, x_TD, grad_TD)
    return {
        "times": times,
        "chosen": chosen,
        "memory": memory,
        "compute_s": compute_s,
        "step_bytes": step_bytes,
        "link_gbps": 1e-9 / seconds_per_byte if seconds_per_byte else float("inf"),
    }


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench moe", description=__doc__.split("\n\n")[1]
    )
    parser.add_argument("--ep", type=int, default=2, help="expert-parallel ranks")
    parser.add_argument("--tokens", type=int, default=8192, help="tokens per rank (B)")
    parser.add_argument("--dim", type=int, default=1024, help="model dim (M)")
    parser.add_argument("--hidden", type=int, default=4096, help="expert hidden dim (H)")
    parser.add_argument("--experts", type=int, default=8, help="experts (E)")
    parser.add_argument("--top-k", type=int, default=1, help="experts per token (MPipeMoE: 1)")
    parser.add_argument(
        "--comm-ratio",
        type=float,
        default=1.0,
        help="emulated link: all-to-all time / expert compute time at n = 1 (default 1.0)",
    )
    parser.add_argument("--partitions", default="1,2,4,8", help="fixed n to time")
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per setting")
    options = parser.parse_args(argv)
    partitions = [int(n) for n in options.partitions.split(",")]
    if options.ep < 2 or options.experts % options.ep:
        parser.error(f"--ep {options.ep} must be >= 2 and divide --experts {options.experts}")
    if partitions[0] != 1 or any(n < 1 or n > options.tokens for n in partitions):
        parser.error("--partitions must start with 1 (the baseline) and stay within --tokens")
    if options.comm_ratio <= 0:
        parser.error(f"--comm-ratio {options.comm_ratio} must be positive")
    spec = {
        "tokens": options.tokens,
        "dim": options.dim,
        "hidden": options.hidden,
        "experts": options.experts,
        "top_k": options.top_k,
        "comm_ratio": options.comm_ratio,
        "partitions": partitions,
        "repeats": options.repeats,
    }
    result = run_ranks(
        "pipekit.bench.moe:_rank_worker",
        options.ep,
        spec,
        env={"GLIBC_TUNABLES": _FAIR_TUNABLES},
    )[0]
    _report(options, spec, result)


def _report(options: argparse.Namespace, spec: dict[str, Any], result: dict[str, Any]) -> None:
    times, memory = result["times"], result["memory"]
    print(
        f"MoE layer: B={spec['tokens']} tokens/rank, M={spec['dim']}, H={spec['hidden']}, "
        f"E={spec['experts']}, top-{spec['top_k']}, float32, SwiGLU experts; ep={options.ep} "
        f"gloo ranks, 1 thread each, GLIBC_TUNABLES={_FAIR_TUNABLES}"
    )
    native_1, emulated_1 = times["native"]["1"], times["emulated"]["1"]
    print(
        f"expert compute per step {result['compute_s']:.3g} s; link bytes per step "
        f"{result['step_bytes'] / _MIB:.1f} MiB; emulated link {result['link_gbps']:.3g} GB/s "
        f"(comm-ratio {options.comm_ratio}; achieved at n=1: (emulated - native) / native = "
        f"{(emulated_1 - native_1) / native_1:.3g})\n"
    )
    local_experts = spec["experts"] // options.ep

    def peak(key: str) -> int:
        return memory[key]["model_states"] + memory[key]["step_peak"]

    baseline = peak("1/none")  # the unpartitioned layer without reuse
    rows = []
    measured: dict[int, float] = {}
    sharing: dict[int, float] = {}
    predicted: dict[int, float] = {}
    for label in [*map(str, spec["partitions"]), "auto"]:
        shown = label
        if label == "auto":
            shown = f"auto (n={result['chosen']['emulated']}/{result['chosen']['native']})"
        row = [
            shown,
            times["native"][label],
            times["native"]["1"] / times["native"][label],
            times["emulated"][label],
            times["emulated"]["1"] / times["emulated"][label],
        ]
        if label == "auto":
            rows.append([*row, *[""] * 6])
            continue
        n = int(label)
        none, shared = peak(f"{n}/none"), peak(f"{n}/S4")
        measured[n] = (baseline - shared) / baseline
        sharing[n] = (none - shared) / none
        predicted[n] = reuse_saving_ratio(
            spec["tokens"] * spec["top_k"],
            spec["dim"],
            spec["hidden"],
            n,
            spec["experts"],
            local_experts=local_experts,
            matrices_per_expert=3,
            middle_tensors=2,
        )
        # Eq. 6's numerator is dM_act + dM_buf with dM_act = dM_buf (Eq. 5): half is sharing's.
        figures = [measured[n], predicted[n], sharing[n], predicted[n] / 2]
        rows.append([*row, none / _MIB, shared / _MIB, *figures])
    print_table(
        [
            "n",
            "native s",
            "vs n=1",
            "emulated s",
            "vs n=1",
            "peak MiB none",
            "peak MiB S4",
            "saving",
            "Eq.6",
            "sharing only",
            "Eq.6 act",
        ],
        rows,
    )
    emulated = {int(k): v for k, v in times["emulated"].items() if k != "auto"}
    native = {int(k): v for k, v in times["native"].items() if k != "auto"}
    best = min(emulated, key=emulated.get)
    print(
        "\npeak = model states (params, grads, Adam moments) + peak live tensors of a step.\n"
        "saving: S4 at n against n = 1 without reuse (Eq. 6's dM_act + dM_buf: the backward's\n"
        "gradient buffers shrink to B/n with partitioning alone, the activations with sharing);\n"
        "sharing only: S4 against no sharing at the same n (Eq. 6 act = its dM_act half).\n"
        f"RESULT at the best emulated n = {best}"
    )
    print_result(
        pipelined_speedup=emulated[1] / emulated[best],
        native_speedup=native[1] / min(native.values()),
        memory_saving=measured[best],
        eq6=predicted[best],
        sharing_saving=sharing[best],
        best_n=best,
        auto_n=result["chosen"]["emulated"],
    )
