"""Hugging Face tensors that hold decoder parameters otherwise than one as it is: several fused
into one, or transposed (gpt-oss's experts).

A `DecoderLayout` lists such tensors (`custom`); the decoder format then lists each once
(under its first parameter), builds it from its parameters' whole tensors on save (every rank of
a sharded model sends its blocks to the tensor's writer, `pipekit.checkpoint.hf_export`), and
loads each parameter through the tensor's block source, which reads only the rows (experts)
the block covers, so an expert-parallel rank or a pipeline stage reads its own part. The
parameters of one fused tensor share its reads: their blocks, asked for one after another (as a
load does), take the tensor's rows off disk once.

`InterleavedTensor` is the one kind the decoder formats need: the parameters (one shape each),
each with its last two dims swapped when `transposed`, interleaved along the last dim. For
gpt-oss's experts:

    Hugging Face: model.layers.L.mlp.experts.   pipekit: layers.L.feed_forward.experts.
    gate_up_proj       [E, D, 2F]   [e, :, 2f] = w1_EFD[e, f]   [e, :, 2f+1] = w3_EFD[e, f]
    gate_up_proj_bias  [E, 2F]      [e, 2f] = b1_EF[e, f]       [e, 2f+1] = b3_EF[e, f]
    down_proj          [E, F, D]    w2_EDF transposed (one parameter, nothing interleaved)

Shape legend: E experts, F expert hidden dim, D model dim, P parameters interleaved.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from pipekit.checkpoint.block_sources import BlockSource
from pipekit.checkpoint.safetensors_io import SafetensorsCheckpoint

__all__ = ["CustomLayerTensor", "InterleavedBlock", "InterleavedTensor"]


class CustomLayerTensor(Protocol):
    """A Hugging Face tensor within `model.layers.L` built from, and read into, parameters of
    block L by code of its own rather than copied."""

    hf_name: str
    """Its name within `model.layers.L`."""
    params: tuple[str, ...]
    """The parameters (names within the block) it holds, in the order `to_hf` takes them."""

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """Its shape, from its parameters' (one) shape."""
        ...

    def to_hf(self, tensors: Sequence[Tensor]) -> Tensor:
        """The tensor, from its parameters' whole tensors (in `params` order)."""
        ...

    def source(self, checkpoint: SafetensorsCheckpoint, name: str, position: int) -> BlockSource:
        """Parameter `params[position]` as a block source over tensor `name` of `checkpoint`."""
        ...


@dataclass(frozen=True)
class InterleavedTensor:
    """`params` (each `[..., A, B]`, swapped to `[..., B, A]` when `transposed`) interleaved
    along the last dim: element k of parameter p is last-dim element P*k + p of the tensor."""

    hf_name: str
    params: tuple[str, ...]
    transposed: bool = False

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        if self.transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        return (*shape[:-1], shape[-1] * len(self.params))

    def to_hf(self, tensors: Sequence[Tensor]) -> Tensor:
        views = [tensor.transpose(-1, -2) if self.transposed else tensor for tensor in tensors]
        return torch.stack(views, dim=-1).flatten(-2)

    def source(
        self, checkpoint: SafetensorsCheckpoint, name: str, position: int
    ) -> InterleavedBlock:
        return InterleavedBlock(checkpoint, name, position, len(self.params), self.transposed)


class _SharedRows:
    """The last block read of one fused checkpoint tensor, kept until each of its `parts`
    parameters has taken it (then dropped), so that they read the interleaved rows once."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.index: tuple[slice, ...] | None = None
        self.block: Tensor | None = None
        self.waiting: set[int] = set()

    def take(
        self, checkpoint: SafetensorsCheckpoint, name: str, index: tuple[slice, ...], position: int
    ) -> Tensor:
        if self.block is None or index != self.index or position not in self.waiting:
            self.block = checkpoint.read_block(name, index)
            self.index, self.waiting = index, set(range(self.parts))
        block = self.block
        self.waiting.discard(position)
        if not self.waiting:
            self.block = self.index = None
        return block


_SHARED_ROWS: weakref.WeakKeyDictionary[SafetensorsCheckpoint, dict[str, _SharedRows]] = (
    weakref.WeakKeyDictionary()
)
"""Per open checkpoint, the shared reads of each fused tensor (gone with the checkpoint)."""


class InterleavedBlock(BlockSource):
    """Parameter `position` of the `parts` interleaved along the last dim of a checkpoint
    tensor (its last two dims swapped back when `transposed`). A block reads the checkpoint
    block of the same leading rows (experts), so a rank reads only its experts; along the
    interleaved dim that block holds the other parameters' elements too, which the next of
    them to ask for the same block takes without reading again."""

    def __init__(
        self,
        checkpoint: SafetensorsCheckpoint,
        name: str,
        position: int,
        parts: int,
        transposed: bool,
    ) -> None:
        info = checkpoint.info(name)
        if len(info.shape) < (3 if transposed else 2) or info.shape[-1] % parts:
            raise ValueError(
                f"{name} has shape {list(info.shape)}, which does not hold {parts} interleaved "
                f"parameters{' transposed' if transposed else ''}; the checkpoint and the "
                "layout disagree"
            )
        shape = (*info.shape[:-1], info.shape[-1] // parts)
        if transposed:
            shape = (*shape[:-2], shape[-1], shape[-2])
        self.checkpoint, self.name = checkpoint, name
        self.position, self.parts, self.transposed = position, parts, transposed
        self.shape, self.dtype = shape, info.dtype
        self._rows = _SHARED_ROWS.setdefault(checkpoint, {}).setdefault(name, _SharedRows(parts))

    def read(self, index: Sequence[slice]) -> Tensor:
        index = tuple(index)
        if self.transposed:
            index = (*index[:-2], index[-1], index[-2])
        columns = index[-1]
        file_columns = slice(columns.start * self.parts, columns.stop * self.parts)
        file_index = (*index[:-1], file_columns)
        block = self._rows.take(self.checkpoint, self.name, file_index, self.position)
        block = block[..., self.position :: self.parts]
        return block.transpose(-1, -2) if self.transposed else block
