"""The pipeline feature table is open: a feature written outside pipekit
(examples/pipeline_feature/forward_log.py) registers itself, is planned, checked and built
through the table, runs its own action under the sliced pipeline, and leaves the model's
losses and gradients exactly as they are without it. pipekit's own features come from the same
table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

import examples.pipeline_feature.forward_log as forward_log
from pipekit.config import ConfigError, load_job_config
from pipekit.config.job_config import ParallelismConfig
from pipekit.models import get_model_spec
from pipekit.pipelining import (
    enabled_pipeline_features,
    get_pipeline_feature,
    pipeline_feature_names,
    plan_pipeline,
    register_pipeline_feature,
    torch_schedule_actions,
)
from pipekit.pipelining.features.registry import FeatureLayout
from pipekit.testing import parity_batch, run_on_ranks
from pipekit.testing.pipeline import pipeline_layout, runner_step
from pipekit.train.job import validate_job

REPO_ROOT = Path(__file__).resolve().parents[2]

LLAMA = get_model_spec("llama")
ARGS = LLAMA.flavor("debug").with_updates(
    dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=61, max_seq_len=64
)
SLICED = {"pipeline_schedule": "sliced", "num_slices": 4, "microbatches": 2}


def _plan(user_actions: dict | None = None, **keys: object):
    parallelism = ParallelismConfig(dp_shard=1, pipeline_parallel_degree=2, **keys)
    return plan_pipeline(
        parallelism, LLAMA.structure, LLAMA.shape(ARGS), 2, 64, user_actions=user_actions
    )


def test_the_table_lists_pipekits_features_and_a_registered_one_in_build_order() -> None:
    assert pipeline_feature_names() == [
        "context_parallel", "context_exchange", "vocab_parallel", "activation_offload",
        "forward_log",
    ]  # fmt: skip
    parallelism = ParallelismConfig(
        vocab_parallel=True, context_exchange=True, pipeline_features=["forward_log"]
    )
    assert enabled_pipeline_features(parallelism) == (
        "context_exchange", "vocab_parallel", "forward_log",
    )  # fmt: skip


def test_a_registered_features_rules_and_plan_come_from_its_entry() -> None:
    plan = _plan(**SLICED, pipeline_features=["forward_log"])
    assert plan.features == ("forward_log",)
    planned = plan.feature_plans["forward_log"]
    assert planned == forward_log.planned_forwards(plan.actions_by_rank)
    assert all(len(forwards) == 2 * 4 for forwards in planned.values())  # m x n, one stage
    with pytest.raises(ValueError, match="'1F1B' cannot carry forward_log"):  # sliced_only
        _plan(pipeline_schedule="1F1B", microbatches=2, pipeline_features=["forward_log"])
    with pytest.raises(ValueError, match="forward_log logs slices: num_slices >= 2, not 1"):
        whole_microbatches = torch_schedule_actions("1F1B", 2, 2)  # as a user schedule
        _plan(whole_microbatches, microbatches=2, pipeline_features=["forward_log"])
    with pytest.raises(ValueError, match="no pipeline feature named 'forward_logs'"):
        _plan(**SLICED, pipeline_features=["forward_logs"])
    with pytest.raises(ValueError, match="set vocab_parallel = true instead"):
        _plan(**SLICED, pipeline_features=["vocab_parallel"])


def _steps(rank: int, world: int, features: list[str]) -> dict:
    batch = parity_batch(ARGS.vocab_size, 2, 64)
    runner, _, _ = pipeline_layout(
        world, LLAMA, ARGS, batch.batch_size, stages_per_rank=2, pipeline_features=features,
        **SLICED,
    )  # fmt: skip
    results = [runner_step(runner, batch) for _ in range(2)]
    log = runner.extension("forward_log")
    return {
        "results": results,
        "closed": log.closed_steps if isinstance(log, forward_log.ForwardLog) else None,
    }


def test_a_feature_from_outside_pipekit_runs_under_the_sliced_pipeline() -> None:
    """Two steps on 2 ranks (2 stages each): the feature's action closed both steps after
    checking every planned forward ran exactly once, and the losses and every gradient equal
    the run without it bit for bit."""
    with_log = run_on_ranks(_steps, 2, ["forward_log"], timeout=120)
    without = run_on_ranks(_steps, 2, [], timeout=120)
    assert [rank["closed"] for rank in with_log] == [2, 2]
    assert [rank["closed"] for rank in without] == [None, None]
    for ours, plain in zip(with_log, without, strict=True):
        for (loss, grads), (plain_loss, plain_grads) in zip(
            ours["results"], plain["results"], strict=True
        ):
            assert loss == plain_loss
            assert grads.keys() == plain_grads.keys()
            for name, grad in grads.items():
                torch.testing.assert_close(grad, plain_grads[name], rtol=0, atol=0)


def test_the_features_close_action_refuses_a_dropped_or_repeated_forward() -> None:
    """Ablation of the check the feature's action makes each step."""
    log = forward_log.ForwardLog([(0, 0), (0, 1)])
    for unit in (0, 0):
        log.after_forward(0, unit, context=None)  # unit 1 dropped, unit 0 repeated
    with pytest.raises(RuntimeError, match=r"forward_log: ran \[\(0, 0\), \(0, 0\)\]"):
        log.run_action(None, None)


