"""Fill a parallelized model's local shards block by block, reading nothing a rank does not own.

A model parallelized on the meta device (expert parallelism, FSDP2, tensor or pipeline parallel:
whatever made its parameters DTensors, or left only some modules on this rank) knows, for each
parameter, which block of the global tensor this rank holds. `load_local_blocks` asks a filler
to write exactly that block into the rank's storage, so loading a checkpoint never
materialises more than one block of one tensor beyond the rank's own shards (and none where the
filler reads straight into the storage).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from pipekit.models.materialize import local_block, local_tensor

__all__ = [
    "BlockFiller",
    "RowShard",
    "global_block",
    "load_local_blocks",
    "local_block",
    "local_nbytes",
]

BlockFiller = Callable[[str, tuple[slice, ...], Tensor], None]
"""(parameter name, block of its global tensor, this rank's storage of the block): writes the
block's values into the storage."""


@dataclass(frozen=True)
class RowShard:
    """A plain parameter holding rows `[start, start + its rows)` of a `rows`-row whole, its
    split known to the layout rather than to a DTensor (vocabulary rows over pipeline ranks)."""

    start: int
    rows: int


def local_nbytes(model: nn.Module) -> int:
    """Bytes of the parameter shards this rank holds."""
    return sum(local_tensor(param).nbytes for param in model.parameters())


def global_block(param: Tensor, row_shard: RowShard | None = None) -> tuple[slice, ...]:
    """The block of the whole tensor this rank holds of `param`: its DTensor block, shifted to
    its rows when the parameter itself is a row shard of a larger whole."""
    index = local_block(param)
    if row_shard is None:
        return index
    rows = index[0]
    return (slice(rows.start + row_shard.start, rows.stop + row_shard.start), *index[1:])


def load_local_blocks(
    model: nn.Module, fill_block: BlockFiller, row_shards: Mapping[str, RowShard] | None = None
) -> None:
    """Fill each parameter's local shard with its block through `fill_block` (a parameter in
    `row_shards` holds rows of a larger whole: its block is shifted to them).

    Parameters must be materialised (`to_empty`); a rank holding an empty shard reads nothing
    for it. The filler checks each block's shape against the storage before writing it.
    """
    row_shards = row_shards or {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            local = local_tensor(param)
            if local.is_meta:
                raise ValueError(
                    f"{name} is on the meta device; call model.to_empty(device=...) first"
                )
            if local.numel() == 0:
                continue
            fill_block(name, global_block(param, row_shards.get(name)), local)
