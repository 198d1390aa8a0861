"""Hugging Face LlamaForCausalLM checkpoints <-> pipekit's Llama: names, RoPE row order, load, save.

pipekit (like Meta's reference code) rotates the interleaved pairs (x[2i], x[2i+1]) of each head;
Hugging Face rotates (x[i], x[i + head_dim/2]) ("rotate_half"). Both compute the same model once
the rows of every head of wq and wk are reordered: pipekit row 2i+c of a head is Hugging Face row
c*head_dim/2 + i. The reorder stays inside a head, so a row range of whole heads is the same row
range in both layouts, and a tensor-parallel rank can read just its heads.

`load_hf_weights` and `save_hf_weights` are the checked load and save of any model of the Llama
family given its names and shapes; Mixtral (`models/llama_moe/hf_mixtral.py`) reuses them.

Shape legend: R rows (output features), D model dim.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

import torch
from torch import nn

from models.llama.args import LlamaArgs
from models.llama.hf_config import CONFIG_FILE, args_to_hf_config, read_hf_llama_args
from models.llama.model import Llama
from pipekit.checkpoint.safetensors_io import (
    DEFAULT_MAX_SHARD_BYTES,
    CheckpointError,
    SafetensorsCheckpoint,
    save_safetensors,
)

__all__ = [
    "build_llama_from_hf",
    "check_hf_llama_checkpoint",
    "comparable_fields",
    "config_differences",
    "from_hf_name",
    "from_hf_state_dict",
    "hf_source_name",
    "llama_param_shapes",
    "load_hf_llama",
    "load_hf_weights",
    "permute_from_hf",
    "permute_to_hf",
    "read_hf_tensor",
    "rope_permuted",
    "save_hf_llama",
    "save_hf_weights",
    "to_hf_name",
    "to_hf_state_dict",
    "to_hf_tensor",
]

_TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attention_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attention.wq.weight": "self_attn.q_proj.weight",
    "attention.wk.weight": "self_attn.k_proj.weight",
    "attention.wv.weight": "self_attn.v_proj.weight",
    "attention.wo.weight": "self_attn.o_proj.weight",
    "feed_forward.w1.weight": "mlp.gate_proj.weight",
    "feed_forward.w2.weight": "mlp.down_proj.weight",
    "feed_forward.w3.weight": "mlp.up_proj.weight",
}
_ROPE_PERMUTED = ("attention.wq.weight", "attention.wk.weight")
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_HF_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")
# Buffers some transformers versions saved; they are recomputed from config.json.
_IGNORED_HF_SUFFIX = "rotary_emb.inv_freq"
_TIED_HEAD = "lm_head.weight"
_LISTED_NAMES = 20


def to_hf_name(name: str) -> str:
    """Hugging Face name of a pipekit Llama parameter."""
    if name in _TOP_LEVEL_NAMES:
        return _TOP_LEVEL_NAMES[name]
    match = _LAYER.fullmatch(name)
    if match and match[2] in _LAYER_NAMES:
        return f"model.layers.{match[1]}.{_LAYER_NAMES[match[2]]}"
    raise ValueError(f"{name!r} is not a pipekit Llama parameter name")


def from_hf_name(hf_name: str) -> str:
    """pipekit name of a Hugging Face LlamaForCausalLM tensor."""
    for name, candidate in _TOP_LEVEL_NAMES.items():
        if candidate == hf_name:
            return name
    match = _HF_LAYER.fullmatch(hf_name)
    for name, hf_suffix in _LAYER_NAMES.items():
        if match and match[2] == hf_suffix:
            return f"layers.{match[1]}.{name}"
    raise ValueError(f"{hf_name!r} is not a Hugging Face Llama weight name")


def permute_to_hf(w_RD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved RoPE pairs to rotate_half halves."""
    heads = _whole_heads(w_RD, head_dim)
    return w_RD.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w_RD.shape)


