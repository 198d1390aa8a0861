"""A model unlike the built-in ones (examples/local_global: sliding-window and full layers, soft-
capped attention scores, (1 + w) RMSNorm, GeGLU MLPs and GeGLU MoE experts, embeddings scaled by
sqrt(dim), soft-capped logits, tied embeddings) equals one process in float64 — loss and every
gradient, 1e-10 — under FSDP, the sliced pipeline (slices planned, and cut per microbatch by
its documents, also with context exchange and vocabulary parallelism), the sliced pipeline with
context exchange (its lent slices sent ahead) and vocabulary parallelism, and (4 ranks) the
sliced pipeline with context parallelism, with and without context exchange. Ablations, each of
which must fail: the pipeline's KV cache ignoring the window, or placing slices cut per
microbatch at the planned cuts; vocabulary parallelism without the soft-cap; the embedding scale
run on every stage."""

from __future__ import annotations

import dataclasses

import pytest

import examples.local_global.model as local_global
import pipekit.attention.kv_cache as kv_cache_module
from pipekit.pipelining.features.vocab_parallel import PipelineVocabParallel
from pipekit.pipelining.runtime.stage import SlicedPipelineStage
from pipekit.testing import (
    RankFailedError,
    data_parallel_step,
    max_relative_difference,
    parity_batch,
    pipeline_step,
    reference_step,
    run_on_ranks,
)

TOLERANCE = 1e-10
ARGS = local_global.LocalGlobalArgs(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=48, vocab_size=61, max_seq_len=64,
    window=5,
)  # fmt: skip
ROWS, SEQ_LEN, MICROBATCHES, SLICES = 4, 32, 2, 4
SLICED = {"pipeline_schedule": "sliced", "num_slices": SLICES, "microbatches": MICROBATCHES}
EXCHANGE = {**SLICED, "context_exchange": True, "vocab_parallel": True}
DOCUMENTS_EXCHANGE = {**EXCHANGE, "slicing": "documents", "work_block": 1}
SPEC = local_global.LOCAL_GLOBAL


def _batch():
    return parity_batch(ARGS.vocab_size, ROWS, SEQ_LEN)


def _drop_softcap(runner) -> None:
    for extension in runner.extensions:
        if isinstance(extension, PipelineVocabParallel):
            extension.logits_transforms = []


def _cases(rank: int, world: int, ablation: str = "") -> dict:
    """Every layout of `world` ranks on one process group (an ablation breaks one mechanism)."""
    spec, adjust = SPEC, None
    if ablation == "window_ignored_by_the_cache":  # the visible slices' keys seen whole
        original = kv_cache_module.block_mask
        kv_cache_module.block_mask = lambda pattern, *rest: original(None, *rest)
    if ablation == "cache_at_the_planned_cuts":  # slices cut per microbatch, cached as planned
        use_bounds = SlicedPipelineStage.use_microbatch_bounds

        def keep_planned_bounds(stage: SlicedPipelineStage, bounds: list) -> None:
            use_bounds(stage, bounds)
            stage.kv_cache.microbatch_bounds = None  # the cache falls back to the planned cuts

        SlicedPipelineStage.use_microbatch_bounds = keep_planned_bounds
    if ablation == "softcap_dropped_by_vocab_parallel":
        adjust = _drop_softcap
    if ablation == "scale_on_every_stage":
        structure = dataclasses.replace(
            SPEC.structure, before_blocks=(), shared=("rope", "embed_scale")
        )
        spec = dataclasses.replace(SPEC, structure=structure)
    if world == 2:
        return {
            "fsdp": data_parallel_step(rank, world, spec, ARGS, _batch()),
            "pp sliced": pipeline_step(rank, world, spec, ARGS, _batch(), **SLICED),
            "pp documents": pipeline_step(
                rank, world, spec, ARGS, _batch(), **SLICED, slicing="documents"
            ),
            "pp exchange vocab": pipeline_step(
                rank, world, spec, ARGS, _batch(), adjust=adjust, **EXCHANGE
            ),
            "pp documents exchange vocab": pipeline_step(
                rank, world, spec, ARGS, _batch(), adjust=adjust, **DOCUMENTS_EXCHANGE
            ),
        }
    return {
        "pp cp": pipeline_step(rank, world, spec, ARGS, _batch(), cp=2, **SLICED),
        "pp cp exchange": pipeline_step(
            rank, world, spec, ARGS, _batch(), cp=2, context_exchange=True, **SLICED
        ),
    }


