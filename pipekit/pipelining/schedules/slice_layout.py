"""`SliceLayout`: how a pipeline cuts every sequence into slices, held once.

The plan, the runner's layouts and the features that depend on slices (context parallelism,
context exchange) read one value instead of keeping their own count: the bounds of the
slices in the whole sequence, the context-parallel ranks sharing each slice, and how the
bounds were cut.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from pipekit.attention.work import (
    SlicedTileKeys,
    attention_work,
    rows_or_one_sequence,
    token_costs,
)
from pipekit.pipelining.schedules.slice_bounds import cost_slice_bounds, minimax_slice_bounds

__all__ = ["SliceLayout"]


@dataclass(frozen=True)
class SliceLayout:
    """`bounds`: token offsets, from 0 to the sequence length, where the slices of a whole
    sequence start and end (before context parallelism splits each slice over
    `context_parallel` ranks); `slicing`: how they were cut (`slice_bounds.SLICINGS`).
    With "documents", `bounds` are the planning shape's (one causal sequence) and each
    microbatch is cut by its own attention work (`microbatch_bounds`), on multiples of
    `granularity` tokens, attention weighing `attention_to_linear` of the linear work of one
    causal sequence, counted in the attention kernel's `work_block`-token tiles."""

    bounds: tuple[int, ...]
    context_parallel: int = 1
    slicing: str = "equal_length"
    granularity: int = 1
    attention_to_linear: float = 0.0
    work_block: int = 1

    def __post_init__(self) -> None:
        steps = list(itertools.pairwise(self.bounds))
        if len(self.bounds) < 2 or self.bounds[0] != 0 or any(end <= start for start, end in steps):
            raise ValueError(
                f"slice bounds {self.bounds} must rise from 0 to the sequence length, one "
                "slice at least"
            )
        uneven = [end - start for start, end in steps if (end - start) % self.context_parallel]
        if uneven:
            raise ValueError(
                f"slices of {uneven} tokens do not split over context_parallel="
                f"{self.context_parallel} ranks; choose bounds that are multiples of it"
            )

    @property
    def num_slices(self) -> int:
        return len(self.bounds) - 1

    @property
    def lengths(self) -> tuple[int, ...]:
        """Tokens of one sequence in each slice, per context-parallel rank."""
        return tuple(
            (end - start) // self.context_parallel for start, end in itertools.pairwise(self.bounds)
        )

    @property
    def rank_bounds(self) -> tuple[int, ...]:
        """Token offsets of the slices in the sequence one context-parallel rank holds (its
        share of every slice, in slice order): what the runner cuts."""
        return tuple(itertools.accumulate(self.lengths, initial=0))

    @property
    def fractions(self) -> tuple[float, ...]:
        """`bounds` as fractions of the sequence (for `CostModel.slice_bounds`)."""
        return tuple(bound / self.bounds[-1] for bound in self.bounds)

    @property
    def longest(self) -> int:
        """Tokens of one sequence in the longest slice, per context-parallel rank."""
        return max(self.lengths)

    @property
    def label(self) -> str:
        """The layout in a few words, for logs."""
        return f"num_slices={self.num_slices} {self.slicing}"

    @property
    def per_microbatch(self) -> bool:
        """Whether each microbatch is cut by its own batch (slicing "documents")."""
        return self.slicing == "documents"

    @property
    def attention_per_key(self) -> float:
        """One key's attention work in units of one token's linear work: a causal sequence's
        attention, `S (S + 1) / 2` keys, is `attention_to_linear` of its `S` tokens' linear work."""
        return 2 * self.attention_to_linear / (self.bounds[-1] + 1)

    def token_costs(self, document_ids_BS: Tensor | None) -> Tensor:
        """Each token position's work in one microbatch whose rows carry `document_ids_BS`
        (None: one causal sequence per row), summed over its rows (they share the slices), in
        units of one token's linear work. Every layer is counted as causal attention (windowed
        or chunked layers see fewer keys: their work is overestimated, never dropped), by the
        keys of the tiles the kernel computes, aligned at the row's start: short documents cost
        their whole tiles."""
        seq_len = self.bounds[-1]
        costs_BS = token_costs(
            document_ids_BS, [None], 1.0, self.attention_per_key, seq_len, self.work_block
        )
        return costs_BS.sum(0)

    def slice_attention(
        self, document_ids_BS: Tensor | None, bounds: tuple[int, ...]
    ) -> list[float]:
        """Each slice's attention keys (as `token_costs` counts them, summed over the rows) when
        the microbatch is cut at `bounds`; in kernel tiles (`work_block` > 1) as the sliced
        kernel computes them, each KV chunk tiled from its own first token (`SlicedTileKeys`)."""
        ids_BS = rows_or_one_sequence(document_ids_BS, self.bounds[-1])
        if self.work_block > 1:
            return [
                float(keys) for keys in SlicedTileKeys(ids_BS, self.work_block).per_slice(bounds)
            ]
        keys_S = attention_work(ids_BS, [None]).sum(0).to(torch.float64)
        return [float(keys_S[start:end].sum()) for start, end in itertools.pairwise(bounds)]

    def slice_costs(self, document_ids_BS: Tensor | None, bounds: tuple[int, ...]) -> list[float]:
        """Each slice's linear plus attention work, in units of one token's linear work."""
        rows = rows_or_one_sequence(document_ids_BS, self.bounds[-1]).shape[0]
        return [
            rows * (end - start) + self.attention_per_key * keys
            for (start, end), keys in zip(
                itertools.pairwise(bounds),
                self.slice_attention(document_ids_BS, bounds),
                strict=True,
            )
        ]

    def microbatch_bounds(self, document_ids_BS: Tensor | None) -> tuple[int, ...]:
        """The bounds of one microbatch: with "documents", equal work per slice (in kernel
        tiles: the costliest slice as cheap as `minimax_slice_bounds` finds; in keys, equal
        `token_costs`); otherwise `bounds`."""
        if not self.per_microbatch:
            return self.bounds
        if self.work_block == 1:
            return cost_slice_bounds(
                self.token_costs(document_ids_BS), self.num_slices, self.granularity
            )
        ids_BS = rows_or_one_sequence(document_ids_BS, self.bounds[-1])
        tiles = SlicedTileKeys(ids_BS, self.work_block)
        rows, per_key = ids_BS.shape[0], self.attention_per_key

        def slice_cost(start: int, end: int, earlier: Sequence[int]) -> float:
            return rows * (end - start) + per_key * tiles.slice_keys(start, end, earlier)

        return minimax_slice_bounds(slice_cost, self.bounds[-1], self.num_slices, self.granularity)
