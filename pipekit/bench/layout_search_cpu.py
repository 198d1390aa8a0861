"""`python -m pipekit.bench layout-search-cpu --world-size 2`: the layout search's ranking
checked against measured steps on this CPU.

The search runs on a profile measured at start (one rank's float32 matmul FLOP/s, shared when
ranks outnumber cores; a gloo send's bandwidth and latency; the job's block's forward and
backward at 2 tokens, its fixed cost, and at every pass shape the search prices, split over
tp and cp with every rank of the world running) for the
debug Llama at `--seq` tokens (on one long document: every row a causal sequence, as the
search assumes), and keeps its `--top` fastest layouts of different structure that pass
`validate_job`: the fastest of each pipeline (pp, stages per rank, schedule), cp and tp.
Layouts that differ only in how data parallelism shards, replicates or accumulates are
predicted within about 1% of each other on a CPU, so their order among themselves is noise,
not a ranking; `--any-structure` measures the raw top ones instead.
Each then trains for real, one after another in fresh forked ranks (the trainer, its data and
optimizer, exactly as `train.py` would run the layout written by hand): `--warmup` untimed
steps, then `--repeats` timed ones; with `--rounds R` the layouts take turns R times, so a
drift in the machine's speed falls on every layout alike, and each layout's figure is the
median of all its timed steps. It prints the predicted and
measured step of every layout, whether the search's first measures within 5% of the fastest
of them, the rank correlation (Spearman) of predicted and measured times, each prediction's
error, and each layout's step spread (how far its own timed steps fall apart): where the five
measure within that spread of each other, their order is noise and so is the correlation.

More ranks than cores make timings shared, not parallel: the profile divides the cores'
FLOP/s among the ranks, and the result line states the machine's load before the run.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path

import torch

from pipekit.bench.report import print_result, print_table
from pipekit.config import JobConfig, load_job_config
from pipekit.layout_search import Layout, apply_layout, device_profile, search_layouts
from pipekit.testing import run_on_ranks
from pipekit.train.data.corpus import stdlib_files

__all__ = ["main", "spearman"]

_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "debug_model.toml"


def spearman(first: list[float], second: list[float]) -> float:
    """Rank correlation of two equally long lists without ties (1: same order)."""
    count = len(first)
    if count != len(second) or count < 2:
        raise ValueError("spearman needs two lists of the same length, at least 2")

    def ranks(values: list[float]) -> list[int]:
        order = sorted(range(count), key=values.__getitem__)
        placed = [0] * count
        for place, index in enumerate(order):
            placed[index] = place
        return placed

    squared = sum((a - b) ** 2 for a, b in zip(ranks(first), ranks(second), strict=True))
    return 1 - 6 * squared / (count * (count**2 - 1))


def _structure(layout: Layout) -> tuple[int, int, str, int, int]:
    """What makes layouts differ by more than data parallelism's placement."""
    return (layout.pp, layout.stages_per_rank, layout.schedule, layout.cp, layout.tp)


def _train_rank(rank: int, world_size: int, config: JobConfig) -> None:
    from pipekit.train.job import validate_job
    from pipekit.train.trainer import Trainer

    del rank
    torch.set_num_threads(1)
    Trainer(validate_job(config, world_size)).train()


def _timed_steps_s(config: JobConfig, world_size: int, warmup: int, timeout: float) -> list[float]:
    """The logged step times after `warmup` steps of one training run."""
    run_on_ranks(_train_rank, world_size, config, timeout=timeout)
    records = Path(config.job.output_dir, "metrics.jsonl").read_text().splitlines()
    times = [
        record["step_time_s"]
        for record in map(json.loads, records)
        if record["step"] > warmup and "step_time_s" in record
    ]
    if not times:
        raise RuntimeError(f"the run logged no step after the {warmup} warm-up steps")
    return times


def _median_and_spread(times: list[float]) -> tuple[float, float]:
    """(median, spread) of a layout's timed steps; the spread, (slowest - fastest) / median, is
    how far apart the same layout's steps fall: layouts predicted closer than it cannot be told
    apart by this measurement."""
    median = statistics.median(times)
    return median, (max(times) - min(times)) / median


def _one_document_corpus(folder: str, nbytes: int) -> Path:
    """A .txt file of `nbytes` or more from the standard library's sources: one document, so
    every row is one causal sequence, what the search prices (packed documents' attention cost
    is not modelled)."""
    path = Path(folder, "one_document.txt")
    with path.open("w") as corpus:
        written = 0
        for source in stdlib_files():
            written += corpus.write(source.read_text(errors="replace"))
            if written >= nbytes:
                break
    return path


