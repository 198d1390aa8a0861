"""Vocabulary parallelism across pipeline ranks: embedding, output layer and loss on every rank.

Without it the first stage holds the whole input embedding and the last stage the whole output
layer with its `[B, S, V]` logits, so the last rank runs out of memory first and stalls the
others while its vocabulary GEMM runs. With it each pipeline rank holds the rows
`[vocab_start, vocab_end)` of both matrices (split as DTensor's `Shard(0)` splits them):

- the input embedding, once per step: each rank looks up the ids it holds for every unit, and one
  `reduce` sums them onto the first stage's rank, which feeds them to stage 0. After the schedule
  one `broadcast` hands every rank the first stage's gradients of those embeddings, and each rank
  backpropagates them into its rows through a second lookup (a gather is cheaper than keeping
  the step's partial embeddings on every rank while the schedule runs).
- the output layer and loss, once per unit, on all ranks together (an output pass): the last
  stage's final hidden states go to every rank (`broadcast`), each rank computes its shard's
  logits (adding its rows of the output layer's bias, if the model's head has one) and the
  cross-entropy statistics (`vocab_parallel_cross_entropy`: two all-reduces), and at once the
  backward of its shard: its weight (and bias) gradient and its part of d loss / d hidden, which
  a `reduce` sums onto the last stage. The last stage's backward then starts from that gradient.
  The model's logits transforms (`ModelStructure.logits_transforms`, e.g. soft-capping) run on
  each shard's logits before the loss: they act on every logit alone, which is checked when the
  feature is built, so the sharded loss is the loss of the transformed logits.

Both modules are replaced by row shards, so they must be what the shards compute: a plain
`nn.Embedding` and a plain `nn.Linear` (`vocab_rules` refuses anything else, e.g. a parameter
the shards would not hold, rather than drop it).

With tensor parallelism the rows are split over the pipeline x tp ranks (the cross-entropy's
statistics over all of them), and every collective above runs per tp coordinate over the
pipeline ranks; the first and the last stage's tp ranks then sum their partial embeddings and
hidden-state gradients over tp. Under sequence parallelism a stage's rank holds its tp share of
the tokens: the embeddings are reduce-scattered onto the first stage's tp ranks and their
gradients all-gathered before the lookup's backward; the output pass all-gathers the last
stage's tokens after the broadcast and reduce-scatters the gradient back.

Where each rank joins an output pass is decided from the schedule (`output_passes`); the last
stage's rank runs its part inside the last stage's loss function. The feature plugs into the
runtime as a `PipelineExtension`: extra actions (the output passes), the loss, and the step's
begin (embedding) and end (its backward).

Legend: U units, B rows of a unit, S tokens of a unit, D model dim, V vocabulary shard.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from tensordict import TensorDict
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from pipekit.checkpoint.local_shards import RowShard
from pipekit.distributed.process_group import new_group_along
from pipekit.layers.loss import IGNORE_INDEX
from pipekit.layers.vocab_parallel import (
    VocabParallelEmbedding,
    VocabParallelOutput,
    dtensor_shard_sizes,
    vocab_parallel_cross_entropy,
)
from pipekit.models.spec import ModelStructure
from pipekit.models.stage_module import build_stage_module
from pipekit.pipelining.actions import Action
from pipekit.pipelining.features.output_passes import OUTPUT_PASS, with_output_passes
from pipekit.pipelining.features.vocab_rules import check_vocab_parallel_model
from pipekit.pipelining.runtime.extension import LossFn, PipelineExtension
from pipekit.pipelining.runtime.stage import StageShapes

if TYPE_CHECKING:
    from pipekit.pipelining.features.registry import FeatureBuilding

__all__ = [
    "PipelineVocabParallel",
    "build_vocab_parallel",
    "copy_full_vocab_rows",
    "vocab_shard_modules",
    "vocabulary_row_dims",
]


def vocabulary_row_dims(mesh: DeviceMesh) -> tuple[str, ...]:
    """The mesh dims whose ranks split the vocabulary rows, in mesh order: the pipeline ranks,
    and the tp ranks of each."""
    tensor_parallel = "tp" in (mesh.mesh_dim_names or ()) and mesh["tp"].size() > 1
    return ("pp", "tp") if tensor_parallel else ("pp",)


def build_vocab_parallel(building: FeatureBuilding) -> PipelineVocabParallel:
    """This rank's vocabulary rows (of a split over the pipeline x tp ranks), filled from the
    unsplit model's and set on the rank model under the model's names (checkpoints see row
    shards of the full matrices); the output passes' collectives get groups of their own: on
    NCCL a pipeline send blocks its communicator until received, and a pass may sit behind
    one."""
    plan, mesh, setup, model = building.plan, building.mesh, building.setup, building.model
    check_vocab_parallel_model(model, plan.structure)
    embedding_name, output_name = plan.structure.vocabulary_modules
    row_dims = vocabulary_row_dims(mesh)
    group = new_group_along(mesh, "pp")
    rows_group = new_group_along(mesh, *row_dims)
    with setup.device:
        embedding, output = vocab_shard_modules(
            plan.model.vocab_size,
            plan.model.dim,
            rows_group,
            [mesh[dim].size() for dim in row_dims],
            output_bias=getattr(model, output_name).bias is not None,
        )
    copy_full_vocab_rows(embedding, output, setup.materialize, model, plan.structure)
    setattr(building.rank_model, embedding_name, embedding)
    setattr(building.rank_model, output_name, output)
    setup.parallelize_vocab(embedding, output)
    transforms = [getattr(model, name) for name in plan.structure.logits_transforms]
    return PipelineVocabParallel(
        embedding,
        output,
        building.shapes,
        first_rank=plan.stage_rank(0),
        last_rank=plan.stage_rank(plan.num_stages - 1),
        group=group,
        tensor_group=new_group_along(mesh, "tp") if "tp" in row_dims else None,
        module_names=(embedding_name, output_name),
        logits_transforms=transforms,
        lockstep="context_exchange" in plan.features,
    )


def vocab_shard_modules(
    vocab_size: int,
    dim: int,
    group: dist.ProcessGroup,
    mesh_dims: Sequence[int] | None = None,
    *,
    output_bias: bool = False,
) -> tuple[VocabParallelEmbedding, VocabParallelOutput]:
    """This rank's embedding and output shards for a pipeline (on the current default device,
    e.g. meta inside `torch.device("meta")`), cut as DTensor's `Shard(0)` so checkpoints save
    them as row shards of the full matrices; `mesh_dims`: the sizes of the mesh dims `group`
    spans, in mesh order (default: one dim); `output_bias`: the output shard holds its rows of
    the head's bias too."""
    sizes = dtensor_shard_sizes(vocab_size, mesh_dims or dist.get_world_size(group))
    embedding = VocabParallelEmbedding(vocab_size, dim, group, sizes, reduce=False)
    output = VocabParallelOutput(
        dim, vocab_size, group, sizes, bias=output_bias, reduce_input_grad=False
    )
    return embedding, output


