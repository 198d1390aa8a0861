"""The sliced pipeline's features on unequal slices, 4 ranks: slices cut per microbatch by its
packed documents (`slicing = "documents"`) and the fixed equal-cost cut, under context
parallelism (each slice dealt to the cp ranks by its documents' work; every variant that runs in
a pipeline), context exchange, vocabulary parallelism (with tp or cp), and on a model with
sliding-window layers, against one process in float64. Ablations, each of which must fail: the
lent slices' dK/dV dropped; the KV cache placing each microbatch's slices at the planned cuts
(which slices a window sees); the tokens dealt on equal slices while the pipeline cuts by
documents (refused, one line)."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from tensordict import TensorDict
from tiny_models import TINY_LLAMA

import examples.local_global.model as local_global
from pipekit.attention.document_lengths import positions_in_documents
from pipekit.config.job_config import ParallelismConfig
from pipekit.distributed.context_parallel import ContextParallelRanks
from pipekit.models import get_model_spec
from pipekit.pipelining.plan import plan_pipeline
from pipekit.pipelining.runtime.stage import SlicedPipelineStage
from pipekit.testing import (
    RankFailedError,
    Result,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    replace_context_exchange,
    run_on_ranks,
)
from pipekit.train.metrics import attention_to_linear_flops

SEQ_LEN, ROWS = 256, 4
LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=2, max_seq_len=SEQ_LEN)
WINDOWED = local_global.LocalGlobalArgs(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61,
    max_seq_len=SEQ_LEN, window=40,
)  # fmt: skip
"""A local layer (a 40-token window) and a global one."""
SLICED = {
    "pipeline_schedule": "sliced", "num_slices": 2, "microbatches": 2, "cp": 2,
    "cp_balance": "documents", "cp_balance_pieces": 2, "work_block": 1,
}  # fmt: skip
EXCHANGE = SLICED | {"num_slices": 4, "slicing": "documents", "context_exchange": True}
CASES = {
    "documents commutated": {"slicing": "documents", "cp_variant": "commutated"},
    "documents kv_passing": {"slicing": "documents", "cp_variant": "kv_passing"},
    "documents ulysses": {"slicing": "documents", "cp_variant": "ulysses"},
    "documents auto": {"slicing": "documents"},
    "equal_cost commutated": {"slicing": "equal_cost", "cp_variant": "commutated"},
}


def packed_batch(vocab_size: int = LLAMA.vocab_size) -> TensorDict:
    """Microbatch 0's rows: one long document, then 12-token ones; microbatch 1's: a 90-token
    document, then one to the end. Positions restart in every document."""
    batch = parity_batch(vocab_size, ROWS, SEQ_LEN)
    index_S = torch.arange(SEQ_LEN)
    long_first = torch.where(index_S < 150, 0, 1 + (index_S - 150) // 12)
    two_documents = (index_S >= 90).long()
    documents_BS = torch.stack([long_first, long_first, two_documents, two_documents])
    batch["document_ids"] = documents_BS
    batch["positions"] = positions_in_documents(documents_BS)
    return batch


@contextmanager
def dealt_on_equal_slices() -> Iterator[None]:
    """Ablation: each rank's tokens (and `cp_tokens`) dealt on equal slices, while `cp_slice`
    says where the pipeline cuts by documents."""
    shard = ContextParallelRanks.shard

    def equal_deal(self: ContextParallelRanks, batch: TensorDict, microbatches: int = 1):
        cut = shard(self, batch, microbatches)
        local = shard(dataclasses.replace(self, slice_cut=None), batch, microbatches)
        local["cp_slice"] = cut["cp_slice"]
        return local

    ContextParallelRanks.shard = equal_deal  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContextParallelRanks.shard = shard  # type: ignore[method-assign]


@contextmanager
def cached_at_planned_cuts() -> Iterator[None]:
    """Ablation: the KV cache places every microbatch's slices at the planned bounds."""
    use_bounds = SlicedPipelineStage.use_microbatch_bounds

    def planned(stage: SlicedPipelineStage, bounds: list) -> None:
        use_bounds(stage, bounds)
        stage.kv_cache.microbatch_bounds = None

    SlicedPipelineStage.use_microbatch_bounds = planned  # type: ignore[method-assign]
    try:
        yield
    finally:
        SlicedPipelineStage.use_microbatch_bounds = use_bounds  # type: ignore[method-assign]