def permute_from_hf(w_RD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of permute_to_hf: rotate_half halves back to interleaved pairs."""
    heads = _whole_heads(w_RD, head_dim)
    return w_RD.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w_RD.shape)


def llama_param_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter of a pipekit Llama (`output.weight` even when tied)."""
    dim, head_dim = args.dim, args.per_head_dim
    q_rows, kv_rows = args.n_heads * head_dim, args.num_kv_heads * head_dim
    per_layer = {
        "attention_norm.weight": (dim,),
        "ffn_norm.weight": (dim,),
        "attention.wq.weight": (q_rows, dim),
        "attention.wk.weight": (kv_rows, dim),
        "attention.wv.weight": (kv_rows, dim),
        "attention.wo.weight": (dim, q_rows),
        "feed_forward.w1.weight": (args.ffn_dim, dim),
        "feed_forward.w2.weight": (dim, args.ffn_dim),
        "feed_forward.w3.weight": (args.ffn_dim, dim),
    }
    shapes = {"tok_embeddings.weight": (args.vocab_size, dim)}
    for layer in range(args.n_layers):
        shapes |= {f"layers.{layer}.{name}": shape for name, shape in per_layer.items()}
    return shapes | {"norm.weight": (dim,), "output.weight": (args.vocab_size, dim)}


def to_hf_state_dict(
    state_dict: Mapping[str, torch.Tensor], args: LlamaArgs
) -> dict[str, torch.Tensor]:
    """Hugging Face names and row order; a tied `output.weight` is dropped, as transformers does."""
    hf_state_dict = {}
    for name, tensor in state_dict.items():
        if args.tie_embeddings and name == "output.weight":
            continue
        hf_state_dict[to_hf_name(name)] = to_hf_tensor(name, tensor, args)
    return hf_state_dict


def to_hf_tensor(name: str, tensor: torch.Tensor, args: LlamaArgs) -> torch.Tensor:
    """pipekit parameter `name` in Hugging Face row order (wq and wk permuted per head)."""
    return permute_to_hf(tensor, args.per_head_dim) if name.endswith(_ROPE_PERMUTED) else tensor


def from_hf_state_dict(
    hf_state_dict: Mapping[str, torch.Tensor], args: LlamaArgs
) -> dict[str, torch.Tensor]:
    """pipekit names and row order; with tied embeddings `output.weight` is the embedding."""
    state_dict = {}
    for hf_name, tensor in hf_state_dict.items():
        if hf_name.endswith(_IGNORED_HF_SUFFIX) or (args.tie_embeddings and hf_name == _TIED_HEAD):
            continue
        name = from_hf_name(hf_name)
        permuted = name.endswith(_ROPE_PERMUTED)
        state_dict[name] = permute_from_hf(tensor, args.per_head_dim) if permuted else tensor
    if args.tie_embeddings and "tok_embeddings.weight" in state_dict:
        state_dict["output.weight"] = state_dict["tok_embeddings.weight"]
    return state_dict


def read_hf_tensor(
    checkpoint: SafetensorsCheckpoint, name: str, args: LlamaArgs, rows: slice | None = None
) -> torch.Tensor:
    """pipekit parameter `name` (or its rows `rows`) read from a Hugging Face checkpoint.

    For wq and wk, `rows` must cover whole heads (multiples of head_dim), because the RoPE
    reorder mixes the rows inside a head.
    """
    permuted = name.endswith(_ROPE_PERMUTED)
    head_dim = args.per_head_dim
    if permuted and rows is not None:
        bounds = [bound for bound in (rows.start, rows.stop) if bound is not None]
        if any(bound % head_dim for bound in bounds):
            raise ValueError(
                f"rows {rows.start}:{rows.stop} of {name} do not cover whole heads; with "
                f"head_dim={head_dim} start and stop must be multiples of {head_dim}"
            )
    tensor = checkpoint.read(hf_source_name(name, args), rows)
    return permute_from_hf(tensor, head_dim) if permuted else tensor


def load_hf_llama(directory: str | os.PathLike[str], model: nn.Module, args: LlamaArgs) -> None:
    """Copy a Hugging Face Llama checkpoint into `model` (laid out as `args`), in its dtype.

    config.json must describe `args` (`max_seq_len` may differ: it is a training choice, not a
    property of the weights). Everything is checked before the first parameter is written, so a
    failed load leaves the model untouched.
    """
    _check_llama_config(directory, args)
    load_hf_weights(
        directory, model, args, llama_param_shapes(args), _llama_hf_shapes(args), read_hf_tensor
    )


def check_hf_llama_checkpoint(checkpoint: SafetensorsCheckpoint, args: LlamaArgs) -> None:
    """CheckpointError unless `checkpoint` is a Llama of shape `args`: its config.json and every
    tensor's name and shape (from the file headers; no tensor data is read unless tied)."""
    _check_llama_config(checkpoint.directory, args)
    _check_checkpoint_tensors(checkpoint, args, _llama_hf_shapes(args))


def rope_permuted(name: str) -> bool:
    """Whether pipekit parameter `name` has its rows reordered per head (wq, wk)."""
    return name.endswith(_ROPE_PERMUTED)


def _check_llama_config(directory: str | os.PathLike[str], args: LlamaArgs) -> None:
    differences = config_differences(
        comparable_fields(read_hf_llama_args(directory)), comparable_fields(args)
    )
    if differences:
        raise CheckpointError(
            f"{os.path.join(directory, CONFIG_FILE)} does not match the model's LlamaArgs: "
            f"{'; '.join(differences)}; build the model from read_hf_llama_args(directory) "
            "or load a checkpoint of this shape"
        )


def _llama_hf_shapes(args: LlamaArgs) -> dict[str, tuple[int, ...]]:
    """Hugging Face name -> shape of every tensor of the checkpoint (tied lm_head dropped)."""
    return {
        to_hf_name(name): shape
        for name, shape in llama_param_shapes(args).items()
        if not (args.tie_embeddings and name == "output.weight")
    }


def load_hf_weights(
    directory: str | os.PathLike[str],
    model: nn.Module,
    args: LlamaArgs,
    param_shapes: Mapping[str, tuple[int, ...]],
    hf_shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[SafetensorsCheckpoint, str, Any], torch.Tensor],
) -> None:
    """Copy `read(checkpoint, name, args)` into every parameter `name` of `model`, once the
    model's parameters match `param_shapes` (for the modules it holds) and the checkpoint holds
    exactly the tensors `hf_shapes` (plus an identical `lm_head.weight` when tied, and ignored
    rotary buffers). A failed check writes nothing.
    """
    params = _parameters_matching(model, args, param_shapes)
    if any(param.is_meta for param in params.values()):
        raise ValueError(
            "the model's parameters are on the meta device; call model.to_empty(device=...) "
            "before loading"
        )
    with SafetensorsCheckpoint(directory) as checkpoint:
        _check_checkpoint_tensors(checkpoint, args, hf_shapes)
        copied: set[int] = set()
        with torch.no_grad():
            for name, param in params.items():
                if id(param) not in copied:  # a tied weight is read once
                    param.copy_(read(checkpoint, name, args))
                    copied.add(id(param))


