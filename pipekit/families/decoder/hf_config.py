"""Hugging Face `config.json` <-> decoder args, for both dialects found in the wild.

Published checkpoints say `rope_theta` and `rope_scaling` (with `rope_type`, or `type` in older
files); transformers 5 writes `rope_parameters` with `rope_theta` inside. Both are read here
with transformers' defaults for absent keys, so a file means the same model to pipekit as to
transformers. We write the published dialect, which every transformers version reads.

Every model type with Llama's config keys (Llama, Mixtral, Qwen3, Qwen3-MoE, DeepSeek-V3) parses
and writes them here; `HFModelType` holds what differs between them: the model_type,
transformers' defaults for absent keys, and the RoPE scalings the family computes (Llama 3.1's,
and YaRN for DeepSeek-V3). Each family adds its own keys (`problems` of its own, extra fields).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from pipekit.checkpoint.safetensors_io import CheckpointError
from pipekit.families.decoder.args import DecoderArgs, RopeScaling
from pipekit.layers.rope import YarnScaling

__all__ = [
    "CONFIG_FILE",
    "HFModelType",
    "build_args",
    "decoder_config_fields",
    "decoder_config_keys",
    "is_int",
    "read_config_json",
]

CONFIG_FILE = "config.json"

_REQUIRED_INTS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "vocab_size",
)
_UNSCALED_ROPE_TYPES = (None, "default")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor")
_Args = TypeVar("_Args", bound=DecoderArgs)


@dataclass(kw_only=True, frozen=True)
class HFModelType:
    """A Hugging Face model type with Llama's config keys, and transformers' defaults for them."""

    model_type: str
    """config.json's `model_type`; any other value is refused."""
    architecture: str
    """The `architectures` entry written."""
    pipekit_model: str
    """The pipekit model it loads into, for messages."""
    rope_theta: float
    """Default of `rope_theta`."""
    rms_norm_eps: float
    """Default of `rms_norm_eps`."""
    max_position_embeddings: int
    """Default of `max_position_embeddings`."""
    num_key_value_heads: int | None
    """Default of an absent `num_key_value_heads`; None: `num_attention_heads` (as for null)."""
    rope_types: tuple[str, ...] = ("llama3",)
    """The scaled `rope_type`s the family computes ("llama3", "yarn"); others are refused."""
    attention_bias: bool = False
    """Whether the family's attention projections have biases (gpt-oss): also the default of
    an absent `attention_bias`, and the only value read."""


def read_config_json(directory: str | os.PathLike[str]) -> tuple[dict[str, Any], str]:
    """(the JSON object in `directory/config.json`, its path for messages)."""
    path = Path(directory) / CONFIG_FILE
    if not path.is_file():
        raise CheckpointError(
            f"{path} does not exist; a Hugging Face checkpoint directory needs its {CONFIG_FILE}"
        )
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise CheckpointError(f"cannot read {path}: {error}") from error
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} must hold a JSON object, not {type(config).__name__}")
    return config, str(path)


