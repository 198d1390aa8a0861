"""Tensor (and sequence) parallelism, applied from outside the model with the family's plan.

`apply_tensor_parallel(model, tp_mesh, spec)` runs `parallelize_module` on every transformer
block with the plan its family gives (`ModelSpec.tensor_parallel_plan`), on the meta device,
before data parallelism (on a pipeline stage's module too; attention sees a rank's heads, so
context parallelism composes): FSDP2 then shards the tensor-parallel DTensors over its own dims (a
2-D `dp x tp` layout) and everything else as usual. Each tensor-parallel rank computes the
whole loss from the same batch, so the trainer counts a step's tokens and loss once per
tensor-parallel group. `check_tensor_parallel` names what a model's shape does not allow
before any process group exists.

Sequence parallelism (on by default, as Megatron pairs it with tensor parallelism) keeps the
residual stream between blocks sharded on the sequence, a DTensor `Shard(1)` over the tp ranks:
the first block's input is split into the ranks' tokens (no communication; its gradient is
all-gathered), so whatever a model adds to its embedding (learned positions, a scale) runs
whole as without tp; the modules after the blocks (the final norm, position-wise) run on a rank's
tokens, and the output layer's input is all-gathered. A pipeline stage without the embedding
takes a rank's tokens `[B, S/tp, D]` and one without the output layer returns them: the
messages between stages shrink by tp.

The embedding is split by vocabulary rows (`RowwiseParallel`, partial embeddings all-reduced).
Loss parallelism (on by default) splits the output layer by vocabulary rows too
(`ColwiseParallel`) and leaves its logits sharded on the vocabulary: the cross-entropy runs on
the shards under torch's `loss_parallel()` (a max and a sum all-reduced per token), so no rank
holds a whole `[B, S, V]` logits tensor. The trainer runs forward and backward inside that
context. Tied embeddings are split alike under loss parallelism, and whole without.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from pipekit.layers.head_values import HeadValues
from pipekit.models.spec import ModelShape, ModelSpec

__all__ = ["apply_tensor_parallel", "check_sequence_parallel_split", "check_tensor_parallel"]


def check_sequence_parallel_split(seq_len: int, tp: int, cp: int = 1, num_slices: int = 1) -> None:
    """ValueError unless each tp rank can hold an equal run of every slice's tokens on a cp rank
    (the one rule of sequence parallelism, inside pipelines and outside)."""
    parts = tp * cp * num_slices
    if seq_len % parts:
        raise ValueError(
            f"sequence_parallel = true with tp={tp}: training.seq_len={seq_len} must be a "
            f"multiple of tp x cp x num_slices = {parts} (each tp rank holds an equal run of "
            "every slice's tokens on a cp rank); choose seq_len, tp, cp or num_slices to fit, "
            "or sequence_parallel = false"
        )


def check_tensor_parallel(
    spec: ModelSpec, shape: ModelShape, tp: int, moe: bool, sequence_parallel: bool = True
) -> None:
    """ValueError (naming the fix) unless `tp` ranks can split the model's heads and layers."""
    if moe and not sequence_parallel:
        raise ValueError(
            f"tp={tp} with a mixture-of-experts model needs sequence_parallel = true: each tp "
            "rank routes its own tokens to the experts (expert-TP 1); set sequence_parallel = "
            "true or tp = 1"
        )
    if spec.tensor_parallel_plan is None:
        raise ValueError(
            f"tp={tp}: model {spec.name!r} has no tensor-parallel plan; set tp = 1 (a family "
            "gives one as ModelSpec.tensor_parallel_plan)"
        )
    problems = [
        f"{name}={value}"
        for name, value in (("n_heads", shape.num_heads), ("n_kv_heads", shape.num_kv_heads))
        if value % tp
    ]
    if problems:
        raise ValueError(
            f"tp={tp} must divide the model's heads ({', '.join(problems)}): every rank holds "
            "whole query heads with their key/value heads; choose tp among their common divisors"
        )


