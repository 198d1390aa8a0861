"""The model contract: what a model family gives pipekit so that pipekit can build, split,
shard, initialise, count and convert it without knowing its names.

A family is one `ModelSpec`, registered once (`pipekit.models.registry`). Its model is a plain
`nn.Module` that follows `CausalLM`:

- built on the meta device by `spec.build(args)`, moved with `to_empty`, then `init_weights(seed)`
  draws every parameter from a generator seeded by (seed, module name) (`seeded_init`), so any
  subset of the modules (a pipeline stage) initialised alone equals the whole model's;
- `forward(tokens_or_hidden, positions=None, attention_context=None)`: token ids `[B, S]` or hidden
  states `[B, S, D]` in; positions may start anywhere (a slice of a longer sequence); attention
  goes through the given `pipekit.attention.context.AttentionContext` (None: causal);
- a pipeline stage is the model with the modules of other stages set to None (and other keys of
  the blocks container deleted): `forward` applies the modules present and returns hidden states
  when it has no output layer, so stages compose to the whole model;
- `tie_weights()` re-ties shared weights after `to_empty` (a no-op for untied models).

`ModelStructure` names the modules pipekit splits and wraps; `ModelShape` gives the sizes it
needs (stage messages, vocabulary shards, FLOPs). Everything else about the model (its args,
its layer internals) is the family's own business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, runtime_checkable

import torch
from torch import Tensor, nn
from torch.distributed.tensor.parallel import ParallelStyle

from pipekit.models.upcycling import Upcycler

if TYPE_CHECKING:
    from pipekit.attention.context import AttentionContext

__all__ = [
    "CausalLM",
    "HFTensor",
    "HuggingFaceAdapter",
    "ModelShape",
    "ModelSpec",
    "ModelStructure",
]


@runtime_checkable
class CausalLM(Protocol):
    """What pipekit calls on a model (see the module docstring)."""

    def init_weights(self, seed: int | None = None) -> None: ...

    def tie_weights(self) -> None: ...

    def forward(
        self,
        tokens_or_hidden: Tensor,
        positions: Tensor | None = None,
        attention_context: AttentionContext | None = None,
    ) -> Tensor: ...


@dataclass(frozen=True)
class ModelStructure:
    """Attribute names of the modules pipekit splits into stages, wraps and shards."""

    blocks: str
    """A ModuleDict of the repeated blocks keyed "0".."L-1": a stage holds a contiguous run of
    them; FSDP and activation checkpointing wrap each; context exchange counts them."""
    embedding: str
    """The token embedding (weight `[V, D]`): on the first stage, or split by vocabulary rows
    across the pipeline ranks (vocabulary parallelism)."""
    output: str
    """The vocabulary projection (weight `[V, D]`): on the last stage, or split like the
    embedding."""
    before_blocks: tuple[str, ...] = ()
    """Modules of the first stage only, applied to the embedding's output before the blocks
    (learned positions, an embedding scale): vocabulary-parallel embeddings pass through them
    too."""
    after_blocks: tuple[str, ...] = ()
    """Modules of the last stage between the blocks and the output (e.g. the final norm)."""
    logits_transforms: tuple[str, ...] = ()
    """Stateless modules the model applies, in order, to the output layer's logits (soft-capping,
    a scale). Each must act on every logit alone (elementwise), so vocabulary parallelism applies
    them shard by shard; the last stage holds them."""
    shared: tuple[str, ...] = ()
    """Stateless modules every stage holds (e.g. rotary embeddings): the one place a module
    may run on more than one stage."""
    multi_token_prediction: tuple[str, ...] = ()
    """Modules run in training on the output layer's input, with the embedding and the output
    layer as shared weights (`pipekit.layers.multi_token_prediction`); an attribute of None is
    a model without them. A pipeline's last stage holds them; no context or tensor
    parallelism."""

    @property
    def placed(self) -> tuple[str, ...]:
        """Every top-level module name the structure places, in no particular order."""
        return (
            self.blocks,
            self.embedding,
            self.output,
            *self.before_blocks,
            *self.after_blocks,
            *self.logits_transforms,
            *self.shared,
            *self.multi_token_prediction,
        )

    @property
    def vocabulary_modules(self) -> tuple[str, str]:
        """(embedding, output): what vocabulary parallelism takes out of the stages."""
        return self.embedding, self.output

    def block_name(self, index: int | str) -> str:
        """The module name of block `index` (e.g. "layers.3")."""
        return f"{self.blocks}.{index}"

    def is_block(self, module_name: str) -> bool:
        """Whether `module_name` names one block."""
        return module_name.startswith(f"{self.blocks}.")

    def blocks_of(self, model: nn.Module) -> list[nn.Module]:
        """The blocks `model` holds, in order (a pipeline stage may hold none)."""
        return list(self.named_blocks_of(model).values())

    def named_blocks_of(self, model: nn.Module) -> dict[str, nn.Module]:
        """The blocks `model` holds by their key in the block container ("3" of "layers.3"),
        in order: a pipeline stage keeps the whole model's keys."""
        container = getattr(model, self.blocks, None)
        return {} if container is None else dict(container.items())


