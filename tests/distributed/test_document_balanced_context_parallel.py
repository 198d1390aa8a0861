"""Context parallelism dealt by documents (`cp_balance = "documents"`): a model trained on
packed rows whose long document sits at one end, each cp rank holding its pieces of every
microbatch by their attention work, under every variant on whole sequences and inside the
sliced pipeline (with context exchange too), against one process in float64. The ablation
deals the tokens by documents but tells the attention head and tail: it must fail."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from tensordict import TensorDict
from tiny_models import TINY_LLAMA

from pipekit.attention.across.token_shards import context_parallel_tokens
from pipekit.attention.document_lengths import positions_in_documents
from pipekit.distributed.context_parallel import ContextParallelRanks
from pipekit.models import get_model_spec
from pipekit.testing import (
    Result,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=2)
SEQ_LEN, ROWS, PIECES = 64, 4, 4
DEALT = {"cp": 2, "cp_balance": "documents", "cp_balance_pieces": PIECES}
SLICED = {"pipeline_schedule": "sliced", "num_slices": 2, "microbatches": 2} | DEALT
WHOLE_SEQUENCE_VARIANTS = ("kv_passing", "ring", "commutated", "ulysses")
PIPELINE_CASES = {
    "pipeline commutated": {"cp_variant": "commutated"},
    "pipeline kv_passing": {"cp_variant": "kv_passing"},
    "pipeline ulysses": {"cp_variant": "ulysses"},
    "pipeline auto + context exchange": {"context_exchange": True},
}


def skewed_batch() -> TensorDict:
    """Microbatch 0's rows: eight 5-token documents, then one long one; microbatch 1's: one
    long document, then short ones. Positions restart in every document."""
    batch = parity_batch(LLAMA.vocab_size, ROWS, SEQ_LEN)
    index_S = torch.arange(SEQ_LEN)
    short_first = torch.where(index_S < 40, index_S // 5, 8)
    long_first = torch.where(index_S < 36, 0, 1 + (index_S - 36) // 7)
    documents_BS = torch.stack([short_first, short_first, long_first, long_first])
    batch["document_ids"] = documents_BS
    batch["positions"] = positions_in_documents(documents_BS)
    return batch


@contextmanager
def told_head_and_tail() -> Iterator[None]:
    """Ablation: the batch dealt by documents, its `cp_tokens` (what the attention reads) the
    head-and-tail deal."""
    shard = ContextParallelRanks.shard

    def wrong_tokens(self: ContextParallelRanks, batch: TensorDict, microbatches: int = 1):
        local = shard(self, batch, microbatches)
        static_CS = dataclasses.replace(self, balance="sequence").rank_tokens(None)
        local["cp_tokens"] = static_CS.T.expand(*local.batch_size, self.cp).contiguous()
        return local

    ContextParallelRanks.shard = wrong_tokens  # type: ignore[method-assign]
    try:
        yield
    finally:
        ContextParallelRanks.shard = shard  # type: ignore[method-assign]


def _runs(rank: int, world: int) -> dict[str, Result]:
    spec, batch = get_model_spec("llama"), skewed_batch()
    results: dict[str, Result] = {}
    for variant in WHOLE_SEQUENCE_VARIANTS:
        results[f"whole sequence {variant}"] = data_parallel_step(
            rank, world, spec, LLAMA, batch, cp_variant=variant, **DEALT
        )
    for name, case in PIPELINE_CASES.items():
        results[name] = pipeline_step(rank, world, spec, LLAMA, batch, **SLICED, **case)
    with told_head_and_tail():
        results["whole sequence kv_passing ablated"] = data_parallel_step(
            rank, world, spec, LLAMA, batch, cp_variant="kv_passing", **DEALT
        )
        results["pipeline commutated ablated"] = pipeline_step(
            rank, world, spec, LLAMA, batch, cp_variant="commutated", **SLICED
        )
    return results


def test_the_document_deal_differs_from_head_and_tail_and_by_microbatch() -> None:
    """The batch the parity test runs on exercises the deal: each microbatch's differs from
    head and tail and from the other's, for whole sequences and for the pipeline's slices; one
    whole-sequence attention context refuses rows of two deals."""
    ranks = ContextParallelRanks(0, 2, SEQ_LEN, 1, "documents", PIECES, None, "auto", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="rows were dealt to the cp ranks in different ways"):
        ranks.attention(ranks.shard(skewed_batch(), microbatches=2))
    batch = skewed_batch()
    for num_slices in (1, 2):
        static_CS = context_parallel_tokens(SEQ_LEN, 2, num_slices)
        first, second = (
            context_parallel_tokens(SEQ_LEN, 2, num_slices, part["document_ids"], PIECES)
            for part in batch.chunk(2)
        )
        assert not torch.equal(first, static_CS) and not torch.equal(second, static_CS)
        assert not torch.equal(first, second)


def test_document_balanced_context_parallelism_matches_one_process_fp64() -> None:
    """4 ranks: dp 2 x cp 2 on whole sequences by K/V passing, the ring, commutated and
    Ulysses; pp 2 x cp 2 in the sliced pipeline by commutated, K/V passing, Ulysses and the
    per-slice choice with context exchange; every microbatch dealt by its own documents in 4
    pieces per rank: loss and every gradient equal one process's (<= 1e-10). Telling the
    attention head and tail instead does not."""
    per_rank = run_on_ranks(_runs, 4, timeout=600)
    reference = reference_step(get_model_spec("llama"), LLAMA, skewed_batch(), microbatches=2)
    for case in per_rank[0]:
        difference = max_relative_difference([results[case] for results in per_rank], reference)
        if case.endswith("ablated"):
            assert difference > 1e-3, (case, difference)
        else:
            assert difference <= 1e-10, (case, difference)
