"""Hugging Face MixtralForCausalLM checkpoints <-> pipekit's Llama-MoE: config, names, load, save.

Mixtral is a Llama-MoE whose every layer is MoE (`moe_every=1`) with the `topk_softmax` router:
transformers takes a softmax over all experts, keeps the top k and renormalises them, which
gives the same weights as a softmax over the top-k logits. Mixtral runs dropless; a model
trained with a `capacity_factor` still saves, and transformers computes it as pipekit would
without capacity (outputs differ only for assignments the capacity drops). Attention, norms,
embeddings and the RoPE row order of wq/wk are the shared decoder format's
(`pipekit.families.decoder.hf_layout`); the MoE blocks map as

    pipekit: layers.L.feed_forward.     Hugging Face: model.layers.L.block_sparse_moe.
    router.gate.weight    [E, D]        gate.weight
    experts.w1_EFD[j]     [F, D]        experts.j.w1.weight   (gate projection)
    experts.w2_EDF[j]     [D, F]        experts.j.w2.weight   (down projection)
    experts.w3_EFD[j]     [F, D]        experts.j.w3.weight   (up projection)

in the per-expert layout of the published Mixtral files, which transformers 4 loads as is and
transformers 5 converts on load (and writes back on `save_pretrained`). The experts are SwiGLU
ones (`MoEArgs.activation="swiglu"`); a model with other experts is refused.

Legend: E experts, F expert hidden dim, D model dim.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pipekit.checkpoint.safetensors_write import DEFAULT_MAX_SHARD_BYTES
from pipekit.families.decoder.hf_config import (
    CONFIG_FILE,
    HFModelType,
    build_args,
    decoder_config_fields,
    decoder_config_keys,
    is_int,
    read_config_json,
)
from pipekit.families.decoder.hf_layout import (
    DENSE_LAYER_NAMES,
    DecoderHF,
    DecoderLayout,
    expert_layout_problems,
)
from pipekit.families.llama_moe.args import LlamaMoEArgs
from pipekit.families.llama_moe.model import LlamaMoE
from pipekit.models.spec import HFTensor
from pipekit.moe import MoEArgs

__all__ = [
    "MIXTRAL_HF",
    "MIXTRAL_MODEL_TYPE",
    "args_to_mixtral_config",
    "check_mixtral_compatible",
    "load_hf_mixtral",
    "mixtral_config_to_args",
    "mixtral_tensor_layout",
    "read_hf_mixtral_args",
    "save_hf_mixtral",
    "to_mixtral_names",
]

MIXTRAL_MODEL_TYPE = HFModelType(
    model_type="mixtral",
    architecture="MixtralForCausalLM",
    pipekit_model="Llama-MoE",
    rope_theta=1e6,
    rms_norm_eps=1e-5,
    max_position_embeddings=4096 * 32,
    num_key_value_heads=8,
)
"""transformers' MixtralConfig (its defaults for the keys Mixtral shares with Llama)."""

_MIXTRAL_ROUTER = "topk_softmax"
# transformers' MixtralConfig defaults of the MoE keys.
_DEFAULT_NUM_EXPERTS = 8
_DEFAULT_TOP_K = 2
_DEFAULT_AUX_LOSS_COEF = 0.001


def read_hf_mixtral_args(directory: str | os.PathLike[str]) -> LlamaMoEArgs:
    """LlamaMoEArgs described by `directory/config.json`, with errors that name the file."""
    config, source = read_config_json(directory)
    return mixtral_config_to_args(config, source=source)


def mixtral_config_to_args(config: Mapping[str, Any], *, source: str = CONFIG_FILE) -> LlamaMoEArgs:
    """Parse a Mixtral config.json; reject what pipekit's Llama-MoE cannot compute.

    Gives every layer MoE (`moe_every=1`), the `topk_softmax` router, dropless routing, and
    `ffn_dim` = the experts' `intermediate_size`. `router_aux_loss_coef` becomes the weight of
    pipekit's switch balance loss (transformers' own loss, applied only with
    `output_router_logits`, is top_k times it and averages the layers where pipekit sums them);
    `router_jitter_noise` perturbs training only and is not carried over.
    """
    problems = _mixtral_problems(config)
    fields = decoder_config_fields(
        config, source=source, model_type=MIXTRAL_MODEL_TYPE, problems=problems
    )
    moe = MoEArgs(
        num_experts=config.get("num_local_experts", _DEFAULT_NUM_EXPERTS),
        top_k=config.get("num_experts_per_tok", _DEFAULT_TOP_K),
        router=_MIXTRAL_ROUTER,
        capacity_factor=None,
        load_balance="switch",
        load_balance_weight=float(config.get("router_aux_loss_coef", _DEFAULT_AUX_LOSS_COEF)),
    )
    return build_args(LlamaMoEArgs, fields | {"moe": moe, "moe_every": 1}, source)