def decoder_config_fields(
    config: Mapping[str, Any],
    *,
    source: str = CONFIG_FILE,
    model_type: HFModelType,
    problems: list[str] | None = None,
) -> dict[str, Any]:
    """`DecoderArgs` keyword arguments from the Llama keys of `config`, absent keys taking
    `model_type`'s defaults.

    Raises one CheckpointError listing every problem found, after the caller's own `problems`
    (what its model type adds to Llama's keys).
    """
    problems = [*(problems or ()), *_unsupported_features(config, model_type)]
    missing = [key for key in _REQUIRED_INTS if key not in config]
    if missing:
        problems.append(f"missing keys {missing}")
    problems += [
        f"{key}={config[key]!r} must be an integer"
        for key in (*_REQUIRED_INTS, "num_key_value_heads", "head_dim")
        if config.get(key) is not None and not is_int(config[key])
    ]
    rope_theta, rope_scaling = _rope(config, model_type, problems)
    if problems:
        raise CheckpointError(
            f"{source} describes a model pipekit's {model_type.pipekit_model} cannot load: "
            f"{'; '.join(problems)}"
        )
    dim, n_heads = config["hidden_size"], config["num_attention_heads"]
    head_dim = config.get("head_dim")
    if head_dim is not None and n_heads > 0 and dim % n_heads == 0 and head_dim == dim // n_heads:
        head_dim = None  # the default, spelled out (transformers 5 always writes it)
    return {
        "dim": dim,
        "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads,
        "n_kv_heads": config.get("num_key_value_heads", model_type.num_key_value_heads) or n_heads,
        "head_dim": head_dim,
        "vocab_size": config["vocab_size"],
        "ffn_dim": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", model_type.rms_norm_eps)),
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_seq_len": _max_position_embeddings(config, model_type),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }


def build_args(args_type: type[_Args], fields: Mapping[str, Any], source: str) -> _Args:
    """`args_type(**fields)`, its validation errors raised as CheckpointErrors naming `source`."""
    try:
        return args_type(**fields)
    except ValueError as error:
        raise CheckpointError(f"{source}: {error}") from error


def decoder_config_keys(
    args: DecoderArgs, dtype: torch.dtype, model_type: HFModelType
) -> dict[str, Any]:
    """The Llama keys of a published-dialect config.json of `model_type` (no bias keys)."""
    dtype_name = str(dtype).removeprefix("torch.")
    scaling: RopeScaling | YarnScaling | None = args.rope_scaling
    return {
        "architectures": [model_type.architecture],
        "model_type": model_type.model_type,
        "hidden_size": args.dim,
        "intermediate_size": args.ffn_dim,
        "num_hidden_layers": args.n_layers,
        "num_attention_heads": args.n_heads,
        "num_key_value_heads": args.num_kv_heads,
        "head_dim": args.per_head_dim,
        "hidden_act": "silu",
        "attention_dropout": 0.0,
        "max_position_embeddings": _max_position_embeddings_of(args.max_seq_len, scaling),
        "rms_norm_eps": args.norm_eps,
        "rope_theta": args.rope_theta,
        "rope_scaling": None if scaling is None else _rope_scaling_keys(scaling),
        "tie_word_embeddings": args.tie_embeddings,
        "vocab_size": args.vocab_size,
        "torch_dtype": dtype_name,  # transformers 4 reads this key,
        "dtype": dtype_name,  # transformers 5 this one.
    }


def _max_position_embeddings_of(max_seq_len: int, scaling: RopeScaling | YarnScaling | None) -> int:
    """The context a config.json declares: the training length, but for YaRN the scaled
    context `factor x original` (some transformers versions derive YaRN's factor from
    `max_position_embeddings / original_max_position_embeddings` and ignore `factor`)."""
    if isinstance(scaling, YarnScaling):
        return round(scaling.factor * scaling.original_max_position_embeddings)
    return max_seq_len


def _rope_scaling_keys(scaling: RopeScaling | YarnScaling) -> dict[str, Any]:
    """The `rope_scaling` object of `scaling`."""
    if isinstance(scaling, YarnScaling):
        return {
            "rope_type": "yarn",
            "factor": scaling.factor,
            "original_max_position_embeddings": scaling.original_max_position_embeddings,
            "beta_fast": scaling.beta_fast,
            "beta_slow": scaling.beta_slow,
            "mscale": scaling.mscale,
            "mscale_all_dim": scaling.mscale_all_dim,
            "truncate": scaling.truncate,
        }
    return {
        "rope_type": "llama3",
        "factor": scaling.factor,
        "low_freq_factor": scaling.low_freq_factor,
        "high_freq_factor": scaling.high_freq_factor,
        "original_max_position_embeddings": scaling.original_max_position_embeddings,
    }


def _unsupported_features(config: Mapping[str, Any], model_type: HFModelType) -> list[str]:
    problems = []
    if config.get("model_type") != model_type.model_type:
        problems.append(f"model_type={config.get('model_type')!r} (need {model_type.model_type!r})")
    if config.get("hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={config['hidden_act']!r} (pipekit's decoders use 'silu')")
    if bool(config.get("attention_bias", model_type.attention_bias)) != model_type.attention_bias:
        problems.append(
            "attention_bias=true (pipekit's decoders have no biases)"
            if not model_type.attention_bias
            else f"attention_bias=false (pipekit's {model_type.pipekit_model} has biased "
            "attention projections; need true)"
        )
    if config.get("mlp_bias"):
        problems.append("mlp_bias=true (pipekit's decoders have no biases)")
    if config.get("partial_rotary_factor") not in (None, 1.0):
        problems.append(f"partial_rotary_factor={config['partial_rotary_factor']} (need 1.0)")
    if config.get("quantization_config") is not None:
        problems.append("quantization_config is set (load an unquantized checkpoint)")
    return problems


def _rope(
    config: Mapping[str, Any], model_type: HFModelType, problems: list[str]
) -> tuple[float, RopeScaling | YarnScaling | None]:
    """(rope_theta, rope_scaling) from either dialect; unsupported kinds go to `problems`."""
    # transformers gives a non-null legacy `rope_scaling` priority over `rope_parameters`.
    parameters = config.get("rope_scaling") or config.get("rope_parameters") or {}
    if not isinstance(parameters, Mapping):
        problems.append(f"rope_scaling/rope_parameters={parameters!r} must be an object or null")
        return model_type.rope_theta, None
    default_theta = config.get("rope_theta", model_type.rope_theta)
    rope_theta = float(parameters.get("rope_theta", default_theta))
    rope_type = parameters.get("rope_type", parameters.get("type"))
    if rope_type in _UNSCALED_ROPE_TYPES:
        return rope_theta, None
    if rope_type not in model_type.rope_types:
        known = ", ".join(repr(kind) for kind in ("default", *model_type.rope_types))
        problems.append(
            f"rope type {rope_type!r} (pipekit's {model_type.pipekit_model} supports {known}; "
            "convert or fine-tune the checkpoint to one of those)"
        )
        return rope_theta, None
    required = _LLAMA3_KEYS if rope_type == "llama3" else ("factor",)
    missing = [key for key in required if parameters.get(key) is None]
    if missing:
        problems.append(f"{rope_type} rope scaling lacks {missing}")
        return rope_theta, None
    original = int(
        parameters.get("original_max_position_embeddings")
        or _max_position_embeddings(config, model_type)
    )
    if rope_type == "yarn":
        return rope_theta, _yarn(parameters, original, problems)
    return rope_theta, RopeScaling(
        factor=float(parameters["factor"]),
        low_freq_factor=float(parameters["low_freq_factor"]),
        high_freq_factor=float(parameters["high_freq_factor"]),
        original_max_position_embeddings=original,
    )


def _yarn(parameters: Mapping[str, Any], original: int, problems: list[str]) -> YarnScaling:
    """YaRN with transformers' defaults: an absent (or 0) `mscale` or `mscale_all_dim` is 0,
    which both read as "not given" (the cos/sin magnitude then depends on `factor` alone)."""
    scaling = YarnScaling(
        factor=float(parameters["factor"]),
        original_max_position_embeddings=original,
        beta_fast=float(parameters.get("beta_fast") or 32.0),
        beta_slow=float(parameters.get("beta_slow") or 1.0),
        mscale=float(parameters.get("mscale") or 0.0),
        mscale_all_dim=float(parameters.get("mscale_all_dim") or 0.0),
        truncate=parameters.get("truncate", True) is not False,
    )
    given = parameters.get("attention_factor")
    close = isinstance(given, int | float) and math.isclose(given, scaling.attention_factor)
    if given is not None and not close:
        problems.append(
            f"yarn attention_factor={given} differs from the {scaling.attention_factor} that "
            "factor, mscale and mscale_all_dim give (pipekit derives it); drop attention_factor"
        )
    return scaling


def _max_position_embeddings(config: Mapping[str, Any], model_type: HFModelType) -> int:
    return int(config.get("max_position_embeddings", model_type.max_position_embeddings))


def is_int(value: object) -> bool:
    """A JSON integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)
