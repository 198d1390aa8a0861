"""`python -m pipekit.bench pipeline-throughput --schedules all --memory-budget B`: every
schedule at the same memory budget.

A schedule that keeps less in flight can spend the difference on speed: it fits a budget with
a cheaper activation policy than one that keeps more. Each schedule (the sliced one at one and
two stages per rank, every torch schedule at its own) runs with the first policy, cheapest
first, whose predicted peak fits B: nothing; for the sliced schedules, 2n and 4n slices
(smaller units in flight cost only per-pass overhead); activation offload of 25-100% of each
unit's saved tensors (copies beside the compute; pipekit offers it to every schedule); then
op-level selective checkpointing, every-k (every second block), full checkpointing (each a
larger share of a forward recomputed). On CPU the offload store is a file whose pages wait in
the kernel's page cache, standing for a GPU's host memory. The prediction is the memory
plan's activations term for that exact layout (`pipekit.memory_plan`, the rank that holds the
most); the check is the measured peak of one more step under `PeakTensorMemory` (every tensor
the step allocates beyond the weights and gradients, which every schedule holds alike), on the
rank that holds the most. A schedule whose measured peak exceeds B is shown but left out of the
ratios.

B is bytes per rank (`768MiB`, `1.5GiB`, or a plain number of bytes), or, at 1 or below, a
fraction of 1F1B's predicted peak without recomputation. `--memory-budget sweep` times every
schedule under every policy instead and draws tokens/s against the measured peak in one
picture (`--out`), each schedule's front (the points no cheaper-in-memory point of the same
schedule beats) joined by a line.

Timing as in `--schedules all`: the same model, weights and global batch, the schedules built in
the same ranks and timed in alternating rounds, fair allocator, pinned ranks.
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import statistics
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipekit.bench._all_schedules import TORCH_SCHEDULES, checked_model
from pipekit.bench._pipeline_launch import (
    bench_job,
    describe_model,
    describe_pinning,
    rank_core_sets,
    run_ranks,
)
from pipekit.bench.report import print_result, print_table
from pipekit.layout_search.candidates import ACTIVATION_POLICIES, OFFLOAD_RATIOS
from pipekit.memory_plan.activations import ActivationProfile
from pipekit.memory_plan.memory import activation_profile, plan_memory

__all__ = [
    "BUDGET_SCHEDULES",
    "Policy",
    "compare_at_budget",
    "parse_budget",
    "policies",
    "sweep_budgets",
]

BUDGET_SCHEDULES: dict[str, dict[str, Any]] = {
    "sliced": {"schedule": "sliced", "stages_per_rank": 1},
    "sliced v=2": {"schedule": "sliced", "stages_per_rank": 2},
    **{name: {"schedule": name, "stages_per_rank": v} for name, v in TORCH_SCHEDULES.items()},
}
"""The compared schedules and their stages per rank."""

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30}
_MIB = 2**20


@dataclass(frozen=True)
class Policy:
    """How a schedule keeps its activations within a budget."""

    num_slices: int = 1
    activation_checkpoint: str = "none"
    activation_offload: float = 0.0

    def label(self) -> str:
        """`n16 | offload 0.5`, `full`, ..."""
        if self.activation_offload:
            kept = f"offload {self.activation_offload:g}"
        else:
            kept = self.activation_checkpoint
        return f"n{self.num_slices} | {kept}" if self.num_slices > 1 else kept

    def keywords(self) -> dict[str, Any]:
        """The `build_runner` / `bench_job` keywords of the policy."""
        return dataclasses.asdict(self)


def policies(schedule: str, num_slices: int) -> list[Policy]:
    """`schedule`'s policies, cheapest first (the module docstring says why in this order)."""
    slices = num_slices if schedule == "sliced" else 1
    unchanged = [Policy(slices * k) for k in ((1, 2, 4) if schedule == "sliced" else (1,))]
    offload = [Policy(slices, activation_offload=ratio) for ratio in OFFLOAD_RATIOS]
    recompute = [Policy(slices, activation_checkpoint=mode) for mode in ACTIVATION_POLICIES[1:]]
    return unchanged + offload + recompute


