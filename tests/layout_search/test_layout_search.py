"""The layout search: its counted shares against the built ranks, its peaks against the memory
plan of the exact layout, its step model's ordering rules, and `layout = "auto"` as users run
it (torchrun on 2 and 4 ranks; nothing fits: one line before any process group)."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest
import torch
from job_runs import (
    CONFIG,
    MOE_SLICED_CONFIG,
    SLICED_PP_CONFIG,
    VOCAB_PP_CONFIG,
    job_command,
    job_env,
    logged_losses,
    single_process_error,
)

from pipekit.attention.kernels.backends import attention_work_block
from pipekit.bench.layout_search_cpu import spearman
from pipekit.config import load_job_config
from pipekit.layout_search import Layout, SearchSpace, apply_layout, device_profile
from pipekit.layout_search.block_timing import measure_placed_block_pass_s
from pipekit.layout_search.candidates import enumerate_layouts
from pipekit.layout_search.search import LayoutSearch, nothing_fits
from pipekit.layout_search.shards import ShareCounter
from pipekit.memory_plan import plan_memory, rank_layouts
from pipekit.memory_plan.documents import attention_share, planning_document_ids
from pipekit.train.job import validate_job

_DEBUG_DEVICE = device_profile("h100", memory_bytes=10 << 20, devices_per_node=2)
"""An accelerator of 10 MiB: small enough that the debug model's layouts differ in whether
they fit and which activation policy they need."""


@pytest.mark.parametrize(
    ("config", "world", "overrides"),
    [
        (SLICED_PP_CONFIG, 4, ("--parallelism.dp_shard", "2")),
        (VOCAB_PP_CONFIG, 2, ()),
        (VOCAB_PP_CONFIG, 4, ("--parallelism.tp", "2")),
        (MOE_SLICED_CONFIG, 4, ()),
        (CONFIG, 2, ("--parallelism.tp", "2", "--parallelism.dp_shard", "1")),
    ],
    ids=["sliced_fsdp", "vocab_parallel", "vocab_parallel_tp", "moe_ep", "tensor_parallel"],
)
def test_counted_shares_equal_the_built_ranks(config, world, overrides):
    """ShareCounter's arithmetic gives every pipeline rank the parameters, stages, blocks,
    output rows and largest FSDP unit (one tp rank's part, one ep rank's experts) that the
    real (meta-device, simulated process group) build gives it."""
    job = validate_job(load_job_config(["--config", config, *overrides]), world, check_files=False)
    with torch.device("meta"):
        model = job.spec.build(job.args)
    counted = ShareCounter(job, model).layouts(job)
    assert counted == rank_layouts(job)


@pytest.fixture(scope="module")
def debug_search() -> tuple[LayoutSearch, object]:
    config = load_job_config(["--config", SLICED_PP_CONFIG])
    space = SearchSpace(world_size=4, devices_per_node=2)
    search = LayoutSearch(config, 4, _DEBUG_DEVICE, space)
    return search, search.run()


def test_search_peaks_agree_with_the_memory_plan_of_each_layout(debug_search):
    """The fastest fitting layouts (each validated as a job) and the closest ones that do
    not fit: the memory plan of that exact layout, built for real, is within 5% of the
    search's peak."""
    search, result = debug_search
    printed = search.validated(result, 4)
    assert len(printed) == 4 and result.excluded
    policies = {candidate.layout.policy for candidate in result.fitting}
    assert "none" in policies and len(policies) > 1  # the budget makes some layouts pay
    for candidate in [*printed, *result.excluded[:2]]:
        job = validate_job(search.job_config(candidate.layout), 4, check_files=False)
        planned = plan_memory(job).peak
        assert candidate.peak_bytes == pytest.approx(planned, rel=0.05), candidate.layout.label()
        fits = planned <= _DEBUG_DEVICE.memory_bytes
        assert fits == (candidate in printed), candidate.layout.label()


def test_search_keeps_the_cheapest_policy_that_fits_and_ranks_by_time(debug_search):
    """Each fitting structure appears once, with a policy no slower than any other that
    fits it; the list is sorted by predicted step time; nothing printed breaks the job's
    rules (validate_job), and refused structures name the rule."""
    search, result = debug_search
    structures = [candidate.layout.structure for candidate in result.fitting]
    assert len(structures) == len(set(structures))
    times = [candidate.step.step_s for candidate in result.fitting]
    assert times == sorted(times)
    recomputing = [c for c in result.fitting if c.layout.activation_checkpoint != "none"]
    assert recomputing, "the 10 MiB budget should force recomputation somewhere"
    for candidate in recomputing[:3]:
        plain = search.evaluate(candidate.layout.structure)
        assert plain[0] is not None and plain[0].layout == candidate.layout
        assert candidate.step.recompute_s > 0
    assert any("[parallelism]" in reason for reason in result.refused)
    for candidate in result.fitting:  # torch's checkpoint recomputes once: no I/W split with it
        if candidate.layout.pp > 1 and candidate.layout.activation_checkpoint != "none":
            assert not search.job(candidate.layout).pipeline.splits_backward, candidate.layout


