"""The memory planner: layouts from a simulated process group, measured activations, refusals."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest
import torch

from pipekit.bench import plan_accuracy
from pipekit.config.loader import load_job_config
from pipekit.memory_plan import activations as activations_module
from pipekit.memory_plan.__main__ import main, parse_bytes
from pipekit.memory_plan.activations import TensorSplit, profile_activations
from pipekit.memory_plan.documents import (
    PLANNING_STEPS,
    longest_drawn_slice,
    planning_document_ids,
)
from pipekit.memory_plan.layout import rank_layouts
from pipekit.memory_plan.memory import plan_memory
from pipekit.models import get_model_spec
from pipekit.pipelining.features.offload_plan import resident_peak
from pipekit.train.job import validate_job

REPO_ROOT = Path(__file__).resolve().parents[2]


def _job(config: str, world: int, *overrides: str):
    argv = ["--config", str(REPO_ROOT / config), *overrides]
    return validate_job(load_job_config(argv), world, check_files=False)


def test_the_large_configs_validate_for_the_world_they_are_written_for() -> None:
    for config, world in [
        ("configs/llama3_8b.toml", 64),
        ("configs/llama3_70b.toml", 128),
        ("configs/llama3_8b_e8t2_upcycle.toml", 512),
        ("configs/llama3_70b_2m_slimpipe.toml", 256),
        ("configs/mixtral_8x7b_4m_slimpipe.toml", 256),
        ("configs/gpt_oss_120b_128k.toml", 64),
        ("configs/deepseek_v3_671b_128k.toml", 1024),
    ]:
        job = _job(config, world)
        assert job.dims is not None and job.dims.world_size == world
        assert job.local_batch_size == 1  # one sequence per rank and micro-step


def test_layouts_are_the_ranks_real_shards() -> None:
    """FSDP2 over 2 ranks holds half the model; a 2-stage pipeline's ranks hold their stages'
    modules (the first the embedding, the second the output), all on the meta device."""
    llama = get_model_spec("llama")
    with torch.device("meta"):
        total = sum(p.numel() for p in llama.build(llama.flavor("debug")).parameters())
    (fsdp,) = rank_layouts(_job("configs/debug_model.toml", 2))
    assert fsdp.param_numel == pytest.approx(total / 2, abs=64)
    assert fsdp.largest_unit_numel > 0 and len(fsdp.block_names) == 4
    first, last = rank_layouts(_job("configs/debug_sliced_pp.toml", 2))
    assert (first.stages, last.stages) == ((0,), (1,))
    assert first.param_numel + last.param_numel == total
    assert first.output_rows == 0 and last.output_rows == llama.flavor("debug").vocab_size
    assert set(first.block_names).isdisjoint(last.block_names)


def test_tensor_parallel_ranks_are_measured_as_they_run() -> None:
    """Blocks and head probed as one of 2 tp ranks (a simulated group in a forked child, after
    this process has run parallel CPU kernels, which once deadlocked the child): a rank saves
    less than the whole block, with or without sequence parallelism (which keeps a rank's
    share of the norms' outputs besides the projections' gathered inputs, and halves its
    checkpointed input), and its K/V and, under loss parallelism, its logits are its half."""
    llama = get_model_spec("llama")
    args = llama.flavor("debug").with_updates(vocab_size=8192)  # logits dominate the head
    torch.randn(256, 256) @ torch.randn(256, 256)  # the parent's OpenMP pool is in use
    whole = profile_activations(llama, args, torch.float32)
    plain = profile_activations(llama, args, torch.float32, split=TensorSplit(2))
    split = profile_activations(llama, args, torch.float32, split=TensorSplit(2, True, True))
    block = "layers.0"
    assert plain.block_bytes[block] < whole.block_bytes[block]
    assert split.block_bytes[block] < whole.block_bytes[block]
    assert split.input_bytes == plain.input_bytes // 2 == whole.input_bytes // 2
    assert plain.kv_bytes[block] == whole.kv_bytes[block] / 2
    assert plain.head_bytes_per_row == pytest.approx(whole.head_bytes_per_row, rel=0.05)
    assert split.head_bytes_per_row < 0.6 * whole.head_bytes_per_row


def test_activation_bytes_per_token_do_not_depend_on_the_probe_length() -> None:
    """What a block saves grows linearly with the tokens, so the slope is the same between any
    two lengths (the constant parts, such as RoPE tables, drop out)."""
    llama = get_model_spec("llama")
    args = llama.flavor("debug")
    short = profile_activations(llama, args, torch.float32, (2, 6))
    longer = profile_activations(llama, args, torch.float32, (16, 48))
    assert short.block_bytes == longer.block_bytes
    assert short.block_bytes["layers.0"] > 8 * args.dim * 4  # more than a few hidden states
    # a backward needs at least the gradient of the block's output and of its input
    assert short.backward_bytes == longer.backward_bytes >= 2 * args.dim * 4
    assert short.head_bytes_per_row == pytest.approx(longer.head_bytes_per_row, rel=1e-6)


def test_moe_backward_bytes_are_those_of_the_fastest_growing_moment() -> None:
    """An MoE block's backward allocates weight-sized gradient buffers: at a few tokens they
    make the peak, at real lengths the per-token tensors do. The probe at 2 and 6 tokens must
    give the per-token working set measured at 512 and 1024 tokens (the peak's own slope at
    2 and 6 tokens is a quarter lower for this block)."""
    moe = get_model_spec("llama_moe")
    args = moe.flavor("debug")
    short = profile_activations(moe, args, torch.float32, (2, 6))
    long = profile_activations(moe, args, torch.float32, (512, 1024))
    assert short.backward_bytes == long.backward_bytes
    assert short.block_bytes == long.block_bytes


def test_experts_too_heavy_to_build_are_measured_at_two_counts_and_extrapolated(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A block's bytes per token are linear in its expert count (the router's scores): the
    DeepSeek-V3 debug block with 32 experts (4 groups, top-2) measured at the two smallest
    counts its router accepts (4, 8) and extrapolated equals the block measured whole; an
    ablation that takes the larger count's bytes as they are does not."""
    spec = get_model_spec("deepseek_v3")
    debug = spec.flavor("debug")
    args = dataclasses.replace(debug, moe=dataclasses.replace(debug.moe, num_experts=32))
    whole = profile_activations(spec, args, torch.float32)
    monkeypatch.setattr(activations_module, "_EXPERT_BYTES_BUDGET", 0)
    counted = []
    real = activations_module.profile_activations

    def counting(spec_, args_, *rest, **options):
        counted.append(args_.moe.num_experts)
        return real(spec_, args_, *rest, **options)

    monkeypatch.setattr(activations_module, "profile_activations", counting)
    extrapolated = real(spec, args, torch.float32)
    assert counted == [4, 8]
    moe_blocks = [
        name
        for name, saved in whole.block_bytes.items()
        if saved != min(whole.block_bytes.values())
    ]
    assert moe_blocks
    for name, saved in whole.block_bytes.items():
        assert extrapolated.block_bytes[name] == pytest.approx(saved, rel=1e-9), name
    assert extrapolated.backward_bytes == pytest.approx(whole.backward_bytes, rel=1e-9)
    monkeypatch.setattr(activations_module, "_extrapolated", lambda small, large, counts: large)
    ablated = real(spec, args, torch.float32)
    assert any(ablated.block_bytes[name] < 0.999 * whole.block_bytes[name] for name in moe_blocks)


