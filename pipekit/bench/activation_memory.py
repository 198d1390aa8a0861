"""`python -m pipekit.bench activation-memory`: what a Llama layer keeps for its backward, per
token, under each memory option, measured against the formula, and what it costs in time.

`--layers` Llama blocks (at `--dim` with `--heads`/`--kv-heads`/`--ffn-dim`) run forward on
one rank over `--seq` tokens in float32. The kept bytes are every storage the forward allocated
that is still alive when it returns, besides its output (`pipekit.memory.live_tensors.
kept_bytes`): what autograd saved, and what activation checkpointing keeps (the blocks' inputs,
the selected ops' outputs). They are divided by tokens and layers and compared with
`pipekit.memory.layer_formula.saved_bytes_per_token`. The options:
- plain: the norms and the SwiGLU as autograd ops, nothing checkpointed;
- efficient: the memory-efficient RMSNorm and SwiGLU (pipekit's default), nothing checkpointed;
- selective: efficient, every block op-level checkpointed, keeping matmuls and attention;
- full: every block keeps only its input;
- every_k: every `--every`-th block checkpointed whole.
Step time is one forward and backward, median of a few.

The kept bytes are also split by the part of the layer that allocated them (attention, norms,
MLP, the rest: `pipekit.memory.layer_parts`) beside `layer_formula.saved_bytes_by_part`.

RESULT: the kept bytes of efficient, selective and full over plain, the largest relative error
of the formula over the options, and the largest error of a part (relative to the layer's
total).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
from dataclasses import dataclass

import torch

from pipekit.bench.report import machine_description, print_result, print_table, time_call

__all__ = ["LayerMemory", "arguments", "build_blocks", "layer_memory", "main", "with_option"]

_SHOWN_PARTS = ("attention", "norms", "mlp", "other")
"""A Llama layer's parts (it has no router or experts)."""


def build_blocks(options: argparse.Namespace) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    """The Llama model holding the blocks, and its RoPE table for `--seq` tokens."""
    from pipekit.models import get_model_spec

    spec = get_model_spec("llama")
    args = dataclasses.replace(
        spec.flavor("debug"), dim=options.dim, n_layers=options.layers, n_heads=options.heads,
        n_kv_heads=options.kv_heads, ffn_dim=options.ffn_dim, vocab_size=256,
        max_seq_len=options.seq,
    )  # fmt: skip
    model = spec.build(args).to(options.dtype)
    model.init_weights(seed=0)
    rope = tuple(t.detach() for t in model.rope(torch.arange(options.seq)))
    return model, rope


def with_option(model: torch.nn.Module, option: str, every: int) -> torch.nn.Module:
    """A copy of `model` whose blocks run as `option` (`LAYER_OPTIONS`)."""
    from pipekit.config.job_config import TrainingConfig
    from pipekit.layers.reference import set_memory_efficient
    from pipekit.train.activation_checkpoint import apply_activation_checkpointing

    copied = copy.deepcopy(model)
    set_memory_efficient(copied, option != "plain")
    mode = "none" if option in ("plain", "efficient") else option
    config = TrainingConfig(activation_checkpoint=mode, activation_checkpoint_every=every)
    apply_activation_checkpointing(dict(copied.layers.items()), config)
    return copied


@dataclass(frozen=True)
class LayerMemory:
    """One option's kept bytes per token per layer, measured and by formula, in total and by
    part of the layer (`pipekit.memory.layer_parts`), and its step time."""

    measured: float
    formula: float
    seconds: float
    measured_parts: dict[str, float]
    formula_parts: dict[str, float]


def layer_memory(options: argparse.Namespace) -> dict[str, LayerMemory]:
    """Per option (`LAYER_OPTIONS`): what a layer keeps, measured and by formula."""
    from pipekit.memory.layer_formula import (
        LAYER_OPTIONS,
        LayerShape,
        saved_bytes_by_part,
    )
    from pipekit.memory.layer_parts import kept_bytes_by_part

    model, rope = build_blocks(options)
    head_dim = options.dim // options.heads
    shape = LayerShape(options.dim, options.heads, options.kv_heads, head_dim, options.ffn_dim)
    x = torch.randn(1, options.seq, options.dim, dtype=options.dtype, requires_grad=True)
    element = torch.finfo(options.dtype).bits // 8
    tokens_and_layers = options.seq * options.layers
    figures = {}
    for option in LAYER_OPTIONS:
        copied = with_option(model, option, options.every)
        blocks = list(copied.layers.values())

        def forward(blocks: list[torch.nn.Module] = blocks) -> torch.Tensor:
            h = x * 1.0  # made here, so a block that keeps its input keeps this
            for block in blocks:
                h = block(h, rope)
            return h

        kept = kept_bytes_by_part(copied, forward)
        measured_parts = {part: kept[part] / tokens_and_layers for part in _SHOWN_PARTS}
        formula_parts = saved_bytes_by_part(shape, option, element, options.every)
        seconds = time_call(lambda forward=forward: forward().sum().backward(), 1, options.repeats)
        figures[option] = LayerMemory(
            measured=sum(kept.values()) / tokens_and_layers,
            formula=sum(formula_parts.values()),
            seconds=seconds,
            measured_parts=measured_parts,
            formula_parts=formula_parts,
        )
    return figures


def arguments(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m pipekit.bench activation-memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=512)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn-dim", type=int, default=1536)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--every", type=int, default=2, help="k of every_k")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per option")
    options = parser.parse_args(argv)
    options.dtype = torch.float32
    return options


def main(argv: list[str]) -> None:
    options = arguments(argv)
    print(machine_description(), flush=True)
    print(
        f"{options.layers} Llama blocks (dim {options.dim}, {options.heads} query heads, "
        f"{options.kv_heads} kv heads of {options.dim // options.heads}, FFN {options.ffn_dim}), "
        f"1 x {options.seq} tokens, float32, one rank"
    )
    figures = layer_memory(options)
    rows = [(option, row.measured, row.formula, row.measured / row.formula, row.seconds)
            for option, row in figures.items()]  # fmt: skip
    print_table(["option", "kept bytes/token/layer", "formula", "measured/formula", "step s"], rows)
    print("\nby part of the layer, bytes/token/layer measured (formula)")
    print_table(
        ["option", *_SHOWN_PARTS],
        [
            [option]
            + [f"{row.measured_parts[p]:.6g} ({row.formula_parts[p]:.6g})" for p in _SHOWN_PARTS]
            for option, row in figures.items()
        ],
    )
    plain = figures["plain"].measured
    part_errors = [
        abs(row.measured_parts[part] - row.formula_parts[part]) / row.formula
        for row in figures.values()
        for part in _SHOWN_PARTS
    ]
    print_result(
        efficient_vs_plain=figures["efficient"].measured / plain,
        selective_vs_plain=figures["selective"].measured / plain,
        full_vs_plain=figures["full"].measured / plain,
        max_formula_err=max(abs(row[3] - 1) for row in rows),
        max_part_err=max(part_errors),
    )
