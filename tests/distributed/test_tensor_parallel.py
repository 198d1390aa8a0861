"""Tensor parallelism against one process: Llama and Qwen3 on 4 ranks (FSDP2 over 2 data ranks
x 2 tensor-parallel ranks), without sequence parallelism, and with it and loss parallelism
(the output layer split by vocabulary, the cross-entropy on the shards), float64, loss and
every gradient; tied embeddings with loss parallelism (embedding and output split alike, one
weight); Llama-MoE with ep 1 and 2 over the tp ranks. Ablations that must fail: query
heads split while keys and values stay whole; norm weights left plain where a rank sees part
of their input (Qwen3's QK-norms over a rank's heads, the sequence-parallel norms over a
rank's tokens), so their gradients stay partial per rank; routers left out of the units over
the tp ranks; the tied modules left with a weight each. The shape rules before launch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any
from unittest import mock

import pytest
from tiny_models import TINY_LLAMA
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInputOutput,
)

import examples.custom_model.model as custom_model
from pipekit.distributed.tensor_parallel import check_tensor_parallel
from pipekit.families.decoder.parallelize import decoder_tensor_parallel_plan
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.families.qwen3.args import Qwen3Args
from pipekit.models import get_model_spec
from pipekit.moe import MoEArgs
from pipekit.testing import (
    Result,
    data_parallel_model,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    reference_step,
    run_on_ranks,
)

MODELS = {
    "llama": TINY_LLAMA,
    "qwen3": Qwen3Args(**{**vars(TINY_LLAMA), "head_dim": 8}),
}
ROWS, SEQ_LEN = 8, 16
TIED_LLAMA = dataclasses.replace(TINY_LLAMA, tie_embeddings=True)
MOE_LLAMA = LlamaMoEArgs(
    **vars(TINY_LLAMA), moe=MoEArgs(num_experts=4, top_k=2, z_loss_weight=0.001), moe_every=1
)


def _kv_heads_whole(block: nn.Module, sequence_parallel: bool) -> Mapping[str, ParallelStyle]:
    """Ablation: keys and values whole on every rank while the query heads are split, so a
    rank's query heads meet the wrong key/value heads."""
    whole = ColwiseParallel(output_layouts=Replicate())
    plan = decoder_tensor_parallel_plan(block, sequence_parallel)
    return {**plan, "attention.wk": whole, "attention.wv": whole}


def _norms_on_own_tokens(block: nn.Module, sequence_parallel: bool) -> Mapping[str, ParallelStyle]:
    """Ablation: sequence-parallel norms with plain weights, whose gradients then cover only a
    rank's tokens (SequenceParallel makes them replicated DTensors, reduced over the ranks)."""
    local = PrepareModuleInputOutput(
        input_layouts=(Shard(1),), desired_input_layouts=(Shard(1),), use_local_input=True,
        output_layouts=(Shard(1),), desired_output_layouts=(Shard(1),),
    )  # fmt: skip
    plan = decoder_tensor_parallel_plan(block, sequence_parallel)
    return {**plan, "attention_norm": local, "ffn_norm": local}


def _logits_layout(rank: int, world: int) -> tuple[tuple, tuple[int, ...]]:
    """Under loss parallelism: the logits' placements and a rank's share of them."""
    model, _, _ = data_parallel_model(world, get_model_spec("llama"), TINY_LLAMA, tp=2,
                                      loss_parallel=True)  # fmt: skip
    batch = parity_batch(TINY_LLAMA.vocab_size, ROWS, SEQ_LEN)
    logits = model(batch["tokens"][:2], batch["positions"][:2])
    return logits.placements, tuple(logits.to_local().shape)