def save_hf_llama(
    model: nn.Module,
    args: LlamaArgs,
    directory: str | os.PathLike[str],
    *,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write `model` as a Hugging Face checkpoint (config.json + safetensors), atomically.

    Tensors keep the model's dtype, so load -> save -> load is bit-exact.
    """
    save_hf_weights(
        model,
        args,
        directory,
        param_shapes=llama_param_shapes(args),
        to_hf=to_hf_state_dict,
        hf_config=args_to_hf_config,
        max_shard_bytes=max_shard_bytes,
        overwrite=overwrite,
    )


def save_hf_weights(
    model: nn.Module,
    args: LlamaArgs,
    directory: str | os.PathLike[str],
    *,
    param_shapes: Mapping[str, tuple[int, ...]],
    to_hf: Callable[[dict[str, torch.Tensor], Any], dict[str, torch.Tensor]],
    hf_config: Callable[[Any, torch.dtype], dict[str, Any]],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> None:
    """Write `to_hf(state_dict, args)` and `hf_config(args, dtype)` (config.json) atomically,
    once the model's parameters match `param_shapes` and a tied output equals the embedding.
    """
    params = _parameters_matching(model, args, param_shapes)
    embedding, output = params["tok_embeddings.weight"], params["output.weight"]
    if args.tie_embeddings and not (output is embedding or torch.equal(output, embedding)):
        raise ValueError(
            "args.tie_embeddings=True but the model's output.weight differs from "
            "tok_embeddings.weight; saving would drop it. Tie them or set tie_embeddings=False"
        )
    config = hf_config(args, embedding.dtype)
    save_safetensors(
        to_hf({name: param.detach() for name, param in params.items()}, args),
        directory,
        max_shard_bytes=max_shard_bytes,
        extra_files={CONFIG_FILE: json.dumps(config, indent=2) + "\n"},
        overwrite=overwrite,
    )


def build_llama_from_hf(
    directory: str | os.PathLike[str], *, device: torch.device | str = "cpu"
) -> tuple[Llama, LlamaArgs]:
    """A float32 pipekit Llama holding a Hugging Face checkpoint: (model, its LlamaArgs)."""
    args = read_hf_llama_args(directory)
    with torch.device("meta"):
        model = Llama(args)
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives tied modules separate tensors
    load_hf_llama(directory, model, args)
    return model, args


def _whole_heads(w_RD: torch.Tensor, head_dim: int) -> int:
    if w_RD.shape[0] % head_dim:
        raise ValueError(
            f"{w_RD.shape[0]} rows are not whole heads of head_dim={head_dim}; "
            "pass rows that are multiples of head_dim"
        )
    return w_RD.shape[0] // head_dim


def hf_source_name(name: str, args: LlamaArgs) -> str:
    """Checkpoint tensor that holds parameter `name` (tied output reads the embedding)."""
    if args.tie_embeddings and name == "output.weight":
        return _TOP_LEVEL_NAMES["tok_embeddings.weight"]
    return to_hf_name(name)


def config_differences(
    checkpoint_fields: Mapping[str, object], model_fields: Mapping[str, object]
) -> list[str]:
    """'key: checkpoint X, model Y' for every field (of `comparable_fields`) that differs."""
    return [
        f"{key}: checkpoint {checkpoint_fields[key]!r}, model {model_fields[key]!r}"
        for key in checkpoint_fields
        if checkpoint_fields[key] != model_fields[key]
    ]


def comparable_fields(args: LlamaArgs) -> dict[str, object]:
    """Fields that change what the weights compute, with their defaults resolved."""
    values = {field.name: getattr(args, field.name) for field in fields(args)}
    del values["max_seq_len"]
    return values | {"n_kv_heads": args.num_kv_heads, "head_dim": args.per_head_dim}


def _parameters_matching(
    model: nn.Module, args: LlamaArgs, param_shapes: Mapping[str, tuple[int, ...]]
) -> dict[str, nn.Parameter]:
    """The model's parameters (tied ones under both names), checked against `param_shapes`. A
    model that holds only some modules (the others None, e.g. a pipeline stage) is checked, and
    loaded, for those."""
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {name: shape for name, shape in param_shapes.items() if _holds(model, name)}
    problems = _name_and_shape_problems(
        {name: tuple(param.shape) for name, param in params.items()}, expected
    )
    if problems:
        raise ValueError(
            f"the model does not have the parameters its {type(args).__name__} imply: {problems}"
        )
    return params


def _holds(model: nn.Module, name: str) -> bool:
    """Whether `model` holds the module of parameter `name` (a top-level module, or one block of
    `layers`)."""
    top, _, rest = name.partition(".")
    module = getattr(model, top, None)
    if module is None or top != "layers":
        return module is not None
    return rest.partition(".")[0] in module


def _check_checkpoint_tensors(
    checkpoint: SafetensorsCheckpoint, args: LlamaArgs, hf_shapes: Mapping[str, tuple[int, ...]]
) -> None:
    expected = dict(hf_shapes)
    present = {name for name in checkpoint.names if not name.endswith(_IGNORED_HF_SUFFIX)}
    tied_head = args.tie_embeddings and _TIED_HEAD in present
    if tied_head:
        expected[_TIED_HEAD] = expected[_TOP_LEVEL_NAMES["tok_embeddings.weight"]]
    found = {name: checkpoint.info(name).shape for name in present}
    problems = _name_and_shape_problems(found, expected)
    if problems:
        raise CheckpointError(f"{checkpoint.directory} does not fit the model: {problems}")
    if tied_head and not torch.equal(
        checkpoint.read(_TIED_HEAD), checkpoint.read(_TOP_LEVEL_NAMES["tok_embeddings.weight"])
    ):
        raise CheckpointError(
            f"{checkpoint.directory}: config.json says tie_word_embeddings=true but lm_head.weight "
            "differs from model.embed_tokens.weight; set tie_word_embeddings=false in config.json "
            "if the checkpoint really has a separate output layer"
        )


def _name_and_shape_problems(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> str:
    """'' when `found` has exactly the expected names and shapes, else what is wrong."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = [
        f"{name} expected {list(expected[name])}, got {list(found[name])}"
        for name in sorted(expected.keys() & found.keys())
        if found[name] != expected[name]
    ]
    parts = [
        f"{label} ({len(items)}): {_listing(items)}"
        for label, items in (
            ("missing tensors", missing),
            ("unexpected tensors", unexpected),
            ("shape mismatches", mismatched),
        )
        if items
    ]
    return "; ".join(parts)


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED_NAMES])
    hidden = len(items) - _LISTED_NAMES
    return f"{shown}, ... ({hidden} more)" if hidden > 0 else shown
