"""Parameters that can produce any block of themselves on demand: the one mechanism by which a
sharded model reads a checkpoint.

A `BlockSource` stands for one parameter of a model: asked for a block (a step-1 slice per dim),
it reads only what covers that block. `CheckpointBlock` is a checkpoint tensor as it is (or with
rows reordered within groups, as RoPE's per-head reorder does); `StackedBlocks` is a parameter
stacked from several checkpoint tensors (an MoE layer's experts, one tensor each in Hugging Face
files); the upcycling sources (`pipekit.checkpoint.upcycle`) copy dense FFNs into experts and draw
routers. `fill_from_sources` turns a name -> source mapping into the filler that
`pipekit.checkpoint.local_shards.load_local_blocks` asks for each rank's local blocks, so a
Hugging Face load and an online upcycle read exactly the bytes a rank owns, where they can
straight into the rank's storage (`BlockSource.read_into`).
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from pipekit.checkpoint.local_shards import BlockFiller
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint, takes_file_rows

__all__ = ["BlockSource", "CheckpointBlock", "StackedBlocks", "fill_from_sources"]


class BlockSource(abc.ABC):
    """One parameter, any block of which can be produced on demand."""

    shape: tuple[int, ...]
    dtype: torch.dtype

    @abc.abstractmethod
    def read(self, index: Sequence[slice]) -> Tensor:
        """The block `index` (a step-1 slice per dim) of this parameter, on CPU."""

    def read_into(self, index: Sequence[slice], out: Tensor) -> None:
        """Write the block `index` into `out` (a rank's storage of that block). This default
        reads the block, then copies it; a source that can read straight into `out` overrides
        it, so no block-sized temporary is allocated and touched."""
        block = self.read(index)
        if block.shape != out.shape:
            raise ValueError(
                f"the source gave a {list(block.shape)} block for storage of shape "
                f"{list(out.shape)}; the model and its checkpoint disagree"
            )
        out.copy_(block)

    @staticmethod
    def _check_rows(index: Sequence[slice], out: Tensor) -> None:
        """A source that fills `out` row by row checks the row count up front (each row's
        shape is checked where it is written)."""
        rows = index[0].stop - index[0].start
        if out.shape[0] != rows:
            raise ValueError(
                f"block rows {index[0].start}:{index[0].stop} do not fit storage of shape "
                f"{list(out.shape)}; the model and its checkpoint disagree"
            )

    def read_all(self) -> Tensor:
        return self.read(tuple(slice(0, size) for size in self.shape))


class CheckpointBlock(BlockSource):
    """A checkpoint tensor copied as it is, or with its rows reordered within groups.

    `row_order` (e.g. RoPE's per-head reorder) gives, for each row of a group of
    `len(row_order)` rows, the group's checkpoint row it holds. A block of whole rows is read
    as the whole groups that cover it, each checkpoint row straight into the storage row that
    holds it (one scattered read; the covering rows outside the block land in a scratch row).
    """

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        name: str,
        *,
        row_order: Sequence[int] | None = None,
    ) -> None:
        info = checkpoint.info(name)
        self.checkpoint, self.name = checkpoint, name
        self.shape, self.dtype = info.shape, info.dtype
        if row_order is not None and sorted(row_order) != list(range(len(row_order))):
            raise ValueError(f"row_order {list(row_order)} is not a permutation of its rows")
        self.row_order = None if row_order is None else tuple(row_order)

    def read_into(self, index: Sequence[slice], out: Tensor) -> None:
        if self.row_order is None:
            self.checkpoint.read_block_into(self.name, index, out)
        elif self._is_direct(index, out):
            self._check_rows(index, out)
            groups = self._whole_groups(index)[0]
            group, rows = len(self.row_order), index[0]
            destinations: list[int | None] = [None] * (groups.stop - groups.start)
            for row in range(rows.start, rows.stop):
                source = row // group * group + self.row_order[row % group]
                destinations[source - groups.start] = row - rows.start
            self.checkpoint.read_rows_scattered(self.name, groups, out, destinations)
        else:
            super().read_into(index, out)

    def _is_direct(self, index: Sequence[slice], out: Tensor) -> bool:
        """Whether `out` can take whole file rows as they are: a block of whole rows, in the
        file's dtype, contiguous, on CPU."""
        whole = all(
            (part.start, part.stop) == (0, size)
            for part, size in zip(index[1:], self.shape[1:], strict=False)
        )
        return whole and out.numel() > 0 and takes_file_rows(out, self.dtype)

    def read(self, index: Sequence[slice]) -> Tensor:
        if self.row_order is None:
            return self.checkpoint.read_block(self.name, index)
        groups_index = self._whole_groups(index)
        groups = self.checkpoint.read_block(self.name, groups_index)
        order = torch.tensor(self.row_order)
        reordered = groups.unflatten(0, (-1, len(order)))[:, order].flatten(0, 1)
        first = groups_index[0].start
        return reordered[index[0].start - first : index[0].stop - first]

    def _whole_groups(self, index: Sequence[slice]) -> tuple[slice, ...]:
        """`index` widened to the whole row groups that cover it."""
        assert self.row_order is not None
        group, rows = len(self.row_order), index[0]
        first = rows.start // group * group
        last = -(-rows.stop // group) * group
        return (slice(first, last), *index[1:])


class StackedBlocks(BlockSource):
    """`[N, ...]`: N sources of one shape stacked on a new leading dim (Hugging Face's
    one-tensor-per-expert files as pipekit's stacked expert weight). A block reads only the
    sources of its leading range, and of each only the block of the rest."""

    def __init__(self, sources: Sequence[BlockSource]) -> None:
        shapes = {source.shape for source in sources}
        dtypes = {source.dtype for source in sources}
        if not sources or len(shapes) != 1 or len(dtypes) != 1:
            raise ValueError(
                f"cannot stack {len(sources)} sources of shapes {sorted(shapes)} and dtypes "
                f"{sorted(map(str, dtypes))}; stacked tensors must all have one shape and dtype"
            )
        self.sources = list(sources)
        self.shape = (len(self.sources), *shapes.pop())
        self.dtype = dtypes.pop()

    def read(self, index: Sequence[slice]) -> Tensor:
        leading, rest = index[0], tuple(index[1:])
        return torch.stack([source.read(rest) for source in self.sources[leading]])

    def read_into(self, index: Sequence[slice], out: Tensor) -> None:
        self._check_rows(index, out)
        leading, rest = index[0], tuple(index[1:])
        for position, source in enumerate(self.sources[leading]):
            source.read_into(rest, out[position])


def fill_from_sources(sources: Mapping[str, BlockSource]) -> BlockFiller:
    """The block filler (`pipekit.checkpoint.local_shards`) over one source per parameter."""

    def fill(name: str, index: Sequence[slice], out: Tensor) -> None:
        if name not in sources:
            raise ValueError(
                f"the model has parameter {name!r}, which no checkpoint source produces; the "
                "model and its checkpoint format disagree"
            )
        try:
            sources[name].read_into(index, out)
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from error

    return fill
