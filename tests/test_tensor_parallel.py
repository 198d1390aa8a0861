"""Tensor parallelism against one process: Llama and Qwen3 on 4 ranks (FSDP2 over 2 data ranks
x 2 tensor-parallel ranks), float64, loss and every gradient. Ablations that must fail: query
heads split without their key/value heads, and Qwen3's QK-norm weights left plain (their
gradients partial per rank). The shape rules before launch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import pytest
from distributed_helpers import run_on_ranks
from parity import Result, data_parallel_step, max_relative_difference, parity_batch, reference_step
from tiny_models import TINY_LLAMA
from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

import examples.custom_model.model as custom_model
from models.decoder.parallelize import decoder_tensor_parallel_plan
from models.qwen3.args import Qwen3Args
from pipekit.distributed.tensor_parallel import check_tensor_parallel
from pipekit.models import get_model_spec

MODELS = {
    "llama": TINY_LLAMA,
    "qwen3": Qwen3Args(**{**vars(TINY_LLAMA), "head_dim": 8}),
}
ROWS, SEQ_LEN = 8, 16


def _kv_heads_whole(block: nn.Module) -> Mapping[str, ParallelStyle]:
    """Ablation: keys and values left whole while the query heads are split."""
    plan = dict(decoder_tensor_parallel_plan(block))
    del plan["attention.wk"], plan["attention.wv"]
    return plan


def _runs(rank: int, world: int) -> dict[str, Result]:
    results = {}
    for name, args in MODELS.items():
        spec = get_model_spec(name)
        batch = parity_batch(args.vocab_size, ROWS, SEQ_LEN)
        results[name] = data_parallel_step(rank, world, spec, args, batch, tp=2)
        ablated = dataclasses.replace(spec, tensor_parallel_plan=_kv_heads_whole)
        results[f"{name} ablated"] = data_parallel_step(
            rank, world, spec, args, batch, tp=2, tp_plan=ablated
        )
    # ablation: Qwen3's QK-norm weights left plain, so their gradients stay partial per rank
    qwen3 = get_model_spec("qwen3")
    plain_norms = dataclasses.replace(qwen3, tensor_parallel_plan=decoder_tensor_parallel_plan)
    batch = parity_batch(MODELS["qwen3"].vocab_size, ROWS, SEQ_LEN)
    results["qwen3 partial norm gradients"] = data_parallel_step(
        rank, world, qwen3, MODELS["qwen3"], batch, tp=2, tp_plan=plain_norms
    )
    return results


def test_fsdp_with_tensor_parallelism_matches_one_process_fp64() -> None:
    per_rank = run_on_ranks(_runs, 4, timeout=300)
    for name, args in MODELS.items():
        batch = parity_batch(args.vocab_size, ROWS, SEQ_LEN)
        reference = reference_step(get_model_spec(name), args, batch, microbatches=2)
        difference = max_relative_difference([r[name] for r in per_rank], reference)
        assert difference <= 1e-10, (name, difference)
        ablated = max_relative_difference([r[f"{name} ablated"] for r in per_rank], reference)
        assert ablated > 1e-3, (name, ablated)
        if name == "qwen3":
            partial = [r["qwen3 partial norm gradients"] for r in per_rank]
            assert max_relative_difference(partial, reference) > 1e-3


def test_tensor_parallel_shape_rules_name_the_fix() -> None:
    llama = get_model_spec("llama")
    shape = llama.shape(TINY_LLAMA)  # 4 query heads, 2 kv heads
    check_tensor_parallel(llama, shape, 2, moe=False)
    with pytest.raises(ValueError, match=r"tp=4 must divide the model's heads \(n_kv_heads=2\)"):
        check_tensor_parallel(llama, shape, 4, moe=False)
    with pytest.raises(ValueError, match="tensor parallelism of MoE layers is not supported"):
        check_tensor_parallel(llama, shape, 2, moe=True)
    custom = get_model_spec(custom_model.TINY_GPT.name)
    with pytest.raises(ValueError, match="has no tensor-parallel plan"):
        check_tensor_parallel(custom, shape, 2, moe=False)
