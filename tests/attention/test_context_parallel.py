"""Context parallelism against one process: load-balanced shards, KV all-gather and commutated
attention over a chunked KV cache (with context exchange on top), float64, outputs and the
gradients of q, k and v, packed documents, windows, attention sinks and ALiBi's score bias
included; whole models under FSDP2 x context parallelism against one process; each with an
ablation that must fail; and the per-slice choice by bytes."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from context_parallel_cases import (
    ALIBI_PATTERN,
    LENGTH,
    SLICES,
    TOLERANCE,
    WINDOW,
    case_inputs,
    case_leaves,
    case_pattern,
    case_sinks,
    summed_grads,
    whole_sequence_run,
    worst_difference,
)
from tiny_models import TINY_LLAMA
from toy_cp_variant import TOY_LOCAL

import examples.custom_model.model as custom
import pipekit.testing.data_parallel as data_parallel_module
from pipekit.attention.across import (
    choose_context_parallel,
    context_parallel_bytes,
)
from pipekit.attention.across import ulysses as ulysses_module
from pipekit.attention.across.lending import (
    AttentionLoan,
    Lending,
    serve_attention_loan,
    serve_attention_loan_backward,
)
from pipekit.attention.across.ring import ring_context_attention
from pipekit.attention.across.token_shards import (
    CachedShard,
    TokenShard,
    commutated_context_attention,
    document_balanced_indices,
    kv_passing_context_attention,
    load_balanced_indices,
)
from pipekit.attention.patterns import AttentionPattern
from pipekit.attention.work import keys_seen
from pipekit.layers.sequence_statistics import statistics_group
from pipekit.models import get_model_spec
from pipekit.testing import (
    Result,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    reference_step,
    run_on_ranks,
)


def _ring_rotation_run(rank: int, world: int, ablate: bool) -> dict[str, torch.Tensor]:
    """Ring KV passing called directly; the ablation stops the rotation (own chunk only)."""
    inputs = case_inputs()
    leaves = case_leaves(inputs)
    tokens = load_balanced_indices(LENGTH, world)[rank]
    shard = TokenShard(tokens, inputs["documents"][:, tokens])
    q, k, v = (leaves[name][:, :, tokens] for name in "qkv")
    out, _ = ring_context_attention(q, k, v, shard, backend="cpu", isolated=ablate)
    (out * inputs["upstream"][:, :, tokens]).sum().backward()
    full_out = torch.zeros_like(inputs["q"])
    full_out[:, :, tokens] = out.detach()
    dist.all_reduce(full_out)
    return {"out": full_out, **summed_grads(leaves)}


def _sliced_run(
    attend, pattern: AttentionPattern | None = None, sinks: bool = False
) -> Callable[[int, int, bool], dict[str, torch.Tensor]]:
    """The sequence in SLICES slices, each split over the ranks; every rank caches the K/V of
    its tokens of every slice so far and calls `attend` (a variant) for each slice; the
    ablation attends to the rank's own cache only (with a `pattern`: ignores the pattern)."""

    def run(rank: int, world: int, ablate: bool) -> dict[str, torch.Tensor]:
        inputs = case_inputs()
        leaves = case_leaves(inputs, sinks=sinks)
        sinks_H, ablate = case_sinks(leaves, ablate), ablate and not sinks
        slice_length = LENGTH // SLICES
        cache: list[CachedShard] = []
        full_out = torch.zeros_like(inputs["q"])
        loss = torch.zeros((), dtype=torch.float64)
        for index in range(SLICES):
            tokens = load_balanced_indices(slice_length, world, start=index * slice_length)[rank]
            shard = TokenShard(tokens, inputs["documents"][:, tokens])
            k, v = leaves["k"][:, :, tokens], leaves["v"][:, :, tokens]
            cache.append(CachedShard(k, v, shard))
            q = leaves["q"][:, :, tokens]
            if pattern is None:
                out, _ = attend(q, shard, cache, backend="cpu", drop_remote=ablate, sinks_H=sinks_H)
            else:
                seen = None if ablate else pattern
                out, _ = attend(q, shard, cache, backend="cpu", pattern=seen, sinks_H=sinks_H)
            loss = loss + (out * inputs["upstream"][:, :, tokens]).sum()
            full_out[:, :, tokens] = out.detach()
        loss.backward()
        dist.all_reduce(full_out)
        return {"out": full_out, **summed_grads(leaves)}

    return run


class _ZeroGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(grad)


