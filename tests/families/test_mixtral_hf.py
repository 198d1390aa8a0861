"""Hugging Face Mixtral interop of the Llama-MoE: parity with transformers, round trips, errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hf_reference import (
    LLAMA3_ROPE,
    TINY_HF_CONFIG,
    rewrite_weights,
    save_transformers_model,
    spread_weights,
)

import pipekit.families.decoder.hf_layout as hf_layout
from pipekit.checkpoint import CheckpointError, SafetensorsCheckpoint
from pipekit.families.llama.args import RopeScaling
from pipekit.families.llama_moe import LlamaMoE, LlamaMoEArgs
from pipekit.families.llama_moe.hf_mixtral import (
    MIXTRAL_HF,
    args_to_mixtral_config,
    load_hf_mixtral,
    mixtral_config_to_args,
    mixtral_tensor_layout,
    read_hf_mixtral_args,
    save_hf_mixtral,
    to_mixtral_names,
)
from pipekit.models import get_model_spec
from pipekit.moe import MoEArgs

transformers = pytest.importorskip("transformers")

TINY = LlamaMoEArgs(
    dim=64,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=128,
    ffn_dim=96,
    rope_theta=10000.0,
    rope_scaling=None,
    max_seq_len=256,
    moe=MoEArgs(num_experts=4, top_k=2),
    moe_every=1,
)
TIED_LLAMA3 = TINY.with_updates(
    tie_embeddings=True, rope_scaling=RopeScaling(factor=8.0, original_max_position_embeddings=16)
)
TINY_MIXTRAL_CONFIG = TINY_HF_CONFIG | dict(
    vocab_size=128, num_local_experts=4, num_experts_per_tok=2
)
TOKENS = torch.tensor([[1, 5, 17, 99, 42, 0, 63, 8, 3, 3, 77, 12, 50, 2, 9, 31, 127, 64]])
PARITY_TOLERANCE = 1e-5  # float32; measured at most 1.4e-6 with logits up to 3.4


def _model(args: LlamaMoEArgs, seed: int = 0, dtype: torch.dtype = torch.float32) -> LlamaMoE:
    with torch.device("meta"):
        model = LlamaMoE(args)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model.to(dtype).eval()


def _our_logits(model: LlamaMoE) -> torch.Tensor:
    with torch.no_grad():
        return model(TOKENS)


def _hf_logits(hf_model) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(TOKENS).logits


def _transformers_mixtral(directory: Path, **overrides: object):
    """A tiny random transformers Mixtral written by its own save_pretrained; returns it."""
    config = transformers.MixtralConfig(**(TINY_MIXTRAL_CONFIG | overrides))
    return save_transformers_model(transformers.MixtralForCausalLM, config, directory)


# (a) parity with transformers' own forward


@pytest.mark.parametrize("args", [TINY, TIED_LLAMA3], ids=["untied", "tied_llama3_rope"])
@pytest.mark.parametrize("spread", [False, True], ids=["init", "spread"])
def test_saved_model_gives_transformers_logits(tmp_path: Path, args, spread: bool) -> None:
    model = _model(args)
    if spread:
        spread_weights(model)
        model.tie_weights()
    save_hf_mixtral(model, args, tmp_path / "hf")
    hf_model = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    assert hf_model.config.tie_word_embeddings == args.tie_embeddings
    difference = (_our_logits(model) - _hf_logits(hf_model)).abs().max()
    assert difference < PARITY_TOLERANCE, difference


@pytest.mark.parametrize(
    "breakage",
    ["swap_gate_and_up", "skip_rope_permutation"],
)
def test_wrong_expert_names_or_rope_order_break_parity(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, breakage: str
) -> None:
    model = _model(TINY)
    spread_weights(model)
    if breakage == "swap_gate_and_up":
        monkeypatch.setitem(MIXTRAL_HF.layout.expert_names, "w1", "w3")
        monkeypatch.setitem(MIXTRAL_HF.layout.expert_names, "w3", "w1")
    else:
        monkeypatch.setattr(hf_layout, "permute_to_hf", lambda w_RD, head_dim: w_RD)
    save_hf_mixtral(model, TINY, tmp_path / "hf")
    hf_model = transformers.MixtralForCausalLM.from_pretrained(
        tmp_path / "hf", torch_dtype=torch.float32
    ).eval()
    assert (_our_logits(model) - _hf_logits(hf_model)).abs().max() > 0.1


@pytest.mark.parametrize(
    "overrides",
    [{}, {"tie_word_embeddings": True, "rope_parameters": LLAMA3_ROPE}],
    ids=["untied", "tied_llama3_rope"],
)
def test_transformers_checkpoint_loads_with_its_logits(tmp_path: Path, overrides: dict) -> None:
    hf_model = _transformers_mixtral(tmp_path / "hf", **overrides)
    with SafetensorsCheckpoint(tmp_path / "hf") as checkpoint:  # the per-expert layout
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in checkpoint.names
    args = read_hf_mixtral_args(tmp_path / "hf")
    expected = TIED_LLAMA3 if overrides else TINY.with_updates(rope_theta=1e6)  # Mixtral's default
    assert args == expected.with_updates(moe=args.moe, norm_eps=1e-5)
    assert (args.moe.num_experts, args.moe.top_k, args.moe.capacity_factor) == (4, 2, None)
    model = _model(args, seed=1)
    load_hf_mixtral(tmp_path / "hf", model, args)
    assert (_our_logits(model) - _hf_logits(hf_model)).abs().max() < PARITY_TOLERANCE


# (b) round trips and the tensor layout


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("args", [TINY, TIED_LLAMA3], ids=["untied", "tied"])
def test_save_load_is_bit_exact(tmp_path: Path, args: LlamaMoEArgs, dtype: torch.dtype) -> None:
    model = _model(args, dtype=dtype)
    save_hf_mixtral(model, args, tmp_path / "hf", max_shard_bytes=100_000)
    assert (tmp_path / "hf" / "model.safetensors.index.json").is_file()
    assert read_hf_mixtral_args(tmp_path / "hf") == args
    reloaded = _model(args, seed=1, dtype=dtype)
    load_hf_mixtral(tmp_path / "hf", reloaded, args)
    for (name, before), after in zip(
        model.state_dict().items(), reloaded.state_dict().values(), strict=True
    ):
        assert after.dtype == dtype and torch.equal(before, after), name


def test_tensor_layout_is_the_checkpoint_in_file_order(tmp_path: Path) -> None:
    _transformers_mixtral(tmp_path / "theirs")
    model = _model(TINY)
    save_hf_mixtral(model, TINY, tmp_path / "ours")
    layout = mixtral_tensor_layout(TINY)
    with (
        SafetensorsCheckpoint(tmp_path / "theirs") as theirs,
        SafetensorsCheckpoint(tmp_path / "ours") as ours,
    ):
        assert sorted(entry.hf_name for entry in layout) == theirs.names == ours.names
        for hf_name, hf_shape, param_name, expert in layout:
            assert theirs.info(hf_name).shape == hf_shape, hf_name
            param = model.get_parameter(param_name)
            hf_tensor = (
                MIXTRAL_HF.to_hf(param_name, param, TINY) if expert is None else param[expert]
            )
            assert torch.equal(ours.read(hf_name), hf_tensor), hf_name
    gate_entries = [entry for entry in layout if entry.param_name.endswith("experts.w1_EFD")]
    assert [entry.expert for entry in gate_entries] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert to_mixtral_names("layers.1.feed_forward.experts.w1_EFD", TINY)[2] == (
        "model.layers.1.block_sparse_moe.experts.2.w1.weight"
    )
    # A tied output is not a tensor of the checkpoint, as transformers writes it.
    tied_names = {entry.hf_name for entry in mixtral_tensor_layout(TIED_LLAMA3)}
    assert "lm_head.weight" not in tied_names and "lm_head.weight" in theirs.names


def test_written_config_is_canonical_mixtral() -> None:
    config = args_to_mixtral_config(TIED_LLAMA3.with_updates(expert_ffn_dim=48), torch.bfloat16)
    assert config["architectures"] == ["MixtralForCausalLM"]
    assert config["model_type"] == "mixtral"
    assert config["intermediate_size"] == 48  # the experts' hidden size
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (4, 2)
    assert config["sliding_window"] is None and config["output_router_logits"] is False
    assert config["router_jitter_noise"] == 0.0
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert config["rope_scaling"]["rope_type"] == "llama3"
    assert "mlp_bias" not in config and "attention_bias" not in config
    # transformers reads it as the same model.
    hf_config = transformers.MixtralConfig.from_dict(config)
    assert (hf_config.num_local_experts, hf_config.intermediate_size) == (4, 48)
    assert hf_config.tie_word_embeddings


def test_capacity_factor_model_saves_dropless(tmp_path: Path) -> None:
    args = TINY.with_updates(moe=MoEArgs(num_experts=4, top_k=2, capacity_factor=1.0))
    save_hf_mixtral(_model(args), args, tmp_path / "hf")
    assert read_hf_mixtral_args(tmp_path / "hf").moe.capacity_factor is None
    load_hf_mixtral(tmp_path / "hf", _model(args, seed=1), args)  # a training choice


# (c) errors a user meets


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"moe_every": 2},
            "moe_every=2 keeps dense FFN layers, and Mixtral has none; set moe_every=1",
        ),
        (
            {"moe": MoEArgs(num_experts=4, top_k=2, router="softmax_topk")},
            "router='softmax_topk' routes differently from Mixtral (softmax over the top-k "
            "logits); use router='topk_softmax'",
        ),
    ],
    ids=["moe_every_2", "softmax_topk"],
)
def test_save_refuses_what_mixtral_cannot_express(
    tmp_path: Path, changes: dict, message: str
) -> None:
    args = TINY.with_updates(**changes)
    with pytest.raises(ValueError) as error:
        save_hf_mixtral(_model(args), args, tmp_path / "hf")
    assert message in str(error.value)
    assert not (tmp_path / "hf").exists()


@pytest.mark.parametrize("activation", ["geglu", "gelu"])
def test_experts_other_than_swiglu_are_refused_at_validation_and_save(
    tmp_path: Path, activation: str
) -> None:
    """The adapter's check_layout (what job validation runs) names the fix in one line."""
    args = TINY.with_updates(moe=MoEArgs(num_experts=4, top_k=2, activation=activation))
    message = (
        rf"no Mixtral layout: moe.activation='{activation}' experts, .* use activation='swiglu'"
    )
    with pytest.raises(ValueError, match=message):
        get_model_spec("llama_moe").hf.check_layout(args)
    with pytest.raises(ValueError, match=message):
        save_hf_mixtral(_model(args), args, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_llama_config_is_refused() -> None:
    config = args_to_mixtral_config(TINY) | {"model_type": "llama"}
    with pytest.raises(CheckpointError, match=r"model_type='llama' \(need 'mixtral'\)"):
        mixtral_config_to_args(config)


@pytest.mark.parametrize(
    "change, message",
    [
        ({"sliding_window": 128}, "sliding_window=128 is shorter than max_position_embeddings=256"),
        ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"num_experts_per_tok": 5}, "num_local_experts=4, num_experts_per_tok=5"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ],
)
def test_unrepresentable_config_is_refused(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError) as error:
        mixtral_config_to_args(args_to_mixtral_config(TINY) | change)
    assert message in str(error.value)


