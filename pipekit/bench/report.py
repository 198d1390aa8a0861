"""Shared pieces of every benchmark and tool that prints figures: timing, a plain-text table, the
final RESULT line."""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from pipekit.text_table import format_table

__all__ = [
    "machine_description",
    "max_over_mean",
    "paired_ratios",
    "print_result",
    "print_table",
    "time_call",
]


def _cpu_model() -> str:
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine_description() -> str:
    """The CPU and the kernels torch picked for it: figures differ between AVX2 and AVX-512."""
    capability = torch.backends.cpu.get_cpu_capability()
    gpu = f"GPU {torch.cuda.get_device_name()}, " if torch.cuda.is_available() else ""
    return (
        f"{gpu}CPU {_cpu_model()} ({platform.machine()}, torch CPU capability {capability}), "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads"
    )


def time_call(fn: Callable[[], object], warmup: int = 2, repeats: int = 5) -> float:
    """Median wall-clock seconds of `fn()` after `warmup` untimed calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def paired_ratios(numerators: Sequence[float], denominators: Sequence[float]) -> list[float]:
    """Round by round ratios of two alternately timed figures: each round's pair shares the
    machine's state, which drifts over a run by more than the effects the benches look for."""
    return [top / bottom for top, bottom in zip(numerators, denominators, strict=True)]


def max_over_mean(values: Sequence[float]) -> float:
    """The largest of `values` over their mean: how far the slowest of equal shares lags."""
    return max(values) * len(values) / sum(values)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """Left-aligned columns, floats in 4 significant digits."""
    print(format_table(headers, rows))


def print_result(**figures: object) -> None:
    """The last line of every benchmark: `RESULT key=value ...`."""
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in figures.items()]
    print("RESULT " + " ".join(parts), flush=True)
