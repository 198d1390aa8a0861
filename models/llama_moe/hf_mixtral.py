"""Hugging Face MixtralForCausalLM checkpoints <-> pipekit's Llama-MoE: config, names, load, save.

Mixtral is a Llama-MoE whose every layer is MoE (`moe_every=1`) with the `topk_softmax` router:
transformers takes a softmax over all experts, keeps the top k and renormalises them, which gives
the same weights as a softmax over the top-k logits. Mixtral runs dropless; a model trained with
a `capacity_factor` still saves, and transformers computes it as pipekit would without capacity
(outputs differ only for assignments the capacity drops). Attention, norms, embeddings and the
RoPE row order of wq/wk are the Llama adapter's (`models.llama.state_dict_adapter`); the MoE
blocks map as

    pipekit: layers.L.feed_forward.     Hugging Face: model.layers.L.block_sparse_moe.
    router.gate.weight    [E, D]        gate.weight
    experts.w1_EFD[j]     [F, D]        experts.j.w1.weight   (gate projection)
    experts.w2_EDF[j]     [D, F]        experts.j.w2.weight   (down projection)
    experts.w3_EFD[j]     [F, D]        experts.j.w3.weight   (up projection)

in the per-expert layout of the published Mixtral files, which transformers 4 loads as is and
transformers 5 converts on load (and writes back on `save_pretrained`).

Legend: E experts, F expert hidden dim, D model dim.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch import nn

from models.llama.hf_config import (
    CONFIG_FILE,
    HFModelType,
    build_args,
    is_int,
    llama_config_fields,
    llama_config_keys,
    read_config_json,
)
from models.llama.state_dict_adapter import (
    comparable_fields,
    config_differences,
    llama_param_shapes,
    load_hf_weights,
    read_hf_tensor,
    save_hf_weights,
    to_hf_name,
    to_hf_tensor,
)
from models.llama_moe.args import LlamaMoEArgs
from pipekit.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    SafetensorsCheckpoint,
)
from pipekit.moe import MoEArgs

__all__ = [
    "EXPERT_WEIGHTS",
    "MIXTRAL_MODEL_TYPE",
    "MixtralTensor",
    "args_to_mixtral_config",
    "check_mixtral_compatible",
    "load_hf_mixtral",
    "mixtral_config_to_args",
    "mixtral_param_shapes",
    "mixtral_tensor_layout",
    "read_hf_mixtral_args",
    "read_mixtral_tensor",
    "save_hf_mixtral",
    "to_mixtral_names",
    "to_mixtral_state_dict",
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

_MOE_PARAM = re.compile(r"layers\.(\d+)\.feed_forward\.(.+)")
_GATE = "router.gate.weight"
EXPERT_WEIGHTS = {"experts.w1_EFD": "w1", "experts.w2_EDF": "w2", "experts.w3_EFD": "w3"}
"""Expert parameter -> the SwiGLU weight it stacks (Mixtral's per-expert name, and the dense
FFN weight it is upcycled from)."""


class MixtralTensor(NamedTuple):
    """One tensor of a Mixtral checkpoint and the pipekit parameter (or expert of it) it holds."""

    hf_name: str
    hf_shape: tuple[int, ...]
    param_name: str
    expert: int | None
    """Index into the parameter's leading expert dim; None: the whole parameter."""


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
    fields = llama_config_fields(
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
    return llama_config_keys(args, dtype, MIXTRAL_MODEL_TYPE) | {
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
    problems = []
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


def mixtral_param_shapes(args: LlamaMoEArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of a pipekit Llama-MoE whose every layer is MoE, as in
    Mixtral (`output.weight` even when tied)."""
    experts, dim, hidden = args.moe.num_experts, args.dim, args.moe_ffn_dim
    moe_shapes = {
        _GATE: (experts, dim),
        "experts.w1_EFD": (experts, hidden, dim),
        "experts.w2_EDF": (experts, dim, hidden),
        "experts.w3_EFD": (experts, hidden, dim),
    }
    shapes = {}
    for name, shape in llama_param_shapes(args).items():
        if ".feed_forward." not in name:
            shapes[name] = shape
        elif name.endswith(".feed_forward.w1.weight"):  # the dense FFN's place: the MoE block
            prefix = name.removesuffix("w1.weight")
            shapes |= {prefix + suffix: moe_shape for suffix, moe_shape in moe_shapes.items()}
    return shapes


def to_mixtral_names(name: str, args: LlamaMoEArgs) -> list[str]:
    """Hugging Face names of a pipekit parameter: one per expert for an expert weight
    (expert j's at index j), else one."""
    match = _MOE_PARAM.fullmatch(name)
    if match is None:
        return [to_hf_name(name)]
    prefix = f"model.layers.{match[1]}.block_sparse_moe"
    if match[2] == _GATE:
        return [f"{prefix}.gate.weight"]
    if match[2] in EXPERT_WEIGHTS:
        short = EXPERT_WEIGHTS[match[2]]
        return [f"{prefix}.experts.{j}.{short}.weight" for j in range(args.moe.num_experts)]
    raise ValueError(
        f"{name!r} is not a parameter of a Mixtral-layout Llama-MoE (every layer MoE with the "
        f"{_MIXTRAL_ROUTER} router)"
    )


def mixtral_tensor_layout(args: LlamaMoEArgs) -> list[MixtralTensor]:
    """Every tensor of the Mixtral checkpoint of a model with `args`, in the order
    `save_hf_mixtral` writes them (shards fill in this order); a tied `lm_head.weight` is left
    out, as transformers does."""
    check_mixtral_compatible(args)
    layout = []
    for name, shape in mixtral_param_shapes(args).items():
        if args.tie_embeddings and name == "output.weight":
            continue
        hf_names = to_mixtral_names(name, args)
        if _is_expert_weight(name):
            layout += [MixtralTensor(hf, shape[1:], name, j) for j, hf in enumerate(hf_names)]
        else:
            layout.append(MixtralTensor(hf_names[0], shape, name, None))
    return layout


def to_mixtral_state_dict(
    state_dict: Mapping[str, torch.Tensor], args: LlamaMoEArgs
) -> dict[str, torch.Tensor]:
    """Hugging Face names, row order and per-expert tensors of the parameters in `state_dict`
    (all of the model's, or those of some modules); a tied `output.weight` is dropped."""
    return {
        entry.hf_name: to_hf_tensor(entry.param_name, tensor, args)
        if entry.expert is None
        else tensor[entry.expert]
        for entry in mixtral_tensor_layout(args)
        if (tensor := state_dict.get(entry.param_name)) is not None
    }


def read_mixtral_tensor(
    checkpoint: SafetensorsCheckpoint, name: str, args: LlamaMoEArgs
) -> torch.Tensor:
    """pipekit parameter `name` read from a Mixtral checkpoint (experts stacked on dim 0)."""
    if _MOE_PARAM.fullmatch(name) is None:
        return read_hf_tensor(checkpoint, name, args)  # RoPE order, tied output
    hf_names = to_mixtral_names(name, args)
    if _is_expert_weight(name):
        return torch.stack([checkpoint.read(hf_name) for hf_name in hf_names])
    return checkpoint.read(hf_names[0])


def load_hf_mixtral(
    directory: str | os.PathLike[str], model: nn.Module, args: LlamaMoEArgs
) -> None:
    """Copy a Hugging Face Mixtral checkpoint into `model` (laid out as `args`), in its dtype.

    config.json must describe `args`, up to training choices (`max_seq_len`, capacity factor,
    auxiliary-loss weights). Every name and shape is checked before the first parameter is
    written, so a failed load leaves the model untouched.
    """
    check_mixtral_compatible(args)
    differences = config_differences(
        _comparable(read_hf_mixtral_args(directory)), _comparable(args)
    )
    if differences:
        raise CheckpointError(
            f"{os.path.join(directory, CONFIG_FILE)} does not match the model's LlamaMoEArgs: "
            f"{'; '.join(differences)}; build the model from read_hf_mixtral_args(directory) "
            "or load a checkpoint of this shape"
        )
    hf_shapes = {entry.hf_name: entry.hf_shape for entry in mixtral_tensor_layout(args)}
    load_hf_weights(
        directory, model, args, mixtral_param_shapes(args), hf_shapes, read_mixtral_tensor
    )


def save_hf_mixtral(
    model: nn.Module,
    args: LlamaMoEArgs,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write `model` as a Hugging Face Mixtral checkpoint (config.json + safetensors), atomically.

    Refused (ValueError, before anything is written) unless every layer is MoE and the router is
    `topk_softmax`. A capacity factor is allowed: Mixtral runs dropless, which is the same
    weights without dropping. Tensors keep the model's dtype, so save -> load is bit-exact.
    """
    check_mixtral_compatible(args)
    save_hf_weights(
        model,
        args,
        directory,
        param_shapes=mixtral_param_shapes(args),
        to_hf=to_mixtral_state_dict,
        hf_config=args_to_mixtral_config,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


def _is_expert_weight(name: str) -> bool:
    match = _MOE_PARAM.fullmatch(name)
    return match is not None and match[2] in EXPERT_WEIGHTS


def _comparable(args: LlamaMoEArgs) -> dict[str, object]:
    """Fields that change what the weights compute: the Llama ones, the experts' hidden size
    (Mixtral's `intermediate_size`; no dense FFN is left) and the expert count and top-k."""
    values = comparable_fields(args)
    for training_or_unused in ("moe", "ffn_dim", "expert_ffn_dim"):
        del values[training_or_unused]
    return values | {
        "moe_ffn_dim": args.moe_ffn_dim,
        "moe.num_experts": args.moe.num_experts,
        "moe.top_k": args.moe.top_k,
    }


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