def _lending_run(
    rank: int,
    world: int,
    ablate: bool,
    sinks: bool = False,
    pattern: AttentionPattern | None = None,
) -> dict[str, torch.Tensor]:
    """Commutated attention with context exchange on top, 2 cp x 2 pipeline ranks: cp ranks 0
    and 1 attend the sliced sequence by `pattern`, lending earlier slices to their pipeline
    peers 2 and 3 (slice 0 in forward, every earlier slice in backward), which serve them for
    both cp ranks' queries. The ablation drops the gradients of the lent chunks."""
    cp_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    pipeline_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline_group = pipeline_groups[rank % 2]
    inputs = case_inputs()
    leaves = case_leaves(inputs, sinks=sinks)
    sinks_H, ablate = case_sinks(leaves, ablate), ablate and not sinks
    full_out = torch.zeros_like(inputs["q"])
    if rank >= 2:  # a pipeline peer: serve every lending slice's forward, then its backward
        loan = AttentionLoan(0, pipeline_group)
        for _ in range(SLICES - 1):
            serve_attention_loan(loan, "cpu")
        for _ in range(SLICES - 1):
            serve_attention_loan_backward(loan, "cpu")
        for leaf in leaves.values():
            leaf.grad = torch.zeros_like(leaf)
        dist.all_reduce(full_out)
        return {"out": full_out, **summed_grads(leaves)}
    slice_length, peer = LENGTH // SLICES, AttentionLoan(1, pipeline_group)
    cache: list[CachedShard] = []
    loss = torch.zeros((), dtype=torch.float64)
    for index in range(SLICES):
        tokens = load_balanced_indices(slice_length, 2, start=index * slice_length)[rank]
        shard = TokenShard(tokens, inputs["documents"][:, tokens])
        k, v = leaves["k"][:, :, tokens], leaves["v"][:, :, tokens]
        cache.append(CachedShard(k, v, shard))
        lent_cache = list(cache)
        if ablate:
            lent_cache[:index] = [
                CachedShard(_ZeroGradient.apply(c.k_BGKD), _ZeroGradient.apply(c.v_BGKD), c.shard)
                for c in cache[:index]
            ]
        lendings = (
            Lending(((peer, (0,)),) if index else ()),
            Lending(((peer, tuple(range(index))),) if index else ()),
        )
        q = leaves["q"][:, :, tokens]
        out, _ = commutated_context_attention(
            q, shard, lent_cache, cp_groups[0], backend="cpu", lendings=lendings, lendable=index,
            sinks_H=sinks_H, pattern=pattern,
        )  # fmt: skip
        loss = loss + (out * inputs["upstream"][:, :, tokens]).sum()
        full_out[:, :, tokens] = out.detach()
    loss.backward()
    dist.all_reduce(full_out)
    return {"out": full_out, **summed_grads(leaves)}


def _ulysses_heads_run(rank: int, world: int, ablate: bool) -> dict[str, torch.Tensor]:
    """Ulysses with ALiBi: each rank biases its heads by their own slopes; the ablation gives
    every rank the first heads' slopes (a wrong head offset)."""
    local_pattern = ulysses_module.local_pattern
    if ablate:
        ulysses_module.local_pattern = lambda pattern, group: pattern.on_head_shard(
            0, dist.get_world_size(group)
        )
    try:
        return whole_sequence_run("ulysses", ALIBI_PATTERN)(rank, world, False)
    finally:
        ulysses_module.local_pattern = local_pattern


