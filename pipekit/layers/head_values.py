"""Constant values, one per query head, that follow the heads wherever they are split.

An attention layer whose scores depend on the head (ALiBi's slopes; any bias that needs the
head's global index) holds the values in a `HeadValues` and hands `head_values()` to
`attend(..., bias_H=...)`. The model never needs to know which heads a rank holds: under tensor
parallelism `apply_tensor_parallel` splits every `HeadValues` along the heads (a DTensor sharded
on dim 0, as the column-split query projection's heads are), and a rank's call returns its own
heads' values. Ulysses context parallelism takes each rank's share of those in turn.

The values live in a non-persistent buffer (not in checkpoints, no gradient, no optimizer
state); `reset_parameters` fills it from the values given at construction, so a model built on
the meta device gets them back in `init_weights` (a local shard keeps its own heads' values).

Legend: H query heads.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, distribute_tensor

__all__ = ["HeadValues"]


class HeadValues(nn.Module):
    """One constant per query head (e.g. `HeadValues(alibi_slopes(n_heads))`, or
    `HeadValues(range(n_heads))` for each head's global index); calling it returns the values
    of the heads this rank holds."""

    def __init__(self, values: Sequence[float]) -> None:
        super().__init__()
        self.values = tuple(float(value) for value in values)
        if not self.values:
            raise ValueError("HeadValues needs one value per query head, got none")
        self.register_buffer("values_H", torch.tensor(self.values), persistent=False)

    def reset_parameters(self) -> None:
        """Fill the buffer with the values (a split buffer: its own heads' values)."""
        buffer = self.values_H
        full_H = torch.tensor(self.values, dtype=buffer.dtype, device=buffer.device)
        with torch.no_grad():
            if isinstance(buffer, DTensor):
                shard = distribute_tensor(
                    full_H, buffer.device_mesh, buffer.placements, src_data_rank=None
                )
                buffer.to_local().copy_(shard.to_local())
            else:
                buffer.copy_(full_H)

    def forward(self) -> Tensor:
        """The values of this rank's heads `[H]` (all heads without tensor parallelism)."""
        buffer = self.values_H
        return buffer.to_local() if isinstance(buffer, DTensor) else buffer

    def extra_repr(self) -> str:
        return f"heads={len(self.values)}"
