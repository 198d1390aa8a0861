"""RoPE row order of Q/K projections: pipekit's interleaved pairs <-> Hugging Face's halves.

pipekit (like Meta's reference code) rotates the interleaved pairs (x[2i], x[2i+1]) of each head;
Hugging Face rotates (x[i], x[i + head_dim/2]) ("rotate_half"). Both compute the same model once
the rows of every head of wq and wk (and of their biases, and of a per-head QK-norm weight) are
reordered: pipekit row 2i+c of a head is Hugging Face row c*head_dim/2 + i. The reorder stays
inside a head, so a row range of whole heads is the same row range in both layouts.

Shape legend: R rows (output features, whole heads), D input dim (absent for a 1-D weight).
"""

from __future__ import annotations

import torch

__all__ = ["permute_from_hf", "permute_to_hf"]


def permute_to_hf(w_RD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved RoPE pairs to rotate_half halves (a 1-D
    per-head weight, such as a bias or a QK-norm's, is one column)."""
    rows = w_RD.reshape(w_RD.shape[0], -1)
    heads = _whole_heads(rows, head_dim)
    return rows.reshape(heads, head_dim // 2, 2, -1).transpose(1, 2).reshape(w_RD.shape)


def permute_from_hf(w_RD: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Inverse of permute_to_hf: rotate_half halves back to interleaved pairs."""
    rows = w_RD.reshape(w_RD.shape[0], -1)
    heads = _whole_heads(rows, head_dim)
    return rows.reshape(heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(w_RD.shape)


def _whole_heads(w_RD: torch.Tensor, head_dim: int) -> int:
    if w_RD.shape[0] % head_dim:
        raise ValueError(
            f"{w_RD.shape[0]} rows are not whole heads of head_dim={head_dim}; "
            "pass rows that are multiples of head_dim"
        )
    return w_RD.shape[0] // head_dim
