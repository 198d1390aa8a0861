"""`python -m pipekit.bench schedules [--pp 4] [--microbatches 4 8] [--slices-per-rank 1 2 4 8]
[--contexts 32768 131072 524288] [--dim 5120]`.

Simulated bubble fraction and peak activation memory of pipeline schedules beside SlimPipe's
Table 2, by `pipekit.pipelining.schedules.simulate` on the schedules' own action
lists (torch's for GPipe, 1F1B, Interleaved1F1B and ZB-V; pipekit's for the sliced schedule,
n = k·p slices).

(a) Uniform costs: every (stage, microbatch) forward costs the same, backward twice that (ZB-V's
I and W one forward each). Table 2's formulas are exact here once their premises hold (m >= p;
for memory, the warm-up fills); the table marks the rows where they do not, and the maximum
relative deviation is taken over the rest. Bubble fraction = idle / busy time (1F1B's is
(p-1)/m); activations = rank 0's peak relative to 1F1B's rank 0.

(b) Causal attention costs at context S for a Llama-like model of hidden size d: per token and
layer the linear layers take 24·d² forward FLOPs (Q, K, V, O projections 4·d² and a SwiGLU MLP
of width ~2.7·d, 3·2.7·d² ≈ 8·d², multiply-adds counted twice) and causal attention 2·S·d (QKᵀ
and PV, 2·d each per attended key, S/2 keys on average), so attention / linear = S / (12·d)
(d = 5120 is Llama 13B, SlimPipe §6). Slice j of n then costs 1/n of the linear part and
(2j+1)/n² of the attention part. Memory does not depend on costs (each rank's order is fixed).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass

from pipekit.bench.report import print_result, print_table
from pipekit.pipelining.actions import Action
from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
from pipekit.pipelining.schedules.simulate import CostModel, SimulationResult, simulate

__all__ = [
    "attention_to_linear_ratio",
    "main",
    "table2_activations",
    "table2_bubble",
]

_UNIFORM = CostModel()
_ATTENTION_ONLY = CostModel(forward_linear=0.0, forward_attention=1.0)
_TORCH_ROWS = (("GPipe", 1), ("1F1B", 1), ("Interleaved1F1B", 2), ("ZBVZeroBubble", 2))
_LABELS = {"ZBVZeroBubble": "ZB-V"}


def attention_to_linear_ratio(context: int, dim: int) -> float:
    """Causal-attention over linear forward FLOPs of a Llama-like layer: 2·S·d / (24·d²)."""
    return 2 * context * dim / (24 * dim**2)


def table2_bubble(
    schedule: str, p: int, m: int, n: int = 1, v: int = 1
) -> float | tuple[float, float]:
    """SlimPipe Table 2's bubble fraction; ZB-V's is a range (low, high)."""
    if schedule in ("GPipe", "1F1B"):
        return (p - 1) / m
    if schedule == "Interleaved1F1B":
        return (p - 1) / (v * m)
    if schedule == "ZBVZeroBubble":
        return (0.0, 2 * (p - 1) / (3 * m))
    if schedule == "sliced":
        return (p - 1) / (n * v * m)
    raise ValueError(f"schedule={schedule!r} has no Table 2 bubble formula here")


def table2_activations(schedule: str, p: int, m: int, n: int = 1, v: int = 1) -> float:
    """SlimPipe Table 2's first-rank activation memory relative to 1F1B's."""
    if schedule == "GPipe":
        return m / p
    if schedule in ("1F1B", "ZBVZeroBubble"):
        return 1.0
    if schedule == "Interleaved1F1B":
        return 1 + (p - 1) / (v * p)
    if schedule == "sliced":
        return 1 / p + 2 * (p - 1) / (n * v * p)  # SlimPipe Eq. 1
    raise ValueError(f"schedule={schedule!r} has no Table 2 memory formula here")


def _premises_hold(schedule: str, p: int, m: int, n: int, v: int) -> tuple[bool, bool]:
    """Whether Table 2's (bubble, memory) formula is exact for this shape under uniform costs.

    The formulas assume every warm-up fills: 1F1B and interleaved 1F1B need m >= p (interleaved
    memory also a whole number of rounds, m % p == 0, and v·m > (v+1)p - 2 chunks); ZB-V holds
    its 2p chunks from m >= 2p - 1; the sliced schedule's rank 0 runs v·n + 2(p-1) forwards
    first, which needs v·n·m of them.
    """
    if schedule == "GPipe":
        return True, True
    if schedule == "1F1B":
        return m >= p, m >= p
    if schedule == "Interleaved1F1B":
        return m >= p, m % p == 0 and v * m >= (v + 1) * p - 1
    if schedule == "ZBVZeroBubble":
        return False, m >= 2 * p - 1  # the bubble is a range, never exact
    return True, v * n * m >= v * n + 2 * (p - 1)


def _actions(schedule: str, p: int, m: int, n: int, v: int) -> dict[int, list[Action]]:
    entry = get_schedule(schedule)
    assert entry.actions is not None
    return entry.actions(ScheduleShape(p, m, n, v))


def _simulate(schedule: str, p: int, m: int, n: int, v: int, cost: CostModel) -> SimulationResult:
    return simulate(_actions(schedule, p, m, n, v), num_slices=n, cost=cost)


def _name(schedule: str, v: int, n: int) -> str:
    slices = f" n={n}" if schedule == "sliced" else ""
    return f"{_LABELS.get(schedule, schedule)} v={v}{slices}"


@dataclass(frozen=True)
class _Shape:
    schedule: str
    stages_per_rank: int
    num_slices: int


def _shapes(
    p: int, slices_per_rank: Sequence[int], torch_rows: Sequence[tuple[str, int]]
) -> list[_Shape]:
    shapes = [_Shape(schedule, v, 1) for schedule, v in torch_rows]
    for k in slices_per_rank:
        shapes += [_Shape("sliced", v, k * p) for v in (1, 2)]
    return shapes


def _format_formula(value: float | tuple[float, float], exact: bool) -> str:
    text = f"({value[0]:.4g}, {value[1]:.4g})" if isinstance(value, tuple) else f"{value:.4g}"
    return text if exact or isinstance(value, tuple) else text + "*"


def _uniform_table(
    pp: Sequence[int], microbatches: Sequence[int], slices_per_rank: Sequence[int]
) -> dict[str, object]:
    """Part (a): print the table; return the figures the RESULT line needs."""
    rows, skipped, deviations, zbv_checks = [], [], [], []
    sliced_bubble = {}
    for p in pp:
        for m in microbatches:
            reference = _simulate("1F1B", p, m, 1, 1, _UNIFORM) if m >= p else None
            base = reference.peak_memory[0]["activations"] if reference else 1.0
            for shape in _shapes(p, slices_per_rank, _TORCH_ROWS):
                schedule, v, n = shape.schedule, shape.stages_per_rank, shape.num_slices
                try:
                    result = _simulate(schedule, p, m, n, v, _UNIFORM)
                except ValueError as error:
                    skipped.append(f"p={p} m={m} {_name(schedule, v, n)}: {error}")
                    continue
                bubble = result.max_bubble_fraction
                activations = result.peak_memory[0]["activations"] / base
                bubble_formula = table2_bubble(schedule, p, m, n, v)
                memory_formula = table2_activations(schedule, p, m, n, v)
                bubble_exact, memory_exact = _premises_hold(schedule, p, m, n, v)
                row_deviation = []
                if bubble_exact:
                    row_deviation.append(abs(bubble - bubble_formula) / bubble_formula)
                if memory_exact:
                    row_deviation.append(abs(activations - memory_formula) / memory_formula)
                deviations += row_deviation
                check = ""
                if isinstance(bubble_formula, tuple):
                    low, high = bubble_formula
                    inside = low < bubble < high
                    zbv_checks.append(inside)
                    at_bound = abs(bubble - high) <= 1e-9 * high
                    check = "inside" if inside else "at bound" if at_bound else "OUTSIDE"
                if schedule == "sliced":
                    sliced_bubble[(p, m, n, v)] = bubble
                rows.append(
                    [
                        p,
                        m,
                        _name(schedule, v, n),
                        bubble,
                        _format_formula(bubble_formula, bubble_exact),
                        check,
                        activations,
                        _format_formula(memory_formula, memory_exact),
                        max(row_deviation) if row_deviation else "",
                    ]
                )
    print("\n(a) uniform costs: simulated beside SlimPipe Table 2")
    print_table(
        [
            "p",
            "m",
            "schedule",
            "bubble",
            "Table 2",
            "range",
            "rank-0 activations",
            "Table 2",
            "rel. dev.",
        ],
        rows,
    )
    print(
        "* the formula's premise does not hold at this shape (m < p, or the warm-up does not "
        "fill; see _premises_hold), so the row is not counted in max_rel_dev_uniform"
    )
    print(
        "activations relative to 1F1B's rank 0 at the same p and m (where m < p, to one whole "
        "microbatch, what 1F1B holds once its warm-up fills)"
    )
    print(
        "V-Half (Table 2: activations 1/2 + 1/p, bubble (p/(2m), 1/3 + p/(2m))) is not "
        "expressible with torch's schedules: torch has ZB-V (ZBVZeroBubble) and DualPipeV but no "
        "memory-controlled V-Half/V-Min, so it has no row"
    )
    for line in skipped:
        print(f"skipped (shape not accepted): {line}")
    return {
        "max_rel_dev": max(deviations),
        "zbv_inside": f"{sum(zbv_checks)}/{len(zbv_checks)}",
        "sliced_bubble": sliced_bubble,
    }


def _context_label(context: int) -> str:
    return f"{context // 1024}k" if context % 1024 == 0 else str(context)


def _context_costs(contexts: Sequence[int], dim: int) -> dict[str, CostModel]:
    """One cost model per context, and the limit where attention is everything."""
    costs = {
        _context_label(context): CostModel(
            forward_linear=1.0, forward_attention=attention_to_linear_ratio(context, dim)
        )
        for context in contexts
    }
    return costs | {"attn-only": _ATTENTION_ONLY}


def _idle_split(p: int, m: int, n: int, costs: dict[str, CostModel]) -> None:
    """Print where the last rank of sliced v=1 idles: before its first action (warm-up), after
    its last (cool-down) and between its actions (under uniform costs, none)."""
    rows = []
    for label, cost in {"uniform": _UNIFORM, **costs}.items():
        result = _simulate("sliced", p, m, n, 1, cost)
        events = sorted((e for e in result.timeline if e.rank == p - 1), key=lambda e: e.start)
        busy = result.busy_time[p - 1]
        head, tail = events[0].start, result.makespan - events[-1].end
        between = events[-1].end - events[0].start - busy  # a rank runs one action at a time
        rows.append(
            [label, head / busy, between / busy, tail / busy, result.bubble_fraction[p - 1]]
        )
    print(f"\nwhere rank {p - 1} idles in sliced v=1 n={n} (p={p}, m={m}), idle / busy:")
    print_table(["costs", "before first action", "between actions", "after last", "total"], rows)


def _causal_table(
    pp: Sequence[int],
    microbatches: Sequence[int],
    slices_per_rank: Sequence[int],
    contexts: Sequence[int],
    dim: int,
) -> dict[tuple[int, int, int, int, str], float]:
    """Part (b): print the table; return {(p, m, n, v, context label): sliced bubble}."""
    costs = _context_costs(contexts, dim)
    print(f"\n(b) causal attention costs, d={dim}: attention share of forward time per context")
    print_table(
        ["context", "attention / linear", "attention share"],
        [
            [label, cost.forward_attention / cost.forward_linear if cost.forward_linear else "inf",
             cost.forward_attention / (cost.forward_attention + cost.forward_linear)]
            for label, cost in costs.items()
        ],
    )  # fmt: skip
    rows, memory_changes, sliced_bubble = [], [], {}
    torch_rows = (("1F1B", 1), ("Interleaved1F1B", 2))
    for p in pp:
        for m in microbatches:
            for shape in _shapes(p, slices_per_rank, torch_rows):
                schedule, v, n = shape.schedule, shape.stages_per_rank, shape.num_slices
                try:
                    uniform = _simulate(schedule, p, m, n, v, _UNIFORM)
                except ValueError:
                    continue  # listed under (a)
                bubbles = []
                for label, cost in costs.items():
                    result = _simulate(schedule, p, m, n, v, cost)
                    bubbles.append(result.max_bubble_fraction)
                    memory_changes.append(
                        max(
                            abs(result.peak_memory[rank]["total"] - peak["total"])
                            for rank, peak in uniform.peak_memory.items()
                        )
                    )
                    if schedule == "sliced":
                        sliced_bubble[(p, m, n, v, label)] = result.max_bubble_fraction
                paper = (p - 1) * p / ((n + 1) * n * m) if schedule == "sliced" and v == 1 else ""
                rows.append(
                    [p, m, _name(schedule, v, n), uniform.max_bubble_fraction, *bubbles, paper,
                     bubbles[-2] / uniform.max_bubble_fraction]
                )  # fmt: skip
    print("\nbubble fraction (idle / busy, every rank alike) under each context's costs")
    print_table(
        [
            "p",
            "m",
            "schedule",
            "uniform",
            *costs,
            "paper attn-dominated",
            f"{_context_label(contexts[-1])} / uniform",
        ],
        rows,
    )
    print(
        "uniform = Table 2's value (the simulation matches it, part (a)); paper attn-dominated = "
        "SlimPipe §4.1.3's (p-1)p/((n+1)nm), the warm-up bubble alone when slice j costs "
        "(j+1) (v=1 only)"
    )
    print(
        f"peak memory per rank is the same under every cost model: max |change| = "
        f"{max(memory_changes):.3g} over {len(memory_changes)} simulations"
    )
    return sliced_bubble


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench schedules",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--pp", type=int, nargs="+", default=[4], help="pipeline ranks p")
    parser.add_argument(
        "--microbatches", type=int, nargs="+", default=[4, 8], help="microbatches m"
    )
    parser.add_argument(
        "--slices-per-rank",
        type=int,
        nargs="+",
        default=[1, 2, 4, 8],
        help="k: the sliced schedule runs n = k·p slices per microbatch",
    )
    parser.add_argument(
        "--contexts",
        type=int,
        nargs="+",
        default=[32768, 131072, 524288],
        help="context lengths S of part (b)",
    )
    parser.add_argument("--dim", type=int, default=5120, help="hidden size d (Llama 13B: 5120)")
    options = parser.parse_args(argv)
    try:
        _check(options)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    uniform = _uniform_table(options.pp, options.microbatches, options.slices_per_rank)
    causal = _causal_table(
        options.pp, options.microbatches, options.slices_per_rank, options.contexts, options.dim
    )
    p, m = options.pp[0], options.microbatches[0]
    n = max(options.slices_per_rank) * p
    _idle_split(p, m, n, _context_costs(options.contexts, options.dim))
    print(
        f"\nfigures below: sliced at p={p}, m={m}, n={n}, v=1; ZB-V rows whose bubble lies "
        "inside Table 2's range"
    )
    figures = {
        "max_rel_dev_uniform": uniform["max_rel_dev"],
        "zbv_bubble_inside_range": uniform["zbv_inside"],
        "sliced_bubble_uniform": uniform["sliced_bubble"][(p, m, n, 1)],
    }
    for context in options.contexts:
        label = _context_label(context)
        figures[f"sliced_bubble_causal_{label}"] = causal[(p, m, n, 1, label)]
    figures["sliced_bubble_attn_only"] = causal[(p, m, n, 1, "attn-only")]
    figures["paper_attn_dominated"] = (p - 1) * p / ((n + 1) * n * m)
    print_result(**figures)


def _check(options: argparse.Namespace) -> None:
    for name in ("pp", "microbatches", "slices_per_rank", "contexts"):
        flag = "--" + name.replace("_", "-")
        for value in getattr(options, name):
            if value < (2 if name == "pp" else 1):
                rule = "at least 2: a pipeline needs two ranks" if name == "pp" else "at least 1"
                raise ValueError(f"{flag} {value} must be {rule}")
    if options.dim < 1:
        raise ValueError(f"--dim={options.dim} must be at least 1")
