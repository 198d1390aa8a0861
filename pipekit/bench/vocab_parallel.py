"""`python -m pipekit.bench vocab-parallel --pp 4 --vocab 128256 --seq 4096`.

One training step of the sliced pipeline on `--pp` gloo ranks, with the embedding and output
layer on the first and the last stage (as usual) and with both split by vocabulary rows across
all ranks (`vocab_parallel`). Per rank it reports:

- peak memory: the process's peak RSS (each mode runs in fresh rank processes, so the high-water
  mark is that mode's) and the peak bytes saved for backward (`ActivationMemoryTracker`, which
  holds the logits the loss keeps for its backward);
- output-layer time: the output projection's forward plus its backward, timed by hooks on the
  output module (the same hooks in both modes); without vocabulary parallelism only the last
  rank has any, with it every rank runs its share in the output passes.

RESULT: `last_rank_peak_ratio` = the last rank's peak RSS with / without vocabulary
parallelism; `output_time_imbalance` = max / min over ranks of the output-layer time, with it.
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch.distributed as dist
from torch import nn

from pipekit.bench._pipeline_launch import (
    add_model_arguments,
    add_pipeline_arguments,
    build_runner,
    describe_model,
    model_spec,
    run_ranks,
    synthetic_batch,
)
from pipekit.bench.report import print_result, print_table
from pipekit.memory.tracker import ActivationMemoryTracker
from pipekit.pipelining.schedules.sliced import check_sliced_shape

__all__ = ["main"]

_MIB = 2**20


class _ModuleTimer:
    """Seconds a module spends in forward and in backward, from its hooks."""

    def __init__(self, module: nn.Module) -> None:
        self.seconds = 0.0
        self._started = 0.0
        module.register_forward_pre_hook(self._start)
        module.register_forward_hook(self._stop)
        module.register_full_backward_pre_hook(self._start)
        module.register_full_backward_hook(self._stop)

    def _start(self, *_: Any) -> None:
        self._started = time.perf_counter()

    def _stop(self, *_: Any) -> None:
        self.seconds += time.perf_counter() - self._started


def _output_module(runner: Any) -> nn.Module | None:
    """This rank's output projection: its vocabulary shard, or the last stage's whole layer."""
    vocab = runner.extension("vocab_parallel")
    if vocab is not None:
        return vocab.output
    for stage in runner.stages:
        if getattr(stage.submod, "output", None) is not None:
            return stage.submod.output
    return None


def _measure(rank: int, num_ranks: int, spec: dict[str, Any]) -> dict[str, Any]:
    """Worker: one untimed warm-up step, then one measured step of the sliced pipeline."""
    model, shape = spec["model"], spec["shape"]
    batch = synthetic_batch(shape["m"], model["max_seq_len"], model["vocab_size"])
    runner = build_runner(
        model,
        schedule="sliced",
        stages_per_rank=1,
        rank=rank,
        num_ranks=num_ranks,
        microbatches=shape["m"],
        num_slices=shape["n"],
        rows=shape["m"],
        vocab_parallel=spec["vocab_parallel"],
    )
    output = _output_module(runner)
    timer = _ModuleTimer(output) if output is not None else None
    runner.step(batch, float(batch["labels"].numel()))  # warm-up: allocator, kernels
    if timer is not None:
        timer.seconds = 0.0
    params = list(runner.model.parameters())  # stages and vocabulary shards
    dist.barrier()
    with ActivationMemoryTracker(exclude=params) as tracker:
        started = time.perf_counter()
        runner.step(batch, float(batch["labels"].numel()))
        step_seconds = time.perf_counter() - started
    return {
        "rank": rank,
        "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "peak_saved": tracker.report().peak_total_bytes,
        "output_seconds": timer.seconds if timer is not None else 0.0,
        "step_seconds": step_seconds,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench vocab-parallel",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_pipeline_arguments(parser, pp=4, slices=0, microbatches=1, seq=4096)
    add_model_arguments(parser, dim=128, heads=8, kv_heads=4, ffn_dim=384, vocab=128256)
    options = parser.parse_args(argv)
    p, m = options.pp, options.microbatches
    n = options.slices or 2 * p
    if options.layers is None:
        options.layers = p
    try:
        if p < 2:
            raise ValueError(f"--pp={p} must be at least 2: the vocabulary is split over ranks")
        check_sliced_shape(p, m, n, 1)
        if options.seq % n:
            raise ValueError(f"--seq={options.seq} must split into --slices={n} equal slices")
        if options.layers < p:
            raise ValueError(f"--layers={options.layers} is too few for {p} stages")
        spec = {"model": model_spec(options, options.seq), "shape": {"m": m, "n": n}}
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {error}\n")

    print(describe_model(spec["model"]))
    print(
        f"sliced pipeline: p={p} ranks, m={m} microbatch(es) of 1 x {options.seq} tokens, n={n} "
        "slices, 1 thread per rank, one measured step after one warm-up"
    )
    runs = {
        mode: run_ranks(
            f"{__name__}:_measure",
            p,
            spec | {"vocab_parallel": mode == "with"},
            timeout=options.timeout,
        )
        for mode in ("without", "with")
    }
    rows = []
    for rank in range(p):
        without, with_ = runs["without"][rank], runs["with"][rank]
        rows.append(
            [
                rank,
                without["peak_rss"] / _MIB,
                with_["peak_rss"] / _MIB,
                without["peak_saved"] / _MIB,
                with_["peak_saved"] / _MIB,
                without["output_seconds"],
                with_["output_seconds"],
            ]
        )
    print()
    print_table(
        [
            "rank",
            "peak RSS MiB without",
            "with",
            "saved for backward MiB without",
            "with",
            "output layer s without",
            "with",
        ],
        rows,
    )
    steps = {mode: max(r["step_seconds"] for r in ranks) for mode, ranks in runs.items()}
    print(f"\nstep time: without {steps['without']:.2f} s, with {steps['with']:.2f} s")
    last = p - 1  # loop placement: stage p-1 on rank p-1
    with_times = [r["output_seconds"] for r in runs["with"]]
    print_result(
        last_rank_peak_ratio=runs["with"][last]["peak_rss"] / runs["without"][last]["peak_rss"],
        output_time_imbalance=max(with_times) / min(with_times),
        first_rank_peak_ratio=runs["with"][0]["peak_rss"] / runs["without"][0]["peak_rss"],
        last_rank_saved_ratio=runs["with"][last]["peak_saved"]
        / runs["without"][last]["peak_saved"],
        step_time_ratio=steps["with"] / steps["without"],
    )


if __name__ == "__main__":
    main()