def test_absent_keys_take_mixtral_defaults() -> None:
    config = args_to_mixtral_config(TINY.with_updates(n_heads=8, n_kv_heads=8))
    for key in (
        "num_key_value_heads",
        "rope_theta",
        "rms_norm_eps",
        "num_local_experts",
        "num_experts_per_tok",
        "sliding_window",
        "max_position_embeddings",
    ):
        del config[key]
    args = mixtral_config_to_args(config)
    assert (args.num_kv_heads, args.rope_theta, args.norm_eps) == (8, 1e6, 1e-5)
    assert (args.moe.num_experts, args.moe.top_k, args.max_seq_len) == (8, 2, 131072)
    # A window covering every position is plain causal attention.
    assert mixtral_config_to_args(config | {"sliding_window": 131072}) == args


def test_missing_expert_tensor_is_refused_by_name(tmp_path: Path) -> None:
    model = _model(TINY)
    save_hf_mixtral(model, TINY, tmp_path / "hf")
    missing = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    rewrite_weights(tmp_path / "hf", lambda tensors: tensors.pop(missing))
    target = _model(TINY, seed=1)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=rf"missing tensors \(1\): {missing}"):
        load_hf_mixtral(tmp_path / "hf", target, TINY)
    for name, tensor in target.state_dict().items():  # a failed load changes nothing
        assert torch.equal(tensor, before[name]), name


def test_config_that_differs_from_model_lists_fields(tmp_path: Path) -> None:
    save_hf_mixtral(_model(TINY), TINY, tmp_path / "hf")
    args = TINY.with_updates(moe=MoEArgs(num_experts=8, top_k=2))
    with pytest.raises(CheckpointError, match=r"moe\.num_experts: checkpoint 4, model 8"):
        load_hf_mixtral(tmp_path / "hf", _model(args), args)


# (d) registry


def test_llama_moe_is_registered_with_the_mixtral_layout(tmp_path: Path) -> None:
    """The trainer's initial_load_path and export_hf_at_end go through the family's Hugging
    Face adapter (job validation refuses them for a family without one)."""
    hf = get_model_spec("llama_moe").hf
    assert hf is not None and hf.model_types == ("mixtral",)
    model = _model(TINY)
    for _ in range(2):  # an export overwrites the previous one
        hf.save(model, TINY, str(tmp_path / "hf"))
    loaded = _model(TINY, seed=1)
    hf.load(str(tmp_path / "hf"), loaded, hf.read_args(str(tmp_path / "hf")))
    assert torch.equal(_our_logits(loaded), _our_logits(model))
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "mixtral"
