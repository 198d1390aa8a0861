"""Pictures of a pipeline timeline: ranks as rows, time to the right, one box per action.

A box's colour is its microbatch (a fixed palette, repeating after ten) and its shade the kind of
action: F light, B full, I darker, W darkest. A box is labelled with its slice index (its
microbatch when there is one slice per microbatch) where the label fits, and idle time is left
blank, so bubbles show as gaps; each row ends with its rank's idle share. SVG is written as text
and needs nothing else; PNG draws the same boxes with matplotlib (`pip install 'pipekit[viz]'`);
`.json` writes the Chrome/Perfetto trace (`pipekit.pipelining.tools.timeline.chrome_trace`).

    python -m pipekit.pipelining.tools.draw --schedule sliced --pp 4 --microbatches 2 --slices 8 \\
        --out sliced.svg
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

from pipekit.attention.document_lengths import (
    DocumentLengths,
    packed_document_ids,
    parse_document_lengths,
)
from pipekit.pipelining.schedules.document_costs import UnitShares, document_unit_shares
from pipekit.pipelining.schedules.events import ScheduledAction
from pipekit.pipelining.schedules.slice_bounds import (
    SLICINGS,
    equal_cost_fractions,
    slice_bounds,
)
from pipekit.pipelining.schedules.slice_layout import SliceLayout
from pipekit.pipelining.tools.timeline import write_chrome_trace

__all__ = ["main", "save_timeline", "timeline_svg"]

PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
"""Microbatch colours (matplotlib's tab10), repeating after ten microbatches."""

_KIND_SHADES = {"F": 0.55, "B": 0.0, "I": -0.3, "W": -0.55}
"""Per kind: > 0 mixes the microbatch colour with white, < 0 with black."""
_KIND_NAMES = {"F": "forward", "B": "backward", "I": "backward (input)", "W": "backward (weight)"}

_LEFT, _RIGHT, _TOP, _ROW, _ROW_GAP, _PLOT_WIDTH, _FONT = 70, 80, 34, 26, 6, 960, 11


@dataclass(frozen=True)
class _Box:
    """One action as drawn: its row, its extent in time, colours and texts."""

    row: int
    start: float
    end: float
    fill: str
    text: str
    text_fill: str
    tooltip: str


def _shade(colour: str, amount: float) -> str:
    channels = [int(colour[i : i + 2], 16) for i in (1, 3, 5)]
    target = 255 if amount > 0 else 0
    mixed = [round(c + (target - c) * abs(amount)) for c in channels]
    return "#" + "".join(f"{c:02x}" for c in mixed)


def _is_dark(colour: str) -> bool:
    red, green, blue = (int(colour[i : i + 2], 16) for i in (1, 3, 5))
    return 0.299 * red + 0.587 * green + 0.114 * blue < 140


def _boxes(
    events: Sequence[ScheduledAction], num_slices: int
) -> tuple[list[int], list[_Box], float, float]:
    """Rows (ranks in order), boxes, and the time span `(origin, makespan)` of a timeline."""
    if not events:
        raise ValueError("the timeline has no actions to draw")
    if num_slices < 1:
        raise ValueError(f"num_slices={num_slices} must be at least 1")
    ranks = sorted({event.rank for event in events})
    row_of = {rank: row for row, rank in enumerate(ranks)}
    origin = min(event.start for event in events)
    makespan = max(event.end for event in events) - origin
    boxes = []
    for event in events:
        microbatch, slice_index = event.microbatch_and_slice(num_slices)
        fill = _shade(PALETTE[microbatch % len(PALETTE)], _KIND_SHADES.get(event.kind, 0.0))
        boxes.append(
            _Box(
                row=row_of[event.rank],
                start=event.start - origin,
                end=event.end - origin,
                fill=fill,
                text=str(slice_index if num_slices > 1 else microbatch),
                text_fill="#ffffff" if _is_dark(fill) else "#000000",
                tooltip=event.label(num_slices),
            )
        )
    return ranks, boxes, origin, makespan


def _idle_fractions(events: Sequence[ScheduledAction], makespan: float) -> dict[int, float]:
    busy: dict[int, float] = {}
    for event in events:
        busy[event.rank] = busy.get(event.rank, 0.0) + event.end - event.start
    return {rank: 1.0 - total / makespan if makespan > 0 else 0.0 for rank, total in busy.items()}


def _tick_step(span: float, max_ticks: int = 10) -> float:
    """A round step (1, 2 or 5 times a power of ten) giving at most `max_ticks` ticks."""
    if span <= 0:
        return 1.0
    raw = span / max_ticks
    power = 10 ** math.floor(math.log10(raw))
    return next(m * power for m in (1, 2, 5, 10) if m * power >= raw)


def _legend_entries(events: Sequence[ScheduledAction], num_slices: int) -> list[tuple[str, str]]:
    microbatches = sorted({event.microbatch_and_slice(num_slices)[0] for event in events})
    entries = [(PALETTE[mb % len(PALETTE)], f"mb {mb}") for mb in microbatches[: len(PALETTE)]]
    kinds = [kind for kind in _KIND_SHADES if any(event.kind == kind for event in events)]
    entries += [(_shade("#808080", _KIND_SHADES[kind]), _KIND_NAMES[kind]) for kind in kinds]
    return entries


def _legend_layout(
    entries: list[tuple[str, str]], *, top: int, width: int
) -> list[tuple[float, int, str, str]]:
    """`(x, y, colour, name)` of each legend entry, in lines that fit `width`."""
    layout, x, y = [], float(_LEFT), top
    for colour, name in entries:
        entry_width = 16 + len(name) * _FONT * 0.62 + 14
        if x > _LEFT and x + entry_width > width:
            x, y = float(_LEFT), y + 20
        layout.append((x, y, colour, name))
        x += entry_width
    return layout


def timeline_svg(
    events: Sequence[ScheduledAction],
    *,
    num_slices: int = 1,
    title: str = "",
    time_label: str = "time",
    time_span: float | None = None,
) -> str:
    """An SVG document of the timeline (see the module docstring for what it shows); every action
    is one `<rect class="action">` with a `<title>` tooltip naming it. The time axis runs to
    `time_span` when that is longer than the timeline, to draw several on one scale."""
    ranks, boxes, _, makespan = _boxes(events, num_slices)
    span = max(makespan, time_span or 0.0)
    scale = _PLOT_WIDTH / span if span > 0 else 0.0
    plot_bottom = _TOP + len(ranks) * (_ROW + _ROW_GAP)
    width = _LEFT + _PLOT_WIDTH + _RIGHT
    legend = _legend_layout(_legend_entries(events, num_slices), top=plot_bottom + 44, width=width)
    height = legend[-1][1] + 24
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="{_FONT}">',
        f'<rect class="background" width="{width}" height="{height}" fill="#ffffff"/>',
    ]
    if title:
        parts.append(f'<text x="{_LEFT}" y="20" font-size="14">{escape(title)}</text>')
    idle = _idle_fractions(events, makespan)
    for row, rank in enumerate(ranks):
        y = _TOP + row * (_ROW + _ROW_GAP)
        parts.append(
            f'<rect class="row" x="{_LEFT}" y="{y}" width="{makespan * scale:.2f}" height="{_ROW}" '
            'fill="#f4f4f4"/>'
        )
        text_y = y + _ROW / 2 + 4
        parts.append(f'<text x="{_LEFT - 8}" y="{text_y}" text-anchor="end">rank {rank}</text>')
        parts.append(
            f'<text x="{_LEFT + _PLOT_WIDTH + 6}" y="{text_y}">idle {idle[rank]:.0%}</text>'
        )
    for box in boxes:
        x, y = _LEFT + box.start * scale, _TOP + box.row * (_ROW + _ROW_GAP)
        box_width = (box.end - box.start) * scale
        parts.append(
            f'<rect class="action" x="{x:.2f}" y="{y}" width="{box_width:.2f}" height="{_ROW}" '
            f'fill="{box.fill}" stroke="#ffffff" stroke-width="0.5">'
            f"<title>{escape(box.tooltip)}</title></rect>"
        )
        if box_width >= len(box.text) * _FONT * 0.62 + 2:
            parts.append(
                f'<text class="label" x="{x + box_width / 2:.2f}" y="{y + _ROW / 2 + 4}" '
                f'text-anchor="middle" fill="{box.text_fill}">{escape(box.text)}</text>'
            )
    parts.append(
        f'<line x1="{_LEFT}" y1="{plot_bottom}" x2="{_LEFT + _PLOT_WIDTH}" y2="{plot_bottom}" '
        'stroke="#000000"/>'
    )
    step = _tick_step(span)
    for index in range(int(span / step + 1e-9) + 1):
        x = _LEFT + index * step * scale
        parts.append(
            f'<line x1="{x:.2f}" y1="{plot_bottom}" x2="{x:.2f}" y2="{plot_bottom + 4}" '
            'stroke="#000000"/>'
        )
        parts.append(
            f'<text x="{x:.2f}" y="{plot_bottom + 16}" text-anchor="middle">'
            f"{round(index * step, 9):g}</text>"
        )
    parts.append(
        f'<text x="{_LEFT + _PLOT_WIDTH / 2}" y="{plot_bottom + 30}" text-anchor="middle">'
        f"{escape(time_label)}</text>"
    )
    for x, y, colour, name in legend:
        parts.append(
            f'<rect class="legend" x="{x:.1f}" y="{y}" width="12" height="12" fill="{colour}"/>'
        )
        parts.append(f'<text x="{x + 16:.1f}" y="{y + 10}">{escape(name)}</text>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _write_png(
    events: Sequence[ScheduledAction],
    path: str | os.PathLike[str],
    *,
    num_slices: int,
    title: str,
    time_label: str,
    time_span: float | None,
) -> None:
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError:
        raise ImportError(
            "PNG output needs matplotlib: pip install 'pipekit[viz]' (or write .svg, which "
            "needs nothing)"
        ) from None
    ranks, boxes, _, makespan = _boxes(events, num_slices)
    figure = Figure(figsize=(12, 0.4 * len(ranks) + 1.2), dpi=150)
    FigureCanvasAgg(figure)
    axes = figure.add_subplot()
    span = max(makespan, time_span or 0.0)
    pixels_per_unit = 12 * 150 * 0.8 / span if span > 0 else 0.0
    for box in boxes:
        axes.barh(
            box.row,
            box.end - box.start,
            left=box.start,
            height=0.8,
            color=box.fill,
            edgecolor="#ffffff",
            linewidth=0.5,
        )
        if (box.end - box.start) * pixels_per_unit >= len(box.text) * 9 + 4:
            axes.text(
                (box.start + box.end) / 2,
                box.row,
                box.text,
                ha="center",
                va="center",
                fontsize=7,
                color=box.text_fill,
            )
    idle = _idle_fractions(events, makespan)
    axes.set_yticks(range(len(ranks)), [f"rank {rank}" for rank in ranks])
    axes.set_ylim(len(ranks) - 0.5, -0.5)
    axes.set_xlim(0, span)
    axes.set_xlabel(time_label)
    for row, rank in enumerate(ranks):
        axes.text(span * 1.005, row, f"idle {idle[rank]:.0%}", va="center", fontsize=8)
    if title:
        axes.set_title(title)
    handles = [
        Patch(color=colour, label=name) for colour, name in _legend_entries(events, num_slices)
    ]
    axes.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.12 - 1.0 / (len(ranks) + 2)),
        ncol=min(len(handles), 8),
        fontsize=7,
        frameon=False,
    )
    figure.savefig(path, bbox_inches="tight")


