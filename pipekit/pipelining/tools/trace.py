"""Opt-in recording of an executed pipeline schedule: each compute action's real start and end.

    with record_schedule(runner) as recorder:
        runner.step(batch, num_label_tokens)
    timeline = gather_timeline(recorder)  # every rank's actions, on every rank of the pipeline

Inside `record_schedule` the runner's stages (`SlicedPipelineStage.action_observer`) time each
`forward_one_chunk` (F), `backward_one_chunk` (B, or I when torch splits the backward) and
`backward_weight_one_chunk` (W) call; outside it no observer is set and nothing is timed. The
ranks meet at a barrier on entry and time from it, so their clocks share an origin up to the
barrier's skew. On CUDA each action
synchronises the device before and after, so an event is the kernel time it caused (and the
recorded step runs without overlap of compute and communication). The loss of the last stage is
computed outside its forward and is not in any event.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist

from pipekit.pipelining.actions import Action
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.pipelining.schedules.events import ScheduledAction

__all__ = ["ScheduleRecorder", "gather_timeline", "record_pipeline_step", "record_schedule"]


@dataclass
class ScheduleRecorder:
    """This rank's recorded actions, timed in seconds from the common origin."""

    rank: int
    group: dist.ProcessGroup | None
    origin: float
    events: list[ScheduledAction] = field(default_factory=list)


@contextmanager
def record_schedule(runner: PipelineRunner) -> Iterator[ScheduleRecorder]:
    """Time every compute action the runner's stages run inside the block (see the module
    docstring); all ranks of the pipeline must enter together (a barrier on their group)."""
    stages = [stage for layout in runner.layouts for stage in layout.stages] or runner.stages
    group = stages[0].group
    for stage in stages:
        if stage.action_observer is not None:
            raise RuntimeError(f"stage {stage.stage_index} is already being recorded")
    if dist.is_initialized():
        dist.barrier(group=group)
    recorder = ScheduleRecorder(stages[0].group_rank, group, time.perf_counter())

    def observe(action: Action, start: float, end: float) -> None:
        recorder.events.append(
            ScheduledAction(recorder.rank, action, start - recorder.origin, end - recorder.origin)
        )

    for stage in stages:
        stage.action_observer = observe
    try:
        yield recorder
    finally:
        for stage in stages:
            stage.action_observer = None


def gather_timeline(
    recorder: ScheduleRecorder, group: dist.ProcessGroup | None = None
) -> list[ScheduledAction]:
    """Every rank's recorded actions, on every rank of `group` (default: the pipeline's), sorted
    by rank and start. A collective: all ranks of the group call it."""
    group = group if group is not None else recorder.group
    if not dist.is_initialized():
        return sorted(recorder.events, key=lambda event: (event.rank, event.start))
    gathered: list[list[ScheduledAction] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, recorder.events, group=group)
    events = [event for rank_events in gathered for event in rank_events or []]
    return sorted(events, key=lambda event: (event.rank, event.start))


@contextmanager
def record_pipeline_step(
    runner: PipelineRunner | None,
    output_dir: str | os.PathLike[str],
    *,
    enabled: bool,
    write: bool,
) -> Iterator[None]:
    """Record the block when `enabled` and `runner` is not None, gather the timeline, and (where
    `write`) save it as `pipeline_trace.json` (Chrome/Perfetto) and `pipeline_trace.svg` in
    `output_dir`. Otherwise the block runs untouched."""
    if not enabled or runner is None:
        yield
        return
    from pipekit.pipelining.tools.draw import save_timeline

    with record_schedule(runner) as recorder:
        yield
    events = gather_timeline(recorder)
    if write:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        for suffix in (".json", ".svg"):
            save_timeline(
                events,
                output_dir / f"pipeline_trace{suffix}",
                num_slices=runner.num_slices,
                title=f"executed pipeline step ({type(runner.schedule).__name__})",
                time_label="time (s)",
            )
