"""Rotary position embedding on interleaved pairs, with Llama 3.1 frequency scaling.

Layout: each head's channels (2i, 2i+1) form one rotating pair (Meta's and torchtitan's layout;
Hugging Face checkpoints rotate halves instead, which the checkpoint adapter fixes by permuting
the Q/K projection rows). Angles are computed from the given positions on every call, so
positions may start anywhere (slice j of a sequence has positions [j*s, (j+1)*s)) and no
max-length table exists. Frequencies and angles are float32, exactly as the reference Llama code
computes them, so that converted checkpoints reproduce its logits.

Legend: B batch, S sequence, H heads, D head dim, F = D/2 rotating pairs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

__all__ = ["RopeScaling", "RotaryEmbedding", "apply_rotary", "rope_inverse_frequencies"]


@dataclass(kw_only=True, frozen=True)
class RopeScaling:
    """Llama 3.1's piecewise rescaling of RoPE frequencies (Hugging Face `rope_type="llama3"`)."""

    factor: float = 8.0
    """How much longer the target context is than the pre-training context."""
    low_freq_factor: float = 1.0
    """Wavelengths above original_max_position_embeddings / low_freq_factor: divided by factor."""
    high_freq_factor: float = 4.0
    """Wavelengths below original_max_position_embeddings / high_freq_factor are kept."""
    original_max_position_embeddings: int = 8192
    """Context length the unscaled model was pre-trained with."""


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | None = None
) -> Tensor:
    """`theta^(-2i/D)` for each pair i, rescaled piecewise by wavelength if `scaling` is given."""
    inv_freq_F = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if scaling is None:
        return inv_freq_F
    low_freq_wavelen = scaling.original_max_position_embeddings / scaling.low_freq_factor
    high_freq_wavelen = scaling.original_max_position_embeddings / scaling.high_freq_factor
    wavelen_F = 2 * math.pi / inv_freq_F
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated.
    scaled_F = torch.where(wavelen_F > low_freq_wavelen, inv_freq_F / scaling.factor, inv_freq_F)
    smooth_F = (scaling.original_max_position_embeddings / wavelen_F - scaling.low_freq_factor) / (
        scaling.high_freq_factor - scaling.low_freq_factor
    )
    interpolated_F = (1 - smooth_F) * scaled_F / scaling.factor + smooth_F * scaled_F
    in_band_F = (wavelen_F >= high_freq_wavelen) & (wavelen_F <= low_freq_wavelen)
    return torch.where(in_band_F, interpolated_F, scaled_F)


class RotaryEmbedding(nn.Module):
    """Maps positions to the (cos, sin) of every pair's rotation angle.

    It holds no buffer: the D/2 frequencies are recomputed per call (negligible next to one
    layer), so casting the model to bfloat16 cannot degrade them and there is nothing to init.
    """

    def __init__(self, head_dim: int, theta: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def forward(self, positions_BS: Tensor) -> tuple[Tensor, Tensor]:
        """`(cos_BSF, sin_BSF)` in float32 for integer positions `[B, S]` (or `[S]`)."""
        inv_freq_F = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        angles_BSF = positions_BS.float().unsqueeze(-1) * inv_freq_F.to(positions_BS.device)
        return angles_BSF.cos(), angles_BSF.sin()


def apply_rotary(x_BSHD: Tensor, cos_BSF: Tensor, sin_BSF: Tensor) -> Tensor:
    """Rotate each interleaved pair of every head by its angle; keeps x's dtype.

    Works on the projections' natural `[B, S, H, D]` layout (contiguous, so the elementwise
    work streams through memory) before heads are moved in front of the sequence.
    """
    cos_BS1F = cos_BSF.unsqueeze(-2).to(x_BSHD.dtype)
    sin_BS1F = sin_BSF.unsqueeze(-2).to(x_BSHD.dtype)
    pairs = x_BSHD.unflatten(-1, (-1, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    rotated = torch.stack(
        (even * cos_BS1F - odd * sin_BS1F, even * sin_BS1F + odd * cos_BS1F), dim=-1
    )
    return rotated.flatten(-2)