def test_the_head_saves_its_float32_log_probabilities_not_its_logits() -> None:
    llama = get_model_spec("llama")
    args = llama.flavor("debug")
    profile = profile_activations(llama, args, torch.float32)
    saved_per_token = profile.head_saved_bytes_per_row * args.vocab_size
    log_probabilities = 4 * args.vocab_size
    assert log_probabilities <= saved_per_token < log_probabilities + 4 * args.dim * 2
    assert profile.head_bytes_per_row > profile.head_saved_bytes_per_row


def test_the_plan_is_within_ten_percent_of_measured_peaks(capsys) -> None:
    """The planner against two ranks' measured peaks on four of the bench's debug configs
    (FSDP2, tensor parallelism, the sliced pipeline with activation offload, an upcycled MoE;
    the bench's other rows
    are in docs/results.md): `python -m pipekit.bench plan-accuracy`."""
    configs = "fsdp,tensor parallel,sliced pipeline + offload,upcycled"
    plan_accuracy.main(["--configs", configs])
    result = capsys.readouterr().out.strip().splitlines()[-1]
    error = float(result.removeprefix("RESULT plan_max_rel_err="))
    assert error <= 0.10, result


def test_offload_takes_what_the_schedule_moves_off_the_first_rank(capsys) -> None:
    """The debug sliced pipeline at ratio 0.9: rank 0 holds fewer activation bytes than
    without offload, by the blocks' bytes but their K/V times the units the schedule's replay
    moves away; the command prints the ratios and what the job needs without them."""
    job = _job("configs/debug_sliced_pp.toml", 2, "--parallelism.activation_offload", "0.9")
    assert job.pipeline is not None
    assert job.pipeline.feature_plans["activation_offload"] == (0.9, 0.9)
    plain_job = dataclasses.replace(
        job, pipeline=job.pipeline.without_feature("activation_offload")
    )
    plan = plan_memory(job)
    plain = plan_memory(plain_job, profile=plan.profile)
    actions = job.pipeline.actions_by_rank[0]
    moved_units = resident_peak(actions, 0.0) - resident_peak(actions, 0.9)
    assert moved_units > 1
    assert plan.ranks[0].activations < plain.ranks[0].activations
    assert plan.ranks[0].peak < plain.ranks[0].peak
    argv = ["--config", str(REPO_ROOT / "configs/debug_sliced_pp.toml"), "--world-size", "2"]
    main([*argv, "--parallelism.activation_offload", "0.9"])
    out = capsys.readouterr().out
    assert "activation offload per pipeline rank: 0.9, 0.9" in out
    assert "without it the plan fits too" in out