def _split_per_head(block: nn.Module, tp_mesh: DeviceMesh) -> None:
    """What a block holds per query head, split with the heads: each a DTensor sharded on its
    head dim, as the column-split query projection's heads are. Attention sinks (one logit
    per head, `*.sinks`) and every `HeadValues` (a score bias's per-head values: ALiBi's
    slopes, a head's global index), so each rank's attention reads its own heads' values."""
    for name, sinks in list(block.named_parameters()):
        if name.endswith(".sinks") and not isinstance(sinks, DTensor):
            owner = block.get_submodule(name.removesuffix(".sinks"))
            split = distribute_tensor(sinks.data, tp_mesh, [Shard(0)])
            owner.register_parameter("sinks", nn.Parameter(split, sinks.requires_grad))
    for module in block.modules():
        if isinstance(module, HeadValues) and not isinstance(module.values_H, DTensor):
            values = distribute_tensor(module.values_H, tp_mesh, [Shard(0)], src_data_rank=None)
            module.register_buffer("values_H", values, persistent=False)


def apply_tensor_parallel(
    model: nn.Module,
    tp_mesh: DeviceMesh,
    spec: ModelSpec,
    *,
    sequence_parallel: bool = True,
    loss_parallel: bool = False,
    tied_embeddings: bool = False,
) -> nn.Module:
    """Split every transformer block of `model` (the whole model or a pipeline stage) over
    `tp_mesh` by the family's plan, the residual stream over the sequence too with
    `sequence_parallel`, the embedding by vocabulary rows, and the output layer too with
    `loss_parallel` (its logits a DTensor sharded on the vocabulary, for `torch.distributed.
    tensor.parallel.loss_parallel`). `tied_embeddings` (the model's, even where a pipeline
    stage holds one copy): both split with `loss_parallel`, both whole without, and a tie
    within `model` kept. Returns `model` (changed in place)."""
    assert spec.tensor_parallel_plan is not None  # check_tensor_parallel
    for block in spec.structure.blocks_of(model):
        plan = spec.tensor_parallel_plan(block, sequence_parallel)
        parallelize_module(block, tp_mesh, dict(plan))
        _split_per_head(block, tp_mesh)
    boundaries = _residual_stream_plan(model, tp_mesh, spec, sequence_parallel)
    embedding, output = (getattr(model, name, None) for name in spec.structure.vocabulary_modules)
    tied = embedding is not None and output is not None and embedding.weight is output.weight
    if embedding is not None and (loss_parallel or not tied_embeddings):
        # each rank looks up the tokens of its rows; the partial embeddings are all-reduced
        boundaries[spec.structure.embedding] = RowwiseParallel(
            input_layouts=Replicate(), output_layouts=Replicate()
        )
    if loss_parallel and output is not None:
        boundaries[spec.structure.output] = ColwiseParallel(
            input_layouts=Shard(1) if sequence_parallel else Replicate(),
            output_layouts=Shard(-1),
            use_local_output=False,
        )
    if boundaries:
        parallelize_module(model, tp_mesh, boundaries)
    if embedding is not None and spec.structure.embedding in boundaries:
        embedding.register_forward_pre_hook(_GradientAsPlaced())
    if tied:
        assert embedding is not None and output is not None
        _keep_tie(embedding, output)
    return model


class _GradientAsPlaced:
    """Forward pre-hook of a vocabulary-split embedding. DTensor's embedding backward returns
    its weight's gradient replicated (each rank scatters its tokens' gradients into all rows);
    this keeps the rank's rows, as the weight is placed (a local slice, no communication), so
    optimizers, clipping and tied copies see the weight's layout and no rank keeps a whole
    `[V, D]` gradient. The gradient hook goes on the weight the forward uses: materialization
    and FSDP2 replace the parameter object after `apply_tensor_parallel`."""

    def __init__(self) -> None:
        self.hooked: weakref.ref | None = None

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> None:
        weight = module.weight
        if not isinstance(weight, DTensor) or not weight.requires_grad:
            return
        if self.hooked is not None and self.hooked() is weight:
            return
        mesh, placements = weight.device_mesh, weight.placements

        def as_placed(grad: DTensor) -> DTensor:
            same = grad.placements == placements
            return grad if same else grad.redistribute(mesh, placements)

        weight.register_hook(as_placed)
        self.hooked = weakref.ref(weight)