def copy_full_vocab_rows(
    embedding: VocabParallelEmbedding,
    output: VocabParallelOutput,
    materialize: Callable[[nn.Module], None],
    model: nn.Module,
    structure: ModelStructure,
) -> None:
    """Fill the shards with their rows of `model`'s embedding and output matrices (the modules
    `structure` names), and of the output's bias where it has one.

    `model` is the whole model on the meta device; a copy holding only one of the two modules
    is materialised by `materialize` (a seeded init, a Hugging Face load), exactly as the
    unsplit model's would be, so every vocabulary split starts from the unsplit model's
    weights, in its dtype. One full `[V, D]` matrix exists on the rank at a time.
    """
    for name, shard in zip(structure.vocabulary_modules, (embedding, output), strict=True):
        full = build_stage_module(model, [name])
        materialize(full)
        with torch.no_grad():
            module = getattr(full, name)
            weight = module.weight.detach()
            shard.to(weight.dtype)  # the shards take the materialised model's dtype
            if weight.is_meta:  # a plan's layout: shapes only, no values to copy
                continue
            shard.load_full_weight(weight)
            if isinstance(shard, VocabParallelOutput) and shard.bias is not None:
                shard.load_full_bias(module.bias.detach())
        del full, weight, module


class _LossFromKnownGradient(torch.autograd.Function):
    """The unit's loss as a function of the last stage's hidden states whose gradient the output
    pass has already computed (and summed over the ranks): backward only scales it."""

    @staticmethod
    def forward(ctx, hidden_BSD: Tensor, loss: Tensor, grad_hidden_BSD: Tensor) -> Tensor:
        ctx.save_for_backward(grad_hidden_BSD)
        return loss.clone()

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, None, None]:
        (grad_hidden_BSD,) = ctx.saved_tensors
        return grad_hidden_BSD * grad_loss, None, None


