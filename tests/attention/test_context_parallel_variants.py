"""The context-parallel variant table: its rules read from the entries, and a variant
registered from outside pipekit (`toy_cp_variant`) training under a whole-sequence job and under
the sliced pipeline with float64 parity against one process; its ablation (each rank attending
to its own keys only) must fail."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import TINY_LLAMA
from toy_cp_variant import TOY, TOY_LOCAL, TOY_WHOLE_ONLY

from pipekit.attention.across import (
    ContextParallelVariant,
    VariantRules,
    check_context_parallel,
    context_parallel_bytes,
    context_parallel_variant_entry,
    context_parallel_variant_names,
    register_context_parallel_variant,
)
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
SEQ_LEN, ROWS = 32, 4
SLICED = {"pipeline_schedule": "sliced", "num_slices": 2, "microbatches": 2, "cp": 2}
RULES = VariantRules(cp=2, query_heads=4, kv_heads=2)


def test_registered_variants_are_checked_by_their_entries() -> None:
    """A registered variant is listed and priced by its own rule; one without per-slice
    attention is refused in pipelines, one that does not lend under context exchange, one
    without groups given cp_ulysses; a name is registered once; an unknown one names them."""
    assert {TOY.name, TOY_LOCAL.name, "kv_passing"} <= set(context_parallel_variant_names())
    assert context_parallel_bytes(TOY.name, slice_index=0, slice_tokens=8, cp=2, q_heads=4,
                                  kv_heads=2, head_dim=8) == 1.0  # fmt: skip
    check_context_parallel(TOY.name, dataclasses.replace(RULES, pipeline=True))
    check_context_parallel(TOY_WHOLE_ONLY.name, RULES)
    with pytest.raises(ValueError, match="cp_variant='toy_whole_only' runs on whole sequences"):
        check_context_parallel(TOY_WHOLE_ONLY.name, dataclasses.replace(RULES, pipeline=True))
    with pytest.raises(ValueError, match="context_exchange = true with cp_variant='toy_kv"):
        check_context_parallel(
            TOY.name, dataclasses.replace(RULES, pipeline=True, context_exchange=True)
        )
    with pytest.raises(ValueError, match="cp_ulysses = 2 sets the groups of"):
        check_context_parallel(TOY.name, dataclasses.replace(RULES, cp=4, ulysses_size=2))
    with pytest.raises(ValueError, match="named 'toy_kv_passing' is registered"):
        register_context_parallel_variant(ContextParallelVariant(TOY.name, "again"))
    with pytest.raises(ValueError, match="cp_variant='spiral' is not one of auto, commutated"):
        context_parallel_variant_entry("spiral")


def _toy_runs(rank: int, world: int) -> dict[str, Result]:
    spec, batch = get_model_spec("llama"), parity_batch(LLAMA.vocab_size, ROWS, SEQ_LEN)
    results = {}
    for variant in (TOY, TOY_LOCAL):
        results[f"whole sequence {variant.name}"] = data_parallel_step(
            rank, world, spec, LLAMA, batch, cp=2, cp_variant=variant.name
        )
        results[f"sliced pipeline {variant.name}"] = pipeline_step(
            rank, world, spec, LLAMA, batch, cp_variant=variant.name, **SLICED
        )
    return results


def test_a_variant_registered_outside_pipekit_trains_with_parity_fp64() -> None:
    """4 ranks: FSDP2 over dp 2 x cp 2 on whole sequences, and a sliced pipeline pp 2 x cp 2,
    both attending by the toy variant: loss and every gradient equal one process's; the
    ablated variant's do not."""
    spec, batch = get_model_spec("llama"), parity_batch(LLAMA.vocab_size, ROWS, SEQ_LEN)
    reference = reference_step(spec, LLAMA, batch, microbatches=2)
    per_rank = run_on_ranks(_toy_runs, 4, timeout=300)
    for job in ("whole sequence", "sliced pipeline"):
        results = [results[f"{job} {TOY.name}"] for results in per_rank]
        assert max_relative_difference(results, reference) <= 1e-10, job
        ablated = [results[f"{job} {TOY_LOCAL.name}"] for results in per_rank]
        assert max_relative_difference(ablated, reference) > 1e-3, job