def _keep_tie(embedding: nn.Module, output: nn.Module) -> None:
    """parallelize_module gave each of the tied modules a DTensor of its own: share one again
    (both are whole, or both split by vocabulary rows)."""
    output.weight = embedding.weight


def _residual_stream_plan(
    model: nn.Module, tp_mesh: DeviceMesh, spec: ModelSpec, sequence_parallel: bool
) -> dict[str, Any]:
    """The sequence-parallel boundaries outside the blocks (see the module docstring): the
    styles to apply, after registering a pipeline stage's hooks."""
    if not sequence_parallel:
        return {}
    structure = spec.structure
    plan: dict[str, Any] = {
        name: SequenceParallel()
        for name in structure.after_blocks
        if getattr(model, name, None) is not None
    }
    blocks = structure.blocks_of(model)
    if getattr(model, structure.embedding, None) is None:  # its input is this rank's tokens
        model.register_forward_pre_hook(_SequenceShardInput(tp_mesh))
        for name in structure.before_blocks:  # vocabulary parallelism's first stage: the
            if getattr(model, name, None) is not None:  # positions it adds, split alike
                plan[name] = PrepareModuleOutput(
                    output_layouts=Replicate(), desired_output_layouts=Shard(1),
                    use_local_output=False,
                )  # fmt: skip
    elif blocks:  # whatever the model adds to the embedding (positions...) is added whole
        blocks[0].register_forward_pre_hook(_ShardSequence(tp_mesh))
    if getattr(model, structure.output, None) is not None:
        plan[structure.output] = PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
        )
    else:  # an earlier pipeline stage: it sends this rank's tokens
        model.register_forward_hook(_RankTokens(tp_mesh))
    return plan


def _shard_sequence(hidden: Tensor, tp_mesh: DeviceMesh) -> DTensor:
    """Whole hidden states, the same on every tp rank, as the DTensor sharded on the sequence
    (each rank keeps its run of tokens; the backward all-gathers the gradient)."""
    whole = DTensor.from_local(hidden, tp_mesh, [Replicate()], run_check=False)
    return whole.redistribute(tp_mesh, [Shard(1)])


class _ShardSequence:
    """Forward pre-hook of the first stage's first block: the residual stream, whole until
    then (embedding, learned positions, any scaling), enters the blocks sharded."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if isinstance(hidden, DTensor):
            return args
        return (_shard_sequence(hidden, self.tp_mesh), *args[1:])


class _SequenceShardInput:
    """Forward pre-hook: a stage's received hidden states `[B, S/tp, D]` become the DTensor
    `[B, S, D]` sharded on the sequence that its blocks take (token ids pass unchanged)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh

    def __call__(self, module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        hidden = args[0]
        if not hidden.is_floating_point() or isinstance(hidden, DTensor):
            return args
        sharded = DTensor.from_local(hidden, self.tp_mesh, [Shard(1)], run_check=False)
        return (sharded, *args[1:])


class _RankTokens:
    """Forward hook: a stage sends its rank's tokens, a plain tensor (from a stage without
    blocks, its rank's run of the whole embedding)."""

    def __init__(self, tp_mesh: DeviceMesh) -> None:
        self.tp_mesh = tp_mesh

    def __call__(self, module: nn.Module, args: Any, output: Tensor) -> Tensor:
        if not isinstance(output, DTensor):
            output = _shard_sequence(output, self.tp_mesh)
        return output.to_local()