def test_validated_keeps_the_fastest_of_each_kind(debug_search):
    """With a kind, only the fastest valid layout of each kind is kept, in the search's order."""
    search, result = debug_search
    by_pp = search.validated(result, 10, kind=lambda layout: layout.pp)
    pps = [candidate.layout.pp for candidate in by_pp]
    assert len(pps) == len(set(pps)) > 1
    plain = search.validated(result, len(result.fitting))
    assert by_pp == [next(c for c in plain if c.layout.pp == pp) for pp in pps]


def test_step_model_charges_bubbles_recompute_and_communication():
    """The predicted step, on a device slow enough that compute outweighs link latency: 1F1B
    pays a larger bubble than the sliced schedule; full checkpointing pays one more forward;
    tensor parallelism pays its collectives."""
    config = load_job_config(["--config", SLICED_PP_CONFIG])
    slow = device_profile("h100", peak_flops=1e9, link_latency_s=0.0)
    search = LayoutSearch(config, 4, slow, SearchSpace(world_size=4, devices_per_node=4))

    def step(layout: Layout):
        job = search.job(layout)
        layouts = search.share_layouts(job)
        return search.candidate(job, layout, search.memory(job, layouts), layouts).step

    flat = step(Layout(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1))
    assert flat.bubble_s == 0 and flat.recompute_s == 0
    full = step(Layout(pp=1, dp_replicate=1, dp_shard=4, cp=1, tp=1, activation_checkpoint="full"))
    assert full.recompute_s == pytest.approx(flat.compute_s / 3)
    piped = step(Layout(pp=4, dp_replicate=1, dp_shard=1, cp=1, tp=1, schedule="1F1B"))
    sliced = step(
        Layout(pp=4, dp_replicate=1, dp_shard=1, cp=1, tp=1, schedule="sliced", num_slices=16)
    )
    assert piped.bubble_s > sliced.bubble_s > 0
    split = step(Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=4))
    assert split.exposed_communication_s > flat.exposed_communication_s


def test_cpu_passes_are_priced_at_the_rate_the_jobs_own_block_reached():
    """On a CPU a microbatch's compute is the measured block's time beyond its fixed cost,
    once per block (pre-set here: no timing in the test), whatever the FLOP/s a matmul
    reached; a layout that accumulates one sequence per pass is priced at its own shape."""
    config = load_job_config(["--config", SLICED_PP_CONFIG])
    cpu = dataclasses.replace(
        device_profile("h100", peak_flops=1e12, link_latency_s=0.0),
        name="cpu",
        block_overhead_s=0.01,
        devices_per_node=1,  # a core per rank on any machine
    )
    search = LayoutSearch(config, 2, cpu, SearchSpace(world_size=2, devices_per_node=1))
    layers = search.shape.num_layers
    rows = config.training.global_batch_size // 2
    search.pass_seconds.update({(rows, 1, 1): 0.01 + 0.2 * rows, (1, 1, 1): 0.01 + 0.3})

    def step(layout: Layout):
        job = search.job(layout)
        layouts = search.share_layouts(job)
        return search.candidate(job, layout, search.memory(job, layouts), layouts).step

    whole = step(Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1))
    assert whole.compute_s == pytest.approx(0.2 * rows * layers)
    accumulated = step(Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, accumulation=rows))
    assert accumulated.compute_s == pytest.approx(0.3 * rows * layers)
    assert "acc" in Layout(pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, accumulation=2).label()
    # under tp the measured pass holds tp's collectives: the rate covers a tp rank's FLOPs,
    # nothing is priced again as communication
    search.pass_seconds[(2 * rows, 2, 1)] = 0.01 + 0.5 * rows
    split = step(Layout(pp=1, dp_replicate=1, dp_shard=1, cp=1, tp=2))
    assert split.compute_s == pytest.approx(0.5 * rows * layers)
    assert split.exposed_communication_s == 0.0
    assert sorted(search.pass_seconds) == [(1, 1, 1), (rows, 1, 1), (2 * rows, 2, 1)]


