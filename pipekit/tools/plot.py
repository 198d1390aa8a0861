"""Loss curves of one or more runs, and the step-by-step loss difference between two.

    python -m pipekit.tools.plot RUN_DIR [RUN_DIR ...] --out curves.png [--labels A B ...]
    python -m pipekit.tools.plot compare RUN_A RUN_B [--metric loss] [--tolerance 1e-5]

A run is a job's output folder (its `metrics.jsonl`) or a metrics JSONL file. The picture puts
the loss of every run against step (its val_loss dashed, if it logged one), and tokens/s per
device beside it. `compare` prints the
steps both runs logged where they differ most and a final `RESULT max_difference=...` line; with
`--tolerance` it exits 1 when the largest difference is above it (a check for CI).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

from pipekit.bench.report import print_result, print_table
from pipekit.train.metric_writers import read_jsonl_rows

__all__ = ["compare_runs", "main", "plot_runs", "read_run"]

METRICS_FILE = "metrics.jsonl"


def read_run(run: str | Path, metric: str = "loss") -> dict[int, float]:
    """step -> `metric` of a run folder or metrics file; ValueError naming a missing one."""
    path = Path(run)
    if path.is_dir():
        path = path / METRICS_FILE
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass a job's output_dir or its metrics JSONL")
    rows = read_jsonl_rows(path)
    values = {int(row["step"]): float(row[metric]) for row in rows if metric in row}
    if not values:
        raise ValueError(
            f"{path} logs no {metric!r}; metrics it logs: {sorted(rows[0]) if rows else 'none'}"
        )
    return values


def compare_runs(run_a: str | Path, run_b: str | Path, metric: str = "loss") -> tuple[float, int]:
    """(largest |a - b| over the steps both runs logged, the step where it is)."""
    return _largest_difference(read_run(run_a, metric), read_run(run_b, metric))


def _largest_difference(a: dict[int, float], b: dict[int, float]) -> tuple[float, int]:
    common = set(a) & set(b)
    if not common:
        raise ValueError("the two runs logged no step in common")
    step = max(sorted(common), key=lambda s: abs(a[s] - b[s]))
    return abs(a[step] - b[step]), step


def plot_runs(runs: list[str], labels: list[str], out: Path) -> None:
    """Loss (left) and tokens/s per device (right) of every run against step, as a PNG."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("plots need matplotlib: pip install 'pipekit[viz]'") from None
    figure = Figure(figsize=(11, 4), dpi=120)
    FigureCanvasAgg(figure)
    loss_axes, speed_axes = figure.subplots(1, 2)
    for run, label in zip(runs, labels, strict=True):
        losses = read_run(run)
        line = loss_axes.plot(list(losses), list(losses.values()), label=label, linewidth=1.2)
        with contextlib.suppress(ValueError):  # runs without validation log no val_loss
            held_out = read_run(run, "val_loss")
            loss_axes.plot(
                list(held_out),
                list(held_out.values()),
                linestyle="--",
                color=line[0].get_color(),
                label=f"{label} (val_loss)",
            )
        try:
            speeds = read_run(run, "tokens_per_s_per_device")
        except ValueError:  # written before per-device throughput was logged
            continue
        speed_axes.plot(list(speeds), list(speeds.values()), label=label, linewidth=1.2)
    for axes, name in ((loss_axes, "loss"), (speed_axes, "tokens/s per device")):
        axes.set_xlabel("step")
        axes.set_ylabel(name)
        axes.grid(alpha=0.3)
        axes.legend()
    figure.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out)


def _compare(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m pipekit.tools.plot compare")
    parser.add_argument("runs", nargs=2, help="two output folders or metrics JSONL files")
    parser.add_argument("--metric", default="loss")
    parser.add_argument("--tolerance", type=float, default=None, help="exit 1 above this")
    args = parser.parse_args(argv)
    a, b = (read_run(run, args.metric) for run in args.runs)
    common = sorted(set(a) & set(b))
    difference, step = _largest_difference(a, b)
    worst = sorted(common, key=lambda s: -abs(a[s] - b[s]))[:10]
    print_table(
        ["step", f"{args.metric} A", f"{args.metric} B", "|A - B|"],
        [(s, a[s], b[s], abs(a[s] - b[s])) for s in sorted(worst)],
    )
    print_result(max_difference=difference, at_step=step, common_steps=len(common))
    return 1 if args.tolerance is not None and difference > args.tolerance else 0


def main(argv: list[str]) -> int:
    try:
        if argv[:1] == ["compare"]:
            return _compare(argv[1:])
        parser = argparse.ArgumentParser(prog="python -m pipekit.tools.plot")
        parser.add_argument("runs", nargs="+", help="output folders or metrics JSONL files")
        parser.add_argument("--out", type=Path, required=True, help="the PNG to write")
        parser.add_argument("--labels", nargs="+", help="one per run (default: folder names)")
        args = parser.parse_args(argv)
        labels = args.labels or [Path(run).name for run in args.runs]
        if len(labels) != len(args.runs):
            parser.error(f"--labels names {len(labels)} runs, but {len(args.runs)} are given")
        plot_runs(args.runs, labels, args.out)
    except (ValueError, ImportError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
