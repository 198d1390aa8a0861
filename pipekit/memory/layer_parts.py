"""What each part of a transformer layer keeps for its backward: attention, norms, MLP, router,
experts, and the rest (block inputs, residual sums).

A storage belongs to the part whose forward was running when it was allocated (the innermost,
found by forward hooks on the model's parts): a norm's output is the norm's even though the
projections after it save it too, a projection's output is its attention's or MLP's. The KV
cache of a sliced pipeline is counted apart, by `ActivationMemoryTracker` ("kv_cache").
`pipekit.memory.layer_formula.saved_bytes_by_part` gives the same split by formula.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

from pipekit.layers.attention import GroupedQueryAttention
from pipekit.layers.norms import RMSNorm
from pipekit.layers.swiglu import FeedForward
from pipekit.memory.live_tensors import kept_bytes_by_label
from pipekit.moe.experts import GroupedExperts
from pipekit.moe.layer import MoE
from pipekit.moe.routers import Router

__all__ = ["LAYER_PARTS", "kept_bytes_by_part", "layer_part"]

LAYER_PARTS = ("attention", "norms", "mlp", "router", "experts", "other")
_KINDS: tuple[tuple[type[nn.Module], str], ...] = (
    (GroupedQueryAttention, "attention"),
    (RMSNorm, "norms"),
    (FeedForward, "mlp"),
    (Router, "router"),
    (GroupedExperts, "experts"),
    (MoE, "experts"),  # its dispatch and combine; the router and experts inside are innermost
)


def layer_part(module: nn.Module) -> str | None:
    """The part `module` is (`LAYER_PARTS`), or None for a module that is none of them."""
    return next((part for kind, part in _KINDS if isinstance(module, kind)), None)


@contextlib.contextmanager
def running_part(model: nn.Module) -> Iterator[Callable[[], str]]:
    """Inside: a function giving the innermost part of `model` whose forward is running
    ("other" outside every part)."""
    stack: list[str] = []

    def enter(module: nn.Module, _args: object) -> None:
        stack.append(layer_part(module) or "other")

    def leave(*_: object) -> None:  # returns None: the module's output stays
        stack.pop()

    handles = []
    for module in model.modules():
        if layer_part(module) is not None:
            handles.append(module.register_forward_pre_hook(enter))
            handles.append(module.register_forward_hook(leave))
    try:
        yield lambda: stack[-1] if stack else "other"
    finally:
        for handle in handles:
            handle.remove()


def kept_bytes_by_part(model: nn.Module, forward: Callable[[], torch.Tensor]) -> dict[str, int]:
    """Bytes `forward()` leaves alive besides its output (`live_tensors.kept_bytes`), per part
    of `model` (every part of `LAYER_PARTS`, zero where nothing was kept)."""
    with running_part(model) as part:
        kept = kept_bytes_by_label(forward, part)
    return {name: kept.get(name, 0) for name in LAYER_PARTS}
