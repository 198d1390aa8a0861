"""Hugging Face safetensors <-> pipekit decoder parameters: names, RoPE row order, experts.

One `DecoderHF` describes one Hugging Face architecture of a decoder family (Llama, Mixtral,
Qwen3, Qwen3-MoE, DeepSeek-V3): how its tensors are named (`DecoderLayout`), how its config.json
maps to the family's args, and which pipekit model it loads into. From that it provides the
checked load and save, the tensor list (`tensors`, the upcycling writer's and the bench's too),
and single parameter reads (whole, or a row block of whole heads: a tensor-parallel rank reads
its heads).

The rows of every head of wq and wk (and of their biases, of a per-head QK-norm weight) are
reordered between pipekit's interleaved RoPE pairs and Hugging Face's halves (`rope_order`); the
reorder stays inside a head, so a row range of whole heads is the same rows in both layouts.

An MoE FFN's experts are one pipekit parameter per weight, stacked on a leading expert dim;
Hugging Face files hold one tensor per expert (the published per-expert layout, which
transformers 4 loads as is and transformers 5 converts on load and writes back on save). A
buffer the layout names (DeepSeek-V3's router bias) is a checkpoint tensor like a parameter. A
tensor holding parameters otherwise (gpt-oss's fused experts) is the layout's `custom` one
(`hf_fused_experts`): it builds itself on save and gives each parameter's blocks on load.

Shape legend: R rows (output features), D model dim, E experts.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from pipekit.checkpoint.block_sources import (
    BlockSource,
    CheckpointBlock,
    StackedBlocks,
    fill_from_sources,
)
from pipekit.checkpoint.hf_export import FusedTensor, save_hf_sharded
from pipekit.checkpoint.local_shards import RowShard, global_block, load_local_blocks
from pipekit.checkpoint.safetensors_io import CheckpointError, SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint.safetensors_write import DEFAULT_MAX_SHARD_BYTES
from pipekit.families.decoder.args import DecoderArgs, MoEFields
from pipekit.families.decoder.hf_checks import name_and_shape_problems
from pipekit.families.decoder.hf_config import CONFIG_FILE, HFModelType, read_config_json
from pipekit.families.decoder.hf_fused_experts import CustomLayerTensor
from pipekit.families.decoder.rope_order import permute_from_hf, permute_to_hf
from pipekit.models.materialize import local_tensor, to_empty_keeping_ties
from pipekit.models.spec import HFTensor, HuggingFaceAdapter

__all__ = [
    "DENSE_LAYER_NAMES",
    "EXPERT_ACTIVATION",
    "EXPERT_WEIGHTS",
    "DecoderHF",
    "DecoderLayout",
    "expert_layout_problems",
    "permute_from_hf",
    "permute_to_hf",
]

TOP_LEVEL_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
DENSE_LAYER_NAMES = {
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
"""pipekit name within a block -> Hugging Face name within `model.layers.L` (Llama's)."""
EXPERT_WEIGHTS = {"experts.w1_EFD": "w1", "experts.w2_EDF": "w2", "experts.w3_EFD": "w3"}
"""Expert parameter -> the SwiGLU weight it stacks (and the dense FFN weight it is upcycled
from)."""
EXPERT_ACTIVATION = "swiglu"
"""The experts' activation (`MoEArgs.activation`) that `EXPERT_WEIGHTS` describes, as the
decoders' dense FFN: the only one the Hugging Face MoE layouts hold and upcycling copies."""
_ROUTER = "router.gate.weight"
_LAYER = re.compile(r"layers\.(\d+)\.(.+)")
_MTP = re.compile(r"mtp\.(\d+)\.(.+)")
_MTP_BLOCK = "block."
# The copies of the shared embedding and output layer each MTP layer holds (DeepSeek-V3's files).
_MTP_SHARED = {
    "embed_tokens.weight": "tok_embeddings.weight",
    "shared_head.head.weight": "output.weight",
}
# Buffers some transformers versions saved; they are recomputed from config.json.
_IGNORED_HF_SUFFIX = "rotary_emb.inv_freq"
logger = logging.getLogger(__name__)
_TIED_HEAD = TOP_LEVEL_NAMES["output.weight"]
_EMBEDDING = TOP_LEVEL_NAMES["tok_embeddings.weight"]


def expert_layout_problems(args: MoEFields, *, shared_experts: bool = False) -> list[str]:
    """What the Hugging Face MoE layouts pipekit writes cannot hold of `args` (experts that
    are not SwiGLU, expert or router biases, shared experts unless the layout has them), each
    with its fix; a family's `check_layout` adds its own."""
    problems = []
    activation = args.moe.activation
    if activation != EXPERT_ACTIVATION:
        problems.append(
            f"moe.activation={activation!r} experts, but the layout's experts are SwiGLU (w1 "
            f"gate, w3 up, w2 down); use activation={EXPERT_ACTIVATION!r}, or keep the model in "
            "pipekit's DCP checkpoints"
        )
    if args.moe.expert_biases or args.moe.router_bias:
        problems.append(
            f"moe.expert_biases={args.moe.expert_biases}, router_bias={args.moe.router_bias}, but "
            "the layout's experts and router have no biases; set both False, or keep the model "
            "in pipekit's DCP checkpoints"
        )
    if args.moe.num_shared_experts and not shared_experts:
        problems.append(
            f"moe.num_shared_experts={args.moe.num_shared_experts}, but the layout has no shared "
            "experts; set num_shared_experts=0, or keep the model in pipekit's DCP checkpoints"
        )
    return problems


@dataclass(frozen=True)
class DecoderLayout:
    """How one Hugging Face architecture names a pipekit decoder's weights."""

    model_type: HFModelType
    layer_names: Mapping[str, str] = field(default_factory=lambda: dict(DENSE_LAYER_NAMES))
    """pipekit name within a block -> Hugging Face name within `model.layers.L` (attention,
    norms, and a dense FFN's weights)."""
    rope_permuted: tuple[str, ...] = ("attention.wq.weight", "attention.wk.weight")
    """Names within a block whose rows are reordered per head (RoPE)."""
    moe_block: str | None = None
    """Hugging Face module of an MoE FFN within a layer (Mixtral's "block_sparse_moe",
    Qwen3-MoE's "mlp"); None: no MoE layers."""
    expert_names: Mapping[str, str] = field(default_factory=dict)
    """SwiGLU weight ("w1", "w2", "w3") -> its name within `experts.J` of the MoE block."""
    buffers: tuple[str, ...] = ()
    """Names within a block of the buffers the checkpoint holds (DeepSeek-V3's router bias;
    their Hugging Face names are in `layer_names`); the model's other buffers are not saved."""
    custom: tuple[CustomLayerTensor, ...] = ()
    """Tensors within `model.layers.L` holding parameters otherwise than as they are."""
    mtp_names: Mapping[str, str] | None = None
    """pipekit name within a multi-token prediction depth k, outside its block -> Hugging Face
    name within `model.layers.{n_layers + k}` (DeepSeek-V3's layout: the block's tensors are
    named as a layer's, beside them the depth's norms and projection and copies of the shared
    embedding and output layer); None: the architecture has no MTP layers."""

    def hf_names(self, name: str, args: DecoderArgs) -> list[str]:
        """Hugging Face names of pipekit parameter `name`: one per expert for an expert
        weight (expert j's at index j), else one."""
        if name in TOP_LEVEL_NAMES:
            return [TOP_LEVEL_NAMES[name]]
        mtp = _MTP.fullmatch(name)
        if mtp is not None:
            return self._mtp_hf_names(args.n_layers + int(mtp[1]), mtp[2], args)
        match = _LAYER.fullmatch(name)
        if match is not None:
            layer, rest = match[1], match[2]
            if rest in self.layer_names:
                return [f"model.layers.{layer}.{self.layer_names[rest]}"]
            custom = self.custom_tensor(name)
            if custom is not None:
                return [f"model.layers.{layer}.{custom[0].hf_name}"]
            moe_param = rest.removeprefix("feed_forward.")
            if self.moe_block is not None and isinstance(args, MoEFields):
                prefix = f"model.layers.{layer}.{self.moe_block}"
                if moe_param == _ROUTER:
                    return [f"{prefix}.gate.weight"]
                if moe_param in EXPERT_WEIGHTS:
                    short = self.expert_names[EXPERT_WEIGHTS[moe_param]]
                    return [
                        f"{prefix}.experts.{j}.{short}.weight" for j in range(args.moe.num_experts)
                    ]
        raise ValueError(
            f"{name!r} is not a parameter of a {self.model_type.pipekit_model} in Hugging Face "
            f"{self.model_type.model_type} layout"
        )

    def _mtp_hf_names(self, layer: int, rest: str, args: DecoderArgs) -> list[str]:
        """Hugging Face names of `rest` of the MTP depth stored as layer `layer`."""
        if self.mtp_names is None:
            raise ValueError(
                f"mtp_depth={args.mtp_depth}, but Hugging Face's {self.model_type.model_type} "
                "layout has no multi-token prediction layers; set mtp_depth = 0 or keep the "
                "model in pipekit's DCP checkpoints"
            )
        if rest.startswith(_MTP_BLOCK):
            return self.hf_names(f"layers.{layer}.{rest.removeprefix(_MTP_BLOCK)}", args)
        if rest in self.mtp_names:
            return [f"model.layers.{layer}.{self.mtp_names[rest]}"]
        raise ValueError(f"mtp {rest!r} has no name in the {self.model_type.model_type} layout")

    def mtp_copies(self, args: DecoderArgs) -> dict[str, str]:
        """Hugging Face name of each copy of the shared embedding and output layer that the
        MTP layers hold -> the Hugging Face name of what it copies."""
        if self.mtp_names is None:
            return {}
        copied = {"tok_embeddings.weight": _EMBEDDING, "output.weight": _TIED_HEAD}
        if args.tie_embeddings:
            copied["output.weight"] = _EMBEDDING
        return {
            f"model.layers.{args.n_layers + k}.{hf}": copied[param]
            for k in range(args.mtp_depth)
            for hf, param in _MTP_SHARED.items()
        }

    def custom_tensor(self, name: str) -> tuple[CustomLayerTensor, list[str]] | None:
        """The custom tensor holding parameter `name` and its parameters' full names; None
        if no custom tensor holds it."""
        match = _LAYER.fullmatch(name)
        for tensor in self.custom if match is not None else ():
            if match[2] in tensor.params:
                return tensor, [f"layers.{match[1]}.{param}" for param in tensor.params]
        return None

    def is_buffer(self, name: str) -> bool:
        """Whether `name` is a buffer the checkpoint holds."""
        return _within_block(name) in self.buffers

    def is_permuted(self, name: str) -> bool:
        """Whether parameter `name` has its rows reordered per head."""
        return _within_block(name) in self.rope_permuted

    @staticmethod
    def is_expert_weight(name: str) -> bool:
        return _within_block(name).removeprefix("feed_forward.") in EXPERT_WEIGHTS


@dataclass(frozen=True)
class DecoderHF:
    """One decoder family's Hugging Face format: tensor names, config.json, and its model."""

    layout: DecoderLayout
    build: Callable[[Any], nn.Module]
    """Model args -> pipekit model (built on the meta device to list the parameters)."""
    config_to_args: Callable[[Mapping[str, Any], str], Any]
    """(config.json object, its path for messages) -> model args; CheckpointError if the file
    describes a model the family cannot compute."""
    args_to_config: Callable[[Any, torch.dtype], dict[str, Any]]
    """(model args, weight dtype) -> config.json object (published dialect)."""
    check_layout: Callable[[Any], None] | None = None
    """ValueError (naming the fix) for args this format cannot express."""
    training_fields: tuple[str, ...] = ("max_seq_len",)
    """Args fields a checkpoint need not match: training choices, not what the weights compute."""

    # -- config.json -------------------------------------------------------------------------

    def read_args(self, directory: str | os.PathLike[str]) -> Any:
        """The model args `directory/config.json` describes, with errors naming the file."""
        config, source = read_config_json(directory)
        args = self.config_to_args(config, source)
        if getattr(args, "mtp_depth", 0) and not _has_layer(directory, args.n_layers):
            # transformers writes the MTP depth into config.json but drops its layers
            logger.warning(
                "%s: %s says %d multi-token prediction layer(s), but no model.layers.%d tensor "
                "is in the checkpoint; loading the main model alone", directory, CONFIG_FILE,
                args.mtp_depth, args.n_layers,
            )  # fmt: skip
            args = args.with_updates(mtp_depth=0)
        return args

    def comparable(self, args: Any) -> dict[str, object]:
        """What the weights compute, from `args` (defaults resolved, training choices out)."""
        values = {f.name: getattr(args, f.name) for f in fields(args)}
        values |= {"n_kv_heads": args.num_kv_heads, "head_dim": args.per_head_dim}
        if isinstance(args, MoEFields):
            moe = values.pop("moe")
            values |= {
                "moe.num_experts": moe.num_experts,
                "moe.top_k": moe.top_k,
                "moe.router": moe.router,
                "moe.num_shared_experts": moe.num_shared_experts,
                "expert_ffn_dim": args.moe_ffn_dim,
            }
            # a group-limited router's options compute the routing; its bias step trains it
            options = moe.router_options().items()
            values |= {f"moe.{k}": v for k, v in options if k != "bias_update_rate"}
            if all(args.is_moe_layer(layer) for layer in range(args.n_layers)):
                del values["ffn_dim"]  # no dense FFN left to size
        return {key: value for key, value in values.items() if key not in self.training_fields}

    def check_config(self, directory: str | os.PathLike[str], args: Any) -> None:
        """CheckpointError unless `directory/config.json` describes a model of `args`."""
        theirs, ours = self.comparable(self.read_args(directory)), self.comparable(args)
        differences = [
            f"{key}: checkpoint {theirs[key]!r}, model {ours[key]!r}"
            for key in theirs
            if theirs[key] != ours.get(key)
        ]
        if differences:
            raise CheckpointError(
                f"{os.path.join(directory, CONFIG_FILE)} does not match the model's "
                f"{type(args).__name__}: {'; '.join(differences)}; build the model from the "
                "checkpoint's config.json or load a checkpoint of this shape"
            )

    # -- tensors -----------------------------------------------------------------------------

    def tensors(self, args: Any) -> list[HFTensor]:
        """Every tensor of the checkpoint of a model with `args`, in model order (a tied
        `lm_head.weight` left out, as transformers does)."""
        if self.check_layout is not None:
            self.check_layout(args)
        with torch.device("meta"):
            model = self.build(args)
        listing = []
        for name, param in self._checkpoint_tensors(model).items():
            if args.tie_embeddings and name == "output.weight":
                continue
            hf_names = self.layout.hf_names(name, args)
            shape = tuple(param.shape)
            custom = self.layout.custom_tensor(name)
            if custom is not None:  # listed once, under its first parameter
                if name == custom[1][0]:
                    listing.append(HFTensor(hf_names[0], custom[0].hf_shape(shape), name, None))
            elif self.layout.is_expert_weight(name):
                listing += [HFTensor(hf, shape[1:], name, j) for j, hf in enumerate(hf_names)]
            else:
                listing.append(HFTensor(hf_names[0], shape, name, None))
        shapes = {entry.hf_name: (entry.hf_shape, entry.param_name) for entry in listing}
        for copy_name, copied in self.layout.mtp_copies(args).items():
            listing.append(HFTensor(copy_name, *shapes[copied], None))
        return listing

    def to_hf(self, name: str, tensor: torch.Tensor, args: Any) -> torch.Tensor:
        """Parameter `name` (one expert's slice for an expert weight) in Hugging Face order."""
        custom = self.layout.custom_tensor(name)
        if custom is not None:  # built from all its parameters (`save` passes them together)
            raise ValueError(f"{name} is part of {custom[0].hf_name}; build it with its to_hf")
        return permute_to_hf(tensor, args.per_head_dim) if self.layout.is_permuted(name) else tensor

    def source_name(self, name: str, args: Any) -> str:
        """The checkpoint tensor holding non-expert parameter `name` (a tied output reads the
        embedding)."""
        if args.tie_embeddings and name == "output.weight":
            return _EMBEDDING
        return self.layout.hf_names(name, args)[0]

    def source(self, checkpoint: SafetensorsCheckpoint, name: str, args: Any) -> BlockSource:
        """Parameter `name` as a block source over `checkpoint`, in pipekit's layout: an expert
        weight stacks its experts' tensors, a permuted weight reads whole heads and reorders
        them, a tied output reads the embedding, a custom tensor gives its own source."""
        custom = self.layout.custom_tensor(name)
        if custom is not None:
            hf_name = self.layout.hf_names(name, args)[0]
            return custom[0].source(checkpoint, hf_name, custom[1].index(name))
        if self.layout.is_expert_weight(name):
            hf_names = self.layout.hf_names(name, args)
            return StackedBlocks([CheckpointBlock(checkpoint, hf) for hf in hf_names])
        source = self.source_name(name, args)
        if not self.layout.is_permuted(name):
            return CheckpointBlock(checkpoint, source)
        head_rows = torch.arange(args.per_head_dim)
        return CheckpointBlock(
            checkpoint, source, row_order=permute_from_hf(head_rows, args.per_head_dim).tolist()
        )

    def check_checkpoint(self, checkpoint: SafetensorsCheckpoint, args: Any) -> None:
        """CheckpointError unless `checkpoint` holds a model of `args`: its config.json and
        every tensor's name, shape and float dtype (from the file headers; no data read unless
        tied). A float dtype other than the model's is cast on load."""
        self.check_config(checkpoint.directory, args)
        expected = {entry.hf_name: entry.hf_shape for entry in self.tensors(args)}
        present = {name for name in checkpoint.names if not name.endswith(_IGNORED_HF_SUFFIX)}
        tied_head = args.tie_embeddings and _TIED_HEAD in present
        if tied_head:
            expected[_TIED_HEAD] = expected[_EMBEDDING]
        infos = {name: checkpoint.info(name) for name in present}
        problems = name_and_shape_problems(
            {name: info.shape for name, info in infos.items()}, expected
        )
        if problems:
            raise CheckpointError(f"{checkpoint.directory} does not fit the model: {problems}")
        not_float = [
            f"{name} ({str(info.dtype).removeprefix('torch.')})"
            for name, info in sorted(infos.items())
            if not info.dtype.is_floating_point
        ]
        if not_float:
            raise CheckpointError(
                f"{checkpoint.directory}: tensors with integer or bool data where the model "
                f"has float weights ({len(not_float)}): {', '.join(not_float[:5])}; the files "
                "are not this model's weights (re-export them in a float dtype)"
            )
        for copy_name, copied in self.layout.mtp_copies(args).items():
            if not torch.equal(checkpoint.read(copy_name), checkpoint.read(copied)):
                raise CheckpointError(
                    f"{checkpoint.directory}: {copy_name} differs from {copied}, but pipekit's "
                    "multi-token prediction shares the main model's embedding and output layer; "
                    "copy the main tensor over it, or set num_nextn_predict_layers = 0 in "
                    "config.json to load the main model alone"
                )
        if tied_head and not torch.equal(checkpoint.read(_TIED_HEAD), checkpoint.read(_EMBEDDING)):
            raise CheckpointError(
                f"{checkpoint.directory}: config.json says tie_word_embeddings=true but "
                "lm_head.weight differs from model.embed_tokens.weight; set "
                "tie_word_embeddings=false in config.json if the checkpoint really has a "
                "separate output layer"
            )

    # -- load and save -----------------------------------------------------------------------

    def load(
        self,
        directory: str | os.PathLike[str],
        model: nn.Module,
        args: Any,
        *,
        row_shards: Mapping[str, RowShard] | None = None,
        read_log: list[TensorRead] | None = None,
    ) -> None:
        """Copy a checkpoint into `model` (laid out as `args`), in the model's dtype. A sharded
        model (FSDP2, expert parallel, a pipeline stage, vocabulary rows named in
        `row_shards`) reads only the blocks this rank holds (appended to `read_log` when
        given). Everything is checked before the first parameter is written, so a failed load
        leaves the model untouched."""
        if self.check_layout is not None:
            self.check_layout(args)
        params = self._parameters_matching(model, args, row_shards)
        if any(local_tensor(param).is_meta for param in params.values()):
            raise ValueError(
                "the model's parameters are on the meta device; call model.to_empty(device=...) "
                "before loading"
            )
        with SafetensorsCheckpoint(directory, read_log=read_log) as checkpoint:
            self.check_checkpoint(checkpoint, args)
            sources = {name: self.source(checkpoint, name, args) for name in params}
            fill = fill_from_sources(sources)
            load_local_blocks(model, fill, row_shards)
            for name, buffer in params.items():  # load_local_blocks fills the parameters
                if self.layout.is_buffer(name):
                    fill(name, global_block(buffer), local_tensor(buffer))

    def save(
        self,
        model: nn.Module,
        args: Any,
        directory: str | os.PathLike[str],
        *,
        row_shards: Mapping[str, RowShard] | None = None,
        max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
        overwrite: bool = False,
    ) -> None:
        """Write `model` with its config.json, atomically. The model may be whole or this
        rank's part of any layout (FSDP2 / expert-parallel shards, pipeline stages,
        vocabulary rows named in `row_shards`): then every rank calls `save`, and each writes
        about 1/world of the tensors, none gathering the model. Tensors keep the model's dtype,
        so save -> load is bit-exact."""
        if self.check_layout is not None:
            self.check_layout(args)
        params = self._parameters_matching(model, args, row_shards)
        embedding, output = params.get("tok_embeddings.weight"), params.get("output.weight")
        both_whole = all(
            param is not None and not isinstance(param, DTensor) for param in (embedding, output)
        )
        if (
            args.tie_embeddings
            and both_whole
            and not (output is embedding or torch.equal(output, embedding))
        ):
            raise ValueError(
                "args.tie_embeddings=True but the model's output.weight differs from "
                "tok_embeddings.weight; saving would drop it. Tie them or set "
                "tie_embeddings=False"
            )
        dtype = next(iter(params.values())).dtype
        config = self.args_to_config(args, dtype)
        entries = self.tensors(args)
        customs = {entry.hf_name: self.layout.custom_tensor(entry.param_name) for entry in entries}
        fused = {name: FusedTensor(tuple(c[1]), c[0].to_hf) for name, c in customs.items() if c}
        save_hf_sharded(
            model,
            entries,
            lambda name, tensor: self.to_hf(name, tensor, args),
            directory,
            extra_files={CONFIG_FILE: json.dumps(config, indent=2) + "\n"},
            row_shards=row_shards,
            max_shard_bytes=max_shard_bytes,
            overwrite=overwrite,
            buffers={name: t for name, t in params.items() if self.layout.is_buffer(name)},
            fused=fused,
        )

    def build_from_checkpoint(
        self, directory: str | os.PathLike[str], *, device: torch.device | str = "cpu"
    ) -> tuple[nn.Module, Any]:
        """A float32 pipekit model holding the checkpoint in `directory`: (model, its args)."""
        args = self.read_args(directory)
        with torch.device("meta"):
            model = self.build(args)
        to_empty_keeping_ties(model, device)
        self.load(directory, model, args)
        return model, args

    def adapter(self) -> HuggingFaceAdapter:
        """This format as the model contract's Hugging Face hooks."""
        return HuggingFaceAdapter(
            model_types=(self.layout.model_type.model_type,),
            read_args=self.read_args,
            load=self.load,
            save=functools.partial(self.save, overwrite=True),
            check_layout=self.check_layout,
            tensors=self.tensors,
            config=self.args_to_config,
            build_from_checkpoint=self.build_from_checkpoint,
        )

    def _checkpoint_tensors(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """The model's parameters (tied ones under both names) and the buffers the layout
        names: what its checkpoint holds."""
        tensors: dict[str, torch.Tensor] = dict(model.named_parameters(remove_duplicate=False))
        buffers = model.named_buffers()
        return tensors | {name: buf for name, buf in buffers if self.layout.is_buffer(name)}

    def _parameters_matching(
        self, model: nn.Module, args: Any, row_shards: Mapping[str, RowShard] | None = None
    ) -> dict[str, torch.Tensor]:
        """The model's checkpoint tensors (`_checkpoint_tensors`), checked against those a
        model of `args` has. A model that holds only some modules (a pipeline stage) is
        checked, and loaded, for those; a parameter in `row_shards` for its rows."""
        params = self._checkpoint_tensors(model)
        with torch.device("meta"):
            full = self._checkpoint_tensors(self.build(args))
        expected = {name: tuple(param.shape) for name, param in full.items() if _holds(model, name)}
        for name, shard in (row_shards or {}).items():
            if name in expected and name in params and expected[name][0] == shard.rows:
                expected[name] = (params[name].shape[0], *expected[name][1:])
        problems = name_and_shape_problems(
            {name: tuple(param.shape) for name, param in params.items()}, expected
        )
        if problems:
            raise ValueError(
                f"the model does not have the parameters its {type(args).__name__} imply: "
                f"{problems}"
            )
        return params


def _has_layer(directory: str | os.PathLike[str], layer: int) -> bool:
    """Whether the safetensors checkpoint in `directory` holds a tensor of `model.layers.L`
    (False without safetensors files: a config alone)."""
    if not any(Path(directory).glob("*.safetensors")):
        return False
    with SafetensorsCheckpoint(directory) as checkpoint:
        return any(name.startswith(f"model.layers.{layer}.") for name in checkpoint.names)


def _within_block(name: str) -> str:
    """`name` within its block (of `layers`, or an MTP depth's), or "" outside blocks."""
    match = _LAYER.fullmatch(name)
    if match is not None:
        return match[2]
    mtp = _MTP.fullmatch(name)
    if mtp is not None and mtp[2].startswith(_MTP_BLOCK):
        return mtp[2].removeprefix(_MTP_BLOCK)
    return ""


def _holds(model: nn.Module, name: str) -> bool:
    """Whether `model` holds the module of parameter `name` (a top-level module, or one block of
    `layers`)."""
    top, _, rest = name.partition(".")
    module = getattr(model, top, None)
    if module is None or top != "layers":
        return module is not None
    return rest.partition(".")[0] in module
