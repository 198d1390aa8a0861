"""A Hugging Face adapter for the example model (examples/custom_model/model.py): its weights in
and out of a safetensors checkpoint directory with a config.json, from any layout.

docs/hf_adapter.md walks through it. The file names come from two tables, pipekit name -> name
in the file, the way the built-in decoder families build theirs
(pipekit/families/decoder/hf_layout.py). An MoE layer's experts are one stacked parameter in
pipekit and one tensor per expert in the file, as in published MoE checkpoints. `model_type =
"tiny_gpt"` is the example's own: transformers has no such architecture, so these files are read
by pipekit only.

Importing this module registers the example's spec with the adapter (`TINY_GPT_WITH_HF`, in
place of the plain one), so a job that names it in `[model] module` can start from a checkpoint
(`initial_load_path`) and export one (`export_hf_at_end`). Your own family passes the adapter
as `ModelSpec(..., hf=...)` instead.

Legend: E experts.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from examples.custom_model.model import TINY_GPT, TinyGPT, TinyGPTArgs
from pipekit.checkpoint.block_sources import (
    BlockSource,
    CheckpointBlock,
    StackedBlocks,
    fill_from_sources,
)
from pipekit.checkpoint.hf_export import save_hf_sharded
from pipekit.checkpoint.local_shards import RowShard, load_local_blocks
from pipekit.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint, TensorRead
from pipekit.models import HuggingFaceAdapter, register_model
from pipekit.models.spec import HFTensor
from pipekit.moe import MoEArgs

__all__ = [
    "BLOCK_NAMES",
    "EXPERT_NAMES",
    "MODEL_TYPE",
    "TINY_GPT_HF",
    "TINY_GPT_WITH_HF",
    "TOP_LEVEL_NAMES",
    "build_from_checkpoint",
    "checkpoint_names",
    "config",
    "load",
    "read_args",
    "save",
    "tensors",
]

MODEL_TYPE = "tiny_gpt"
CONFIG_FILE = "config.json"

TOP_LEVEL_NAMES = {
    "wte.weight": "transformer.wte.weight",
    "wpe.weight": "transformer.wpe.weight",
    "ln_f.weight": "transformer.ln_f.weight",
    "ln_f.bias": "transformer.ln_f.bias",
    "lm_head.weight": "lm_head.weight",
}
"""pipekit name -> name in the file, outside the blocks."""
BLOCK_NAMES = {
    "ln_1.weight": "ln_1.weight",
    "ln_1.bias": "ln_1.bias",
    "ln_2.weight": "ln_2.weight",
    "ln_2.bias": "ln_2.bias",
    "attn.qkv.weight": "attn.qkv.weight",
    "attn.qkv.bias": "attn.qkv.bias",
    "attn.proj.weight": "attn.proj.weight",
    "attn.proj.bias": "attn.proj.bias",
    "mlp.0.weight": "mlp.fc_in.weight",  # a dense block's MLP
    "mlp.0.bias": "mlp.fc_in.bias",
    "mlp.2.weight": "mlp.fc_out.weight",
    "mlp.2.bias": "mlp.fc_out.bias",
    "mlp.router.gate.weight": "mlp.gate.weight",  # an MoE block's router
}
"""pipekit name within block L -> name within `transformer.h.L`."""
EXPERT_NAMES = {
    "mlp.experts.w1_EFD": "w1.weight",
    "mlp.experts.w2_EDF": "w2.weight",
    "mlp.experts.w3_EFD": "w3.weight",
}
"""Stacked expert parameter within block L -> name within `transformer.h.L.mlp.experts.J`."""
_BLOCK = re.compile(r"blocks\.(\d+)\.(.+)")


def checkpoint_names(name: str, args: TinyGPTArgs) -> list[str]:
    """The file's names for pipekit parameter `name`: one per expert for a stacked expert
    weight (expert J's at index J), else one."""
    if name in TOP_LEVEL_NAMES:
        return [TOP_LEVEL_NAMES[name]]
    match = _BLOCK.fullmatch(name)
    if match is not None:
        layer, rest = match[1], match[2]
        if rest in BLOCK_NAMES:
            return [f"transformer.h.{layer}.{BLOCK_NAMES[rest]}"]
        if rest in EXPERT_NAMES:
            prefix = f"transformer.h.{layer}.mlp.experts"
            return [f"{prefix}.{j}.{EXPERT_NAMES[rest]}" for j in range(args.moe.num_experts)]
    raise ValueError(f"{name!r} is not a parameter of a TinyGPT in the {MODEL_TYPE} layout")


def _is_expert_weight(name: str) -> bool:
    match = _BLOCK.fullmatch(name)
    return match is not None and match[2] in EXPERT_NAMES


def tensors(args: TinyGPTArgs) -> list[HFTensor]:
    """Every tensor of the checkpoint of a model with `args`, in model order (a tied head is
    the embedding's tensor: `named_parameters` lists it once)."""
    with torch.device("meta"):
        model = TinyGPT(args)
    listing = []
    for name, param in model.named_parameters():
        names, shape = checkpoint_names(name, args), tuple(param.shape)
        if _is_expert_weight(name):  # [E, ...] in pipekit, one tensor per expert in the file
            listing += [HFTensor(hf, shape[1:], name, j) for j, hf in enumerate(names)]
        else:
            listing.append(HFTensor(names[0], shape, name, None))
    return listing


def config(args: TinyGPTArgs, dtype: torch.dtype) -> dict[str, Any]:
    """The config.json object of a model with `args` whose weights are `dtype`."""
    return {
        "model_type": MODEL_TYPE,
        "torch_dtype": str(dtype).removeprefix("torch."),
        **dataclasses.asdict(args),
    }


def read_args(directory: str | os.PathLike[str]) -> TinyGPTArgs:
    """The model args `directory/config.json` describes, with errors that name the file."""
    path = Path(directory) / CONFIG_FILE
    try:
        fields = json.loads(path.read_text())
        if fields.pop("model_type", None) != MODEL_TYPE:
            raise ValueError(f"model_type is not {MODEL_TYPE!r}")
        fields.pop("torch_dtype", None)
        return TinyGPTArgs(**fields | {"moe": MoEArgs(**fields.get("moe", {}))})
    except (OSError, ValueError, TypeError) as error:
        raise CheckpointError(f"{path} does not describe a TinyGPT: {error}") from None


def _source(checkpoint: SafetensorsCheckpoint, name: str, args: TinyGPTArgs) -> BlockSource:
    """Parameter `name` as a source of any block of it: a stacked expert weight stacks its
    experts' tensors; a tied head (a pipeline's last stage holds a copy) reads the embedding."""
    if name == "lm_head.weight" and args.tie_embeddings:
        name = "wte.weight"
    names = checkpoint_names(name, args)
    if _is_expert_weight(name):
        return StackedBlocks([CheckpointBlock(checkpoint, hf) for hf in names])
    return CheckpointBlock(checkpoint, names[0])


def load(
    directory: str | os.PathLike[str],
    model: nn.Module,
    args: TinyGPTArgs,
    *,
    row_shards: Mapping[str, RowShard] | None = None,
    read_log: list[TensorRead] | None = None,
) -> None:
    """Copy a checkpoint into `model`: the whole model or this rank's part of it (DTensor
    shards, a pipeline stage, vocabulary rows named in `row_shards`), reading only the blocks
    it holds (each appended to `read_log` when given). Everything is checked before the first
    parameter is written."""
    described = read_args(directory)
    if described != args:
        raise CheckpointError(
            f"{directory}/{CONFIG_FILE} describes {described}, not the model's {args}; build "
            "the model from the checkpoint's args"
        )
    row_shards = row_shards or {}
    with SafetensorsCheckpoint(directory, read_log=read_log) as checkpoint:
        sources = {}
        for name, param in model.named_parameters():
            sources[name] = source = _source(checkpoint, name, args)  # names a missing tensor
            whole = tuple(param.shape)  # a DTensor's is the global shape
            if name in row_shards:
                whole = (row_shards[name].rows, *whole[1:])
            if tuple(source.shape) != whole:
                raise CheckpointError(
                    f"{directory}: {name} is {list(source.shape)} in the file, {list(whole)} "
                    "in the model"
                )
        load_local_blocks(model, fill_from_sources(sources), row_shards)


def save(
    model: nn.Module,
    args: TinyGPTArgs,
    directory: str | os.PathLike[str],
    *,
    row_shards: Mapping[str, RowShard] | None = None,
) -> None:
    """Write `model` with its config.json, replacing `directory`. A sharded model is saved by
    every rank calling this with its part (`row_shards`: parameters of which the rank holds a
    row range); each writes about 1/world of the tensors, none gathering the model."""
    dtype = next(model.parameters()).dtype
    save_hf_sharded(
        model,
        tensors(args),
        lambda name, tensor: tensor,  # pipekit's layout is the file's: nothing to reorder
        directory,
        extra_files={CONFIG_FILE: json.dumps(config(args, dtype), indent=2) + "\n"},
        row_shards=row_shards,
        overwrite=True,
    )


def build_from_checkpoint(directory: str | os.PathLike[str]) -> tuple[TinyGPT, TinyGPTArgs]:
    """A float32 model holding the checkpoint in `directory`, on the CPU: (model, its args)."""
    args = read_args(directory)
    with torch.device("meta"):
        model = TinyGPT(args)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives tied modules separate tensors
    load(directory, model, args)
    return model, args


TINY_GPT_HF = HuggingFaceAdapter(
    model_types=(MODEL_TYPE,),
    read_args=read_args,
    load=load,
    save=save,
    tensors=tensors,
    config=config,
    build_from_checkpoint=build_from_checkpoint,
)
"""The example's Hugging Face format, as the model contract's hooks."""
TINY_GPT_WITH_HF = dataclasses.replace(TINY_GPT, hf=TINY_GPT_HF)
"""The example's spec with the adapter."""
# In place of model.py's plain spec: `[model] module = "examples.custom_model.hf_adapter"`.
register_model(TINY_GPT_WITH_HF, replace=True)
