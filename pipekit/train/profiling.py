"""`[profiling]`: torch.profiler traces of chosen steps, and where the step's memory went.

For each step in `profiling.steps`, every rank writes into `{output_dir}/{profiling.folder}/
step-N/`:
- `rank{R}_trace.json`: a torch.profiler trace (open it in Perfetto or chrome://tracing). torch
  names each pipeline action `PP:<action>`; pipekit adds what runs inside it: `pipekit: F stage
  s microbatch m slice k` for each forward, backward (B, or I/W) of a slice, `exchange: ...` for
  attention context served to or awaited from another pipeline rank, `moe: partition p/n ...`
  for each of MPipeMoE's pipelined all-to-all partitions.
- with `memory = true`, `rank{R}_memory.json`: the live bytes of what autograd saved for
  backward, the KV cache and the stage inputs (`pipekit.memory.tracker`), with the process's
  RSS, each time they change during the step, as Chrome-trace counters (Perfetto draws them as
  tracks). On CUDA also `rank{R}_cuda_memory.pickle`, the caching allocator's history for
  https://pytorch.org/memory_viz.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

from pipekit._torch_private import dump_cuda_memory_snapshot, record_cuda_memory_history
from pipekit.config.job_config import ProfilingConfig
from pipekit.memory.tracker import CATEGORIES, ActivationMemoryTracker, process_memory_bytes

__all__ = ["MemoryTimeline", "StepProfiler"]

logger = logging.getLogger(__name__)


class MemoryTimeline:
    """Samples a tracker's live bytes per category (and RSS) at every change."""

    def __init__(self) -> None:
        self.origin = time.perf_counter()
        self.samples: list[tuple[float, dict[str, int], int | None]] = []

    def sample(self, tracker: ActivationMemoryTracker) -> None:
        live = {category: tracker.live_bytes(category) for category in CATEGORIES}
        rss = process_memory_bytes().get("VmRSS")
        self.samples.append((time.perf_counter() - self.origin, live, rss))

    def chrome_trace(self, rank: int) -> dict[str, Any]:
        """Counter events ("ph": "C") in MiB, one track for activations and one for RSS."""
        events = []
        for seconds, live, rss in self.samples:
            timestamp = seconds * 1e6
            megabytes = {category: nbytes / 2**20 for category, nbytes in live.items()}
            events.append(_counter("activation memory (MiB)", rank, timestamp, megabytes))
            if rss is not None:
                events.append(_counter("rss (MiB)", rank, timestamp, {"rss": rss / 2**20}))
        return {"traceEvents": events, "displayTimeUnit": "ms"}


def _counter(name: str, rank: int, timestamp: float, values: dict[str, float]) -> dict[str, Any]:
    return {"name": name, "ph": "C", "ts": timestamp, "pid": rank, "args": values}


class StepProfiler:
    """`with profiler.step(n):` around step n; profiles it if the config names it."""

    def __init__(
        self, config: ProfilingConfig, output_dir: Path, rank: int, exclude: list[torch.Tensor]
    ) -> None:
        self.config, self.rank = config, rank
        self.folder = output_dir / config.folder
        self._exclude = exclude  # parameters: weights a layer saves are not activations

    @contextlib.contextmanager
    def step(self, step: int) -> Iterator[None]:
        if step not in self.config.steps:
            yield
            return
        folder = self.folder / f"step-{step}"
        folder.mkdir(parents=True, exist_ok=True)
        cuda = torch.cuda.is_available()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        timeline = MemoryTimeline()
        with contextlib.ExitStack() as stack:
            if self.config.memory:
                stack.enter_context(
                    ActivationMemoryTracker(self._exclude, on_change=timeline.sample)
                )
                if cuda:
                    record_cuda_memory_history(True)
            profiler = stack.enter_context(
                profile(activities=activities, profile_memory=self.config.memory)
            )
            yield
        trace = folder / f"rank{self.rank}_trace.json"
        profiler.export_chrome_trace(str(trace))
        if self.config.memory:
            memory = folder / f"rank{self.rank}_memory.json"
            memory.write_text(json.dumps(timeline.chrome_trace(self.rank)))
            if cuda:
                dump_cuda_memory_snapshot(str(folder / f"rank{self.rank}_cuda_memory.pickle"))
                record_cuda_memory_history(False)
        logger.info("profiled step %d: %s", step, folder)
