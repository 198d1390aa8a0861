"""DeepSeek-V3 in Hugging Face's layout: checkpoints transformers writes (low-rank and full query
projections, YaRN, a dense first layer, group-limited routing with a nonzero router bias,
shared experts) give transformers' logits in pipekit; pipekit's checkpoints (saved from the
absorbed "latent" attention) give pipekit's logits in transformers and load back bit for bit;
the inspect command reads them; config.json keys pipekit cannot compute are refused by name."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from hf_reference import spread_weights
from safetensors.torch import load_file

from pipekit.checkpoint import CheckpointError
from pipekit.checkpoint.inspect import main as inspect_main
from pipekit.families.deepseek_v3 import DeepSeekV3, DeepSeekV3Args
from pipekit.families.deepseek_v3.hf import DEEPSEEK_V3_HF, deepseek_v3_config_to_args
from pipekit.layers.rope import YarnScaling
from pipekit.models import get_model_spec, spec_for_checkpoint
from pipekit.moe import MoEArgs

transformers = pytest.importorskip("transformers")

TOKENS = torch.randint(0, 100, (2, 24), generator=torch.Generator().manual_seed(0))
PARITY_TOLERANCE = 1e-4
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
HF_CONFIG = dict(
    hidden_size=64,
    num_hidden_layers=3,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    vocab_size=100,
    intermediate_size=96,
    moe_intermediate_size=24,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=4,
    topk_group=2,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    max_position_embeddings=256,
    rope_parameters=YARN,
)
TINY = DeepSeekV3Args(
    dim=64, n_layers=3, n_heads=4, vocab_size=100, ffn_dim=96, rope_theta=10000.0,
    rope_scaling=YarnScaling(
        factor=4.0, original_max_position_embeddings=64, mscale=0.707, mscale_all_dim=1.0
    ),
    max_seq_len=256, q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
    v_head_dim=16, first_dense_layers=1, expert_ffn_dim=24,
    moe=MoEArgs(
        num_experts=8, top_k=2, router="sigmoid_topk", num_shared_experts=1, num_groups=4,
        topk_groups=2, routed_scaling=2.5, bias_update_rate=1e-3, load_balance="sequence",
        load_balance_weight=1e-4,
    ),
)  # fmt: skip


def _random_biases(count: int, seed: int = 1) -> list[torch.Tensor]:
    """Router biases large enough to change which experts are picked."""
    generator = torch.Generator().manual_seed(seed)
    return [(torch.rand(8, generator=generator) - 0.5) * 0.2 for _ in range(count)]


def _transformers_model(directory: Path, **overrides: object):
    """A transformers DeepSeek-V3 with spread weights and nonzero router biases, saved."""
    config = transformers.DeepseekV3Config(**(HF_CONFIG | overrides))
    model = transformers.DeepseekV3ForCausalLM(config).eval()
    spread_weights(model)
    with torch.no_grad():
        for layer, bias in zip(model.model.layers[1:], _random_biases(2), strict=True):
            layer.mlp.gate.e_score_correction_bias.copy_(bias)
    model.save_pretrained(directory)
    return model


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        output = model.eval()(TOKENS)
    return getattr(output, "logits", output)


# (a) transformers' checkpoints give transformers' logits


@pytest.mark.parametrize("q_lora_rank", [32, None], ids=["query_lora", "full_query"])
def test_transformers_checkpoint_gives_transformers_logits(
    tmp_path: Path, q_lora_rank: int | None
) -> None:
    hf_model = _transformers_model(tmp_path / "hf", q_lora_rank=q_lora_rank)
    model, args = get_model_spec("deepseek_v3").hf.build_from_checkpoint(str(tmp_path / "hf"))
    assert isinstance(model, DeepSeekV3)
    assert args == TINY.with_updates(q_lora_rank=q_lora_rank)
    assert args.attention_cache == "expanded"
    bias = model.layers["2"].feed_forward.router.expert_bias
    assert torch.equal(bias, _random_biases(2)[1]) and bias.dtype == torch.float32
    assert (_logits(model) - _logits(hf_model)).abs().max() < PARITY_TOLERANCE


# (b) pipekit's checkpoints give pipekit's logits in transformers, and load back bit for bit


def _pipekit_model(args: DeepSeekV3Args) -> DeepSeekV3:
    with torch.device("meta"):
        model = DeepSeekV3(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=0)
    spread_weights(model, seed=2)
    with torch.no_grad():
        moe_layers = list(model.layers.values())[1:]
        for layer, bias in zip(moe_layers, _random_biases(2, seed=3), strict=True):
            layer.feed_forward.router.expert_bias.copy_(bias)
    return model


def test_pipekit_checkpoint_gives_pipekit_logits_in_transformers(tmp_path: Path) -> None:
    args = TINY.with_updates(attention_cache="latent")  # saved from the absorbed form
    model = _pipekit_model(args)
    DEEPSEEK_V3_HF.adapter().save(model, args, str(tmp_path / "hf"))
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["head_dim"] == 8 and config["rope_scaling"]["rope_type"] == "yarn"
    hf_model, info = transformers.DeepseekV3ForCausalLM.from_pretrained(
        tmp_path / "hf", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    expected = _logits(model)
    assert (_logits(hf_model) - expected).abs().max() < PARITY_TOLERANCE
    reloaded, reloaded_args = DEEPSEEK_V3_HF.build_from_checkpoint(tmp_path / "hf")
    assert reloaded_args == args.with_updates(attention_cache="expanded")
    ours, theirs = model.state_dict(), reloaded.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[name], theirs[name]) for name in ours)


# (c) the inspect command lists and runs the checkpoint


def test_inspect_reads_the_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    hf_model = _transformers_model(tmp_path / "hf")
    assert spec_for_checkpoint(tmp_path / "hf").name == "deepseek_v3"
    tokens = ",".join(str(token) for token in TOKENS[0].tolist())
    monkeypatch.setattr(sys, "argv", ["inspect"])
    status = inspect_main([str(tmp_path / "hf"), "--tokens", tokens, "--out", str(tmp_path / "l")])
    printed = capsys.readouterr()
    assert status == 0, printed.err
    assert "model.layers.2.mlp.gate.e_score_correction_bias" in printed.out
    assert "DeepSeekV3Args(" in printed.out
    with torch.no_grad():
        expected = hf_model(TOKENS[:1]).logits
    assert (load_file(tmp_path / "l")["logits"] - expected).abs().max() < PARITY_TOLERANCE


# (d) what pipekit cannot compute is refused by name, in one line


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"norm_topk_prob": False}, r"norm_topk_prob=false \(.*renormalises.*; only true loads"),
        ({"rope_interleave": False}, r"rope_interleave=false \(pipekit's RoPE rotates"),
        ({"attention_bias": True}, r"attention_bias=true \(pipekit's decoders have no biases"),
        ({"num_key_value_heads": 2}, r"num_key_value_heads=2 differs from num_attention_heads"),
    ],
    ids=["norm_topk_prob", "rope_interleave", "attention_bias", "kv_heads"],
)
def test_configs_pipekit_cannot_compute_are_refused(overrides: dict, message: str) -> None:
    config = transformers.DeepseekV3Config(**HF_CONFIG).to_dict() | overrides
    with pytest.raises(CheckpointError, match=message) as error:
        deepseek_v3_config_to_args(config)
    assert "\n" not in str(error.value)


def test_a_yarn_export_declares_the_scaled_context_whatever_the_training_length() -> None:
    """Some transformers versions take YaRN's factor from max_position_embeddings /
    original_max_position_embeddings: the export declares factor x original (DeepSeek-V3's
    163840), not the length the model was trained at."""
    from pipekit.families.deepseek_v3.hf import args_to_deepseek_v3_config

    args = get_model_spec("deepseek_v3").flavor("671B").with_updates(max_seq_len=4096)
    config = args_to_deepseek_v3_config(args)
    assert config["max_position_embeddings"] == 40 * 4096 == 163840