def _runs(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Every case on one process group: the variants and their ablations."""
    return {
        f"{name}{' ablated' if ablate else ''}": run(rank, world, ablate)
        for name, run in (
            *(
                (f"{variant}, whole sequence", whole_sequence_run(variant))
                for variant in ("kv_passing", "ring", "commutated", "ulysses")
            ),
            *(
                (
                    f"{variant}, whole sequence, documents dealt",
                    whole_sequence_run(variant, documents_dealt=True),
                )
                for variant in ("kv_passing", "ring", "commutated", "ulysses")
            ),
            ("ring rotation", _ring_rotation_run),
            ("kv passing, sliced", _sliced_run(kv_passing_context_attention)),
            ("commutated, sliced", _sliced_run(commutated_context_attention)),
            *(
                (f"{variant}, whole sequence, window", whole_sequence_run(variant, WINDOW))
                for variant in ("kv_passing", "ring", "commutated", "ulysses")
            ),
            *(
                (f"{variant}, whole sequence, alibi", whole_sequence_run(variant, ALIBI_PATTERN))
                for variant in ("kv_passing", "ring", "commutated")
            ),
            ("ulysses, whole sequence, alibi (heads' own slopes)", _ulysses_heads_run),
            *(
                (
                    f"{variant}, whole sequence, keys are values",
                    whole_sequence_run(variant, shared=True),
                )
                for variant in ("kv_passing", "commutated", "ulysses")
            ),
            *(
                (f"{variant}, whole sequence, sinks", whole_sequence_run(variant, sinks=True))
                for variant in ("kv_passing", "ring", "commutated", "ulysses")
            ),
            ("kv passing, sliced, sinks", _sliced_run(kv_passing_context_attention, sinks=True)),
            ("commutated, sliced, sinks", _sliced_run(commutated_context_attention, sinks=True)),
            ("kv passing, sliced, window", _sliced_run(kv_passing_context_attention, WINDOW)),
            ("commutated, sliced, window", _sliced_run(commutated_context_attention, WINDOW)),
            ("kv passing, sliced, alibi", _sliced_run(kv_passing_context_attention, ALIBI_PATTERN)),
            ("commutated, sliced, alibi", _sliced_run(commutated_context_attention, ALIBI_PATTERN)),
            *(
                (
                    ("commutated, sliced, exchange", _lending_run),
                    ("commutated, sliced, exchange, sinks", partial(_lending_run, sinks=True)),
                    (
                        "commutated, sliced, exchange, alibi",
                        partial(_lending_run, pattern=ALIBI_PATTERN),
                    ),
                )
                if world == 4
                else ()
            ),
        )
        for ablate in (False, True)
    }


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_attention_matches_one_process_fp64(world: int) -> None:
    """Every variant over the whole sequence (KV all-gather, ring, commutated, Ulysses: with 4
    ranks its 2 kv heads are repeated to split) and over a
    chunked cache of slices (KV passing, commutated) equals single-process attention in output
    and every gradient, causal, with a sliding window and with ALiBi; the ablations (shards
    masked as if their tokens came first; attending to the local cache only; the pattern
    ignored; Ulysses biasing every rank's heads by the first heads' slopes) do not."""
    per_rank = run_on_ranks(_runs, world, timeout=120)
    for case in per_rank[0]:
        pattern = case_pattern(case)
        shared, sinks = "keys are values" in case, "sinks" in case
        results = [results[case] for results in per_rank]
        difference = worst_difference(results, pattern, shared, sinks)
        if case.endswith("ablated"):
            assert difference > 1e-3, (case, difference)
        else:
            assert difference <= TOLERANCE, (case, difference)


def test_load_balanced_shards_cover_the_sequence_and_share_causal_work() -> None:
    for cp in (1, 2, 4):
        indices = load_balanced_indices(32, cp, start=64)
        assert sorted(indices.flatten().tolist()) == list(range(64, 96))
        keys_attended = (indices - 64 + 1).sum(dim=1)  # causal: token t sees t + 1 keys
        assert keys_attended.unique().numel() == 1
    with pytest.raises(ValueError, match=r"length 36 is not a multiple of 8: choose seq_len"):
        load_balanced_indices(36, 4)


def _rank_work(work_S: torch.Tensor, indices_CS: torch.Tensor) -> list[float]:
    return [float(work_S[tokens].sum()) for tokens in indices_CS]


def test_document_deal_balances_packed_rows_and_is_head_and_tail_on_one_sequence() -> None:
    """On one causal sequence with two pieces per rank the deal is head and tail; on a row of
    short documents followed by a long one, head and tail leave one rank far more attention
    work, the deal with 8 pieces per rank within 5% of the mean; every token once, each
    rank's in order, deterministic; and a length that does not cut is refused."""
    for cp in (1, 2, 4):
        causal_S = keys_seen(None, seq_len=64)[0].double()
        assert torch.equal(
            document_balanced_indices(causal_S, cp, 2), load_balanced_indices(64, cp)
        )
    documents_S = torch.cat(
        [torch.arange(96).div(8, rounding_mode="floor"), torch.full((160,), 99)]
    )
    work_S = keys_seen(documents_S[None]).sum(dim=0).double()
    head_tail = _rank_work(work_S, load_balanced_indices(256, 4))
    dealt_CS = document_balanced_indices(work_S, 4, 8)
    dealt = _rank_work(work_S, dealt_CS)
    mean = sum(dealt) / 4
    assert max(head_tail) / mean > 1.3 and max(dealt) / mean <= 1.05, (head_tail, dealt)
    assert sorted(dealt_CS.flatten().tolist()) == list(range(256))
    assert all(torch.equal(tokens.sort().values, tokens) for tokens in dealt_CS)
    assert torch.equal(dealt_CS, document_balanced_indices(work_S, 4, 8))
    with pytest.raises(ValueError, match="cp x cp_balance_pieces = 32 equal pieces; length 36"):
        document_balanced_indices(work_S[:36], 4, 8)


def test_the_cheaper_variant_depends_on_grouped_query_attention_and_the_slice() -> None:
    """Llama 3 70B (64 query heads, 8 kv heads): the query and output of a slice weigh as
    much as about 8 slices of K/V, so KV passing is cheaper for the first 8 slices and
    commutated attention after; with as many kv heads as query heads it wins from slice 1."""
    gqa = {"slice_tokens": 1024, "cp": 4, "q_heads": 64, "kv_heads": 8, "head_dim": 128}
    choices = [choose_context_parallel(slice_index=j, **gqa) for j in range(12)]
    assert choices == ["kv_passing"] * 8 + ["commutated"] * 4
    mha = gqa | {"kv_heads": 64}
    assert [choose_context_parallel(slice_index=j, **mha) for j in range(3)] == [
        "kv_passing",
        "commutated",
        "commutated",
    ]
    commutated = [context_parallel_bytes("commutated", slice_index=j, **gqa) for j in range(4)]
    assert len(set(commutated)) == 1  # constant per slice
    assert context_parallel_bytes("kv_passing", slice_index=3, **gqa) == 4 * context_parallel_bytes(
        "kv_passing", slice_index=0, **gqa
    )
    ring = context_parallel_bytes("ring", slice_index=2, **gqa)  # moves what K/V passing does
    assert ring == context_parallel_bytes("kv_passing", slice_index=2, **gqa)
    with pytest.raises(ValueError, match="'auto' has no bytes rule: choose 'commutated'"):
        context_parallel_bytes("auto", slice_index=0, **gqa)


_MODELS = {
    "llama": TINY_LLAMA,
    "tiny_gpt": custom.TinyGPTArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=64),
}


