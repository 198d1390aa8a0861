"""Cross-entropy normalised by the global number of label tokens.

Each micro-batch contributes `sum(token losses) / global_label_tokens`, where the count covers
every data-parallel rank and every accumulation micro-step of the optimizer step. Summing these
over micro-steps and ranks gives exactly the mean over the global batch, whatever the split, so
sliced, accumulated and data-parallel losses equal the single-process one.

Legend: B batch, S sequence, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor

__all__ = ["IGNORE_INDEX", "count_label_tokens", "token_sum_cross_entropy"]

IGNORE_INDEX = -100
"""Label of a position that has no next-token target (cross-entropy skips it)."""


def count_label_tokens(labels_BS: Tensor) -> Tensor:
    """Number of labels that count (not IGNORE_INDEX), as a 0-dim int64 tensor."""
    return (labels_BS != IGNORE_INDEX).sum()


def token_sum_cross_entropy(
    logits_BSV: Tensor, labels_BS: Tensor, normaliser: Tensor | float
) -> Tensor:
    """`sum over tokens of CE / normaliser`, computed in float32 (or float64 for float64 logits).

    Logits sharded on the vocabulary (a DTensor, under tensor parallelism's loss parallelism)
    need torch's `loss_parallel()` context around this call and the backward; the loss comes
    back a plain tensor, equal on every rank."""
    loss_sum = F.cross_entropy(
        logits_BSV.flatten(0, 1).to(torch.promote_types(logits_BSV.dtype, torch.float32)),
        labels_BS.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
    if isinstance(loss_sum, DTensor):  # replicated: every rank holds the whole sum
        loss_sum = loss_sum.to_local()
    return loss_sum / normaliser
