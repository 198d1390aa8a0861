"""Hierarchical context parallelism (Ulysses inside groups of cp ranks, another variant across
them) against one process in float64: the attention alone with every variant across, sinks,
windows, ALiBi and keys that are their own values; whole models with Ulysses and hierarchical
context parallelism under tensor parallelism, pipelines and FSDP2; the bytes rule; the
refusals. Each with an ablation that must fail."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from context_parallel_cases import (
    ALIBI_PATTERN,
    TOLERANCE,
    WINDOW,
    whole_sequence_run,
    worst_difference,
)
from tiny_models import TINY_LLAMA

from pipekit.attention.across import context_parallel_bytes, context_parallel_variant
from pipekit.attention.across import ulysses as ulysses_module
from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.variants.hierarchical import hierarchical_bytes
from pipekit.models import get_model_spec
from pipekit.pipelining.features.context_parallel import PipelineContextParallel
from pipekit.pipelining.runtime.runner import PipelineRunner
from pipekit.testing import (
    Result,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

ULYSSES = 2
"""Ranks per Ulysses group: 4 cp ranks in 2 groups."""


def _groups(rank: int, world: int) -> tuple[HierarchicalGroups, dist.ProcessGroup]:
    """This rank's Ulysses group (adjacent ranks) and across group, and its own one-rank group
    (the ablation's "across": no other group's tokens)."""
    ulysses = across = alone = None
    for start in range(0, world, ULYSSES):
        group = dist.new_group(list(range(start, start + ULYSSES)))
        ulysses = group if rank // ULYSSES == start // ULYSSES else ulysses
    for offset in range(ULYSSES):
        group = dist.new_group(list(range(offset, world, ULYSSES)))
        across = group if rank % ULYSSES == offset else across
    for other in range(world):
        group = dist.new_group([other])
        alone = group if other == rank else alone
    assert ulysses is not None and across is not None and alone is not None
    return HierarchicalGroups(ulysses, across), alone


CASES = {
    "kv_passing across": {},
    "ring across": {},
    "commutated across": {},
    "auto across": {},
    "commutated across, window": {"pattern": WINDOW},
    "kv_passing across, alibi": {"pattern": ALIBI_PATTERN},
    "ring across, alibi": {"pattern": ALIBI_PATTERN},
    "ring across, sinks": {"sinks": True},
    "kv_passing across, keys are values": {"shared": True},
    "commutated across, documents dealt": {"documents_dealt": True},
}


def _runs(rank: int, world: int) -> dict[str, dict[str, torch.Tensor]]:
    groups, alone = _groups(rank, world)
    results = {}
    for name, options in CASES.items():
        across = name.split(" ")[0]

        def hierarchy(ablate: bool, across: str = across) -> HierarchicalGroups:
            return HierarchicalGroups(groups.ulysses, alone if ablate else groups.across, across)

        run = whole_sequence_run("hierarchical", hierarchy=hierarchy, **options)
        for ablate in (False, True):
            results[f"{name}{' ablated' if ablate else ''}"] = run(rank, world, ablate)
    return results


def test_hierarchical_attention_matches_one_process_fp64() -> None:
    """4 cp ranks as 2 Ulysses groups of 2: with K/V passing, the ring, commutated attention or
    the byte rule's choice across the groups, with a window, ALiBi (each rank its heads'
    slopes), attention sinks and keys that are their own values, output and every gradient
    equal one process's; with each group attending to its own tokens only they do not."""
    per_rank = run_on_ranks(_runs, 4, timeout=120)
    for case in per_rank[0]:
        name = case.removesuffix(" ablated")
        options = CASES[name]
        results = [results[case] for results in per_rank]
        difference = worst_difference(
            results,
            options.get("pattern"),
            options.get("shared", False),
            options.get("sinks", False),
        )
        if case.endswith("ablated"):
            assert difference > 1e-3, (case, difference)
        else:
            assert difference <= TOLERANCE, (case, difference)