def test_equal_cost_slices_are_planned_by_their_tokens() -> None:
    """The debug sliced pipeline at 4K tokens (attention 2.6x the matmul FLOPs): equal-cost
    slices raise rank 0's planned activations, by less than if every slice were the longest."""
    overrides = ("--training.seq_len", "4096", "--parallelism.slicing")
    equal_cost = _job("configs/debug_sliced_pp.toml", 2, *overrides, "equal_cost")
    equal_length = _job("configs/debug_sliced_pp.toml", 2, *overrides, "equal_length")
    assert equal_cost.pipeline is not None and equal_length.pipeline is not None
    lengths = equal_cost.pipeline.slice_lengths
    assert lengths[0] > 1.5 * lengths[-1], lengths
    profile = plan_memory(equal_length).profile
    held = {
        name: plan_memory(job, profile=profile).ranks[0].activations
        for name, job in (("cost", equal_cost), ("length", equal_length))
    }
    longest = lengths[0] / equal_length.pipeline.slice_length
    assert held["length"] < held["cost"] < longest * held["length"], (held, lengths)


def test_a_plan_that_does_not_fit_is_refused_naming_the_term(capsys) -> None:
    argv = ["--config", str(REPO_ROOT / "configs/debug_model.toml"), "--world-size", "2"]
    main([*argv, "--device-memory", "1GiB"])
    assert "fits: peak" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--device-memory", "40MiB"])
    assert exit_info.value.code == 2
    error = capsys.readouterr().err
    assert "largest term is activations" in error and "activation_checkpoint" in error
    with pytest.raises(SystemExit):
        main([*argv, "--device-memory", "2MiB"])
    assert "parameters, gradients and optimizer states alone" in capsys.readouterr().err


def test_sizes_are_read_with_their_units() -> None:
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GB") == 141 * 10**9
    assert parse_bytes("1.5e9") == 1_500_000_000
    with pytest.raises(ValueError, match=r"write e\.g\. 80GiB"):
        parse_bytes("eighty")


@pytest.mark.parametrize(
    "config",
    [
        "configs/debug_model.toml",
        "configs/debug_sliced_pp.toml",
        "configs/debug_vocab_parallel_pp.toml",
    ],
)
def test_tied_models_are_planned(config: str, capsys) -> None:
    """A tied model's head is probed with its embedding's weight, whether or not a pipeline
    splits the two (the planner once refused every tied model)."""
    main(["--config", str(REPO_ROOT / config), "--world-size", "8", "--model.flavor",
          "debug_tied", "--parallelism.dp_shard", "-1"])  # fmt: skip
    assert "fits: peak" in capsys.readouterr().out


def test_packed_documents_size_units_at_the_longest_cut_a_drawn_microbatch_takes(
    tmp_path: Path,
) -> None:
    """Short documents with a few long ones (FlexAttention's 128-token tiles, one row per
    microbatch): some drawn microbatches are cut into a first slice longer than the planned
    shape's, so the plan holds more, by the longest cut among the drawn steps (recounted here
    from the drawn rows); fixed bounds with the same documents plan as before."""
    lengths = tmp_path / "lengths.json"
    lengths.write_text('{"lengths": [16, 3000], "counts": [400, 3]}')
    overrides = (
        "--training.seq_len", "4096", "--parallelism.microbatches", "16",
        "--model.attention_backend", "flex",
    )  # fmt: skip
    config = "configs/debug_sliced_pp.toml"
    causal = _job(config, 2, *overrides, "--parallelism.slicing", "documents")
    packed = _job(config, 2, *overrides, "--parallelism.slicing", "documents",
                  "--data.document_lengths", str(lengths))  # fmt: skip
    assert packed.pipeline is not None and causal.pipeline is not None
    drawn_BS = planning_document_ids(packed.config, packed.local_batch_size)
    assert drawn_BS is not None and drawn_BS.shape == (PLANNING_STEPS * 16, 4096)
    cuts = [
        end - start
        for row_BS in drawn_BS.split(1)
        for start, end in itertools.pairwise(packed.pipeline.slices.microbatch_bounds(row_BS))
    ]
    planned = causal.pipeline.slice_length
    assert max(cuts) > planned  # the case the planned shape alone misses
    assert longest_drawn_slice(packed) == max(cuts)
    assert longest_drawn_slice(causal) == planned
    profile = plan_memory(causal).profile
    held = {
        name: plan_memory(job, profile=profile).ranks[0].activations
        for name, job in (("causal", causal), ("packed", packed))
    }
    assert held["packed"] > held["causal"], held
    fixed = [
        _job(config, 2, *overrides, *documents)
        for documents in ((), ("--data.document_lengths", str(lengths)))
    ]
    assert len({plan_memory(job, profile=profile).peak for job in fixed}) == 1