def _runs(rank: int, world: int) -> dict[str, Result]:
    spec, batch = get_model_spec("llama"), packed_batch()
    results = {
        name: pipeline_step(rank, world, spec, LLAMA, batch, **SLICED, **case)
        for name, case in CASES.items()
    }
    documents = CASES["documents commutated"]
    windowed = local_global.LOCAL_GLOBAL, WINDOWED, packed_batch(WINDOWED.vocab_size)
    results["windowed documents commutated"] = pipeline_step(
        rank, world, *windowed, **SLICED, **documents
    )
    results["windowed documents ulysses"] = pipeline_step(
        rank, world, *windowed, **SLICED, **CASES["documents ulysses"]
    )
    results["documents context exchange"] = pipeline_step(
        rank, world, spec, LLAMA, batch, **EXCHANGE
    )
    results["windowed documents context exchange"] = pipeline_step(
        rank, world, *windowed, **EXCHANGE
    )
    vocabulary = {**SLICED, "slicing": "documents", "vocab_parallel": True}
    results["documents vocabulary parallel"] = pipeline_step(
        rank, world, spec, LLAMA, batch, **vocabulary
    )
    tensor_parallel = {**vocabulary, "cp": 1, "tp": 2}  # sequence parallel: a share per tp rank
    results["documents vocabulary parallel tp"] = pipeline_step(
        rank, world, spec, LLAMA, batch, **tensor_parallel
    )
    results["context exchange without lent dK/dV ablated"] = pipeline_step(
        rank, world, spec, LLAMA, batch, **EXCHANGE,
        adjust=lambda runner: replace_context_exchange(runner, drop_remote_kv_grads=True),
    )  # fmt: skip
    return results


def _dealt_on_equal_slices(rank: int, world: int) -> Result:
    spec, batch = get_model_spec("llama"), packed_batch()
    with dealt_on_equal_slices():
        return pipeline_step(rank, world, spec, LLAMA, batch, **SLICED, **CASES["documents auto"])


def _cached_at_planned_cuts(rank: int, world: int) -> Result:
    """Ulysses attends over the stage cache's whole slices, which the cache places."""
    windowed = local_global.LOCAL_GLOBAL, WINDOWED, packed_batch(WINDOWED.vocab_size)
    with cached_at_planned_cuts():
        return pipeline_step(rank, world, *windowed, **SLICED, **CASES["documents ulysses"])


def test_the_batch_is_cut_unequally_and_differently_per_microbatch() -> None:
    """What the parity test runs on: the planned equal-cost cut is unequal, and each
    microbatch's document cut differs from it and from the other's (on multiples of the cp
    ranks' pieces, so each slice deals evenly)."""
    spec = get_model_spec("llama")
    with torch.device("meta"):
        model = spec.build(LLAMA)
    shape = spec.shape(LLAMA)
    settings = {k: v for k, v in SLICED.items() if k != "work_block"}
    parallelism = ParallelismConfig(
        pipeline_parallel_degree=2, dp_shard=1, slicing="documents", **settings
    )
    plan = plan_pipeline(
        parallelism, spec.structure, shape, ROWS, SEQ_LEN, attention_work_block=1,
        attention_to_linear=attention_to_linear_flops(model, shape, spec.structure, SEQ_LEN),
    )  # fmt: skip
    slices = plan.slices
    cuts = [slices.microbatch_bounds(part) for part in packed_batch()["document_ids"].chunk(2)]
    assert slices.bounds[1] != SEQ_LEN // 2
    assert len({slices.bounds, *cuts}) == 3, (slices.bounds, cuts)
    assert slices.granularity % 4 == 0


def test_unequal_slices_match_one_process_fp64() -> None:
    """4 ranks, pp 2 x cp 2: slices cut per microbatch by documents under commutated, K/V
    passing, Ulysses, the per-slice choice, with context exchange (4 slices) and with
    vocabulary parallelism, and the equal-cost cut under commutated, each slice dealt by its
    documents; a model with a sliding window (commutated, Ulysses, context exchange); pp 2 x
    tp 2 with vocabulary parallelism (sequence parallel): loss and every gradient
    equal one process's (<= 1e-10). Without the lent slices' dK/dV it does not."""
    per_rank = run_on_ranks(_runs, 4, timeout=600)
    references = {
        False: reference_step(get_model_spec("llama"), LLAMA, packed_batch(), microbatches=2),
        True: reference_step(
            local_global.LOCAL_GLOBAL, WINDOWED, packed_batch(WINDOWED.vocab_size),
            microbatches=2,
        ),
    }  # fmt: skip
    for case in per_rank[0]:
        reference = references[case.startswith("windowed")]
        difference = max_relative_difference([results[case] for results in per_rank], reference)
        if case.endswith("ablated"):
            assert difference > 1e-4, (case, difference)
        else:
            assert difference <= 1e-10, (case, difference)


def test_slices_cut_per_microbatch_need_the_cache_to_follow_them_under_cp() -> None:
    """Cached where the plan cut, a slice cut elsewhere indexes its window's keys out of
    range."""
    with pytest.raises(RankFailedError, match=r"index \d+ is out of bounds"):
        run_on_ranks(_cached_at_planned_cuts, 4, timeout=300)


def test_a_batch_dealt_on_other_slices_than_the_pipeline_cuts_is_refused() -> None:
    """Dealt on equal slices while the pipeline cuts by documents, a unit would hold tokens of
    its neighbours (and miss keys it should see); each rank's feature refuses the step."""
    with pytest.raises(RankFailedError, match="dealt on other slices than the pipeline cuts"):
        run_on_ranks(_dealt_on_equal_slices, 4, timeout=300)
