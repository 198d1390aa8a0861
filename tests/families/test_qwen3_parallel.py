"""Qwen3 under pipekit's parallelisms equals one process (float64, loss and every gradient,
1e-10): FSDP over 2 ranks, the sliced pipeline (with context exchange and vocabulary
parallelism), and Qwen3-MoE with expert parallelism 2 (auxiliary losses on, per microbatch as the
reference takes them). The ablation drops the QK-norm on the pipeline's ranks only."""

from __future__ import annotations

import pytest

from pipekit.families.qwen3 import Qwen3Args, Qwen3Attention, Qwen3MoEArgs
from pipekit.models import get_model_spec
from pipekit.moe import MoEArgs
from pipekit.testing import (
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

TOLERANCE = 1e-10
DENSE = Qwen3Args(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, head_dim=16, vocab_size=61, ffn_dim=48,
    rope_theta=10000.0, max_seq_len=32,
)  # fmt: skip
MOE = Qwen3MoEArgs(**vars(DENSE), moe=MoEArgs(num_experts=4, top_k=2), expert_ffn_dim=24)
ROWS, SEQ_LEN = 4, 16
SLICED = {"pipeline_schedule": "sliced", "num_slices": 4, "microbatches": 2}
EXCHANGE = SLICED | {"context_exchange": True, "vocab_parallel": True}


def _batch():
    return parity_batch(DENSE.vocab_size, ROWS, SEQ_LEN)


def _cases(rank: int, world: int, ablation: bool = False) -> list:
    qwen3, qwen3_moe = get_model_spec("qwen3"), get_model_spec("qwen3_moe")
    results = [data_parallel_step(rank, world, qwen3, DENSE, _batch())]
    if ablation:  # the pipelines' model forgets its QK-norm
        Qwen3Attention.transform_qk = lambda self, q, k: (q, k)
    results += [
        pipeline_step(rank, world, qwen3, DENSE, _batch(), **SLICED),
        pipeline_step(rank, world, qwen3, DENSE, _batch(), **EXCHANGE),
    ]
    if ablation:
        return results
    return [*results, data_parallel_step(rank, world, qwen3_moe, MOE, _batch(), ep=2)]


@pytest.fixture(scope="module")
def references() -> list:
    qwen3, qwen3_moe = get_model_spec("qwen3"), get_model_spec("qwen3_moe")
    dense = reference_step(qwen3, DENSE, _batch())
    return [dense, dense, dense, reference_step(qwen3_moe, MOE, _batch(), microbatches=2)]


def _differences(references: list, ablation: bool = False) -> list[float]:
    per_rank = run_on_ranks(_cases, 2, ablation, timeout=180)
    return [
        max_relative_difference([results[index] for results in per_rank], reference)
        for index, reference in enumerate(references[: len(per_rank[0])])
    ]


def test_qwen3_matches_one_process_under_fsdp_pipelines_and_expert_parallelism_fp64(references):
    differences = _differences(references)
    assert max(differences) <= TOLERANCE, differences


def test_a_pipeline_without_the_qk_norm_breaks_parity(references):
    per_rank = run_on_ranks(_cases, 2, True, timeout=180)
    for index in (1, 2):  # the sliced pipeline, without and with exchange and vocab parallel
        loss = next(results[index][0] for results in per_rank if results[index][0] is not None)
        reference_loss = references[index][0]
        # the parity tolerance is 1e-10; the norm moves this init's loss by ~3e-4
        assert abs(loss - reference_loss) / abs(reference_loss) > 1e-6, index