def test_hierarchical_bytes_are_ulysses_within_plus_the_variant_across() -> None:
    """DeepSeek-V3-like MHA heads (128 q = kv heads, d 128) over cp 8 in groups of 4: Ulysses
    moves a group's share, the variant across moves a quarter of the heads over 2 groups; the
    whole-sequence rule picks hierarchical only where its sum is the smallest."""
    shape = {
        "slice_index": 0,
        "slice_tokens": 8192,
        "q_heads": 128,
        "kv_heads": 128,
        "head_dim": 128,
    }
    within = context_parallel_bytes("ulysses", **{**shape, "slice_tokens": 4096}, cp=4)
    across = {
        variant: context_parallel_bytes(variant, **{**shape, "q_heads": 32, "kv_heads": 32}, cp=2)
        for variant in ("commutated", "kv_passing")
    }
    for variant, moved in across.items():
        assert hierarchical_bytes(variant, ulysses_size=4, cp=8, **shape) == within + moved
    assert (
        hierarchical_bytes("ring", ulysses_size=4, cp=8, **shape) == within + across["kv_passing"]
    )
    assert context_parallel_bytes("hierarchical", ulysses_size=4, cp=8, **shape) == within + min(
        across.values()
    )
    q_BHSD, k_BGSD = torch.zeros(1, 128, 1024, 128), torch.zeros(1, 128, 1024, 128)
    options = {"slice_index": 0, "slice_tokens": 8192, "cp": 8, "whole_sequence": True}
    chosen = context_parallel_variant("auto", q_BHSD, k_BGSD, **options, ulysses_size=4)
    every = {
        variant: context_parallel_bytes(variant, **shape, cp=8, element_bytes=4, ulysses_size=4)
        for variant in ("commutated", "kv_passing", "ulysses", "hierarchical")
    }
    assert every[chosen] == min(every.values())
    # 6 heads do not split over 4 ranks (no Ulysses), but over groups of 2 they do
    q_6, shape_6 = torch.zeros(1, 6, 1024, 128), {**shape, "q_heads": 6, "kv_heads": 6}
    options_6 = {**options, "cp": 4}
    moved = {
        variant: context_parallel_bytes(variant, **shape_6, cp=4, element_bytes=4, ulysses_size=2)
        for variant in ("commutated", "kv_passing", "hierarchical")
    }
    assert context_parallel_variant("auto", q_6, q_6, **options_6) == min(
        ("commutated", "kv_passing"), key=moved.get
    )
    assert context_parallel_variant("auto", q_6, q_6, **options_6, ulysses_size=2) == min(
        moved, key=moved.get
    )


def test_hierarchical_is_refused_where_it_cannot_run() -> None:
    """One line each, before launch: groups that do not split cp, heads that do not split over
    a group, the ring across inside a pipeline, context exchange, and cp_ulysses on a variant
    that does not use it."""
    from pipekit.config import ConfigError, load_job_config
    from pipekit.train.job import validate_job

    configs = Path(__file__).resolve().parents[2] / "configs"
    flat = ["--config", str(configs / "debug_model.toml"), "--parallelism.dp_shard", "1"]
    hierarchical = [*flat, "--parallelism.cp", "4", "--parallelism.cp_variant", "hierarchical"]

    def validate(arguments: list[str], world: int = 4) -> object:
        return validate_job(load_job_config(arguments), world, check_files=False)

    with pytest.raises(
        ConfigError, match=r"cp_ulysses, the ranks per Ulysses group, to divide cp=4"
    ):
        validate(hierarchical)
    with pytest.raises(
        ConfigError, match=r"cp_ulysses, the ranks per Ulysses group, to divide cp=4"
    ):
        validate([*hierarchical, "--parallelism.cp_ulysses", "3"])
    with pytest.raises(ConfigError, match=r"cp_across='spiral' is not one of"):
        validate(
            [*hierarchical, "--parallelism.cp_ulysses", "2", "--parallelism.cp_across", "spiral"]
        )
    with pytest.raises(
        ConfigError,
        match=r"sets the groups of cp_variant='auto' or 'hierarchical' here, not of 'ring'",
    ):
        validate([*flat, "--parallelism.cp", "4", "--parallelism.cp_variant", "ring",
                  "--parallelism.cp_ulysses", "2"])  # fmt: skip
    assert validate([*hierarchical, "--parallelism.cp_ulysses", "2"]).dims.cp == 4
    sliced = ["--config", str(configs / "debug_sliced_pp.toml"), "--parallelism.cp", "4"]
    sliced += ["--parallelism.cp_variant", "hierarchical", "--parallelism.cp_ulysses", "2"]
    with pytest.raises(ConfigError, match=r"cp_across='ring' inside a pipeline is not one of"):
        validate([*sliced, "--parallelism.cp_across", "ring"], 8)
    with pytest.raises(
        ConfigError, match=r"context_exchange = true with cp_variant='hierarchical'"
    ):
        validate([*sliced, "--parallelism.context_exchange", "true"], 8)
    assert validate(sliced, 8).dims.cp == 4


