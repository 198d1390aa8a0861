"""What one block's pass costs on a CPU, measured on the job's own block at its real width.

On a CPU neither FLOPs nor a datasheet predict a pass: a small pass is dominated by the
operators' dispatch and Python (the fixed cost, paid by every pass whatever its tokens, which
layouts that cut work into many small passes pay over and over), and a long one by attention
and element-wise kernels that reach a fraction of a large matmul's FLOP/s. So the search times
the job's first block forward and backward at 2 tokens (the fixed cost) and once per pass
shape it prices (rows x tokens, in one thread, as a rank runs), and prices each layout's
passes at the rate its own shape reached.
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

__all__ = ["measure_block_overhead", "measure_block_pass_s"]


def measure_block_overhead(spec: ModelSpec, meta_model: nn.Module, dim: int) -> float:
    """Seconds of one forward and backward of the model's first block at 2 tokens: the fixed
    cost of a pass."""
    return measure_block_pass_s(spec, meta_model, dim, rows=1, tokens=2, repeats=7)


def measure_block_pass_s(
    spec: ModelSpec, meta_model: nn.Module, dim: int, rows: int, tokens: int, repeats: int = 2
) -> float:
    """Median seconds of one forward and backward of the model's first block (model dim `dim`)
    over `rows` sequences of `tokens`, after one untimed pass, in a forked child with one
    thread."""
    return in_forked_child(_time_block, spec, meta_model, dim, rows, tokens, repeats)


def _time_block(
    spec: ModelSpec, meta_model: nn.Module, dim: int, rows: int, tokens: int, repeats: int
) -> float:
    structure = spec.structure
    block = build_stage_module(meta_model, [*structure.shared, structure.block_name(0)])
    give_probe_weights(block)
    samples = []
    for _ in range(repeats + 1):
        hidden_BSD = torch.randn(rows, tokens, dim, requires_grad=True)
        start = time.perf_counter()
        block(hidden_BSD).float().sum().backward()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples[1:])
