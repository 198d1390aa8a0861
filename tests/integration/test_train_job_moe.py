"""The mixture-of-experts and upcycling jobs end to end, as users run them: torchrun train.py
with a config; expert parallelism against FSDP experts, upcycling from a dense checkpoint,
Mixtral export."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from job_runs import (
    CONFIG,
    MOE_CONFIG,
    MOE_SLICED_CONFIG,
    REPO_ROOT,
    SHORT_RUN,
    logged_losses,
    single_process_error,
    train_job,
    write_debug_llama,
)

from pipekit.config import ConfigError, load_job_config
from pipekit.models import get_model_spec
from pipekit.train.job import validate_job


def test_expert_parallel_moe_job_matches_fsdp_experts_and_resumes(tmp_path: Path) -> None:
    """configs/debug_moe.toml (ep = 2, two pipelined partitions, shared buffers with S4
    restores) against the same model with its experts under FSDP (ep = 1, one partition, no
    sharing): equal losses step for step; the loss falls; stopping at step 2 and resuming
    gives the uninterrupted losses (expert DTensors on the ep mesh in the DCP checkpoint)."""
    short = (*SHORT_RUN[:10], "--training.steps", "4", "--checkpoint.interval", "2")
    expert_parallel = train_job(tmp_path / "ep2", *short, config=MOE_CONFIG)
    dense_fsdp = (
        "--parallelism.ep", "1", "--moe.partitions", "1", "--moe.memory_reuse", "none"
    )  # fmt: skip
    fsdp = train_job(tmp_path / "ep1", *short, *dense_fsdp, config=MOE_CONFIG)
    assert sorted(expert_parallel) == [1, 2, 3, 4]
    assert expert_parallel == pytest.approx(fsdp, rel=1e-4)
    assert expert_parallel[4] < expert_parallel[1]
    resumed_dir = tmp_path / "resumed"
    train_job(resumed_dir, *short[:-2], "--training.steps", "2", config=MOE_CONFIG)
    resumed = train_job(resumed_dir, *short, config=MOE_CONFIG)
    assert resumed[4] == pytest.approx(expert_parallel[4], rel=1e-5)


def test_experts_sharded_over_ep_and_ep_groups_match_fsdp_experts(tmp_path: Path) -> None:
    """4 ranks, ep = 2: two ep groups each hold all 8 experts, FSDP2 shards them over the two
    groups (ep_replicate) and reduce-scatters their gradients there; the losses equal those of
    the experts under FSDP over the 4 ranks."""
    short = (*SHORT_RUN[:10], "--training.steps", "3", "--checkpoint.enable", "false")
    replicated = train_job(tmp_path / "ep2", *short, nproc=4, config=MOE_CONFIG)
    fsdp = train_job(tmp_path / "ep1", *short, "--parallelism.ep", "1", nproc=4, config=MOE_CONFIG)
    assert sorted(replicated) == [1, 2, 3]
    assert replicated == pytest.approx(fsdp, rel=1e-4)


def test_moe_job_with_expert_parallelism_inside_the_sliced_pipeline(tmp_path: Path) -> None:
    """configs/debug_moe.toml (ep = 2, pipelined all-to-all with shared buffers) on 2 pipeline
    ranks x 2 FSDP ranks, 2 slices, against the same job without a pipeline on 2 ranks: the
    auxiliary losses take the whole sequence's statistics, so the runs are the same computation
    up to float32 rounding (AdamW's first steps amplify it: measured 1e-6 at step 2, 5e-5 at
    step 3; the float64 parity tests hold the computation to 1e-10)."""
    short = (*SHORT_RUN[:10], "--training.steps", "3", "--checkpoint.enable", "false")
    data_parallel = train_job(tmp_path / "dp", *short, config=MOE_CONFIG)
    pipeline = (
        "--parallelism.dp_shard", "2",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.num_slices", "2",
    )  # fmt: skip
    pipelined = train_job(tmp_path / "pp", *short, *pipeline, nproc=4, config=MOE_CONFIG)
    assert pipelined[1] == pytest.approx(data_parallel[1], rel=1e-6)
    assert pipelined == pytest.approx(data_parallel, rel=2e-4)
    assert pipelined[3] < pipelined[1]


UPCYCLE_CONFIG = str(REPO_ROOT / "configs" / "debug_upcycle.toml")


def test_upcycled_job_starts_at_the_dense_loss_resumes_and_exports_mixtral(tmp_path: Path) -> None:
    """configs/debug_upcycle.toml (ep = 2, FSDP2, E8T2, capacity 4) from a dense checkpoint: the
    first loss is the dense job's (the Mixtral router keeps the first forward), also in the
    sliced pipeline (2 pipeline ranks x 2 FSDP ranks splitting the experts) and under tp 2
    (sequence parallel, ep 2 over the tp ranks); training goes on and resumes exactly from its
    own (MoE) checkpoint; the exports are Mixtral checkpoints."""
    from pipekit.families.llama_moe.hf_mixtral import read_hf_mixtral_args

    write_debug_llama(tmp_path / "dense")
    common = (*SHORT_RUN[2:10], "--checkpoint.initial_load_path", str(tmp_path / "dense"))
    dense = train_job(
        tmp_path / "dense_job", *common, "--training.steps", "2", "--checkpoint.enable", "false"
    )
    steps = ("--training.steps", "3", "--checkpoint.interval", "2", "--optimizer.lr", "3e-3")
    upcycled = train_job(tmp_path / "upcycled", *common, *steps, config=UPCYCLE_CONFIG)
    assert upcycled[1] == pytest.approx(dense[1], rel=1e-5)
    assert upcycled[3] < upcycled[1]
    pipeline = (
        "--parallelism.ep", "2",
        "--parallelism.dp_shard", "2",
        "--parallelism.pipeline_parallel_degree", "2",
        "--parallelism.pipeline_schedule", "sliced",
        "--parallelism.num_slices", "2",
        "--checkpoint.enable", "false",
    )  # fmt: skip
    staged = train_job(
        tmp_path / "pp", *common, "--training.steps", "2", *pipeline, nproc=4, config=UPCYCLE_CONFIG
    )
    # upcycled x sliced + EP: each stage is sharded (experts over its 2 data ranks, the rest by
    # FSDP2) on meta, then fills its own blocks; every rank exports its share
    assert staged[1] == pytest.approx(dense[1], rel=1e-5)
    assert read_hf_mixtral_args(tmp_path / "pp" / "hf").moe.num_experts == 8
    tp = ("--parallelism.dp_shard", "1", "--parallelism.tp", "2", "--checkpoint.enable", "false")
    split = train_job(tmp_path / "tp", *common, "--training.steps", "2", *tp, config=UPCYCLE_CONFIG)
    assert split[1] == pytest.approx(dense[1], rel=1e-5)  # each rank read its tp/ep blocks
    assert read_hf_mixtral_args(tmp_path / "tp" / "hf").moe.num_experts == 8
    exported = read_hf_mixtral_args(tmp_path / "upcycled" / "hf")
    assert (exported.moe.num_experts, exported.moe.top_k) == (8, 2)
    resumed_dir = tmp_path / "resumed"
    train_job(resumed_dir, *common, *steps[2:], "--training.steps", "2", config=UPCYCLE_CONFIG)
    resumed = train_job(resumed_dir, *common, *steps, config=UPCYCLE_CONFIG)
    assert resumed[3] == pytest.approx(upcycled[3], rel=1e-5)


def test_bad_upcycling_input_gives_one_error_line_and_exit_2(tmp_path: Path) -> None:
    """Each mistake is named at validation, before any process group, model or read: bad
    [model.upcycle] keys, and a dense checkpoint that is not the flavor's (its config.json and
    tensor headers are checked)."""
    from hf_reference import rewrite_weights

    write_debug_llama(tmp_path / "dense")
    write_debug_llama(tmp_path / "missing_ffn")
    rewrite_weights(
        tmp_path / "missing_ffn", lambda tensors: tensors.pop("model.layers.2.mlp.up_proj.weight")
    )
    upcycle = (
        "--config",
        UPCYCLE_CONFIG,
        "--checkpoint.initial_load_path",
        str(tmp_path / "dense"),
    )
    cases = [
        (("--model.upcycle.num_experts", "3"), "ep=2 must divide the 3 experts of [model.upcycle]"),
        (("--model.upcycle.granularity", "5"), "granularity=5 must divide"),
        (("--model.upcycle.layers", "some"), "layers='some' must be"),
        (("--model.upcycle.layers", "0"), "layers=0 must be"),
        (("--model.upcycle.capacity_factor", "-1"), "capacity_factor=-1.0 must be > 0"),
        (("--model.name", "llama_moe"), "model 'llama_moe' cannot be upcycled"),
        (("--checkpoint.initial_load_path", ""), "initial_load_path, which is empty"),
        (("--model.upcycle.num_experts", "0"), "turns upcycling off, but other"),
        (("--model.flavor", "8B"), "does not match the model's LlamaArgs"),
        (
            ("--checkpoint.initial_load_path", str(tmp_path / "missing_ffn")),
            "missing tensors (1): model.layers.2.mlp.up_proj.weight",
        ),
    ]
    # train.py turns these into one line and exit 2 (checked for the first); the rest in-process
    first, message = cases[0]
    assert message in single_process_error(tmp_path / "job", *upcycle, *first, world_size=2)
    base = ("--config", CONFIG, "--job.output_dir", str(tmp_path / "job"))
    for overrides, message in cases[1:]:
        with pytest.raises(ConfigError) as error:
            validate_job(load_job_config([*base, *upcycle, *overrides]), world_size=2)
        assert message in str(error.value), error.value
    moe_export = ("--config", MOE_CONFIG, "--checkpoint.export_hf_at_end", "true")
    with pytest.raises(ConfigError, match="moe_every=2"):
        validate_job(load_job_config([*base, *moe_export]), world_size=2)


def test_upcycled_job_with_tied_embeddings_starts_at_the_dense_loss(tmp_path: Path) -> None:
    """Tied embedding and output weights (as Llama 3.2 1B/3B) stay one parameter through FSDP2
    on meta and `to_empty`: the upcycled job's first loss is the dense job's."""
    write_debug_llama(tmp_path / "dense", flavor="debug_tied")
    common = (
        *SHORT_RUN[2:10],
        "--model.flavor", "debug_tied",
        "--checkpoint.initial_load_path", str(tmp_path / "dense"),
        "--training.steps", "2",
        "--checkpoint.enable", "false",
    )  # fmt: skip
    dense = train_job(tmp_path / "dense_job", *common)
    no_export = ("--checkpoint.export_hf_at_end", "false")
    upcycled = train_job(tmp_path / "upcycled", *common, *no_export, config=UPCYCLE_CONFIG)
    assert upcycled[1] == pytest.approx(dense[1], rel=1e-5)


def test_moe_sliced_pipeline_job_trains_and_exports_what_transformers_loads(tmp_path: Path) -> None:
    """configs/debug_moe_sliced_pp.toml (pp 2 x dp_shard 2 x ep 2, bf16, vocabulary parallel,
    context exchange) on 4 ranks: the loss falls, and the export, each rank writing its share
    of whole tensors, loads in transformers as a Mixtral with pipekit's logits."""
    transformers = pytest.importorskip("transformers")
    run = (
        "--training.steps", "8",
        "--training.seq_len", "64",
        "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_interval", "1",
        "--checkpoint.enable", "false",
    )  # fmt: skip
    losses = train_job(tmp_path / "job", *run, nproc=4, config=MOE_SLICED_CONFIG)
    assert losses[8] < losses[1] - 0.5, losses
    directory = tmp_path / "job" / "hf"
    ours, args = get_model_spec("llama_moe").hf.build_from_checkpoint(str(directory))
    theirs = transformers.MixtralForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    tokens = torch.randint(0, args.vocab_size, (2, 48), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (ours.eval()(tokens) - theirs.eval()(tokens).logits).abs().max()
    assert difference < 1e-4, difference


BALANCED_CONFIG = str(REPO_ROOT / "configs" / "debug_moe_balanced.toml")


def test_bias_balanced_moe_job_resumes_with_its_expert_biases(tmp_path: Path) -> None:
    """configs/debug_moe_balanced.toml's model (sigmoid routing with bias balancing, grouped
    routing, a shared expert, the sequence-wise loss) on 2 ranks as ep 2 over FSDP 2 (the loads
    summed over both; the pipeline layouts: tests/moe/test_moe_balanced_routing.py): its step-2
    checkpoint, resumed, gives the uninterrupted run's steps 3 and 4 exactly, so the routers'
    biases (moved after every step, steering steps 3 and 4's routing) come back with it."""
    run = (
        "--parallelism.pipeline_parallel_degree", "1",
        "--training.steps", "4", "--training.seq_len", "64", "--lr_scheduler.warmup_steps", "2",
        "--metrics.log_interval", "1", "--checkpoint.interval", "2", "--checkpoint.keep_last", "2",
    )  # fmt: skip
    whole = train_job(tmp_path / "whole", *run, config=BALANCED_CONFIG)
    assert sorted(whole) == [1, 2, 3, 4]
    resumed_dir = tmp_path / "resumed"
    shutil.copytree(
        tmp_path / "whole" / "checkpoints" / "step-2", resumed_dir / "checkpoints" / "step-2"
    )
    train_job(resumed_dir, *run, config=BALANCED_CONFIG)
    resumed = logged_losses(resumed_dir)
    assert sorted(resumed) == [3, 4]
    assert resumed == {step: whole[step] for step in (3, 4)}
