"""The `[parallelism]` rules that hold a layout against the model: degrees that fit the world
size, tensor parallelism that splits whole heads (and, for an MoE, only with sequence
parallelism), sequence and context parallelism that cut the sequence evenly, expert parallelism
that splits whole experts, multi-token prediction only where it runs whole; and each enabled
pipeline feature's own layout rules, from its entry in the feature table (vocabulary
parallelism's: pipeline ranks to split over, a model its row shards honour).

`check_parallel_layout` is the one place these run: job validation calls it for a config, and
`pipekit.testing`'s parity steps call it for the layout they are asked to build, so a layout the
trainer refuses is refused there too, with the same line, before any process group exists.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipekit.config.loader import ConfigError
from pipekit.pipelining.features.registry import (
    FeatureLayout,
    enabled_pipeline_features,
    get_pipeline_feature,
)

if TYPE_CHECKING:
    from torch import nn

    from pipekit.config.job_config import ParallelismConfig
    from pipekit.distributed.parallel_dims import ParallelDims
    from pipekit.models.spec import ModelSpec

__all__ = ["check_parallel_layout"]


def check_parallel_layout(
    parallelism: ParallelismConfig,
    world_size: int,
    spec: ModelSpec,
    args: Any,
    *,
    seq_len: int | None,
    model: str,
    meta_model: nn.Module | None = None,
    upcycling: bool = False,
) -> ParallelDims:
    """The degrees of `parallelism` on `world_size` ranks, checked against the model
    `spec.build(args)` (`meta_model`: that model already built on the meta device) and
    sequences of `seq_len` tokens (None: before any batch, the rules of the sequence's length
    left out); `model` names it in messages. ConfigError ("[parallelism] ...") for the first
    rule broken. Inside a pipeline the plan checks its slices by the same length rules."""
    import torch

    from pipekit.distributed.parallel_dims import ParallelDims

    try:
        dims = ParallelDims.from_config(parallelism, world_size)
    except ValueError as error:
        raise ConfigError(f"[parallelism] {error}") from None
    if meta_model is None:
        with torch.device("meta"):
            meta_model = spec.build(args)
    shape = spec.shape(args)
    try:
        _check_multi_token_prediction(parallelism, dims, spec, meta_model)
        if dims.tp > 1:
            _check_tensor_parallel(parallelism, seq_len, dims, spec, args)
        if dims.ep_enabled:
            _check_expert_parallel(meta_model, args, dims.ep, dims.etp, model)
    except ValueError as error:
        raise ConfigError(f"[parallelism] {error}") from None
    layout = FeatureLayout(parallelism, dims, spec, meta_model, shape, seq_len, upcycling)
    try:  # each pipeline feature's own rules of the layout and the model (its table entry)
        for name in enabled_pipeline_features(parallelism):
            get_pipeline_feature(name).check_layout(layout)
    except ValueError as error:
        raise ConfigError(f"[parallelism] {error}") from None
    return dims


def _check_multi_token_prediction(
    parallelism: ParallelismConfig, dims: ParallelDims, spec: ModelSpec, meta_model: nn.Module
) -> None:
    """Multi-token prediction runs beside the output layer, on whole sequences or on a
    pipeline's last stage: not split across context-parallel shards or tensor-parallel ranks,
    nor with the pipeline features that move the embedding, the output layer or attention."""
    present = [
        name
        for name in spec.structure.multi_token_prediction
        if getattr(meta_model, name, None) is not None
    ]
    split = [f"{dim}={getattr(dims, dim)}" for dim in ("cp", "tp") if getattr(dims, dim) > 1]
    if dims.pp > 1:
        split += [
            f"pipeline feature {name}"
            for name in enabled_pipeline_features(parallelism)
            if name != "context_parallel"
        ]
    if present and split:
        raise ValueError(
            f"{', '.join(split)} with multi-token prediction ({', '.join(present)}), which "
            "pipekit runs beside the output layer with data, expert and plain pipeline "
            "parallelism only; set mtp_depth = 0 or turn those off"
        )


def _check_tensor_parallel(
    parallelism: ParallelismConfig,
    seq_len: int | None,
    dims: ParallelDims,
    spec: ModelSpec,
    args: Any,
) -> None:
    """Whole heads per rank, sequence parallelism for an MoE, and (outside pipelines) a
    sequence that sequence parallelism cuts evenly."""
    from pipekit.distributed.tensor_parallel import (
        check_sequence_parallel_split,
        check_tensor_parallel,
    )

    moe = getattr(args, "moe", None) is not None
    check_tensor_parallel(spec, spec.shape(args), dims.tp, moe, parallelism.sequence_parallel)
    if parallelism.sequence_parallel and dims.pp == 1 and seq_len is not None:
        check_sequence_parallel_split(seq_len, dims.tp, dims.cp)


def _check_expert_parallel(meta_model: nn.Module, args: Any, ep: int, etp: int, model: str) -> None:
    from pipekit.moe.expert_parallel import check_expert_parallel, check_expert_tensor_parallel
    from pipekit.moe.experts import GroupedExperts

    check_expert_parallel(getattr(args, "moe", None), ep, model)
    if etp > 1:  # the experts' hidden dim and biases
        for experts in meta_model.modules():
            if isinstance(experts, GroupedExperts):
                check_expert_tensor_parallel(experts.w1_EFD.shape[1], experts.has_biases, etp)
