"""Activation memory: the memory-efficient RMSNorm and SwiGLU against their autograd-op forms
(float64, values and gradients); what Llama layers keep per token under each option, measured
and held to the formula exactly, so the test fails if the SwiGLU recompute, the norm's trick or
a checkpointing mode were silently off; every checkpointing mode's gradients equal none's."""

from __future__ import annotations

import pytest
import torch

from pipekit.bench.activation_memory import arguments, build_blocks, layer_memory, with_option
from pipekit.layers.norms import rms_norm, rms_norm_reference
from pipekit.layers.swiglu import swiglu, swiglu_reference
from pipekit.memory.layer_formula import LAYER_OPTIONS
from pipekit.memory.layer_parts import kept_bytes_by_part
from pipekit.memory.live_tensors import kept_bytes
from pipekit.models import get_model_spec

SMALL = ["--seq", "64", "--dim", "64", "--heads", "4", "--kv-heads", "2", "--ffn-dim", "192",
         "--repeats", "1"]  # fmt: skip


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def _value_and_grads(fn, *inputs: torch.Tensor) -> list[torch.Tensor]:
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    upstream = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    (out * upstream).sum().backward()
    return [out.detach(), *(leaf.grad for leaf in leaves)]


def test_memory_efficient_norm_and_swiglu_match_their_references_fp64() -> None:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, 16, dtype=torch.float64, generator=generator)
    weight = torch.randn(16, dtype=torch.float64, generator=generator)  # signs of both kinds
    gate, up = (torch.randn(2, 8, 32, dtype=torch.float64, generator=generator) for _ in "gu")
    eps = 1e-5
    pairs = (
        (lambda x, w: rms_norm(x, w, eps), lambda x, w: rms_norm_reference(x, w, eps), (x, weight)),
        (swiglu, swiglu_reference, (gate, up)),
    )
    for efficient, reference, inputs in pairs:
        got, want = _value_and_grads(efficient, *inputs), _value_and_grads(reference, *inputs)
        for g, w in zip(got, want, strict=True):
            assert _relative(g, w) <= 1e-12


def test_each_option_keeps_what_the_formula_says() -> None:
    """Measured kept bytes equal the formula for every option, in total and by part of the
    layer; with the norm and SwiGLU as autograd ops, or checkpointing off, they would equal
    another option's formula instead."""
    figures = layer_memory(arguments(SMALL))
    for option, row in figures.items():
        assert row.measured == pytest.approx(row.formula, rel=1e-9), (option, row)
        for part, formula in row.formula_parts.items():
            assert row.measured_parts[part] == pytest.approx(formula, rel=1e-9), (option, part)
    kept = {option: figures[option].measured for option in LAYER_OPTIONS}
    assert kept["plain"] > kept["efficient"] > kept["selective"] > kept["full"]
    assert kept["full"] < kept["every_k"] < kept["efficient"]


def test_an_moe_layer_splits_into_router_and_experts() -> None:
    """The parts of a Mixtral-layout block partition what it keeps, the router's and the
    experts' shares among them."""
    spec = get_model_spec("llama_moe")
    args = spec.flavor("debug_mixtral").with_updates(n_layers=1)
    model = spec.build(args)
    model.init_weights(seed=0)
    rope = tuple(t.detach() for t in model.rope(torch.arange(32)))
    block = next(iter(model.layers.values()))
    x = torch.randn(1, 32, args.dim, requires_grad=True)
    parts = kept_bytes_by_part(block, lambda: block(x * 1.0, rope))
    assert sum(parts.values()) == kept_bytes(lambda: block(x * 1.0, rope))
    assert parts["router"] > 0 and parts["experts"] > 0 and parts["attention"] > 0
    assert parts["mlp"] == 0  # every layer is an MoE in the Mixtral layout


def test_checkpointing_modes_give_the_same_gradients_fp64() -> None:
    options = arguments(SMALL)
    options.dtype = torch.float64
    model, rope = build_blocks(options)
    x = torch.randn(1, options.seq, options.dim, dtype=torch.float64)
    grads = {}
    for option in LAYER_OPTIONS:
        copied = with_option(model, option, options.every)
        h = x
        for block in copied.layers.values():
            h = block(h, rope)
        h.pow(2).sum().backward()
        grads[option] = [p.grad for p in copied.parameters() if p.grad is not None]
    for option in LAYER_OPTIONS:
        assert len(grads[option]) == len(grads["plain"])
        for got, want in zip(grads[option], grads["plain"], strict=True):
            assert _relative(got, want) <= 1e-12, option


def test_every_k_checkpoints_by_the_blocks_index_in_the_whole_model():
    """A pipeline stage holding only block 1 checkpoints it under every-2 checkpointing, as one
    process holding blocks 0-3 would (counting by position within the stage checkpointed
    nothing there, while the memory plan counted it checkpointed); a stage holding block 2
    does not; keys that are not indices count by position."""
    from pipekit.config.job_config import TrainingConfig
    from pipekit.train.activation_checkpoint import apply_activation_checkpointing

    every_2 = TrainingConfig(activation_checkpoint="every_k", activation_checkpoint_every=2)
    assert apply_activation_checkpointing({"1": torch.nn.Linear(2, 2)}, every_2) == 1
    assert apply_activation_checkpointing({"2": torch.nn.Linear(2, 2)}, every_2) == 0
    whole = {str(i): torch.nn.Linear(2, 2) for i in range(4)}
    assert apply_activation_checkpointing(whole, every_2) == 2
    named = {"first": torch.nn.Linear(2, 2), "second": torch.nn.Linear(2, 2)}
    assert apply_activation_checkpointing(named, every_2) == 1