def _job_config(options: argparse.Namespace, output_dir: str) -> JobConfig:
    tokens = (options.warmup + options.repeats + 1) * options.global_batch * options.seq
    corpus = _one_document_corpus(output_dir, 2 * tokens)
    return load_job_config([
        "--config", str(_CONFIG), "--job.output_dir", output_dir,
        "--data.source", str(corpus),
        "--training.seq_len", str(options.seq),
        "--training.global_batch_size", str(options.global_batch),
        "--training.steps", str(options.warmup + options.repeats),
        "--metrics.log_interval", "1", "--metrics.peak_flops", "1e12",
        "--checkpoint.enable", "false", "--lr_scheduler.warmup_steps", "1",
    ])  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench layout-search-cpu",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--seq", type=int, default=8192, help="tokens per sequence")
    parser.add_argument("--global-batch", type=int, default=4, help="sequences per step")
    parser.add_argument("--top", type=int, default=5, help="layouts measured (default 5)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per layout")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per layout")
    parser.add_argument(
        "--rounds", type=int, default=1, help="times the layouts take turns (default 1)"
    )
    parser.add_argument("--timeout", type=float, default=900, help="seconds per layout")
    parser.add_argument(
        "--any-structure",
        action="store_true",
        help="measure the top layouts even where they differ only in data parallelism",
    )
    options = parser.parse_args(argv)
    if options.top < 2 or min(options.world_size, options.repeats, options.rounds) < 1:
        parser.error("--top must be at least 2, --world-size, --repeats and --rounds at least 1")
    load = os.getloadavg()[0]
    folder = tempfile.mkdtemp(prefix="pipekit-layout-cpu-")
    config = _job_config(options, folder)
    device = device_profile("cpu", ranks_per_machine=options.world_size)
    search, result = search_layouts(config, options.world_size, device)
    kind = None if options.any_structure else _structure
    kept = search.validated(result, options.top, kind)
    if len(kept) < 2:
        parser.exit(2, f"{parser.prog}: error: the search kept {len(kept)} layouts; need 2\n")
    passes = ", ".join(
        f"{rows} row{'s' if rows > 1 else ''} tp{tp} cp{cp} {seconds:.3g} s"
        for (rows, tp, cp), seconds in search.pass_seconds.items()
    )
    print(
        f"debug Llama, {options.global_batch} x {options.seq} tokens per step, "
        f"{options.world_size} ranks on {os.cpu_count()} cores; profile: "
        f"{device.peak_flops / 1e9:.3g} GFLOP/s per rank, gloo "
        f"{device.intra_node_bandwidth / 1e9:.3g} GB/s, {device.link_latency_s * 1e6:.0f} us, "
        f"block's fixed cost {search.device.block_overhead_s * 1e3:.3g} ms; a block's forward "
        f"and backward on the slowest rank by pass shape: {passes}; load average {load:.2f} before "
        "the run",
        flush=True,
    )
    steps: list[list[float]] = [[] for _ in kept]
    for round_index in range(options.rounds):
        for index, candidate in enumerate(kept):
            run = apply_layout(config, candidate.layout)
            where = Path(folder, f"round{round_index}", f"layout{index}")
            run = dataclasses.replace(run, job=dataclasses.replace(run.job, output_dir=str(where)))
            times = _timed_steps_s(run, options.world_size, options.warmup, options.timeout)
            steps[index] += times
            print(
                f"  round {round_index + 1}: {candidate.layout.label()}: measured "
                f"{statistics.median(times):.3g} s",
                flush=True,
            )
    measured, spreads = map(list, zip(*map(_median_and_spread, steps), strict=True))
    predicted = [candidate.step.step_s for candidate in kept]
    fastest = min(measured)
    rows = [
        [index + 1, candidate.layout.label(), predicted[index], measured[index],
         sorted(measured).index(measured[index]) + 1, measured[index] / fastest,
         spreads[index], predicted[index] / measured[index] - 1]
        for index, candidate in enumerate(kept)
    ]  # fmt: skip
    print_table(
        ["#", "layout", "predicted s", "measured s", "measured rank", "vs fastest measured",
         "step spread", "prediction error"],
        rows,
    )  # fmt: skip
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured, strict=True)]
    print_result(
        world_size=options.world_size,
        top1_vs_fastest_measured=measured[0] / fastest,
        spearman=spearman(predicted, measured),
        measured_range=max(measured) / fastest - 1,
        mean_abs_prediction_error=statistics.fmean(errors),
        median_step_spread=statistics.median(spreads),
        layouts=len(kept),
        rounds=options.rounds,
        load_before=load,
    )