def parse_budget(text: str) -> tuple[float, str]:
    """(value, kind) of `--memory-budget`: kind "fraction" (value <= 1) or "bytes"; ValueError
    naming the accepted forms otherwise."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).lower() if match else None
    if match is None or unit not in _UNITS:
        raise ValueError(
            f"--memory-budget={text!r} is not a budget; give bytes per rank (e.g. 768MiB, "
            "1.5GiB, 805306368), a fraction of 1F1B's peak without recomputation (e.g. 0.45), "
            "or sweep"
        )
    value = float(match.group(1))
    if value <= 0:
        raise ValueError(f"--memory-budget={text!r} must be above 0")
    if not unit and value <= 1:
        return value, "fraction"
    return value * _UNITS[unit], "bytes"


class _Predictor:
    """The memory plan's activation peak of a schedule under a policy (the rank holding the
    most), its bytes per token measured once per checkpointing kind."""

    def __init__(self, model: Mapping[str, Any], shape: Mapping[str, int]) -> None:
        self.model, self.shape = model, shape
        self._profiles: dict[bool, ActivationProfile] = {}

    def peak(self, schedule: Mapping[str, Any], policy: Policy) -> float:
        """Bytes; ValueError (ConfigError included) when the planner refuses the layout."""
        job = bench_job(self.model, **self.shape, **schedule, **policy.keywords())
        selective = policy.activation_checkpoint == "selective"
        if selective not in self._profiles:
            self._profiles[selective] = activation_profile(job)
        plan = plan_memory(job, profile=self._profiles[selective])
        return max(rank.activations for rank in plan.ranks)


def _predicted(
    predictor: _Predictor, schedule: Mapping[str, Any], num_slices: int
) -> Iterator[tuple[Policy, float | ValueError]]:
    """`schedule`'s policies, cheapest first, each with its predicted peak or the planner's
    refusal; an offload ratio that leaves the peak where no offload has it is skipped (the
    schedule keeps nothing in flight long enough to offload: 1F1B and GPipe at m = p)."""
    unchanged: float | None = None
    for policy in policies(schedule["schedule"], num_slices):
        try:
            peak = predictor.peak(schedule, policy)
        except ValueError as error:
            yield policy, error
            continue
        if unchanged is None:
            unchanged = peak
        elif policy.activation_offload and peak >= unchanged * (1 - 1e-6):
            continue
        yield policy, peak


def _setup(
    parser: argparse.ArgumentParser, options: argparse.Namespace
) -> tuple[dict[str, Any], _Predictor]:
    """The checked model and its predictor."""
    model = checked_model(parser, options)
    m = options.microbatches
    shape = {"num_ranks": options.pp, "microbatches": m, "rows": m * options.rows_per_microbatch}
    return model, _Predictor(model, shape)


def _time(
    options: argparse.Namespace, model: dict[str, Any], runs: dict[str, dict[str, Any]]
) -> tuple[dict[str, float], dict[str, float], str]:
    """Tokens/s and the measured peak (the rank holding the most) of every run, timed in
    alternating rounds in the same ranks; and the header line saying how."""
    p = options.pp
    cores = rank_core_sets(p, pin=not options.no_pin)
    spec = {
        "model": model, "microbatches": options.microbatches,
        "rows_per_microbatch": options.rows_per_microbatch, "warmup": options.warmup,
        "repeats": options.repeats, "runs": runs, "step_peak": True, "record": False,
    }  # fmt: skip
    tokens = options.microbatches * options.rows_per_microbatch * options.seq
    header = (
        f"p={p} ranks, m={options.microbatches} microbatches of {options.rows_per_microbatch} x "
        f"{options.seq} tokens ({tokens} per step), 1 thread per rank, {describe_pinning(cores)}"
        f", GLIBC_TUNABLES={options.fair_tunables}; {options.warmup} warm-up and "
        f"{options.repeats} timed steps of each run, alternating"
    )
    print(describe_model(model))
    print(header, flush=True)
    ranks = run_ranks(
        "pipekit.bench._schedule_timing:time_schedules", p, spec,
        env={"GLIBC_TUNABLES": options.fair_tunables}, timeout=options.timeout, cores=cores,
    )  # fmt: skip
    samples = ranks[0]["samples"]  # every rank times the same barrier-to-barrier steps
    tokens_per_s = {name: tokens / statistics.median(samples[name]) for name in runs}
    peaks = {name: max(rank["step_peaks"][name] for rank in ranks) for name in runs}
    return tokens_per_s, peaks, header


def compare_at_budget(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Each schedule at the cheapest policy predicted to fit the budget; the table and RESULT."""
    model, predictor = _setup(parser, options)
    try:
        value, kind = parse_budget(options.memory_budget)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")
    reference = predictor.peak(BUDGET_SCHEDULES["1F1B"], Policy())
    budget = value * reference if kind == "fraction" else value
    runs, chosen, left_out = {}, {}, {}
    for name, schedule in BUDGET_SCHEDULES.items():
        smallest: tuple[float, Policy] | None = None
        for policy, peak in _predicted(predictor, schedule, options.slices):
            if isinstance(peak, ValueError):
                if policy == Policy() or policy == Policy(options.slices):
                    left_out[name] = f"not run: {peak}"
                    break
                continue  # this policy's layout is refused; a later one may run
            if peak <= budget:
                chosen[name] = (policy, peak)
                runs[name] = {**schedule, **policy.keywords()}
                break
            if smallest is None or peak < smallest[0]:
                smallest = (peak, policy)
        if name not in chosen and name not in left_out and smallest is not None:
            left_out[name] = (
                f"does not fit: its smallest predicted peak is {smallest[0] / _MIB:.1f} MiB "
                f"({smallest[1].label()})"
            )
    print(
        f"budget {budget / _MIB:.1f} MiB per rank"
        + (f" ({value:g} of 1F1B's predicted peak without recomputation, "
           f"{reference / _MIB:.1f} MiB)" if kind == "fraction" else "")
    )  # fmt: skip
    if not runs:
        parser.exit(2, f"{parser.prog}: error: no schedule fits {budget / _MIB:.1f} MiB\n")
    tokens_per_s, measured, _ = _time(options, model, runs)
    within = {name: measured[name] <= budget for name in runs}
    torch_names = [name for name in TORCH_SCHEDULES if within.get(name)]
    sliced_names = [name for name in runs if name.startswith("sliced") and within[name]]
    best_torch = max(torch_names, key=tokens_per_s.__getitem__, default=None)
    rows = []
    for name in runs:
        policy, predicted = chosen[name]
        versus = tokens_per_s[name] / tokens_per_s[best_torch] if best_torch else float("nan")
        rows.append([
            name, runs[name]["stages_per_rank"], policy.label(), predicted / _MIB,
            measured[name] / _MIB, "yes" if within[name] else "NO", tokens_per_s[name], versus,
        ])  # fmt: skip
    headers = ["schedule", "v", "policy", "predicted MiB", "measured MiB", "within"]
    print_table([*headers, "tokens/s", "vs best torch"], rows)
    for name, reason in left_out.items():
        print(f"{name} {reason}")
    for name in runs:
        if not within[name]:
            print(f"{name} measured above the budget: left out of the ratios")
    if best_torch is None or not sliced_names:
        print_result(budget_mib=budget / _MIB, compared="none: a side has no schedule within")
        return
    best_sliced = max(sliced_names, key=tokens_per_s.__getitem__)
    sliced = tokens_per_s["sliced"] if "sliced" in sliced_names else float("nan")
    print(f"\nfastest torch schedule: {best_torch}; fastest sliced: {best_sliced}")
    print_result(
        budget_sliced_vs_best_torch=sliced / tokens_per_s[best_torch],
        budget_best_sliced_vs_best_torch=tokens_per_s[best_sliced] / tokens_per_s[best_torch],
        budget_mib=budget / _MIB,
        best_torch=best_torch,
        best_torch_policy=chosen[best_torch][0].label().replace(" ", ""),
        best_sliced=best_sliced.replace(" ", "_"),
        best_sliced_policy=chosen[best_sliced][0].label().replace(" ", ""),
        max_measured_over_predicted=max(measured[n] / chosen[n][1] for n in runs),
    )


