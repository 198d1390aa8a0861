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
from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor

from pipekit.checkpoint.local_shards import BlockFiller
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint

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

    `row_transform` (e.g. RoPE's per-head reorder) mixes rows only inside groups of
    `row_group` rows, so a block is read as the whole groups that cover it, then cut.
    """

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        name: str,
        *,
        row_group: int = 1,
        row_transform: Callable[[Tensor], Tensor] | None = None,
    ) -> None:
        info = checkpoint.info(name)
        self.checkpoint, self.name = checkpoint, name
        self.shape, self.dtype = info.shape, info.dtype
        self.row_group, self.row_transform = row_group, row_transform

    def read_into(self, index: Sequence[slice], out: Tensor) -> None:
        if self.row_transform is None:
            self.checkpoint.read_block_into(self.name, index, out)
        else:
            super().read_into(index, out)

    def read(self, index: Sequence[slice]) -> Tensor:
        if self.row_transform is None:
            return self.checkpoint.read_block(self.name, index)
        rows, rest = index[0], tuple(index[1:])
        first = rows.start // self.row_group * self.row_group
        last = -(-rows.stop // self.row_group) * self.row_group
        groups = self.checkpoint.read_block(self.name, (slice(first, last), *rest))
        return self.row_transform(groups)[rows.start - first : rows.stop - first]


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
