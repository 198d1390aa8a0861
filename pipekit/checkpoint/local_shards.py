"""Fill a parallelized model's local shards block by block, reading nothing a rank does not own.

A model parallelized on the meta device (expert parallelism, FSDP2, tensor or pipeline parallel:
whatever made its parameters DTensors, or left only some modules on this rank) knows, for each
parameter, which block of the global tensor this rank holds. `load_local_blocks` asks a reader
for exactly that block and copies it in, so loading a checkpoint never materialises more than
one block of one tensor beyond the rank's own shards.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit._torch_private import local_shape_and_offset

__all__ = ["BlockReader", "load_local_blocks", "local_block", "local_nbytes"]

BlockReader = Callable[[str, tuple[slice, ...]], Tensor]
"""(parameter name, block of its global tensor) -> that block's values."""


def local_block(param: Tensor) -> tuple[slice, ...]:
    """The block of the global tensor that this rank holds: a slice per dim."""
    if not isinstance(param, DTensor):
        return tuple(slice(0, size) for size in param.shape)
    shape, offset = local_shape_and_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape, strict=True))


def local_nbytes(model: nn.Module) -> int:
    """Bytes of the parameter shards this rank holds."""
    return sum(
        (param.to_local() if isinstance(param, DTensor) else param).nbytes
        for param in model.parameters()
    )


def load_local_blocks(model: nn.Module, read_block: BlockReader) -> None:
    """Copy each parameter's local block from `read_block`.

    Parameters must be materialised (`to_empty`); a rank holding an empty shard reads nothing
    for it. Every block's shape is checked before it is copied.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = param.to_local() if isinstance(param, DTensor) else param
            if local.is_meta:
                raise ValueError(
                    f"{name} is on the meta device; call model.to_empty(device=...) first"
                )
            if local.numel() == 0:
                continue
            index = local_block(param)
            block = read_block(name, index)
            if block.shape != local.shape:
                raise ValueError(
                    f"{name}: the reader gave a {list(block.shape)} block for local shard "
                    f"{[(part.start, part.stop) for part in index]} of shape {list(local.shape)}"
                )
            local.copy_(block)