LLAMA = dataclasses.replace(TINY_LLAMA, n_layers=2)
"""4 query heads, 2 kv heads: under tp 2 a rank's 2 query heads read one kv head. One layer a
stage: every layer of a stage attends through the same context (the parity matrix runs
stages of several layers), so a second one only costs 16 ranks on 2 cores more time."""
SEQ_LEN, ROWS = 32, 4
SLICED = {"pipeline_schedule": "sliced", "num_slices": 4, "microbatches": 2, "dp_shard": 1}
HIERARCHICAL = {"cp_variant": "hierarchical", "cp_ulysses": 2}
LAYOUTS = {
    "sliced pp 2 x Ulysses cp 2 x tp 2": SLICED | {"cp": 2, "tp": 2, "cp_variant": "ulysses"},
    "hierarchical cp 4 (2 x 2, ring across) x tp 2": {"cp": 4, "tp": 2} | HIERARCHICAL,
}
"""8 ranks each: Ulysses and hierarchical context parallelism with tensor parallelism, inside
a sliced pipeline and over whole sequences under FSDP2."""
LAYOUTS_16 = {
    "sliced pp 2 x hierarchical cp 4 (2 x 2) x tp 2": SLICED | {"cp": 4, "tp": 2} | HIERARCHICAL
}
"""16 ranks: hierarchical context parallelism, tensor parallelism and the sliced pipeline."""


def _ablate(name: str, runner: PipelineRunner) -> None:
    """Break the layout's mechanism: Ulysses' gathered tokens put in the wrong order; the
    ranks across the Ulysses groups attending to their own caches only."""
    parallel = runner.extension("context_parallel")
    assert isinstance(parallel, PipelineContextParallel)
    if "hierarchical" in name:
        parallel.drop_remote = True
        return
    rank_tokens = parallel.rank_tokens
    parallel.rank_tokens = lambda microbatch, index: rank_tokens(microbatch, index).flip(0)


def _reversed(gather: Callable[..., list], shard: object, group: object) -> list:
    return gather(shard, group)[::-1]


def _model_runs(rank: int, world: int, layouts: dict[str, dict]) -> dict[str, Result]:
    spec, batch = get_model_spec("llama"), parity_batch(LLAMA.vocab_size, ROWS, SEQ_LEN)
    results = {}
    for name, layout in layouts.items():
        for ablate in (False, True):
            key = f"{name}{' ablated' if ablate else ''}"
            if "pipeline_schedule" in layout:
                adjust = functools.partial(_ablate, name) if ablate else None
                results[key] = pipeline_step(
                    rank, world, spec, LLAMA, batch, adjust=adjust, **layout
                )
                continue
            gather = ulysses_module.gather_token_shards
            if ablate:  # the group's tokens gathered in the wrong order
                ulysses_module.gather_token_shards = functools.partial(_reversed, gather)
            results[key] = data_parallel_step(
                rank, world, spec, LLAMA, batch, loss_parallel=True, cp_across="ring",
                **layout,
            )  # fmt: skip
            ulysses_module.gather_token_shards = gather
    return results


def test_ulysses_and_hierarchical_compose_with_tp_and_pipelines_fp64() -> None:
    """Loss and every gradient of each layout (8 ranks; 16 for hierarchical x tp x pipeline)
    equal one process's (float64); each ablation does not."""
    spec, batch = get_model_spec("llama"), parity_batch(LLAMA.vocab_size, ROWS, SEQ_LEN)
    reference = reference_step(spec, LLAMA, batch, microbatches=2)
    for world, layouts in ((8, LAYOUTS), (16, LAYOUTS_16)):
        per_rank = run_on_ranks(_model_runs, world, layouts, timeout=600)
        for name in layouts:
            results = [results[name] for results in per_rank]
            assert max_relative_difference(results, reference) <= 1e-10, name
            ablated = [results[f"{name} ablated"] for results in per_rank]
            assert max_relative_difference(ablated, reference) > 1e-3, name