def _runs(rank: int, world: int) -> dict[str, Result]:
    results: dict[str, Any] = {"logits": _logits_layout(rank, world)}
    for name, args in MODELS.items():
        spec = get_model_spec(name)
        batch = parity_batch(args.vocab_size, ROWS, SEQ_LEN)
        for sequence_parallel in (False, True):
            results[f"{name} sp={sequence_parallel}"] = data_parallel_step(
                rank, world, spec, args, batch, tp=2, sequence_parallel=sequence_parallel,
                loss_parallel=sequence_parallel,
            )  # fmt: skip
    llama = get_model_spec("llama")
    batch = parity_batch(TINY_LLAMA.vocab_size, ROWS, SEQ_LEN)
    # tied embeddings under loss parallelism: embedding and output split alike, one weight;
    # ablation: the two modules keep the DTensors parallelize_module gave each
    results["llama tied"] = data_parallel_step(
        rank, world, llama, TIED_LLAMA, batch, tp=2, loss_parallel=True
    )
    with mock.patch("pipekit.distributed.tensor_parallel._keep_tie", lambda *_: None):
        results["tie lost"] = data_parallel_step(
            rank, world, llama, TIED_LLAMA, batch, tp=2, loss_parallel=True
        )
    for ablation in (_kv_heads_whole, _norms_on_own_tokens):
        ablated = dataclasses.replace(llama, tensor_parallel_plan=ablation)
        results[ablation.__name__] = data_parallel_step(
            rank, world, llama, TINY_LLAMA, batch, tp=2, tp_plan=ablated
        )
    # MoE (expert-TP 1): each tp rank routes its own tokens; ep 2 folded over the tp ranks,
    # and the experts replicated over them (ep 1); ablation: routers outside the tp units
    moe_batch = parity_batch(MOE_LLAMA.vocab_size, ROWS, SEQ_LEN)
    llama_moe = get_model_spec("llama_moe")
    for ep in (1, 2):
        results[f"moe ep={ep}"] = data_parallel_step(
            rank, world, llama_moe, MOE_LLAMA, moe_batch, tp=2, ep=ep
        )
    results["moe partial router gradients"] = data_parallel_step(
        rank, world, llama_moe, MOE_LLAMA, moe_batch, tp=2, ep=2, routers=False
    )
    # ablation: Qwen3's QK-norm weights left plain, so their gradients stay partial per rank
    qwen3 = get_model_spec("qwen3")
    plain_norms = dataclasses.replace(qwen3, tensor_parallel_plan=decoder_tensor_parallel_plan)
    batch = parity_batch(MODELS["qwen3"].vocab_size, ROWS, SEQ_LEN)
    results["qwen3 partial norm gradients"] = data_parallel_step(
        rank, world, qwen3, MODELS["qwen3"], batch, tp=2, tp_plan=plain_norms
    )
    return results


def test_fsdp_with_tensor_and_sequence_parallelism_matches_one_process_fp64() -> None:
    per_rank = run_on_ranks(_runs, 4, timeout=300)
    # no rank holds whole logits: each has its half of the vocabulary
    assert per_rank[0]["logits"] == ((Shard(2),), (2, SEQ_LEN, TINY_LLAMA.vocab_size // 2))
    references = {}
    for name, args in MODELS.items():
        batch = parity_batch(args.vocab_size, ROWS, SEQ_LEN)
        references[name] = reference_step(get_model_spec(name), args, batch, microbatches=2)
        for sequence_parallel in (False, True):
            row = f"{name} sp={sequence_parallel}"
            difference = max_relative_difference([r[row] for r in per_rank], references[name])
            assert difference <= 1e-10, (row, difference)
    batch = parity_batch(TINY_LLAMA.vocab_size, ROWS, SEQ_LEN)
    references["tied"] = reference_step(get_model_spec("llama"), TIED_LLAMA, batch, microbatches=2)
    tied = max_relative_difference([r["llama tied"] for r in per_rank], references["tied"])
    assert tied <= 1e-10, tied
    # the lost tie reports output.weight apart, each weight with its module's gradient only
    untied = [(loss, {n: g for n, g in grads.items() if n != "output.weight"})
              for loss, grads in (r["tie lost"] for r in per_rank)]  # fmt: skip
    assert max_relative_difference(untied, references["tied"]) > 1e-3
    moe_batch = parity_batch(MOE_LLAMA.vocab_size, ROWS, SEQ_LEN)
    references["moe"] = reference_step(
        get_model_spec("llama_moe"), MOE_LLAMA, moe_batch, microbatches=2
    )
    for ep in (1, 2):
        difference = max_relative_difference(
            [r[f"moe ep={ep}"] for r in per_rank], references["moe"]
        )
        assert difference <= 1e-10, (ep, difference)
    partial = [r["moe partial router gradients"] for r in per_rank]
    assert max_relative_difference(partial, references["moe"]) > 1e-3
    ablations = ("_kv_heads_whole", "_norms_on_own_tokens")
    for row, reference in (*((a, references["llama"]) for a in ablations),
                           ("qwen3 partial norm gradients", references["qwen3"])):  # fmt: skip
        ablated = max_relative_difference([r[row] for r in per_rank], reference)
        assert ablated > 1e-3, (row, ablated)


def test_tensor_parallel_shape_rules_name_the_fix() -> None:
    llama = get_model_spec("llama")
    shape = llama.shape(TINY_LLAMA)  # 4 query heads, 2 kv heads
    check_tensor_parallel(llama, shape, 2, moe=False)
    with pytest.raises(ValueError, match=r"tp=4 must divide the model's heads \(n_kv_heads=2\)"):
        check_tensor_parallel(llama, shape, 4, moe=False)
    check_tensor_parallel(llama, shape, 2, moe=True)
    with pytest.raises(ValueError, match="mixture-of-experts model needs sequence_parallel"):
        check_tensor_parallel(llama, shape, 2, moe=True, sequence_parallel=False)
    unplanned = dataclasses.replace(custom_model.TINY_GPT, tensor_parallel_plan=None)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        check_tensor_parallel(unplanned, shape, 2, moe=False)
