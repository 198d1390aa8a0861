"""Upcycling a Hugging Face Llama checkpoint into pipekit's Llama-MoE (Llama 3 meets MoE, §3.1).

The chosen layers' FFNs become `spec.num_experts` copies (in `spec.granularity` pieces each), the
router is drawn fresh, and every other weight is the dense one, read through the Llama adapter's
names and RoPE row order. The result is a `LlamaMoEArgs` and a `BlockSource` per parameter; see
`pipekit.checkpoint.upcycle` for how the sources read only the blocks asked for.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import Any

import torch

from models.llama.args import LlamaArgs
from models.llama.hf_config import read_hf_llama_args
from models.llama.state_dict_adapter import (
    check_hf_llama_checkpoint,
    hf_source_name,
    permute_from_hf,
    rope_permuted,
    to_hf_tensor,
)
from models.llama_moe.args import LlamaMoEArgs
from models.llama_moe.hf_mixtral import (
    EXPERT_WEIGHTS,
    MixtralTensor,
    args_to_mixtral_config,
    check_mixtral_compatible,
    mixtral_tensor_layout,
)
from models.llama_moe.model import LlamaMoE
from pipekit.checkpoint.safetensors_io import PendingTensor, SafetensorsCheckpoint, TensorRead
from pipekit.checkpoint.upcycle import (
    BlockSource,
    CheckpointBlock,
    ExpertCopies,
    RouterInit,
    Upcycler,
    UpcycleSpec,
    upcycle_into,
)
from pipekit.moe import MoEArgs

__all__ = [
    "LLAMA_UPCYCLER",
    "mixtral_layout",
    "upcycle_llama",
    "upcycle_sources",
    "upcycled_args",
]

_ROUTERS_KEEPING_OR_ABLATING = ("topk_softmax", "softmax_topk")
# The hidden (F) dim of each dense FFN weight: gate/up are [F, D], down is [D, F].
_HIDDEN_DIM = {"w1": 0, "w3": 0, "w2": 1}


def upcycled_args(dense: LlamaArgs, spec: UpcycleSpec) -> LlamaMoEArgs:
    """The Llama-MoE that `spec` makes of a dense Llama of shape `dense`."""
    if spec.router not in _ROUTERS_KEEPING_OR_ABLATING:
        raise ValueError(
            f"upcycling router={spec.router!r}: use topk_softmax (Mixtral; the first forward "
            "equals the dense model's) or softmax_topk (the paper's ablation)"
        )
    if spec.moe_every > dense.n_layers:
        raise ValueError(
            f"upcycling every {spec.moe_every}-th layer of a {dense.n_layers}-layer model makes "
            f"no layer MoE; choose moe_every <= {dense.n_layers}"
        )
    expert_ffn_dim = spec.expert_hidden_dim(dense.ffn_dim)
    return LlamaMoEArgs(
        **{field.name: getattr(dense, field.name) for field in fields(LlamaArgs)},
        moe=MoEArgs(
            num_experts=spec.total_experts,
            top_k=spec.routed_experts,
            router=spec.router,
            capacity_factor=spec.capacity_factor,
            router_init_std=spec.router_init_std,
        ),
        moe_every=spec.moe_every,
        expert_ffn_dim=None if expert_ffn_dim == dense.ffn_dim else expert_ffn_dim,
    )


def upcycle_sources(
    checkpoint: SafetensorsCheckpoint, args: LlamaMoEArgs, spec: UpcycleSpec, seed: int
) -> dict[str, BlockSource]:
    """A source for every parameter of `LlamaMoE(args)` (tied output under its own name too).

    The dense checkpoint is checked (config and every tensor's name and shape) first.
    """
    dense = LlamaArgs(**{field.name: getattr(args, field.name) for field in fields(LlamaArgs)})
    check_hf_llama_checkpoint(checkpoint, dense)
    with torch.device("meta"):
        model = LlamaMoE(args)
    dtype = checkpoint.info(hf_source_name("tok_embeddings.weight", dense)).dtype
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
            dense_ffn = _dense_block(
                checkpoint, f"layers.{layer}.feed_forward.{weight}.weight", dense
            )
            scale = spec.granularity if weight == "w2" else 1  # the pieces' outputs sum to f
            sources[name] = ExpertCopies(
                dense_ffn, spec.num_experts, spec.granularity, _HIDDEN_DIM[weight], scale
            )
        else:
            sources[name] = _dense_block(checkpoint, name, dense)
    return sources


def _dense_block(checkpoint: SafetensorsCheckpoint, name: str, dense: LlamaArgs) -> CheckpointBlock:
    """Dense parameter `name` in pipekit's layout (wq/wk rows reordered per head)."""
    if not rope_permuted(name):
        return CheckpointBlock(checkpoint, hf_source_name(name, dense))
    return CheckpointBlock(
        checkpoint,
        hf_source_name(name, dense),
        row_group=dense.per_head_dim,
        row_transform=functools.partial(permute_from_hf, head_dim=dense.per_head_dim),
    )


def mixtral_layout(
    sources: Mapping[str, BlockSource], args: LlamaMoEArgs
) -> tuple[dict[str, PendingTensor], dict[str, Any]]:
    """The upcycled model's Mixtral checkpoint, each tensor produced from `sources` when written
    (an expert's block is that one expert) in its source's dtype, and its config.json."""
    check_mixtral_compatible(args)
    tensors = {}
    for entry in mixtral_tensor_layout(args):
        source = sources[entry.param_name]
        tensors[entry.hf_name] = PendingTensor(
            entry.hf_shape, source.dtype, functools.partial(_mixtral_tensor, source, entry, args)
        )
    return tensors, args_to_mixtral_config(args, sources["tok_embeddings.weight"].dtype)


def _mixtral_tensor(source: BlockSource, entry: MixtralTensor, args: LlamaMoEArgs) -> torch.Tensor:
    if entry.expert is None:
        return to_hf_tensor(entry.param_name, source.read_all(), args)
    index = (slice(entry.expert, entry.expert + 1), *(slice(0, n) for n in source.shape[1:]))
    return source.read(index)[0].clone()  # experts may share one dense block


LLAMA_UPCYCLER = Upcycler(
    moe_model="llama_moe",
    moe_args=upcycled_args,
    sources=upcycle_sources,
    check_dense=check_hf_llama_checkpoint,
    hf_layout=mixtral_layout,
)


def upcycle_llama(
    directory: str | os.PathLike[str],
    spec: UpcycleSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallelize: Callable[[LlamaMoE], object] | None = None,
    read_log: list[TensorRead] | None = None,
) -> tuple[LlamaMoE, LlamaMoEArgs]:
    """Online upcycling of a Hugging Face Llama directory into a `LlamaMoE` of `dtype`.

    The model is built on the meta device and handed to `parallelize` (expert parallelism,
    FSDP2, ...) before it has any storage, so each rank materialises and reads only its own
    blocks. Tied embeddings stay one parameter (re-tied after `to_empty`, which unties plain
    modules; FSDP2 keeps the tie itself).
    """
    args = upcycled_args(read_hf_llama_args(directory), spec)
    with torch.device("meta"):
        model = LlamaMoE(args).to(dtype)
    if parallelize is not None:
        parallelize(model)
    model.to_empty(device=device)
    model.tie_weights()
    upcycle_into(model, directory, LLAMA_UPCYCLER, args, spec, seed, read_log=read_log)
    return model, args