def _model_runs(rank: int, world: int) -> dict[str, Result]:
    results = {}
    for name, args in _MODELS.items():
        batch = parity_batch(args.vocab_size, 8, LENGTH)
        spec = get_model_spec(name)
        results[name] = data_parallel_step(rank, world, spec, args, batch, cp=2)
        results[f"{name} ablated"] = data_parallel_step(  # each cp rank its own keys only
            rank, world, spec, args, batch, cp=2, cp_variant=TOY_LOCAL.name
        )
    # ablation: the MoE's load-balancing statistics of each cp rank's tokens alone
    data_parallel_module.statistics_group = lambda group: nullcontext()
    batch = parity_batch(_MODELS["tiny_gpt"].vocab_size, 8, LENGTH)
    spec, args = get_model_spec("tiny_gpt"), _MODELS["tiny_gpt"]
    results["statistics per rank"] = data_parallel_step(rank, world, spec, args, batch, cp=2)
    data_parallel_module.statistics_group = statistics_group
    return results


def test_fsdp_with_context_parallelism_matches_one_process_fp64() -> None:
    """Llama and the custom example (an MoE with a load-balancing loss) on 4 ranks, FSDP2 over
    dp_shard 2 x cp 2 (each data rank's rows, each cp rank its load-balanced half of their
    tokens and packed documents): loss and every gradient equal the single process's. Attending
    only to a rank's own keys does not, nor do load-balancing statistics of a rank's tokens
    alone (the MoE's statistics are added over the cp ranks)."""
    per_rank = run_on_ranks(_model_runs, 4, timeout=300)
    for name, args in _MODELS.items():
        batch = parity_batch(args.vocab_size, 8, LENGTH)
        reference = reference_step(get_model_spec(name), args, batch, microbatches=2)
        results = [results[name] for results in per_rank]
        assert max_relative_difference(results, reference) <= 1e-10, name
        ablated = [results[f"{name} ablated"] for results in per_rank]
        assert max_relative_difference(ablated, reference) > 1e-3, name
    per_rank_statistics = [results["statistics per rank"] for results in per_rank]
    # the statistics reach the loss through the routers (9e-4 of the largest gradient)
    assert max_relative_difference(per_rank_statistics, reference) > 1e-4