def args_to_mixtral_config(
    args: LlamaMoEArgs, dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The config.json of a Mixtral with `args` whose weights are `dtype` (published dialect)."""
    check_mixtral_compatible(args)
    return decoder_config_keys(args, dtype, MIXTRAL_MODEL_TYPE) | {
        "intermediate_size": args.moe_ffn_dim,
        "num_local_experts": args.moe.num_experts,
        "num_experts_per_tok": args.moe.top_k,
        "sliding_window": None,
        "router_aux_loss_coef": args.moe.load_balance_weight,
        "output_router_logits": False,
        "router_jitter_noise": 0.0,
    }


def check_mixtral_compatible(args: LlamaMoEArgs) -> None:
    """Raise ValueError, naming the fix, if a model with `args` has no Mixtral layout."""
    problems = expert_layout_problems(args)
    if args.moe_every != 1:
        problems.append(
            f"moe_every={args.moe_every} keeps dense FFN layers, and Mixtral has none; set "
            "moe_every=1 (every layer MoE), or keep the model in pipekit's DCP checkpoints"
        )
    if args.moe.router != _MIXTRAL_ROUTER:
        problems.append(
            f"router={args.moe.router!r} routes differently from Mixtral (softmax over the top-k "
            f"logits); use router={_MIXTRAL_ROUTER!r}"
        )
    if problems:
        raise ValueError(f"the LlamaMoEArgs have no Mixtral layout: {'; '.join(problems)}")


MIXTRAL_HF = DecoderHF(
    layout=DecoderLayout(
        MIXTRAL_MODEL_TYPE,
        layer_names={k: v for k, v in DENSE_LAYER_NAMES.items() if "feed_forward" not in k},
        moe_block="block_sparse_moe",
        expert_names={"w1": "w1", "w2": "w2", "w3": "w3"},
    ),
    build=LlamaMoE,
    config_to_args=lambda config, source: mixtral_config_to_args(config, source=source),
    args_to_config=args_to_mixtral_config,
    check_layout=check_mixtral_compatible,
)
"""The Llama-MoE family's Hugging Face format (Mixtral)."""


def mixtral_tensor_layout(args: LlamaMoEArgs) -> list[HFTensor]:
    """Every tensor of the Mixtral checkpoint of a model with `args`, in the order
    `save_hf_mixtral` writes them (a tied `lm_head.weight` left out, as transformers does)."""
    return MIXTRAL_HF.tensors(args)


def to_mixtral_names(name: str, args: LlamaMoEArgs) -> list[str]:
    """Hugging Face names of a pipekit parameter: one per expert for an expert weight
    (expert j's at index j), else one."""
    return MIXTRAL_HF.layout.hf_names(name, args)


def load_hf_mixtral(
    directory: str | os.PathLike[str], model: nn.Module, args: LlamaMoEArgs
) -> None:
    """Copy a Hugging Face Mixtral checkpoint into `model` (laid out as `args`), in its dtype.

    config.json must describe `args`, up to training choices (`max_seq_len`, capacity factor,
    auxiliary-loss weights). Every name and shape is checked before the first parameter is
    written, so a failed load leaves the model untouched.
    """
    MIXTRAL_HF.load(directory, model, args)


def save_hf_mixtral(
    model: nn.Module,
    args: LlamaMoEArgs,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write `model` as a Hugging Face Mixtral checkpoint (config.json + safetensors), atomically.

    Refused (ValueError, before anything is written) unless every layer is MoE, the experts are
    SwiGLU and the router is `topk_softmax`. A capacity factor is allowed: Mixtral runs dropless,
    which is the same weights without dropping. Tensors keep the model's dtype, so save -> load
    is bit-exact.
    """
    MIXTRAL_HF.save(model, args, directory, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def _mixtral_problems(config: Mapping[str, Any]) -> list[str]:
    """What pipekit's Llama-MoE cannot represent of the Mixtral keys of `config`."""
    problems = []
    experts = config.get("num_local_experts", _DEFAULT_NUM_EXPERTS)
    top_k = config.get("num_experts_per_tok", _DEFAULT_TOP_K)
    if not (is_int(experts) and is_int(top_k) and 1 <= top_k <= experts):
        problems.append(
            f"num_local_experts={experts!r}, num_experts_per_tok={top_k!r} must be integers "
            "with 1 <= num_experts_per_tok <= num_local_experts"
        )
    coefficient = config.get("router_aux_loss_coef", _DEFAULT_AUX_LOSS_COEF)
    if not isinstance(coefficient, int | float) or isinstance(coefficient, bool):
        problems.append(f"router_aux_loss_coef={coefficient!r} must be a number")
    window = config.get("sliding_window")
    max_positions = config.get(
        "max_position_embeddings", MIXTRAL_MODEL_TYPE.max_position_embeddings
    )
    if window is not None and not (
        is_int(window) and is_int(max_positions) and window >= max_positions
    ):
        problems.append(
            f"sliding_window={window!r} is shorter than max_position_embeddings="
            f"{max_positions!r} (pipekit's Llama-MoE attends to the whole causal context; only "
            "a checkpoint with sliding_window null, or at least max_position_embeddings, loads)"
        )
    return problems
