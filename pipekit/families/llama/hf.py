"""Hugging Face LlamaForCausalLM checkpoints <-> pipekit's Llama: config.json, names, load, save.

The names, the RoPE row order of wq/wk and the checked load and save are the shared decoder
format's (`pipekit.families.decoder.hf_layout`); this module says what is Llama's: its model
type with transformers' defaults, its config keys, and the family's public functions.
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
)
from pipekit.families.decoder.hf_layout import DecoderHF, DecoderLayout
from pipekit.families.llama.args import LlamaArgs
from pipekit.families.llama.model import Llama

__all__ = [
    "LLAMA_HF",
    "LLAMA_MODEL_TYPE",
    "args_to_hf_config",
    "build_llama_from_hf",
    "hf_config_to_args",
    "load_hf_llama",
    "read_hf_llama_args",
    "save_hf_llama",
]

LLAMA_MODEL_TYPE = HFModelType(
    model_type="llama",
    architecture="LlamaForCausalLM",
    pipekit_model="Llama",
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=2048,
    num_key_value_heads=None,
)
"""transformers' LlamaConfig."""


def hf_config_to_args(config: Mapping[str, Any], *, source: str = CONFIG_FILE) -> LlamaArgs:
    """Parse a Llama config.json (either dialect); reject what pipekit's Llama cannot compute."""
    fields = decoder_config_fields(config, source=source, model_type=LLAMA_MODEL_TYPE)
    return build_args(LlamaArgs, fields, source)


def args_to_hf_config(args: LlamaArgs, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """The published-dialect config.json of a Llama with `args` whose weights are `dtype`."""
    return decoder_config_keys(args, dtype, LLAMA_MODEL_TYPE) | {
        "attention_bias": False,
        "mlp_bias": False,
    }


LLAMA_HF = DecoderHF(
    layout=DecoderLayout(LLAMA_MODEL_TYPE),
    build=Llama,
    config_to_args=lambda config, source: hf_config_to_args(config, source=source),
    args_to_config=args_to_hf_config,
)
"""The Llama family's Hugging Face format."""


def read_hf_llama_args(directory: str | os.PathLike[str]) -> LlamaArgs:
    """LlamaArgs described by `directory/config.json`, with errors that name the file."""
    return LLAMA_HF.read_args(directory)


def load_hf_llama(directory: str | os.PathLike[str], model: nn.Module, args: LlamaArgs) -> None:
    """Copy a Hugging Face Llama checkpoint into `model` (laid out as `args`), in its dtype;
    config.json must describe `args` (`max_seq_len` may differ: a training choice)."""
    LLAMA_HF.load(directory, model, args)


def save_hf_llama(
    model: nn.Module,
    args: LlamaArgs,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write `model` as a Hugging Face Llama checkpoint (config.json + safetensors), atomically."""
    LLAMA_HF.save(model, args, directory, max_shard_bytes=max_shard_bytes, overwrite=overwrite)


def build_llama_from_hf(
    directory: str | os.PathLike[str], *, device: torch.device | str = "cpu"
) -> tuple[Llama, LlamaArgs]:
    """A float32 pipekit Llama holding a Hugging Face checkpoint: (model, its LlamaArgs)."""
    return LLAMA_HF.build_from_checkpoint(directory, device=device)
