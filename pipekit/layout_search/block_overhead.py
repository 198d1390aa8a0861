"""The fixed cost of one block's pass on a CPU: what a pass costs whatever its tokens.

On a CPU a small pass is dominated by the operators' dispatch and Python, not by FLOPs, so a
layout that cuts work into many small passes (deep pipelines, many slices, wide context
parallelism) pays it over and over. It is measured once per search from the job's own first
block at its real width: the median forward-and-backward time at 2 tokens, in one thread.
"""

from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from pipekit.memory_plan.activations import give_probe_weights
from pipekit.memory_plan.forked import in_forked_child
from pipekit.models.spec import ModelSpec
from pipekit.models.stage_module import build_stage_module

__all__ = ["measure_block_overhead"]


def measure_block_overhead(
    spec: ModelSpec, meta_model: nn.Module, dim: int, repeats: int = 7
) -> float:
    """Seconds of one forward and backward of the model's first block (model dim `dim`) at 2
    tokens, in a forked child with one thread, as a rank runs."""
    return in_forked_child(_time_block, spec, meta_model, dim, repeats)


def _time_block(spec: ModelSpec, meta_model: nn.Module, dim: int, repeats: int) -> float:
    structure = spec.structure
    block = build_stage_module(meta_model, [*structure.shared, structure.block_name(0)])
    give_probe_weights(block)
    samples = []
    for _ in range(repeats + 1):
        hidden_BSD = torch.randn(1, 2, dim, requires_grad=True)
        start = time.perf_counter()
        block(hidden_BSD).float().sum().backward()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])
