"""What vocabulary parallelism can honour of a model: checked before it is split, refused in one
line rather than dropped.

The feature takes the model's embedding and output modules out of the stages and puts row
shards in their place, which look up and project with the weight's rows (and add the output
bias's); the logits transforms then run on each shard's columns. So the two modules must be a
plain `nn.Embedding` and a plain `nn.Linear`, holding nothing else, and each transform must be
stateless and act on every logit alone.
"""

from __future__ import annotations

import torch
from torch import nn

from pipekit.layers.vocab_parallel import dtensor_shard_sizes
from pipekit.models.spec import ModelStructure
from pipekit.pipelining.features.registry import FeatureLayout

__all__ = [
    "check_elementwise",
    "check_vocab_parallel_layout",
    "check_vocab_parallel_model",
    "check_vocabulary_modules",
]

_EMBEDDING_DEFAULTS = {
    "padding_idx": None,
    "max_norm": None,
    "scale_grad_by_freq": False,
    "sparse": False,
}
"""`nn.Embedding` options the sharded lookup does not implement, at their defaults."""


def check_vocab_parallel_model(model: nn.Module, structure: ModelStructure) -> None:
    """ValueError naming the first piece of `model` (whole, on any device, meta included) that
    vocabulary parallelism would change: its two vocabulary modules, then its logits
    transforms."""
    check_vocabulary_modules(model, structure)
    for name in structure.logits_transforms:
        check_elementwise(getattr(model, name), name)


def check_vocabulary_modules(model: nn.Module, structure: ModelStructure) -> None:
    """ValueError unless `model`'s embedding is a plain `nn.Embedding` (default options) and its
    output a plain `nn.Linear` (with a bias or not): the row shards that replace them hold the
    weight's rows and the bias's and run a lookup and a projection, so any other parameter,
    buffer, option or forward of the two would be silently lost."""
    embedding_name, output_name = structure.vocabulary_modules
    for name, kind, kept in (
        (embedding_name, nn.Embedding, ("weight",)),
        (output_name, nn.Linear, ("weight", "bias")),
    ):
        module = getattr(model, name)
        if not isinstance(module, kind) or type(module).forward is not kind.forward:
            raise ValueError(
                f"{name!r} is a {type(module).__name__}, which vocabulary parallelism replaces "
                f"by row shards of a plain nn.{kind.__name__} (its own forward would not run); "
                f"make {name!r} an nn.{kind.__name__} (any other work a module of its own) or "
                "set vocab_parallel = false"
            )
        dropped = [key for key, _ in module.named_parameters() if key not in kept]
        dropped += [key for key, _ in module.named_buffers()]
        if dropped:
            raise ValueError(
                f"{name!r} holds {dropped}, which vocabulary parallelism's row shards (of "
                f"{' and '.join(kept)} only) would drop; move them into a module of their own "
                "or set vocab_parallel = false"
            )
    embedding = getattr(model, embedding_name)
    options = {
        option: getattr(embedding, option)
        for option, default in _EMBEDDING_DEFAULTS.items()
        if getattr(embedding, option) != default
    }
    if options:
        raise ValueError(
            f"{embedding_name!r} is an nn.Embedding with {options}, which vocabulary "
            "parallelism's sharded lookup does not apply; leave them at their defaults or set "
            "vocab_parallel = false"
        )


def check_elementwise(transform: nn.Module, name: str, vocab_size: int = 16) -> None:
    """ValueError unless `transform` (a logits transform named `name`) is stateless and acts on
    every logit alone, as vocabulary parallelism applies it to each rank's columns: probed on
    random logits, whole and split into two column blocks."""
    if any(True for _ in transform.parameters()) or any(True for _ in transform.buffers()):
        raise ValueError(
            f"logits transform {name!r} holds parameters or buffers, which vocabulary parallelism "
            "cannot split across its shards; make it stateless or set vocab_parallel = false"
        )
    probe_BSV = 20 * torch.randn(2, 3, vocab_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        whole = transform(probe_BSV)
        halves = torch.cat([transform(part) for part in probe_BSV.chunk(2, dim=-1)], dim=-1)
    if whole.shape != probe_BSV.shape or not torch.allclose(whole, halves, rtol=1e-5, atol=1e-6):
        raise ValueError(
            f"logits transform {name!r} does not act on each logit alone (its output on a block "
            "of the vocabulary differs from the same columns of its output on the whole), so "
            "vocabulary parallelism would change the model; set vocab_parallel = false"
        )


def check_vocab_parallel_layout(layout: FeatureLayout) -> None:
    """Vocabulary parallelism needs pipeline ranks to split the vocabulary over (and their tp
    ranks split each pipeline rank's rows), vocabulary modules its row shards compute exactly,
    and logits transforms it can apply shard by shard; not an upcycled model yet."""
    dims = layout.dims
    if dims.pp < 2:
        raise ValueError(
            "vocab_parallel = true splits the vocabulary across pipeline ranks; set "
            "pipeline_parallel_degree >= 2 or vocab_parallel = false"
        )
    if layout.upcycling:
        raise ValueError(
            "vocab_parallel = true does not combine with [model.upcycle] yet (the vocabulary "
            "shards are initialised from the full rows); set vocab_parallel = false"
        )
    try:
        dtensor_shard_sizes(layout.shape.vocab_size, (dims.pp, dims.tp))
        check_vocab_parallel_model(layout.meta_model, layout.spec.structure)
    except ValueError as error:
        raise ValueError(f"vocab_parallel = true: {error}") from None
