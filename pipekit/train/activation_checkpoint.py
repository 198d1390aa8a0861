"""Activation checkpointing of transformer blocks: none, every block, every k-th block, or
op-level selective checkpointing of every block.

- `full`: a block keeps only its input; its whole forward runs again in the backward.
- `every_k`: the same for every k-th block (`activation_checkpoint_every`), the others keep
  everything: a memory/compute trade between none and full.
- `selective`: every block is checkpointed, but torch's selective-checkpoint contexts keep the
  outputs of the ops `activation_checkpoint_keep` names, so the recompute skips them: by default
  the matmuls, the attention kernels and the collectives (what is costly to run again), while
  element-wise ops and norms are recomputed (what is cheap to run again but large to keep).

In a sliced pipeline a recomputed forward attends to the KV cache as the first did (the cache
knows a recompute and neither appends nor drops chunks); see `pipekit.attention.kv_cache`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from pipekit._torch_private import (
    ATTENTION_KERNEL_OPS,
    FUNCTIONAL_COLLECTIVE_OPS,
    checkpoint_module_activations,
    ignore_profiler_markers_in_selective_checkpointing,
)

if TYPE_CHECKING:  # pipekit.config imports this module's choices: no import back at run time
    from pipekit.config.job_config import TrainingConfig

__all__ = [
    "ACTIVATION_CHECKPOINT_MODES",
    "SELECTIVE_KEEP",
    "apply_activation_checkpointing",
    "check_checkpoint_with_schedule",
    "checkpoints_block",
    "selective_checkpoint_context",
]

ACTIVATION_CHECKPOINT_MODES = ("none", "full", "every_k", "selective")
"""`activation_checkpoint`'s choices; `pipekit.train.config_values` reads them here."""

_aten = torch.ops.aten
_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default)
SELECTIVE_KEEP: dict[str, frozenset[Any]] = {
    "matmuls_and_attention": frozenset(
        (*_MATMULS, *ATTENTION_KERNEL_OPS, *FUNCTIONAL_COLLECTIVE_OPS)
    ),
    "attention": frozenset((*ATTENTION_KERNEL_OPS, *FUNCTIONAL_COLLECTIVE_OPS)),
}
"""`activation_checkpoint_keep` -> the ops whose outputs selective checkpointing keeps (its keys
are that key's choices; `pipekit.train.config_values` reads them here)."""


def _policy(keep: frozenset[Any], ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_context(keep: str) -> Callable[[], tuple[Any, Any]]:
    """The `context_fn` of selective checkpointing that keeps `SELECTIVE_KEEP[keep]`."""
    if keep not in SELECTIVE_KEEP:
        raise ValueError(
            f"activation_checkpoint_keep={keep!r} is not one of {', '.join(SELECTIVE_KEEP)}"
        )
    ignore_profiler_markers_in_selective_checkpointing()
    policy = functools.partial(_policy, SELECTIVE_KEEP[keep])
    return functools.partial(create_selective_checkpoint_contexts, policy)


def check_checkpoint_with_schedule(mode: str, schedule: str, splits_backward: bool) -> None:
    """ValueError naming the fix when `mode` cannot run under the pipeline schedule.

    A schedule that splits backwards into input and weight parts (I/W) unpacks a checkpointed
    block's saved tensors in two autograd passes, so the block would be recomputed in each;
    torch's composable checkpoint (which keeps parameter names) enters its recompute context
    once per forward, so the second recompute fails inside the backward, whatever the mode.
    """
    if mode != "none" and splits_backward:
        raise ValueError(
            f"activation_checkpoint={mode!r} with pipeline_schedule={schedule!r}, which splits "
            "backwards into input and weight parts that would each recompute a checkpointed "
            "block (torch's checkpoint recomputes once); use activation_offload, or a schedule "
            "with full backwards (1F1B, Interleaved1F1B, sliced)"
        )


def checkpoints_block(key: str, position: int, config: TrainingConfig) -> bool:
    """Whether full or every-k checkpointing recomputes the block stored under `key`.

    Every-k counts blocks by their index in the whole model (their key, "3" of "layers.3"), so
    a pipeline stage checkpoints the blocks one process would, whatever the stage holds; a key
    that is not an index counts by `position` among the blocks given.
    """
    mode = config.activation_checkpoint
    if mode not in ("full", "every_k"):
        return False
    every = config.activation_checkpoint_every if mode == "every_k" else 1
    index = int(key) if key.isdigit() else position
    return index % every == every - 1


def apply_activation_checkpointing(blocks: Mapping[str, nn.Module], config: TrainingConfig) -> int:
    """Checkpoint the blocks (by their key in the model's block container) the config selects;
    returns how many were checkpointed."""
    mode = config.activation_checkpoint
    if mode not in ACTIVATION_CHECKPOINT_MODES:
        raise ValueError(
            f"activation_checkpoint={mode!r} is not one of {', '.join(ACTIVATION_CHECKPOINT_MODES)}"
        )
    if mode == "none":
        return 0
    if mode == "selective":
        context_fn = selective_checkpoint_context(config.activation_checkpoint_keep)
        chosen = list(blocks.values())
    else:
        context_fn = None
        chosen = [
            block
            for position, (key, block) in enumerate(blocks.items())
            if checkpoints_block(key, position, config)
        ]
    for block in chosen:
        checkpoint_module_activations(block, context_fn)
    return len(chosen)