@pytest.mark.parametrize(("tp", "cp"), [(1, 1), (2, 1), (1, 2)])
def test_a_placed_block_is_timed_split_as_the_job_splits_it(tp: int, cp: int):
    """The CPU measurement runs the job's block on forked gloo ranks of its world, split over
    tp (DTensor) and cp (the job's cp variant), and reports the slowest rank's pass."""
    config = load_job_config(["--config", CONFIG, "--training.seq_len", "64"])
    search = LayoutSearch(config, 2, _DEBUG_DEVICE, SearchSpace(world_size=2, devices_per_node=2))
    job = search.job(Layout(pp=1, dp_replicate=2 // (tp * cp), dp_shard=1, cp=cp, tp=tp))
    seconds = measure_placed_block_pass_s(job, search.meta_model, rows=2, repeats=1)
    assert 0.0 < seconds < 5.0


def test_apply_layout_writes_what_a_user_would(debug_search):
    """A layout becomes config fields: `--print-config` of the result names them, and the
    result is a manual layout."""
    search, result = debug_search
    layout = result.fitting[0].layout
    config = apply_layout(search.config, layout)
    parallelism = config.parallelism
    assert parallelism.layout == "manual"
    assert (parallelism.pipeline_parallel_degree, parallelism.cp, parallelism.tp) == (
        layout.pp, layout.cp, layout.tp,
    )  # fmt: skip
    assert config.training.activation_checkpoint == layout.activation_checkpoint


def test_nothing_fits_is_one_line_before_any_process_group(tmp_path: Path):
    """`layout = "auto"` where no layout fits: exit 2, one line naming the closest layout, its
    shortfall and the fix."""
    line = single_process_error(
        tmp_path / "out", "--parallelism.layout", "auto",
        "--parallelism.layout_memory_gib", "0.001",
    )  # fmt: skip
    assert line.startswith("config error: [parallelism] layout = 'auto': no layout fits")
    assert "needs" in line and "MiB of 1.0 MiB" in line and "launch more ranks" in line


def test_nothing_fits_names_the_rules_when_every_structure_is_refused(debug_search):
    _, result = debug_search
    empty = dataclasses.replace(result, fitting=[], excluded=[])
    assert "passes the job's rules" in nothing_fits(empty, _DEBUG_DEVICE)


def test_auto_layout_trains_the_debug_model(tmp_path: Path):
    """torchrun train.py with `layout = "auto"` on 4 ranks: rank 0 names the layout it chose
    with its prediction, the other 3 read it from the launcher's store and run it, and the
    loss falls."""
    nproc = 4
    output = tmp_path / "out"
    command = job_command(
        output, "--parallelism.layout", "auto", "--training.steps", "3",
        "--training.seq_len", "64", "--training.global_batch_size", "8",
        "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "false",
        "--metrics.log_interval", "1",
        "--metrics.peak_flops", "1e12", nproc=nproc,
    )  # fmt: skip
    run = subprocess.run(command, env=job_env(), capture_output=True, text=True, check=False)
    assert run.returncode == 0, run.stderr[-3000:]
    assert f"[rank 0] layout = auto on {nproc} ranks: " in run.stdout
    losses = logged_losses(output)
    assert sorted(losses) == [1, 2, 3] and losses[3] < losses[1]


def test_spearman_ranks_orders_not_values():
    assert spearman([1.0, 2.0, 3.0, 4.0], [10.0, 20.0, 30.0, 400.0]) == 1.0
    assert spearman([1.0, 2.0, 3.0], [3.0, 2.0, 1.0]) == -1.0
    assert spearman([1.0, 2.0, 3.0, 4.0], [1.0, 2.0, 4.0, 3.0]) == pytest.approx(0.8)
    with pytest.raises(ValueError, match="same length"):
        spearman([1.0], [1.0])


def test_packed_documents_are_priced_and_cut_per_microbatch_by_the_search():
    """With `[data] document_lengths` the search prices the drawn rows: attention at their
    share of causal attention (counted in the device kernel's tiles), each microbatch's slices
    as the layout cuts them; it tries `slicing = "documents"`, which it then predicts fastest on
    short documents. Without a distribution the document cut is the equal-cost one and is not
    tried."""
    argv = ["--config", SLICED_PP_CONFIG, "--training.seq_len", "4096"]
    slow = device_profile("h100", peak_flops=1e9, link_latency_s=0.0)
    space = SearchSpace(world_size=4, devices_per_node=4)
    steps = {}
    for lengths in ("", "lognormal:median=128,sigma=1.0"):
        config = load_job_config([*argv, "--data.document_lengths", lengths])
        search = LayoutSearch(config, 4, slow, space)
        slicings = {
            layout.slicing
            for layout in enumerate_layouts(config, space, search.shape)
            if layout.num_slices > 1
        }
        assert ("documents" in slicings) == bool(lengths)
        for slicing in ("equal_length", "equal_cost", "documents"):
            layout = Layout(pp=4, dp_replicate=1, dp_shard=1, cp=1, tp=1, num_slices=8,
                            slicing=slicing)  # fmt: skip
            job = search.job(layout)
            layouts = search.share_layouts(job)
            candidate = search.candidate(job, layout, search.memory(job, layouts), layouts)
            steps[lengths, slicing] = candidate.step.step_s
        drawn_BS = planning_document_ids(config, 16)
        share = search.costs.attention_share
        if lengths:
            assert share == attention_share(drawn_BS, attention_work_block("auto", "cuda")) < 0.5
        else:
            assert drawn_BS is None and share == 1.0
    assert steps["", "documents"] == steps["", "equal_cost"] < steps["", "equal_length"]
    packed = {slicing: steps[lengths, slicing] for (lengths, slicing) in steps if lengths}
    assert packed["documents"] < min(packed["equal_length"], packed["equal_cost"]), packed
    assert packed["documents"] < steps["", "documents"]  # less attention on short documents