def test_a_job_turns_a_registered_feature_on_by_name() -> None:
    """From the config, as train.py reads it: `[model] module` registers the feature and
    `pipeline_features` turns it on; without a pipeline it is refused with one line."""
    argv = [
        "--config", str(REPO_ROOT / "configs/debug_sliced_pp.toml"),
        "--model.module", "examples.pipeline_feature.forward_log",
        "--parallelism.pipeline_features", "forward_log",
    ]  # fmt: skip
    job = validate_job(load_job_config(argv), world_size=2, check_files=False)
    assert job.pipeline is not None and job.pipeline.features == ("forward_log",)
    flat = [*argv, "--parallelism.pipeline_parallel_degree", "1"]
    with pytest.raises(ConfigError, match=r"pipeline_features=\['forward_log'\] are pipeline"):
        validate_job(load_job_config(flat), world_size=1, check_files=False)


def test_a_features_layout_rules_come_from_its_entry_pipeline_or_not() -> None:
    """`check_layout` of every enabled feature runs when the job's layout is checked, before
    any plan, with or without a pipeline: job validation names no feature. Vocabulary
    parallelism's own rules (pipeline ranks to split over) come from its entry the same way."""
    argv = [
        "--config", str(REPO_ROOT / "configs/debug_sliced_pp.toml"),
        "--model.module", "examples.pipeline_feature.forward_log",
        "--parallelism.pipeline_features", "forward_log",
    ]  # fmt: skip
    original = get_pipeline_feature("forward_log")
    seen: list[int] = []

    def refuse(layout: FeatureLayout) -> None:
        seen.append(layout.dims.pp)
        raise ValueError(f"forward_log refuses tp={layout.dims.tp}; set tp = 1")

    register_pipeline_feature(dataclasses.replace(original, check_layout=refuse), replace=True)
    try:
        with pytest.raises(ConfigError, match=r"^\[parallelism\] forward_log refuses tp=1"):
            validate_job(load_job_config(argv), world_size=2, check_files=False)
    finally:
        register_pipeline_feature(original, replace=True)
    assert seen == [2]
    validate_job(load_job_config(argv), world_size=2, check_files=False)  # restored
    flat = ["--config", str(REPO_ROOT / "configs/debug_model.toml"), "--parallelism.vocab_parallel",
            "true"]  # fmt: skip
    with pytest.raises(ConfigError, match="splits the vocabulary across pipeline ranks"):
        validate_job(load_job_config(flat), world_size=1, check_files=False)
    sliced = [
        *("--config", str(REPO_ROOT / "configs/debug_sliced_pp.toml")),
        *("--parallelism.vocab_parallel", "true", "--model.upcycle.num_experts", "4"),
        *("--model.upcycle.layers", "1", "--checkpoint.initial_load_path", "/dense"),
    ]
    with pytest.raises(ConfigError, match="vocab_parallel = true does not combine with"):
        validate_job(load_job_config(sliced), world_size=2, check_files=False)


@pytest.mark.parametrize("slicing", ["equal_cost", "documents"])
def test_a_feature_that_needs_equal_slices_is_refused_on_unequal_cuts(slicing: str) -> None:
    """A feature whose extension declares `equal_length_slices` (none of pipekit's own need
    it) is refused on unequal cuts, named, before anything is built; equal lengths plan."""
    original = get_pipeline_feature("forward_log")

    class EqualSlicesOnly(original.extension):  # type: ignore[name-defined,misc]
        equal_length_slices = True

    register_pipeline_feature(
        dataclasses.replace(original, extension=EqualSlicesOnly), replace=True
    )
    try:
        with pytest.raises(ValueError, match=f"slicing='{slicing}' with .*forward_log.*equal"):
            _plan(slicing=slicing, pipeline_features=["forward_log"], **SLICED)
        _plan(pipeline_features=["forward_log"], **SLICED)
    finally:
        register_pipeline_feature(original, replace=True)
