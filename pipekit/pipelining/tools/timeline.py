"""Chrome/Perfetto trace JSON of a pipeline timeline (`ScheduledAction`s).

The simulator returns a timeline, the recorder of an executed step (`tools.trace`) gathers
one; this writes either as trace-event JSON for ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence

from pipekit.pipelining.schedules.events import ScheduledAction

__all__ = ["chrome_trace", "write_chrome_trace"]


def chrome_trace(
    events: Iterable[ScheduledAction], *, num_slices: int = 1, time_unit_s: float = 1.0
) -> dict:
    """Chrome/Perfetto trace-event JSON (load in ui.perfetto.dev or chrome://tracing).

    One process per rank (`pid = rank`, named "rank r") and one complete event (`"ph": "X"`) per
    action; `ts` and `dur` are microseconds, an event's time multiplied by `time_unit_s`.
    """
    if num_slices < 1:
        raise ValueError(f"num_slices={num_slices} must be at least 1")
    events = sorted(events, key=lambda event: (event.rank, event.start))
    trace_events: list[dict] = []
    for rank in sorted({event.rank for event in events}):
        trace_events.append(
            {
                "name": "process_name",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"name": f"rank {rank}"},
            }
        )
        trace_events.append(
            {
                "name": "process_sort_index",
                "ph": "M",
                "pid": rank,
                "tid": 0,
                "args": {"sort_index": rank},
            }
        )
    to_us = time_unit_s * 1e6
    for event in events:
        microbatch, slice_index = event.microbatch_and_slice(num_slices)
        trace_events.append(
            {
                "name": event.label(num_slices),
                "cat": event.kind,
                "ph": "X",
                "pid": event.rank,
                "tid": 0,
                "ts": event.start * to_us,
                "dur": (event.end - event.start) * to_us,
                "args": {
                    "stage": event.action.stage_index,
                    "microbatch": microbatch,
                    "slice": slice_index,
                    "unit": event.action.microbatch_index,
                    "kind": event.kind,
                },
            }
        )
    return {"traceEvents": trace_events, "displayTimeUnit": "ms"}


def write_chrome_trace(
    events: Sequence[ScheduledAction],
    path: str | os.PathLike[str],
    *,
    num_slices: int = 1,
    time_unit_s: float = 1.0,
) -> None:
    """Write `chrome_trace(events, ...)` to `path` as JSON."""
    with open(path, "w") as handle:
        json.dump(chrome_trace(events, num_slices=num_slices, time_unit_s=time_unit_s), handle)
