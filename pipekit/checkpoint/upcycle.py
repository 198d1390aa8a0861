"""Sparse upcycling: a dense checkpoint's FFNs become N experts, read block by block.

Every parameter of the upcycled MoE is a `BlockSource` (`pipekit.checkpoint.block_sources`):
something that can produce any block of it on demand. Copied weights read the same block of the
dense tensor; experts read only the dense FFN rows (or columns) their block covers, once per
distinct piece however many local experts copy it; the router is drawn from a generator seeded
by (seed, parameter name), so every rank and the offline writer draw the same router. The online
loader (`pipekit.checkpoint.local_shards`) and the offline writer (`python -m pipekit.upcycle`)
ask the same sources for different blocks, so their weights agree by construction.

Granular upcycling (He et al., "Upcycling large language models into mixture of experts") cuts
each dense FFN into G pieces along its hidden dim: expert `c·G + g` is piece g of copy c, there
are N·G experts and each token takes k·G of them. The router gives the G pieces of a copy the
same row ("virtual groups"), so top-(k·G) picks whole copies and the top-k softmax gives each
piece 1/G of its copy's weight; the pieces' down projections are scaled by G to undo that. With
the Mixtral router (top-k, then softmax: weights sum to 1) the first forward then equals the
dense model's; with softmax-then-top-k it does not (the weights sum to less than 1).

Legend: N copies, G pieces per copy, E = N·G experts, F dense hidden dim, D model dim.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from pipekit.checkpoint.block_sources import BlockSource, fill_from_sources
from pipekit.checkpoint.local_shards import load_local_blocks
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint, TensorRead
from pipekit.layers.init import name_seed, trunc_normal_
from pipekit.memory.prefault import prefaulting
from pipekit.models.materialize import to_empty_keeping_ties
from pipekit.models.upcycling import Upcycler, UpcycleSpec

__all__ = [
    "ExpertCopies",
    "RouterInit",
    "check_dense_checkpoint",
    "materialize_upcycled",
    "upcycle_model",
]


class ExpertCopies(BlockSource):
    """`[E, ...]` experts, expert c·G + g being piece g of copy c of a dense `source` tensor.

    `split_dim` is the source's hidden (F) dim: 0 for gate/up `[F, D]`, 1 for down `[D, F]`.
    `scale` multiplies every piece (G for the down projections of granular upcycling). A power
    of two is exact in any dtype; another scale is applied in at least float32, and the pieces
    stay in float32 (`dtype`) rather than being rounded back to a half-precision source.
    """

    def __init__(
        self, source: BlockSource, copies: int, granularity: int, split_dim: int, scale: float
    ) -> None:
        if source.shape[split_dim] % granularity:
            raise ValueError(
                f"granularity={granularity} must divide dim {split_dim} of a dense "
                f"{list(source.shape)} FFN weight"
            )
        piece_shape = list(source.shape)
        piece_shape[split_dim] //= granularity
        self.source, self.granularity = source, granularity
        self.split_dim, self.scale = split_dim, scale
        self.piece_size = piece_shape[split_dim]
        self.shape = (copies * granularity, *piece_shape)
        exact = math.frexp(scale)[0] == 0.5  # a power of two
        self.dtype = source.dtype if exact else torch.promote_types(source.dtype, torch.float32)

    def _piece_block(self, piece: int, block: Sequence[slice]) -> tuple[slice, ...]:
        """The dense source's block that `block` of piece `piece` of an expert copies."""
        hidden = block[self.split_dim]
        offset = piece * self.piece_size
        piece_block = list(block)
        piece_block[self.split_dim] = slice(offset + hidden.start, offset + hidden.stop)
        return tuple(piece_block)

    def _read_piece(self, piece: int, block: Sequence[slice]) -> Tensor:
        values = self.source.read(self._piece_block(piece, block))
        return values if self.scale == 1 else values.to(self.dtype) * self.scale

    def read(self, index: Sequence[slice]) -> Tensor:
        experts, block = index[0], index[1:]
        pieces: dict[int, Tensor] = {}
        for expert in range(experts.start, experts.stop):
            piece = expert % self.granularity
            if piece not in pieces:  # each distinct piece is read once
                pieces[piece] = self._read_piece(piece, block)
        count = experts.stop - experts.start
        if len(pieces) == 1:  # the same piece for every expert: a broadcast view, no stacked copy
            (piece,) = pieces.values()
            return piece.unsqueeze(0).expand(count, *piece.shape)
        return torch.stack(
            [pieces[expert % self.granularity] for expert in range(experts.start, experts.stop)]
        )

    def read_into(self, index: Sequence[slice], out: Tensor) -> None:
        """Each distinct piece is read once, straight into the first local expert that copies
        it; the other experts copy that expert's storage. Every owned byte is written once,
        and no block-sized temporary exists (unless a scale needs one)."""
        self._check_rows(index, out)
        experts, block = index[0], index[1:]
        first_with_piece: dict[int, int] = {}
        for position, expert in enumerate(range(experts.start, experts.stop)):
            piece = expert % self.granularity
            if piece in first_with_piece:
                out[position].copy_(out[first_with_piece[piece]])
            elif self.scale == 1:
                self.source.read_into(self._piece_block(piece, block), out[position])
            else:
                out[position].copy_(self._read_piece(piece, block))
            first_with_piece.setdefault(piece, position)