def save_timeline(
    events: Sequence[ScheduledAction],
    path: str | os.PathLike[str],
    *,
    num_slices: int = 1,
    title: str = "",
    time_label: str = "time",
    time_span: float | None = None,
    time_unit_s: float = 1.0,
) -> None:
    """Write the timeline as `.svg`, `.png` (needs matplotlib) or `.json` (Chrome/Perfetto trace,
    one time unit = `time_unit_s` seconds), chosen by the suffix of `path`; `time_span` as in
    `timeline_svg`."""
    suffix = Path(path).suffix.lower()
    picture = {"num_slices": num_slices, "title": title, "time_label": time_label}
    if suffix == ".svg":
        Path(path).write_text(timeline_svg(events, **picture, time_span=time_span))
    elif suffix == ".png":
        _write_png(events, path, **picture, time_span=time_span)
    elif suffix == ".json":
        write_chrome_trace(events, path, num_slices=num_slices, time_unit_s=time_unit_s)
    else:
        raise ValueError(f"path={str(path)!r}: write .svg, .png or .json (a Chrome/Perfetto trace)")


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    from pipekit.pipelining.schedules.registry import SCHEDULES

    generated = [name for name, entry in SCHEDULES.items() if entry.actions is not None]
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.pipelining.tools.draw",
        description="Simulate a pipeline schedule and draw its timeline (SVG, PNG or trace JSON).",
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--schedule",
        default="sliced",
        choices=generated,
        help="a schedule of the registry (default: sliced)",
    )
    source.add_argument(
        "--actions-csv", help="draw a user schedule: torch's compute-only CSV, one row per rank"
    )
    parser.add_argument("--pp", type=int, default=4, help="pipeline ranks (default: 4)")
    parser.add_argument("--microbatches", type=int, default=8, help="microbatches (default: 8)")
    parser.add_argument(
        "--slices",
        type=int,
        default=1,
        help="slices per microbatch (sliced schedule, or the CSV's units; default: 1)",
    )
    parser.add_argument(
        "--stages-per-rank",
        type=int,
        default=None,
        help="stages per rank (default: 2 for V-shaped schedules, else 1)",
    )
    parser.add_argument(
        "--attention-share",
        type=float,
        default=0.0,
        help="share of an action's cost that is causal attention, growing with the attended "
        "length, so later slices are heavier (default: 0, uniform costs)",
    )
    parser.add_argument(
        "--slicing",
        default="equal_length",
        choices=SLICINGS,
        help="where slices are cut: equal lengths, or equal costs under --attention-share "
        "(early slices longer; default: equal_length)",
    )
    parser.add_argument(
        "--document-lengths",
        default="",
        help="packed documents: a distribution as [data] document_lengths names it (e.g. "
        '"lognormal:median=1024,sigma=1.6" or a .json histogram); each microbatch is one row of '
        "--seq-len tokens drawn from it, priced (and with --slicing documents, cut) by its "
        "documents (default: one causal sequence per row)",
    )
    parser.add_argument(
        "--seq-len", type=int, default=8192, help="tokens per row with --document-lengths"
    )
    parser.add_argument(
        "--work-block",
        type=int,
        default=128,
        help="the attention kernel's tile, in tokens, a document's work is counted in "
        "(default: 128, FlexAttention's block)",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the drawn rows")
    parser.add_argument(
        "--time-span",
        type=float,
        default=None,
        help="length of the time axis, to draw several schedules on one scale (default: the "
        "makespan)",
    )
    parser.add_argument("--title", default=None, help="picture title (default: describes the run)")
    parser.add_argument("--out", required=True, help="output file: .svg, .png or .json")
    return parser.parse_args(argv)


def _actions_and_title(args: argparse.Namespace) -> tuple[dict, str]:
    from pipekit.pipelining.schedules.registry import ScheduleShape, get_schedule
    from pipekit.pipelining.schedules.user import read_actions_csv

    if args.actions_csv:
        return read_actions_csv(args.actions_csv), Path(args.actions_csv).name
    entry = get_schedule(args.schedule)
    stages_per_rank = args.stages_per_rank or entry.stages_per_rank or 1
    shape = ScheduleShape(args.pp, args.microbatches, args.slices, stages_per_rank)
    entry.check(shape)
    assert entry.actions is not None  # only generated schedules are choices
    title = f"{args.schedule} p={args.pp} m={args.microbatches}"
    if stages_per_rank > 1:
        title += f" v={stages_per_rank}"
    if entry.sliced:
        title += f" n={args.slices}"
    return entry.actions(shape), title


def _drawn_shares(args: argparse.Namespace, lengths: DocumentLengths) -> UnitShares:
    """Each microbatch's slices' shares of a row drawn from `lengths`, cut by `--slicing`."""
    share = args.attention_share
    if share >= 1.0:
        raise ValueError("--attention-share must be below 1 with --document-lengths")
    attention_to_linear = share / (1.0 - share)
    layout = SliceLayout(
        slice_bounds(args.seq_len, args.slices, args.slicing, attention_to_linear),
        slicing=args.slicing,
        attention_to_linear=attention_to_linear,
        work_block=args.work_block,
    )
    document_ids_BS = packed_document_ids(lengths, args.microbatches, args.seq_len, args.seed)
    return document_unit_shares(layout, document_ids_BS, args.microbatches)


def main(argv: Sequence[str] | None = None) -> None:
    """Simulate the schedule the arguments name and write its timeline to `--out`."""
    from pipekit.pipelining.schedules.simulate import CostModel, simulate

    args = _parse_args(argv)
    actions, title = _actions_and_title(args)
    if args.attention_share:
        title += f", attention share {args.attention_share:g}"
    if not 0.0 <= args.attention_share <= 1.0:
        raise ValueError(f"--attention-share {args.attention_share} must be in [0, 1]")
    bounds: tuple[float, ...] = ()
    if args.slicing != "equal_length":
        title += {"equal_cost": ", equal-cost slices", "documents": ", slices cut by documents"}[
            args.slicing
        ]
        bounds = equal_cost_fractions(args.slices, args.attention_share)
    cost = CostModel(
        forward_linear=1.0 - args.attention_share,
        forward_attention=args.attention_share,
        slice_bounds=bounds,
    )
    if args.document_lengths:
        lengths = parse_document_lengths(args.document_lengths)
        assert lengths is not None
        title += f", {lengths.label}"
        cost = dataclasses.replace(cost, unit_shares=_drawn_shares(args, lengths))
    elif args.slicing == "documents":
        raise ValueError(
            "--slicing documents cuts each microbatch by its documents; give --document-lengths"
        )
    result = simulate(actions, num_slices=args.slices, cost=cost)
    save_timeline(
        result.timeline,
        args.out,
        num_slices=args.slices,
        title=args.title or title,
        time_span=args.time_span,
    )
    bubbles = ", ".join(f"{share:.3f}" for _, share in sorted(result.bubble_fraction.items()))
    print(
        f"{title}: makespan {result.makespan:g}, bubble fraction per rank {bubbles} -> {args.out}"
    )


if __name__ == "__main__":
    main()