def _ulysses_runs(rank: int, world: int) -> dict[str, Result]:
    """Llama with Ulysses CP on 4 ranks: cp 2 x tp 2 (each tp rank's heads split again over
    the cp ranks) and cp 2 x dp_shard 2; the ablation gathers the shards' token indices in the
    wrong order (the mask no longer matches the all-to-all's token order)."""
    args = _MODELS["llama"]
    batch = parity_batch(args.vocab_size, 8, LENGTH)
    spec = get_model_spec("llama")
    layouts = {"cp2 tp2": {"tp": 2}, "cp2 dp2": {}}
    results = {
        name: data_parallel_step(
            rank, world, spec, args, batch, cp=2, cp_variant="ulysses", **extra
        )
        for name, extra in layouts.items()
    }
    gather = ulysses_module.gather_token_shards
    ulysses_module.gather_token_shards = lambda shard, group: gather(shard, group)[::-1]
    results["ablated"] = data_parallel_step(
        rank, world, spec, args, batch, cp=2, cp_variant="ulysses"
    )
    ulysses_module.gather_token_shards = gather
    return results


def test_ulysses_context_parallelism_composes_with_tp_and_fsdp_fp64() -> None:
    per_rank = run_on_ranks(_ulysses_runs, 4, timeout=300)
    args = _MODELS["llama"]
    reference = reference_step(
        get_model_spec("llama"), args, parity_batch(args.vocab_size, 8, LENGTH), microbatches=2
    )
    for layout in ("cp2 tp2", "cp2 dp2"):
        results = [results[layout] for results in per_rank]
        assert max_relative_difference(results, reference) <= 1e-10, layout
    ablated = [results["ablated"] for results in per_rank]
    assert max_relative_difference(ablated, reference) > 1e-3


def test_ulysses_is_refused_where_it_cannot_run() -> None:
    """Heads that do not split over the cp ranks (after tp), ring inside a pipeline, and
    Ulysses under context exchange (which lends token shards) are refused before launch with
    one line; Ulysses in a sliced pipeline plans."""
    from pipekit.attention.across.ulysses import check_ulysses_heads
    from pipekit.config import ConfigError, load_job_config
    from pipekit.train.job import validate_job

    with pytest.raises(ValueError, match=r"cp=4 ranks heads / cp query heads, but a rank holds 6"):
        check_ulysses_heads(6, 4)
    configs = Path(__file__).resolve().parents[2] / "configs"
    sliced = ["--config", str(configs / "debug_sliced_pp.toml"), "--parallelism.cp", "2"]
    with pytest.raises(ConfigError, match=r"cp_variant='ring' runs on whole sequences"):
        validate_job(
            load_job_config([*sliced, "--parallelism.cp_variant", "ring"]), 4, check_files=False
        )
    ulysses = [*sliced, "--parallelism.cp_variant", "ulysses"]
    with pytest.raises(ConfigError, match=r"context_exchange = true with cp_variant='ulysses'"):
        validate_job(
            load_job_config([*ulysses, "--parallelism.context_exchange", "true"]),
            4,
            check_files=False,
        )
    assert validate_job(load_job_config(ulysses), 4, check_files=False).dims.cp == 2
    flat = ["--config", str(configs / "debug_model.toml"), "--parallelism.dp_shard", "1"]
    job = validate_job(
        load_job_config([*flat, "--parallelism.cp", "2", "--parallelism.cp_variant", "ulysses"]),
        2,
        check_files=False,
    )
    assert job.dims.cp == 2


def test_auto_picks_ulysses_on_whole_sequences_only_where_it_moves_fewest_bytes() -> None:
    """Multi-head attention over 4 ranks: Ulysses' all-to-alls move (2 h + 2 h) d / cp per
    token against KV passing's 2 h d, so the whole-sequence rule picks it; with one kv head
    (grouped-query) KV passing stays cheaper; the per-slice rule never considers it."""
    from pipekit.attention.across import (
        context_parallel_variant,
    )

    q_BHSD, k_mha, k_gqa = (
        torch.zeros(1, 8, 16, 4),
        torch.zeros(1, 8, 16, 4),
        torch.zeros(1, 1, 16, 4),
    )
    whole = {"slice_index": 0, "slice_tokens": 64, "cp": 4}
    assert (
        context_parallel_variant("auto", q_BHSD, k_mha, **whole, whole_sequence=True) == "ulysses"
    )
    assert (
        context_parallel_variant("auto", q_BHSD, k_gqa, **whole, whole_sequence=True)
        == "kv_passing"
    )
    assert context_parallel_variant("auto", q_BHSD, k_mha, **whole) != "ulysses"
