"""Where a rank's CPU went in the pipeline benches' timed steps, thread by thread.

On a CPU the context exchange's moved attention runs on the serving rank's own cores, and gloo
moves its bytes with them too. The simulator takes the moved work to cost the server what it
saves the lender, and the transfers to cost nothing: then the exchange leaves the step's CPU
seconds as they are and only fills idle time. These figures, from the worker's per-step CPU
clocks (`time_schedules`), say how far that holds: per rank, the rank's own thread, the serving
threads, the rest (gloo's threads), and the step's seconds not spent on CPU (with one core per
rank, the core's idle time).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from pipekit.bench.report import paired_ratios, print_table

__all__ = ["cpu_ratio", "print_cpu_per_step"]


_Steps = Sequence[Mapping[str, float]]
"""One rank's timed steps of one schedule: each step's CPU seconds by clock (the worker's)."""


def _own_s(steps: _Steps) -> float:
    return statistics.median(step["rank_thread_s"] for step in steps)


def _serving_s(steps: _Steps) -> float:
    return statistics.median(step["serving_s"] for step in steps)


def _other_s(steps: _Steps) -> float:
    """gloo's threads and any other: the process's CPU less the rank's and the serving ones'."""
    return statistics.median(
        step["process_s"] - step["rank_thread_s"] - step["serving_s"] for step in steps
    )


def _process_s(rank: Mapping[str, Any], name: str) -> list[float]:
    return [step["process_s"] for step in rank["cpu"][name]]


def cpu_ratio(ranks: Sequence[Mapping[str, Any]], plain: str, other: str) -> float:
    """The median over rounds of `other`'s CPU seconds per step over `plain`'s, all ranks
    summed (`paired_ratios`)."""

    def per_step(name: str) -> list[float]:
        return [
            sum(steps) for steps in zip(*(_process_s(rank, name) for rank in ranks), strict=True)
        ]

    ratios = paired_ratios(per_step(other), per_step(plain))
    return statistics.median(ratios)


def print_cpu_per_step(
    ranks: Sequence[Mapping[str, Any]], names: Sequence[str], plain: str, exchanged: str
) -> float:
    """Print each schedule's CPU seconds per step by thread (medians over the timed steps),
    then the `exchanged` schedule's against `plain`'s, all ranks; returns
    `cpu_ratio(ranks, plain, exchanged)`."""
    rows = []
    for name in names:
        for rank, result in enumerate(ranks):
            steps, seconds = result["cpu"][name], result["samples"][name]
            idle = [step_s - step["process_s"] for step_s, step in zip(seconds, steps, strict=True)]
            row = [statistics.median(seconds), _own_s(steps), _serving_s(steps), _other_s(steps)]
            rows.append([name, rank, *row, statistics.median(idle)])
    print("\nCPU seconds per step (medians of the timed steps), per rank:")
    headers = ["schedule", "rank", "step s", "rank's thread s", "serving threads s"]
    print_table([*headers, "other threads s", "step - CPU s"], rows)

    def total(name: str, part: Callable[[_Steps], float]) -> float:
        return sum(part(rank["cpu"][name]) for rank in ranks)

    ratio = cpu_ratio(ranks, plain, exchanged)
    print(
        f"{exchanged}, all ranks (medians): the ranks' own threads "
        f"{total(exchanged, _own_s):.4g} s against {plain}'s {total(plain, _own_s):.4g} s, the "
        f"serving threads {total(exchanged, _serving_s):.4g} s, the other threads "
        f"{total(exchanged, _other_s):.3g} s against {total(plain, _other_s):.3g} s; CPU per "
        f"step {ratio:.4g}x {plain}'s (median of the per-round ratios)"
    )
    return ratio