def _all_gather_along(local: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's `local`, concatenated along `dim` in rank order."""
    ranks, local = dist.get_world_size(group), local.contiguous()
    stacked = local.new_empty((ranks * local.shape[0], *local.shape[1:]))
    dist.all_gather_single(stacked, local, group=group)
    return torch.cat(stacked.chunk(ranks), dim=dim)


def _reduce_scatter_along(whole: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """The sum over the ranks of `whole`, this rank's piece of it along `dim`."""
    pieces = whole.chunk(dist.get_world_size(group), dim=dim)
    mine = torch.empty_like(pieces[0], memory_format=torch.contiguous_format)
    dist.reduce_scatter_single(mine, torch.cat(pieces), group=group)
    return mine


class PipelineVocabParallel(PipelineExtension):
    """This pipeline rank's vocabulary shards and its part in every step's vocabulary work.

    `embedding` (built with `reduce=False`) and `output` (with `reduce_input_grad=False`) hold
    this rank's rows of the split over their group (the pipeline ranks, or pipeline x tp);
    `group` is the pipeline ranks of this rank's tp coordinate, in which `first_rank` and
    `last_rank` hold the first and the last stage. `tensor_group`: this rank's tp ranks (None
    without tp); a stage's rank holds its tp share of the tokens when `shapes` says so.
    `module_names` are the model's names for the two (their checkpoint names).
    `logits_transforms` (stateless, elementwise: `vocab_rules.check_elementwise`) run on every
    shard's logits before the loss. With `lockstep`, output passes go at lockstep cuts, which
    never part two passes of one lockstep moment (context exchange pairs those).
    """

    name = "vocab_parallel"
    action_types = (OUTPUT_PASS,)

    @staticmethod
    def modules_outside_stages(structure: ModelStructure) -> tuple[str, ...]:
        """The embedding, the output layer and the logits transforms: split by rows here."""
        return (*structure.vocabulary_modules, *structure.logits_transforms)

    def __init__(
        self,
        embedding: VocabParallelEmbedding,
        output: VocabParallelOutput,
        shapes: StageShapes,
        *,
        first_rank: int,
        last_rank: int,
        group: dist.ProcessGroup,
        tensor_group: dist.ProcessGroup | None = None,
        module_names: tuple[str, str] = ("embedding", "output"),
        logits_transforms: Sequence[nn.Module] = (),
        lockstep: bool = False,
    ) -> None:
        if embedding.reduce or output.reduce_input_grad:
            raise ValueError(
                "build the pipeline's shards with VocabParallelEmbedding(reduce=False) and "
                "VocabParallelOutput(reduce_input_grad=False): the pipeline reduces onto the "
                "first and the last stage itself"
            )
        self.embedding, self.output, self.shapes, self.group = embedding, output, shapes, group
        self.tensor_group = tensor_group
        self.module_names, self.lockstep = module_names, lockstep
        self.logits_transforms = list(logits_transforms)
        self.rank = dist.get_rank(group)
        self.first_rank, self.last_rank = first_rank, last_rank
        self._tokens: list[Tensor] = []
        self._stage_inputs: list[Tensor] = []
        self._stage_input_grads: list[Tensor | None] = []
        self._labels: list[Tensor] = []
        self._normaliser: Tensor | float = 1.0
        self._passes_left = 0

    def _global(self, group_rank: int) -> int:
        return dist.get_global_rank(self.group, group_rank)

    def begin_step(
        self, units: Sequence[TensorDict], normaliser: Tensor | float
    ) -> list[tuple[Tensor, ...]]:
        """Embed every unit's tokens (collective); the first stage's inputs, one per unit, on the
        first stage's rank (no inputs elsewhere). Units may differ in length (slices cut
        unequally): they travel together, concatenated along the sequence."""
        self._tokens = [unit["tokens"] for unit in units]
        self._labels = [unit["labels"] for unit in units]
        self._normaliser = normaliser
        self._passes_left = len(units)
        # no graph kept: end_step looks the ids up again (cheap), so no rank holds the partial
        # embeddings of the whole step while the schedule runs
        with torch.no_grad():
            summed_BTD = self.embedding(torch.cat(self._tokens, dim=1)).to(self.shapes.dtype)
        dist.reduce(summed_BTD, dst=self._global(self.first_rank), group=self.group)
        if self.rank != self.first_rank:
            return [() for _ in units]
        lengths = [tokens_BS.shape[1] for tokens_BS in self._tokens]
        summed = self._per_unit(summed_BTD.split(lengths, dim=1), self._sum_over_tensor_ranks)
        self._stage_inputs = [embedded_BSD.detach().requires_grad_() for embedded_BSD in summed]
        self._stage_input_grads = [None] * len(units)
        for unit, stage_input_BSD in enumerate(self._stage_inputs):
            # torch's stage hands input gradients on and clears .grad: catch them on the way
            stage_input_BSD.register_hook(functools.partial(self._keep_stage_input_grad, unit))
        return [(stage_input_BSD,) for stage_input_BSD in self._stage_inputs]

    def _keep_stage_input_grad(self, unit: int, grad_BSD: Tensor) -> None:
        self._stage_input_grads[unit] = grad_BSD

    def end_step(self) -> None:
        """Backpropagate the first stage's input gradients into every rank's embedding rows
        (collective), then forget the step."""
        if not self._tokens:
            raise RuntimeError("end_step without begin_step: call begin_step before the schedule")
        shards, dim = self.shapes.sequence_shards, self.shapes.model_dim
        rows, device = self._tokens[0].shape[0], self._tokens[0].device
        local = [tokens_BS.shape[1] // shards for tokens_BS in self._tokens]
        grads_BTD = torch.zeros((rows, sum(local), dim), dtype=self.shapes.dtype, device=device)
        if self.rank == self.first_rank:
            for grad_BSD, stage_input_grad_BSD in zip(
                grads_BTD.split(local, dim=1), self._stage_input_grads, strict=True
            ):
                if stage_input_grad_BSD is None:
                    raise RuntimeError(
                        "the first stage produced no gradient for a unit's embeddings; its "
                        "schedule must run every unit's backward"
                    )
                grad_BSD.copy_(stage_input_grad_BSD)
        dist.broadcast(grads_BTD, src=self._global(self.first_rank), group=self.group)
        grads = self._per_unit(grads_BTD.split(local, dim=1), self._gather_sequence)
        with torch.enable_grad():
            embedded_BTD = self.embedding(torch.cat(self._tokens, dim=1)).to(self.shapes.dtype)
            embedded_BTD.backward(torch.cat(grads, dim=1))
        self._tokens, self._labels = [], []
        self._stage_inputs, self._stage_input_grads = [], []

    @staticmethod
    def _per_unit(
        parts: Sequence[Tensor], along_sequence: Callable[[Tensor, int], Tensor]
    ) -> list[Tensor]:
        """`along_sequence` (a tp collective along the sequence dim) on every unit's `[B, S, D]`
        part: stacked in one call when the units are of one length, else one by one."""
        if len({part.shape[1] for part in parts}) == 1:
            return list(along_sequence(torch.stack(list(parts)), 2).unbind(0))
        return [along_sequence(part.contiguous(), 1) for part in parts]

    def output_pass(
        self, labels_BS: Tensor, hidden_BSD: Tensor | None = None
    ) -> tuple[Tensor, Tensor] | None:
        """One unit's output layer, loss and their backward on every rank (collective).

        The last stage's rank passes the final hidden states and gets `(loss, d loss / d
        hidden)` back, the loss already over the normaliser; the other ranks pass nothing and
        get None. Every rank's output rows receive their weight gradient.
        """
        is_last = self.rank == self.last_rank
        if is_last != (hidden_BSD is not None):
            raise ValueError("pass hidden_BSD on the last stage's rank and only there")
        self._passes_left -= 1
        if isinstance(self.output, FSDPModule):  # data parallelism: sync after the last pass
            self.output.set_requires_gradient_sync(self._passes_left == 0)
            self.output.set_reshard_after_backward(self._passes_left == 0)
        tokens = labels_BS.shape[1] // self.shapes.sequence_shards  # this unit's, per tp rank
        source_BSD = hidden_BSD if is_last else self.shapes.hidden(labels_BS.device, tokens)
        received_BSD = source_BSD.detach().contiguous()
        dist.broadcast(received_BSD, src=self._global(self.last_rank), group=self.group)
        received_BSD = self._gather_sequence(received_BSD, sequence_dim=1).requires_grad_()
        with torch.enable_grad():
            logits_BSV = self.output(received_BSD)
            for transform in self.logits_transforms:
                logits_BSV = transform(logits_BSV)
            loss = (
                vocab_parallel_cross_entropy(
                    logits_BSV,
                    labels_BS,
                    self.output.group,
                    vocab_start=self.output.vocab_start,
                    vocab_size=self.output.vocab_size,
                    ignore_index=IGNORE_INDEX,
                )
                / self._normaliser
            )
            loss.backward()
        grad_hidden_BSD = received_BSD.grad
        dist.reduce(grad_hidden_BSD, dst=self._global(self.last_rank), group=self.group)
        if not is_last:
            return None
        return loss.detach(), self._sum_over_tensor_ranks(grad_hidden_BSD, sequence_dim=1)

    def _sum_over_tensor_ranks(self, partial: Tensor, sequence_dim: int) -> Tensor:
        """On a first or last stage's rank: the sum of its tp ranks' `partial` embeddings or
        hidden-state gradients (each over its tp coordinate's rows), its own tokens' share
        under sequence parallelism."""
        if self.tensor_group is None:
            return partial
        if self.shapes.sequence_shards > 1:
            return _reduce_scatter_along(partial, sequence_dim, self.tensor_group)
        dist.all_reduce(partial, group=self.tensor_group)
        return partial

    def _gather_sequence(self, local: Tensor, sequence_dim: int) -> Tensor:
        """Under sequence parallelism, every tp rank's tokens (a rank's vocabulary rows see all
        of them); else `local` itself, already whole."""
        if self.tensor_group is None or self.shapes.sequence_shards == 1:
            return local
        return _all_gather_along(local, sequence_dim, self.tensor_group)

    def stage_loss(self, hidden_BSD: Tensor, labels_BS: Tensor, **_: Any) -> Tensor:
        """The last stage's loss function: joins the unit's output pass and returns the loss,
        whose backward hands the stage the summed gradient of its hidden states."""
        result = self.output_pass(labels_BS, hidden_BSD)
        assert result is not None  # the last stage's rank always gets one
        loss, grad_hidden_BSD = result
        return _LossFromKnownGradient.apply(hidden_BSD, loss, grad_hidden_BSD)

    def loss_fn(self, loss_fn: LossFn) -> LossFn:
        """The last stage's loss is `stage_loss`: its output pass."""
        return self.stage_loss

    def extra_actions(
        self, actions_by_rank: Mapping[int, Sequence[Action]], num_slices: int
    ) -> dict[int, list[tuple[int, Action]]]:
        """Every unit's output pass on the ranks without the last stage (where the last stage's
        rank runs its share inside `stage_loss`), after the compute actions before it."""
        placed = with_output_passes(actions_by_rank, num_slices, lockstep=self.lockstep)
        extra: dict[int, list[tuple[int, Action]]] = {}
        for rank, actions in placed.items():
            if rank == self.last_rank:
                continue
            extra[rank], computed = [], 0
            for action in actions:
                if action.computation_type == OUTPUT_PASS:
                    extra[rank].append((computed, action))
                else:
                    computed += 1
        return extra

    def run_action(self, action: Action, context: object) -> None:
        """An output pass on a rank without the last stage."""
        self.output_pass(self._labels[action.microbatch_index])

    def tensor_split_parameters(self) -> tuple[list[nn.Parameter], dist.ProcessGroup] | None:
        """Under tp, the tp ranks hold different rows of both matrices (and of the bias)."""
        if self.tensor_group is None:
            return None
        return [param for _, param in self._row_parameters()], self.tensor_group

    def row_shard_dims(self) -> tuple[str, ...]:
        """The pipeline ranks, and the tp ranks of each under tp."""
        return ("pp", "tp") if self.tensor_group is not None else ("pp",)

    def tied_copies(self) -> list[nn.Parameter]:
        """Both row shards of a tied embedding and output, on every rank."""
        return [self.embedding.weight, self.output.weight]

    def row_sharded_parameters(self) -> dict[str, RowShard]:
        """The embedding's and the output's rows (and the output bias's) are split over the
        pipeline ranks, under the model's names."""
        rows = RowShard(self.embedding.vocab_start, self.embedding.vocab_size)
        return {name: rows for name, _ in self._row_parameters()}

    def _row_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """This rank's row shards, by the model's parameter names."""
        return [
            (f"{module_name}.{key}", param)
            for module_name, module in zip(
                self.module_names, (self.embedding, self.output), strict=True
            )
            for key, param in module.named_parameters()
        ]
