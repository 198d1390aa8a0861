"""DeepSeek-V3's multi-token prediction layer in Hugging Face's layout and in a job: a
checkpoint transformers writes, with an MTP layer added as DeepSeek publishes it (layer
n_layers, its own norms and projection, copies of the embedding and head), loads with the main
logits still transformers'; it exports with the MTP layer bit for bit; a copy that differs from
the main weight is refused; a job trains it under expert parallelism with `mtp_loss` in its
metrics; layouts that would split it are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from job_runs import SLICED_PP_CONFIG, single_process_error, train_job
from safetensors.torch import load_file, save_file

from pipekit.checkpoint import CheckpointError
from pipekit.config.job_config import JobConfig, ParallelismConfig
from pipekit.config.loader import ConfigError
from pipekit.families.deepseek_v3.hf import DEEPSEEK_V3_HF, args_to_deepseek_v3_config
from pipekit.models import get_model_spec
from pipekit.train.job import validate_job

transformers = pytest.importorskip("transformers")

HF_CONFIG = dict(
    hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4,
    num_key_value_heads=4, vocab_size=100, intermediate_size=96, moe_intermediate_size=24,
    q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    n_routed_experts=8, num_experts_per_tok=2, n_group=4, topk_group=2, n_shared_experts=1,
    max_position_embeddings=256, num_nextn_predict_layers=1,
)  # fmt: skip
TOKENS = torch.randint(0, 100, (2, 16), generator=torch.Generator().manual_seed(0))


def _with_mtp_layer(
    directory: Path, config: dict | None = None
) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """A transformers DeepSeek-V3 saved to `directory`, then an MTP layer added beside it as
    DeepSeek's files hold one: layer L (L layers), a block named as transformers names layer
    L-1 (an MoE layer), perturbed, with enorm/hnorm/eh_proj/shared_head.norm and copies of the
    embedding and head."""
    config = transformers.DeepseekV3Config(**(config or HF_CONFIG))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    model.save_pretrained(directory)
    main = load_file(directory / "model.safetensors")
    mtp_layer, dim = config.num_hidden_layers, config.hidden_size
    last = mtp_layer - 1
    generator = torch.Generator().manual_seed(5)
    mtp = {
        name.replace(f"model.layers.{last}.", f"model.layers.{mtp_layer}."): tensor
        + 0.01 * torch.randn(tensor.shape, generator=generator)
        for name, tensor in main.items()
        if name.startswith(f"model.layers.{last}.")
    }
    prefix = f"model.layers.{mtp_layer}"
    mtp |= {
        f"{prefix}.enorm.weight": 1 + 0.1 * torch.randn(dim, generator=generator),
        f"{prefix}.hnorm.weight": 1 + 0.1 * torch.randn(dim, generator=generator),
        f"{prefix}.eh_proj.weight": 0.05 * torch.randn(dim, 2 * dim, generator=generator),
        f"{prefix}.shared_head.norm.weight": 1 + 0.1 * torch.randn(dim, generator=generator),
        f"{prefix}.embed_tokens.weight": main["model.embed_tokens.weight"].clone(),
        f"{prefix}.shared_head.head.weight": main["lm_head.weight"].clone(),
    }
    save_file(mtp, directory / "model-mtp.safetensors")
    return model, mtp


def test_a_transformers_checkpoint_with_its_mtp_layer_loads_and_exports(tmp_path: Path):
    hf_model, mtp = _with_mtp_layer(tmp_path / "hf")
    model, args = DEEPSEEK_V3_HF.build_from_checkpoint(tmp_path / "hf")
    assert args.mtp_depth == 1
    assert torch.equal(model.mtp["0"].eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])
    assert torch.equal(
        model.mtp["0"].block.feed_forward.experts.w1_EFD[3],
        mtp["model.layers.2.mlp.experts.3.gate_proj.weight"],
    )
    with torch.no_grad():
        difference = (model(TOKENS) - hf_model(TOKENS).logits).abs().max()
    assert difference < 1e-4
    DEEPSEEK_V3_HF.adapter().save(model, args, str(tmp_path / "out"))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["num_nextn_predict_layers"] == 1
    written = {}
    for path in (tmp_path / "out").glob("*.safetensors"):
        written |= load_file(path)
    assert all(torch.equal(written[name], tensor) for name, tensor in mtp.items())


def test_an_mtp_copy_that_differs_from_the_main_weight_is_refused(tmp_path: Path):
    _, mtp = _with_mtp_layer(tmp_path / "hf")
    mtp["model.layers.2.shared_head.head.weight"][0, 0] += 1
    save_file(mtp, tmp_path / "hf" / "model-mtp.safetensors")
    with pytest.raises(CheckpointError, match=r"shared_head\.head\.weight differs from lm_head"):
        DEEPSEEK_V3_HF.build_from_checkpoint(tmp_path / "hf")


def test_without_its_layers_a_checkpoint_loads_as_the_main_model(tmp_path: Path, caplog):
    """transformers writes num_nextn_predict_layers but not the layers."""
    transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**HF_CONFIG)).save_pretrained(
        tmp_path / "hf"
    )
    model, args = DEEPSEEK_V3_HF.build_from_checkpoint(tmp_path / "hf")
    assert args.mtp_depth == 0 and model.mtp is None
    assert "loading the main model alone" in caplog.text


MTP_JOB = (
    "--model.name", "deepseek_v3", "--model.mtp_depth", "1", "--training.steps", "3",
    "--training.global_batch_size", "4", "--training.seq_len", "32",
    "--lr_scheduler.warmup_steps", "1", "--checkpoint.enable", "false",
)  # fmt: skip


def test_a_transformers_checkpoint_with_mtp_trains_under_the_sliced_pipeline_and_ep(tmp_path):
    """The debug flavor's shape written by transformers with an MTP layer added; a job on 4
    ranks (pp 2 x ep 2, sliced) starts from it, validates between steps, logs `mtp_loss`, and
    exports a checkpoint with the MTP layer whose main logits transformers reproduces."""
    args = get_model_spec("deepseek_v3").flavor("debug").with_updates(mtp_depth=1)
    config = args_to_deepseek_v3_config(args) | {"num_nextn_predict_layers": 1}
    _with_mtp_layer(tmp_path / "hf", config)
    layout = ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.num_slices", "2",
              "--parallelism.microbatches", "2", "--parallelism.ep", "2",
              "--parallelism.dp_shard", "2")  # fmt: skip
    validation = ("--validation.enable", "true", "--validation.interval", "2",
                  "--validation.steps", "1")  # fmt: skip
    train_job(
        tmp_path / "job", *MTP_JOB, *layout, *validation, "--metrics.log_interval", "1",
        "--checkpoint.initial_load_path", str(tmp_path / "hf"),
        "--checkpoint.export_hf_at_end", "true", nproc=4, config=SLICED_PP_CONFIG,
    )  # fmt: skip
    records = [
        json.loads(line) for line in (tmp_path / "job" / "metrics.jsonl").read_text().splitlines()
    ]
    mtp_losses = [record["mtp_loss"] for record in records if "loss" in record]
    assert len(mtp_losses) == 3 and all(4 < loss < 6 for loss in mtp_losses)  # ~ln(258)
    assert len([record for record in records if "val_loss" in record]) == 2
    exported, exported_args = DEEPSEEK_V3_HF.build_from_checkpoint(tmp_path / "job" / "hf")
    assert exported_args.mtp_depth == 1
    hf_model = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "job" / "hf").eval()
    tokens = TOKENS % args.vocab_size
    with torch.no_grad():
        assert (exported(tokens) - hf_model(tokens).logits).abs().max() < 1e-4


def test_a_sliced_pipeline_job_with_mtp_resumes_exactly(tmp_path: Path):
    """The MTP depth on the last stage with its copy of the embedding: stopped after step 2
    and resumed, the job logs the uninterrupted run's losses (both copies in the checkpoint
    under the embedding's one name)."""
    run = (*MTP_JOB[:-2], "--checkpoint.interval", "2", "--metrics.log_interval", "1")
    whole = train_job(tmp_path / "whole", *run, "--checkpoint.enable", "false",
                      config=SLICED_PP_CONFIG)  # fmt: skip
    stopped = (*run, "--checkpoint.enable", "true")
    train_job(tmp_path / "resumed", *stopped, "--training.steps", "2", config=SLICED_PP_CONFIG)
    resumed = train_job(tmp_path / "resumed", *stopped, config=SLICED_PP_CONFIG)
    assert resumed == whole and len(whole) == 3
    metrics = (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()
    assert all(4 < json.loads(line)["mtp_loss"] < 6 for line in metrics)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ("--parallelism.pipeline_parallel_degree", "2", "--parallelism.vocab_parallel", "true"),
            "pipeline feature vocab_parallel with multi-token prediction",
        ),
        (("--training.loss_chunk_tokens", "16"), "multi-token prediction (mtp) also runs"),
        (("--model.mtp_loss_weight", "-0.5"), "must be >= 0"),
    ],
    ids=["pipeline", "chunked_loss", "negative_weight"],
)
def test_layouts_that_would_split_mtp_are_refused_in_one_line(tmp_path, overrides, message):
    error = single_process_error(tmp_path, *MTP_JOB, *overrides, world_size=2)
    assert message in error and "\n" not in error.strip()


def test_mtp_off_the_output_stage_is_refused_before_launch():
    """A hand-written split that puts the MTP depths with the embedding would never run them."""
    config = JobConfig()
    config.model.name, config.model.mtp_depth = "deepseek_v3", 1
    config.training.global_batch_size, config.training.seq_len = 4, 64
    stages = ["tok_embeddings,layers.0,layers.1,mtp", "layers.2,layers.3,norm,output"]
    config.parallelism = ParallelismConfig(
        dp_shard=1, pipeline_parallel_degree=2, pipeline_stage_modules=stages
    )
    with pytest.raises(ConfigError, match="put mtp and output in the last stage's modules"):
        validate_job(config, world_size=2)
    config.parallelism.pipeline_stage_modules = ["tok_embeddings,layers.0,layers.1",
                                                 "layers.2,layers.3,norm,output,mtp"]  # fmt: skip
    assert validate_job(config, world_size=2).multi_token_depth == 1
