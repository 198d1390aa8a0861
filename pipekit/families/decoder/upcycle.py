"""Upcycling a dense decoder checkpoint into its family's MoE form (Llama 3 meets MoE, §3.1).

The chosen layers' FFNs become `spec.num_experts` copies (in `spec.granularity` pieces each),
the router is drawn fresh, and every other weight is the dense one, read through the dense
format's names and RoPE row order. `decoder_upcycler(dense, moe, moe_model, moe_args_type)`
makes the `Upcycler` of one family (Llama -> Mixtral layout, Qwen3 -> Qwen3-MoE layout); see
`pipekit.checkpoint.upcycle` for how its sources read only the blocks asked for.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

import torch

from pipekit.checkpoint.block_sources import BlockSource
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint
from pipekit.checkpoint.safetensors_write import PendingTensor
from pipekit.checkpoint.upcycle import ExpertCopies, RouterInit
from pipekit.families.decoder.args import DecoderArgs, MoEFields
from pipekit.families.decoder.hf_layout import EXPERT_ACTIVATION, EXPERT_WEIGHTS, DecoderHF
from pipekit.models.spec import HFTensor
from pipekit.models.upcycling import Upcycler, UpcycleSpec
from pipekit.moe import MoEArgs

__all__ = ["decoder_upcycler"]

_ROUTERS_KEEPING_OR_ABLATING = ("topk_softmax", "softmax_topk")
# The hidden (F) dim of each dense FFN weight: gate/up are [F, D], down is [D, F].
_HIDDEN_DIM = {"w1": 0, "w3": 0, "w2": 1}


def _moe_args(dense: DecoderArgs, spec: UpcycleSpec, *, moe_args_type: type) -> Any:
    """The MoE args that `spec` makes of a dense decoder of shape `dense`."""
    if spec.router not in _ROUTERS_KEEPING_OR_ABLATING:
        raise ValueError(
            f"upcycling router={spec.router!r}: use topk_softmax (the first forward equals the "
            "dense model's) or softmax_topk (the paper's ablation)"
        )
    if spec.moe_every > dense.n_layers:
        raise ValueError(
            f"upcycling every {spec.moe_every}-th layer of a {dense.n_layers}-layer model makes "
            f"no layer MoE; choose moe_every <= {dense.n_layers}"
        )
    expert_ffn_dim = spec.expert_hidden_dim(dense.ffn_dim)
    return moe_args_type(
        **{field.name: getattr(dense, field.name) for field in fields(dense)},
        moe=MoEArgs(
            num_experts=spec.total_experts,
            top_k=spec.routed_experts,
            router=spec.router,
            capacity_factor=spec.capacity_factor,
            router_init_std=spec.router_init_std,
            activation=EXPERT_ACTIVATION,  # copies of the dense SwiGLU FFN
        ),
        moe_every=spec.moe_every,
        expert_ffn_dim=None if expert_ffn_dim == dense.ffn_dim else expert_ffn_dim,
    )


def _dense_args(args: MoEFields, dense_args_type: type) -> DecoderArgs:
    return dense_args_type(
        **{field.name: getattr(args, field.name) for field in fields(dense_args_type)}
    )


def _sources(
    checkpoint: SafetensorsCheckpoint,
    args: Any,
    spec: UpcycleSpec,
    seed: int,
    *,
    dense_hf: DecoderHF,
    moe_hf: DecoderHF,
    dense_args_type: type,
) -> dict[str, BlockSource]:
    """A source for every parameter of the MoE model of `args` (a tied output under its own
    name too). The args' experts, then the dense checkpoint (config, every tensor's name and
    shape) are checked first."""
    if args.moe.activation != EXPERT_ACTIVATION:
        raise ValueError(
            f"upcycling into moe.activation={args.moe.activation!r} experts: each expert is a "
            f"copy of the dense SwiGLU FFN; use activation={EXPERT_ACTIVATION!r} (the upcycler's "
            "moe_args give it)"
        )
    if args.moe.expert_biases or args.moe.router_bias:
        raise ValueError(
            "upcycling into experts or a router with biases: a dense FFN has none to copy; set "
            "moe.expert_biases = moe.router_bias = false (the upcycler's moe_args do)"
        )
    dense = _dense_args(args, dense_args_type)
    dense_hf.check_checkpoint(checkpoint, dense)
    with torch.device("meta"):
        model = moe_hf.build(args)
    dtype = checkpoint.info(dense_hf.source_name("tok_embeddings.weight", dense)).dtype
    sources: dict[str, BlockSource] = {}
    for name, _ in model.named_parameters(remove_duplicate=False):
        layer, _, rest = name.removeprefix("layers.").partition(".feed_forward.")
        if rest == "router.gate.weight":
            sources[name] = RouterInit(
                name,
                spec.num_experts,
                spec.granularity,
                args.dim,
                spec.router_init_std,
                seed,
                dtype,
            )
        elif rest in EXPERT_WEIGHTS:
            weight = EXPERT_WEIGHTS[rest]
            dense_ffn = dense_hf.source(
                checkpoint, f"layers.{layer}.feed_forward.{weight}.weight", dense
            )
            scale = spec.granularity if weight == "w2" else 1  # the pieces' outputs sum to f
            sources[name] = ExpertCopies(
                dense_ffn, spec.num_experts, spec.granularity, _HIDDEN_DIM[weight], scale
            )
        else:
            sources[name] = dense_hf.source(checkpoint, name, dense)
    return sources


def _hf_layout(
    sources: Mapping[str, BlockSource], args: Any, *, moe_hf: DecoderHF
) -> tuple[dict[str, PendingTensor], dict[str, Any]]:
    """The upcycled model's checkpoint in the MoE format, each tensor produced from `sources`
    when written (an expert's block is that one expert) in its source's dtype, and its
    config.json."""
    tensors = {}
    for entry in moe_hf.tensors(args):
        source = sources[entry.param_name]
        tensors[entry.hf_name] = PendingTensor(
            entry.hf_shape,
            source.dtype,
            functools.partial(_hf_tensor, source, entry, args, moe_hf),
        )
    return tensors, moe_hf.args_to_config(args, sources["tok_embeddings.weight"].dtype)


def _hf_tensor(source: BlockSource, entry: HFTensor, args: Any, moe_hf: DecoderHF) -> torch.Tensor:
    if entry.expert is None:
        return moe_hf.to_hf(entry.param_name, source.read_all(), args)
    index = (slice(entry.expert, entry.expert + 1), *(slice(0, n) for n in source.shape[1:]))
    return source.read(index)[0].clone()  # experts may share one dense block


def decoder_upcycler(
    dense_hf: DecoderHF,
    moe_hf: DecoderHF,
    moe_model: str,
    dense_args_type: type,
    moe_args_type: type,
) -> Upcycler:
    """How a dense decoder family (args `dense_args_type`, checkpoints in `dense_hf`'s format)
    becomes the MoE family registered as `moe_model` (args `moe_args_type`, a `MoEFields`
    form of the dense args, checkpoints in `moe_hf`'s format)."""
    return Upcycler(
        moe_model=moe_model,
        moe_args=functools.partial(_moe_args, moe_args_type=moe_args_type),
        sources=functools.partial(
            _sources, dense_hf=dense_hf, moe_hf=moe_hf, dense_args_type=dense_args_type
        ),
        check_dense=dense_hf.check_checkpoint,
        hf_layout=functools.partial(_hf_layout, moe_hf=moe_hf),
    )