class RouterInit(BlockSource):
    """`[N·G, D]` router: N truncated-normal rows drawn from (seed, name), each repeated G times.

    The N x D draw is small and the same on every rank, so a block is cut from it.
    """

    def __init__(
        self,
        name: str,
        copies: int,
        granularity: int,
        dim: int,
        std: float,
        seed: int,
        dtype: torch.dtype,
    ) -> None:
        self.name, self.copies, self.granularity = name, copies, granularity
        self.dim, self.std, self.seed = dim, std, seed
        self.shape, self.dtype = (copies * granularity, dim), dtype

    def read(self, index: Sequence[slice]) -> Tensor:
        generator = torch.Generator().manual_seed(name_seed(self.seed, self.name))
        rows_ND = torch.empty(self.copies, self.dim, dtype=torch.float32)
        trunc_normal_(rows_ND, self.std, generator=generator)
        rows_ED = rows_ND.repeat_interleave(self.granularity, dim=0).to(self.dtype)
        return rows_ED[tuple(index)]


def check_dense_checkpoint(
    directory: str | os.PathLike[str], upcycler: Upcycler, dense_args: Any
) -> None:
    """CheckpointError unless `directory` holds the dense model of `dense_args` that `upcycler`
    upcycles; reads only config.json and the file headers."""
    with SafetensorsCheckpoint(directory) as checkpoint:
        upcycler.check_dense(checkpoint, dense_args)


def materialize_upcycled(
    module: nn.Module,
    device: torch.device | str,
    directory: str | os.PathLike[str],
    upcycler: Upcycler,
    args: Any,
    spec: UpcycleSpec,
    seed: int,
    *,
    read_log: list[TensorRead] | None = None,
) -> None:
    """Online upcycling: storage on `device` for `module` (a meta model of `args`, or one of
    its pipeline stages, parallelized or not), then its local blocks filled from the dense
    checkpoint in `directory`; blocks read are appended to `read_log` when given; tied weights
    stay tied.

    Uncached checkpoint rows are read past the page cache (`direct_reads`): each dense byte is
    read once and copied into several experts, so caching it only costs fresh pages."""
    to_empty_keeping_ties(module, device)
    with (
        prefaulting(module),
        SafetensorsCheckpoint(directory, read_log=read_log, direct_reads=True) as checkpoint,
    ):
        sources = upcycler.sources(checkpoint, args, spec, seed)
        load_local_blocks(module, fill_from_sources(sources))


def upcycle_model(
    directory: str | os.PathLike[str],
    upcycler: Upcycler,
    dense_args: Any,
    build: Callable[[Any], nn.Module],
    spec: UpcycleSpec,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    parallelize: Callable[[nn.Module], object] | None = None,
    read_log: list[TensorRead] | None = None,
) -> tuple[nn.Module, Any]:
    """Online upcycling of the dense checkpoint in `directory` (a model of `dense_args`) into
    `build(moe args)` of `dtype`: (model, its args).

    The model is built on the meta device and handed to `parallelize` (expert parallelism,
    FSDP2, ...) before it has any storage, so each rank materialises and reads only its own
    blocks (`materialize_upcycled`).
    """
    args = upcycler.moe_args(dense_args, spec)
    with torch.device("meta"):
        model = build(args).to(dtype)
    if parallelize is not None:
        parallelize(model)
    materialize_upcycled(model, device, directory, upcycler, args, spec, seed, read_log=read_log)
    return model, args