def sweep_budgets(parser: argparse.ArgumentParser, options: argparse.Namespace) -> None:
    """Every schedule under every policy: the table, the picture, and whether any torch point
    beats the fastest sliced one at equal or lower memory."""
    model, predictor = _setup(parser, options)
    runs, predicted = {}, {}
    for name, schedule in BUDGET_SCHEDULES.items():
        for policy, peak in _predicted(predictor, schedule, options.slices):
            if isinstance(peak, ValueError):
                print(f"{name} {policy.label()} not run: {peak}")
                if policy == Policy(options.slices if name.startswith("sliced") else 1):
                    break  # the schedule refuses the shape: no policy changes that
                continue
            key = f"{name} | {policy.label()}"
            runs[key] = {**schedule, **policy.keywords()}
            predicted[key] = peak
    tokens_per_s, measured, header = _time(options, model, runs)
    rows = [[key, predicted[key] / _MIB, measured[key] / _MIB, tokens_per_s[key]] for key in runs]
    print_table(["schedule | policy", "predicted MiB", "measured MiB", "tokens/s"], rows)
    points = {key: (measured[key] / _MIB, tokens_per_s[key]) for key in runs}
    _draw(points, Path(options.out), header)
    print(f"picture: {options.out}")
    sliced = [key for key in runs if key.startswith("sliced")]
    best = max(sliced, key=tokens_per_s.__getitem__)
    torch_keys = [key for key in runs if not key.startswith("sliced")]
    beaten_by = [
        key for key in torch_keys
        if measured[key] <= measured[best] and tokens_per_s[key] >= tokens_per_s[best]
    ]  # fmt: skip
    cheaper = [key for key in torch_keys if measured[key] <= measured[best]]
    fastest_cheaper = max(cheaper, key=tokens_per_s.__getitem__, default=None)
    print(f"\nfastest sliced point: {best}; torch points at equal or lower memory: {len(cheaper)}")
    print_result(
        best_sliced_point=best.replace(" ", ""),
        best_sliced_tokens_per_s=tokens_per_s[best],
        best_sliced_peak_mib=measured[best] / _MIB,
        torch_points_faster_at_equal_or_lower_memory=len(beaten_by),
        best_sliced_vs_fastest_torch_within_its_memory=(
            tokens_per_s[best] / tokens_per_s[fastest_cheaper] if fastest_cheaper else "none"
        ),
        max_measured_over_predicted=max(measured[k] / predicted[k] for k in runs),
    )


