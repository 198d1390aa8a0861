"""The structure's order checked against the model's own forward, before a job launches.

A pipeline stage runs the model's `forward` with the modules of other stages removed, so a module
that `ModelStructure` places on the wrong side of the blocks runs at another depth under a
pipeline than in one process (learned positions declared in `after_blocks` are added to the last
stage's input): the job trains, but another model. `check_forward_order` runs the forward once on
the meta device with the blocks stubbed out (identity: their insides are the blocks' business and
need not run on meta), records the order in which it calls the top-level modules, and refuses a
structure that orders them otherwise:

- the embedding and `before_blocks` before the first block (in any order: one stage holds them);
- the blocks in the container's order (stages hold consecutive keys);
- `after_blocks`, then the output, after the last block (vocabulary parallelism applies the
  output after the last stage);
- `logits_transforms` after the output, in the structure's order (vocabulary parallelism applies
  them in that order);
- `shared` modules anywhere; a module called again later (an embedding reused as the tied output)
  counts where it is first called; a module the forward never calls is never misplaced.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from pipekit.models.spec import ModelStructure

__all__ = ["check_forward_order"]

_LOG = logging.getLogger(__name__)

_TOKENS = 2
"""Tokens of the probe: the order of top-level calls does not depend on the length."""

_BEFORE, _BETWEEN, _AFTER, _AFTER_OUTPUT = "before", "between", "after", "after_output"
_FIELD_RUNS = {  # where a field's modules must run, in the message's words
    "embedding": (_BEFORE, "first stage, before the blocks"),
    "before_blocks": (_BEFORE, "first stage, before the blocks"),
    "after_blocks": (_AFTER, "last stage, between the blocks and the output"),
    "output": (_AFTER, "last stage, after the blocks"),
    "logits_transforms": (_AFTER_OUTPUT, "after the output"),
}
_FIELD_FOR = {_BEFORE: "before_blocks", _AFTER: "after_blocks", _AFTER_OUTPUT: "logits_transforms"}


def check_forward_order(model: nn.Module, structure: ModelStructure) -> None:
    """ValueError (one line: the module, where the structure puts it, where `forward` runs it,
    the fix) when `model`'s forward calls its top-level modules in an order `structure` does not
    imply (see the module docstring). `model` is on the meta device; it is left unchanged."""
    calls, error = _recorded_calls(model, structure)
    blocks = [f"{structure.blocks}.{key}" for key in _block_keys(model, structure)]
    block_index = {name: index for index, name in enumerate(blocks)}
    called_blocks = [name for name in calls if name in block_index]
    for earlier, later in itertools.pairwise(called_blocks):
        if block_index[later] < block_index[earlier]:
            raise ValueError(
                f"{type(model).__name__}.forward runs {later!r} after {earlier!r}, but pipeline "
                f"stages hold consecutive blocks in the order of {structure.blocks!r}'s keys; "
                "key the blocks in the order forward runs them"
            )
    field_of = _fields(structure)
    blocks_seen, output_seen, last_block = 0, False, ""
    for name in calls:
        if name in block_index:
            blocks_seen, last_block = blocks_seen + 1, name
            continue
        if name not in field_of:  # shared
            continue
        where = _BEFORE if blocks_seen == 0 else _AFTER if blocks_seen == len(blocks) else _BETWEEN
        if output_seen and where == _AFTER:
            where = _AFTER_OUTPUT
        field = field_of[name]
        if where != _FIELD_RUNS[field][0]:
            raise ValueError(_misplaced(model, name, field, where, last_block))
        output_seen = output_seen or name == structure.output
    order = [name for name in calls if name in structure.logits_transforms]
    expected = [name for name in structure.logits_transforms if name in order]
    if order != expected:
        raise ValueError(
            f"ModelStructure lists logits_transforms {tuple(expected)}, but "
            f"{type(model).__name__}.forward applies them as {tuple(order)}, and vocabulary "
            "parallelism applies them in the structure's order; list them in forward's order"
        )
    if error:
        _LOG.warning(
            "%s.forward stopped on the meta device with its blocks stubbed out (%s); the "
            "structure's order was checked up to its calls %s",
            type(model).__name__,
            error,
            calls,
        )


def _misplaced(model: nn.Module, name: str, field: str, where: str, after_block: str) -> str:
    """The one-line refusal of `name` (of `field`), run `where` by forward (`after_block`: the
    last block run before it)."""
    runs = {
        _BEFORE: "before the blocks",
        _BETWEEN: f"between {after_block!r} and the next block",
        _AFTER: "after the blocks, before the output",
        _AFTER_OUTPUT: "after the output",
    }[where]
    if where == _BETWEEN:
        fix = "no stage boundary keeps that place: move it into a block, or before or after them"
    elif field in ("embedding", "output"):
        fix = f"forward must call the {field} {_FIELD_RUNS[field][1].split(', ')[-1]}"
    else:
        fix = f"name it in {_FIELD_FOR[where]} instead"
    placed = f"as the {field}" if field in ("embedding", "output") else f"in {field}"
    return (
        f"ModelStructure places {name!r} {placed} ({_FIELD_RUNS[field][1]}), but "
        f"{type(model).__name__}.forward runs it {runs}, so a pipeline would apply it elsewhere "
        f"than one process does; {fix}"
    )


def _fields(structure: ModelStructure) -> dict[str, str]:
    """Each non-shared, non-block module name -> its structure field."""
    field_of = {structure.embedding: "embedding", structure.output: "output"}
    for field in ("before_blocks", "after_blocks", "logits_transforms"):
        field_of.update(dict.fromkeys(getattr(structure, field), field))
    return field_of


def _block_keys(model: nn.Module, structure: ModelStructure) -> list[str]:
    container = getattr(model, structure.blocks)
    if isinstance(container, (nn.ModuleDict, nn.ModuleList)):
        return [key for key, _ in container.named_children()]
    return []


def _recorded_calls(model: nn.Module, structure: ModelStructure) -> tuple[list[str], str]:
    """The top-level modules (and blocks, by their names) in the order `model.forward` first
    calls them on meta tokens, and why the forward stopped early ("" if it finished)."""
    calls: list[str] = []
    handles, stubbed = [], []

    def recorder(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any) -> None:
            if name not in calls:
                calls.append(name)

        return record

    for name, child in model.named_children():
        if name == structure.blocks and isinstance(child, (nn.ModuleDict, nn.ModuleList)):
            for key, block in child.named_children():
                handles.append(block.register_forward_pre_hook(recorder(f"{name}.{key}")))
                block.forward = _passes_hidden_states  # an instance attribute, deleted below
                stubbed.append(block)
        elif child is not None:
            handles.append(child.register_forward_pre_hook(recorder(name)))
    error = ""
    try:
        with torch.device("meta"), torch.no_grad():
            tokens_BS = torch.zeros(1, _TOKENS, dtype=torch.int64)
            model(tokens_BS, torch.arange(_TOKENS).unsqueeze(0))
    except Exception as raised:  # a forward that cannot run on meta keeps what it recorded
        error = f"{type(raised).__name__}: {raised}".splitlines()[0]
    finally:
        for handle in handles:
            handle.remove()
        for block in stubbed:
            del block.forward
    return calls, error


def _passes_hidden_states(*args: Any, **kwargs: Any) -> Tensor:
    """A block's stand-in: its first tensor argument, unchanged."""
    tensors = [value for value in (*args, *kwargs.values()) if isinstance(value, Tensor)]
    return tensors[0]