@pytest.fixture(scope="module")
def references() -> dict:
    whole = reference_step(SPEC, ARGS, _batch(), microbatches=2)  # FSDP: each rank's rows
    pipelined = reference_step(SPEC, ARGS, _batch(), microbatches=MICROBATCHES)
    return {"fsdp": whole, "pp": pipelined}


def _differences(references: dict, world: int, ablation: str = "") -> dict[str, float]:
    per_rank = run_on_ranks(_cases, world, ablation, timeout=120)
    return {
        layout: max_relative_difference(
            [results[layout] for results in per_rank],
            references["fsdp" if layout == "fsdp" else "pp"],
        )
        for layout in per_rank[0]
    }


def test_every_layout_equals_one_process_fp64(references) -> None:
    differences = _differences(references, 2) | _differences(references, 4)
    assert max(differences.values()) <= TOLERANCE, differences


@pytest.mark.parametrize(
    ("ablation", "world", "layouts"),
    [
        (
            "window_ignored_by_the_cache",
            2,
            ["pp sliced", "pp documents", "pp exchange vocab", "pp documents exchange vocab"],
        ),
        (
            "softcap_dropped_by_vocab_parallel",
            2,
            ["pp exchange vocab", "pp documents exchange vocab"],
        ),
        ("scale_on_every_stage", 2, ["pp sliced", "pp exchange vocab"]),
    ],
)
def test_each_mechanism_is_needed(references, ablation: str, world: int, layouts) -> None:
    differences = _differences(references, world, ablation)
    for layout in layouts:
        assert differences[layout] > 1e-4, (ablation, layout, differences)


def test_slices_cut_per_microbatch_need_the_cache_to_follow_them() -> None:
    """Cached where the plan cut, a slice cut elsewhere indexes its window's keys out of range."""
    with pytest.raises(RankFailedError, match=r"index \d+ is out of bounds"):
        run_on_ranks(_cases, 2, "cache_at_the_planned_cuts", timeout=120)


def test_one_rank_trains_the_losses_of_two_in_float32(tmp_path) -> None:
    """The whole job in float32 for 5 steps: one process (tied weights kept tied), FSDP over 2
    ranks and the 2-rank sliced pipeline with context exchange and vocabulary parallelism give
    the same losses to 1e-5. Every run takes its MoE load-balancing statistics over 2 rows (one
    process accumulates two micro-steps, the pipeline runs 2 microbatches), as the auxiliary
    loss depends on them."""
    from job_runs import REPO_ROOT, train_job

    run = (
        "--training.steps", "5", "--training.global_batch_size", "4",
        "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_interval", "1", "--checkpoint.enable", "false",
    )  # fmt: skip
    configs = REPO_ROOT / "examples" / "local_global"
    fsdp_config, pipeline_config = (
        str(configs / "debug.toml"),
        str(configs / "debug_sliced_pp.toml"),
    )
    accumulated = ("--training.gradient_accumulation_steps", "2")
    one = train_job(tmp_path / "one", *run, *accumulated, nproc=1, config=fsdp_config)
    fsdp = train_job(tmp_path / "fsdp", *run, config=fsdp_config)
    pipeline = ("--parallelism.microbatches", "2")
    pipelined = train_job(tmp_path / "pp", *run, *pipeline, config=pipeline_config)
    assert len(one) == 5 and one[5] < one[1]
    assert one == pytest.approx(fsdp, rel=1e-5)
    assert one == pytest.approx(pipelined, rel=1e-5)
