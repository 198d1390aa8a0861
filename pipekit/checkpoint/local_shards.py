"""Fill a parallelized model's local shards block by block, reading nothing a rank does not own.

A model parallelized on the meta device (expert parallelism, FSDP2, tensor or pipeline parallel:
whatever made its parameters DTensors, or left only some modules on this rank) knows, for each
parameter, which block of the global tensor this rank holds. `load_local_blocks` asks a reader
for exactly that block and copies it in, so loading a checkpoint never materialises more than
one block of one tensor beyond the rank's own shards.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipekit.models.materialize import local_block

__all__ = ["BlockReader", "RowShard", "load_local_blocks", "local_block", "local_nbytes"]

BlockReader = Callable[[str, tuple[slice, ...]], Tensor]
"""(parameter name, block of its global tensor) -> that block's values."""


@dataclass(frozen=True)
class RowShard:
    """A plain parameter holding rows `[start, start + its rows)` of a `rows`-row whole, its
    split known to the layout rather than to a DTensor (vocabulary rows over pipeline ranks)."""

    start: int
    rows: int


def local_nbytes(model: nn.Module) -> int:
    """Bytes of the parameter shards this rank holds."""
    return sum(
        (param.to_local() if isinstance(param, DTensor) else param).nbytes
        for param in model.parameters()
    )


def load_local_blocks(
    model: nn.Module, read_block: BlockReader, row_shards: Mapping[str, RowShard] | None = None
) -> None:
    """Copy each parameter's local block from `read_block` (a parameter in `row_shards` holds
    rows of a larger whole: its block is shifted to them).

    Parameters must be materialised (`to_empty`); a rank holding an empty shard reads nothing
    for it. Every block's shape is checked before it is copied.
    """
    row_shards = row_shards or {}
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
            if name in row_shards:
                start = row_shards[name].start
                index = (slice(index[0].start + start, index[0].stop + start), *index[1:])
            block = read_block(name, index)
            if block.shape != local.shape:
                raise ValueError(
                    f"{name}: the reader gave a {list(block.shape)} block for local shard "
                    f"{[(part.start, part.stop) for part in index]} of shape {list(local.shape)}"
                )
            local.copy_(block)