def _front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The points no point at equal or lower memory beats on tokens/s, by memory."""
    front: list[tuple[float, float]] = []
    for memory, speed in sorted(points, key=lambda point: (point[0], -point[1])):
        if not front or speed > front[-1][1]:
            front.append((memory, speed))
    return front


def _draw(points: dict[str, tuple[float, float]], out: Path, header: str) -> None:
    """Tokens/s against measured peak MiB: every run a point, each schedule's front a line."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("the picture needs matplotlib: pip install 'pipekit[viz]'") from None
    figure = Figure(figsize=(11, 6.5), dpi=110)
    FigureCanvasAgg(figure)
    ax = figure.subplots()
    by_schedule: dict[str, list[tuple[str, tuple[float, float]]]] = {}
    for key, point in points.items():
        schedule, policy = key.split(" | ", 1)
        by_schedule.setdefault(schedule, []).append((policy, point))
    for schedule, entries in by_schedule.items():
        style = "-" if schedule.startswith("sliced") else "--"
        front = _front([point for _, point in entries])
        (line,) = ax.plot(*zip(*front, strict=True), style, marker="o", label=schedule)
        for policy, (memory, speed) in entries:
            ax.scatter([memory], [speed], color=line.get_color(), s=12)
            ax.annotate(policy, (memory, speed), fontsize=6, xytext=(3, 2),
                        textcoords="offset points", color=line.get_color())  # fmt: skip
    ax.set_xlabel("measured peak beyond weights and gradients (MiB, the rank holding the most)")
    ax.set_ylabel("tokens/s")
    ax.set_title(header, fontsize=7)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(out)
