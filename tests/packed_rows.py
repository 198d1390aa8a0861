"""What every packed row's positions must hold, whatever source packed it."""

from __future__ import annotations

import torch
from tensordict import TensorDict


def assert_positions_restart_per_row(batch: TensorDict, seq_len: int, bos_id: int) -> None:
    """Every position lies in [0, seq_len); each row's first token has position 0 (a document
    continued from the previous row starts again); within a row positions count on by one per
    document and are 0 at each BOS. And some row continues a document (else this says nothing
    about continued ones)."""
    positions, tokens, documents = batch["positions"], batch["tokens"], batch["document_ids"]
    assert ((positions >= 0) & (positions < seq_len)).all(), int(positions.max())
    assert (positions[:, 0] == 0).all(), positions[:, 0]
    same = documents[:, 1:] == documents[:, :-1]
    assert torch.equal(positions[:, 1:][same], positions[:, :-1][same] + 1)
    assert (positions[:, 1:][~same] == 0).all() and (tokens[:, 1:][~same] == bos_id).all()
    assert (tokens[:, 0] != bos_id).any(), "no row continues a document"
