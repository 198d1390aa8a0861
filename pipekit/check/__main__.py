"""`python -m pipekit.check --config x.toml [--world-size N] [--layouts a,b] [overrides]`.

Checks the config by every rule training applies, then runs the job's model in float64 for one
step under every parallel layout the world size allows (FSDP, tensor, context and expert
parallelism, the sliced pipeline with and without context exchange and vocabulary parallelism)
on N CPU gloo ranks, each against one process on the same weights and batch, and prints the
relative differences of the loss and of the gradients (each gradient's on the scale of the
reference's largest gradient, so one that is zero in exact arithmetic is not read as wrong).
A failure of a model whose MoE routers drop tokens over capacity is marked as likely that: the
tokens dropped depend on the split; --dropless checks without drops. Exits 0 when every layout
that ran matched, 1 when one did not, 2 for bad input (the config, the options) or when no
layout could run.
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from pipekit.check.capacity import capacity_note, capacity_routers, dropless
from pipekit.check.layouts import LAYOUTS, Layout, PlannedLayout, plan_layout, run_layouts
from pipekit.config.loader import ConfigError, load_job_config
from pipekit.distributed.parallel_dims import ParallelDims
from pipekit.testing import Comparison, Result, compare, parity_batch, reference_step
from pipekit.train.job import Job, validate_job

__all__ = ["main"]

_DEFAULT_TOLERANCE = 1e-10
"""What float64 parity allows: a correct layout differs by rounding (about 1e-15 to 1e-12)."""
_MAX_SEQ_LEN = 64
"""Longest sequence the check runs by default: enough for every layout, fast on a CPU."""
_ROWS_PER_RANK = 2
_CAPACITY_FAIL = "FAIL (capacity drops?)"
"""The verdict of a failed layout of a model whose routers drop tokens over capacity."""
_MAX_WORLD_SIZE = 4


def _parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    names = ", ".join(layout.name for layout in LAYOUTS)
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.check",
        description=" ".join(__doc__.split("\n\n")[1].split()),
        epilog="--config x.toml and any --section.key value (overrides) work as in train.py.",
        allow_abbrev=False,
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=0,
        help=f"CPU ranks, 2 to {_MAX_WORLD_SIZE} (default: the fewest the config's degrees "
        f"allow, at least 2 and at most {_MAX_WORLD_SIZE})",
    )
    parser.add_argument("--layouts", default="", help=f"comma-separated subset of: {names}")
    parser.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help=f"tokens per sequence (default: training.seq_len, at most {_MAX_SEQ_LEN})",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=_DEFAULT_TOLERANCE,
        help=f"largest relative difference a layout may show (default {_DEFAULT_TOLERANCE:g})",
    )
    parser.add_argument(
        "--timeout", type=float, default=600.0, help="seconds a process group may take"
    )
    parser.add_argument(
        "--dropless",
        action="store_true",
        help="route without expert capacity (every MoEArgs capacity_factor = None): which "
        "tokens a capacity drops depends on how a layout splits the batch",
    )
    return parser.parse_known_args(argv)


def _world_size(requested: int, job: Job) -> int:
    if requested == 0:
        return min(max(job.dims.world_size, 2), _MAX_WORLD_SIZE)
    if not 2 <= requested <= _MAX_WORLD_SIZE:
        raise ValueError(
            f"--world-size {requested}: the check runs 2 to {_MAX_WORLD_SIZE} CPU ranks (each "
            "layout uses 2, the rest FSDP); choose 2 or 4"
        )
    return requested


def _layouts(names: str) -> list[Layout]:
    if not names:
        return list(LAYOUTS)
    known = {layout.name: layout for layout in LAYOUTS}
    chosen = [name.strip() for name in names.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in known]
    if unknown or not chosen:
        raise ValueError(
            f"--layouts {names!r}: unknown {', '.join(unknown) or 'empty list'}; choose among "
            f"{', '.join(known)}"
        )
    return [known[name] for name in chosen]


def _checked_options(options: argparse.Namespace, config_seq_len: int) -> int:
    """The sequence length the layouts run (ValueError for an option out of range)."""
    if not options.tolerance > 0:
        raise ValueError(f"--tolerance {options.tolerance} must be > 0, e.g. 1e-10")
    if options.seq_len < 0:
        raise ValueError(f"--seq-len {options.seq_len} must be > 0, e.g. {_MAX_SEQ_LEN}")
    return options.seq_len or min(config_seq_len, _MAX_SEQ_LEN)


def _plan(
    job: Job, layouts: list[Layout], world_size: int, rows: int, seq_len: int
) -> list[PlannedLayout]:
    """The layouts that can run, each skipped one printed with its reason."""
    planned = []
    for layout in layouts:
        reason = layout.unsupported(job.spec, job.args)
        if not reason:
            try:
                planned.append(plan_layout(job, layout, world_size, rows, seq_len))
                continue
            except ConfigError as error:
                reason = f"config error: {error}"
        print(f"skipped {layout.name}: {reason}", flush=True)
    return planned


def _row(
    entry: PlannedLayout, outcome: Comparison | str, tolerance: float, capacity: bool
) -> list[str]:
    name, ranks = entry.layout.name, str(entry.job.dims.world_size)
    if isinstance(outcome, str):
        return [name, ranks, entry.mesh, "-", "-", "(error below)", "error"]
    parameter = outcome.parameter
    if outcome.missing:
        parameter = f"missing: {', '.join(outcome.missing)}"
    verdict = "pass" if outcome.within(tolerance) else "FAIL"
    if verdict == "FAIL" and capacity and not outcome.missing:
        verdict = _CAPACITY_FAIL
    return [name, ranks, entry.mesh, f"{outcome.loss:.1e}", f"{outcome.gradient:.1e}", parameter,
            verdict]  # fmt: skip


def _table(rows: list[list[str]]) -> str:
    """Rows under the check's column names, aligned."""
    headers = ["layout", "ranks", "mesh", "loss rel. diff", "grad rel. diff", "largest at",
               "verdict"]  # fmt: skip
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """Run the check; the exit status (0 all matched, 1 one did not, 2 bad input)."""
    options, config_argv = _parse(argv)
    try:
        config = load_job_config(config_argv)
        job = validate_job(config, ParallelDims.smallest_world_size(config.parallelism))
        world_size = _world_size(options.world_size, job)
        layouts = _layouts(options.layouts)
        seq_len = _checked_options(options, config.training.seq_len)
        spec, args = job.spec, dropless(job.spec, job.args) if options.dropless else job.args
    except ConfigError as error:
        print(f"config error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # the check's own options (--dropless included)
        print(f"error: {error}", file=sys.stderr)
        return 2
    rows = _ROWS_PER_RANK * world_size
    with torch.device("meta"):
        model = spec.build(args)
    parameters = sum(p.numel() for p in model.parameters())
    routers = capacity_routers(model)
    moe = ", MoE" if getattr(args, "moe", None) is not None or routers else ""
    moe += " with capacity drops" if routers else ""
    print(
        f"{spec.name} {config.model.flavor} ({parameters:,} parameters{moe}): one step of "
        f"{rows} x {seq_len} tokens in float64 on {world_size} CPU ranks under each layout, "
        f"against one process (tolerance {options.tolerance:g}; gradients on the scale of the "
        "reference's largest)",
        flush=True,
    )
    planned = _plan(job, layouts, world_size, rows, seq_len)
    if not planned:
        print("error: no layout can run; see the reasons above", file=sys.stderr)
        return 2
    batch = parity_batch(job.shape.vocab_size, rows, seq_len)
    references: dict[int, Result] = {}
    for entry in planned:
        blocks = entry.reference_microbatches
        if blocks not in references:
            references[blocks] = reference_step(spec, args, batch, microbatches=blocks)
    outcomes = run_layouts(spec, args, batch, planned, world_size, options.timeout)
    report = []
    for entry, outcome in zip(planned, outcomes, strict=True):
        reference = references[entry.reference_microbatches]
        report.append(outcome if isinstance(outcome, str) else compare(outcome, reference))
    table = [
        _row(e, o, options.tolerance, bool(routers)) for e, o in zip(planned, report, strict=True)
    ]
    print(_table(table))
    if any(row[-1] == _CAPACITY_FAIL for row in table):
        print(capacity_note(routers))
    for entry, outcome in zip(planned, report, strict=True):
        if isinstance(outcome, str):  # the rank's last line here, its traceback on stderr
            print(f"error in {entry.layout.name}: {outcome.splitlines()[-1].strip()}")
            print(f"{entry.layout.name}: {outcome}", file=sys.stderr)
    compared = [outcome for outcome in report if isinstance(outcome, Comparison)]
    passed = sum(outcome.within(options.tolerance) for outcome in compared)
    failed = len(planned) - passed
    worst = max((c.worst for c in compared), default=math.nan, key=_nan_largest)
    print(
        f"RESULT layouts={len(planned)} passed={passed} failed={failed} worst={worst:.1e} "
        f"skipped={len(layouts) - len(planned)}"
    )
    return 1 if failed else 0


def _nan_largest(value: float) -> float:
    return math.inf if math.isnan(value) else value


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