@dataclass(frozen=True)
class ModelShape:
    """The sizes pipekit needs of a model."""

    dim: int
    """Width of the hidden states between blocks (and between pipeline stages)."""
    num_layers: int
    """Number of blocks."""
    vocab_size: int
    num_heads: int
    """Query heads per attention layer (for the attention FLOPs)."""
    num_kv_heads: int
    head_dim: int
    tied_embeddings: bool
    """Whether the output projection is the embedding's weight."""
    max_seq_len: int
    """Longest sequence the model is built for: a job's longer `seq_len` is refused, and
    packed positions stay below `seq_len`."""
    multi_token_depth: int = 0
    """Depths of the model's multi-token prediction modules (0: none): a pipeline's last stage
    holds them."""


class HFTensor(NamedTuple):
    """One tensor of a Hugging Face checkpoint and the parameter (or expert of it) it holds."""

    hf_name: str
    hf_shape: tuple[int, ...]
    param_name: str
    expert: int | None
    """Index into the parameter's leading expert dim; None: the whole parameter."""


@dataclass(frozen=True)
class HuggingFaceAdapter:
    """How a family's weights move in and out of a Hugging Face checkpoint directory."""

    model_types: tuple[str, ...]
    """The config.json `model_type`s this adapter reads (tools pick the family by it)."""
    read_args: Callable[[str], Any]
    """Checkpoint directory -> model args (from its config.json)."""
    load: Callable[..., None]
    """`load(directory, model, args)`: copy a checkpoint into a materialised model of these
    args, whole or this rank's part (shards, pipeline stages): each rank reads only its
    blocks."""
    save: Callable[..., None]
    """`save(model, args, directory, *, row_shards=None)`: write the checkpoint with its
    config.json, replacing `directory`. A sharded model (or pipeline stage) is saved by every
    rank calling it with its part; `row_shards` (`pipekit.checkpoint.hf_export.RowShard`) names
    parameters of which the rank holds a row range (vocabulary parallelism)."""
    tensors: Callable[[Any], list[HFTensor]]
    """Model args -> every tensor of their checkpoint, in writing order."""
    config: Callable[[Any, torch.dtype], dict[str, Any]]
    """(model args, weight dtype) -> the config.json object."""
    build_from_checkpoint: Callable[[str], tuple[nn.Module, Any]]
    """Checkpoint directory -> (a float32 model holding it, its args), on the CPU."""
    check_layout: Callable[[Any], None] | None = None
    """ValueError (naming the fix) when models with these args have no layout on disk, so a
    job finds out before it trains rather than when it exports."""


@dataclass(frozen=True)
class ModelSpec:
    """One model family: how to build it, its structure and sizes, and its converters."""

    name: str
    flavors: Mapping[str, Any]
    """Named sizes -> model args (what `spec.build` takes)."""
    build: Callable[[Any], nn.Module]
    """Model args -> module; call under `torch.device("meta")`, then `to_empty` and
    `init_weights`."""
    shape: Callable[[Any], ModelShape]
    """Model args -> the sizes pipekit needs."""
    structure: ModelStructure
    hf: HuggingFaceAdapter | None = None
    """Hugging Face import/export (None: DCP checkpoints only)."""
    upcycler: Upcycler | None = None
    """How a dense model of this family becomes a mixture of experts (None: it cannot)."""
    tensor_parallel_plan: Callable[[nn.Module, bool], Mapping[str, ParallelStyle]] | None = None
    """(a transformer block, sequence_parallel) -> its tensor-parallel plan (submodule path ->
    DTensor parallel style, for `parallelize_module`); None: the family has no tensor
    parallelism. Attention must take its head count from what its projections return
    (`view(..., -1, head_dim)`). With sequence parallelism a block takes and returns a DTensor
    sharded on the sequence (dim 1), and the plan must keep it so (norms `SequenceParallel`,
    row-split outputs `Shard(1)`); pipekit shards it after the embedding and gathers it before
    the output layer."""

    def flavor(self, name: str) -> Any:
        """The args of flavor `name`, with an error that lists the known ones."""
        if name not in self.flavors:
            raise ValueError(
                f"unknown {self.name} flavor {name!r}; known flavors: {sorted(self.flavors)}"
            )
        return self.flavors[name]
