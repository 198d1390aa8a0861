"""Rotary position embedding on interleaved pairs, with Llama 3.1 or YaRN frequency scaling.

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

__all__ = [
    "RopeScaling",
    "RotaryEmbedding",
    "YarnScaling",
    "apply_rotary",
    "rope_inverse_frequencies",
]


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


@dataclass(kw_only=True, frozen=True)
class YarnScaling:
    """YaRN's frequency interpolation ("YaRN: Efficient Context Window Extension of Large
    Language Models"; Hugging Face `rope_type="yarn"`, as DeepSeek-V3 uses it): pairs that turn
    fewer than `beta_slow` times over the original context are interpolated by `factor`, those
    turning more than `beta_fast` times are kept, with a linear ramp between."""

    factor: float = 40.0
    """How much longer the target context is than the pre-training context."""
    original_max_position_embeddings: int = 4096
    """Context length the unscaled model was pre-trained with."""
    beta_fast: float = 32.0
    """Rotations over the original context above which a pair keeps its frequency."""
    beta_slow: float = 1.0
    """Rotations over the original context below which a pair is fully interpolated."""
    mscale: float = 1.0
    """Numerator of the rotation's magnitude factor (`0.1 mscale ln(factor) + 1`)."""
    mscale_all_dim: float = 0.0
    """Denominator of that factor, and DeepSeek's softmax-scale correction (0: none)."""
    truncate: bool = True
    """Round the ramp's ends to whole pairs (DeepSeek); gpt-oss keeps them fractional."""

    @staticmethod
    def magnitude(factor: float, mscale: float) -> float:
        """YaRN's `0.1 mscale ln(factor) + 1` (1 where the context is not extended)."""
        return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0

    @property
    def attention_factor(self) -> float:
        """What cos and sin are multiplied by."""
        if self.mscale and self.mscale_all_dim:
            return self.magnitude(self.factor, self.mscale) / self.magnitude(
                self.factor, self.mscale_all_dim
            )
        return self.magnitude(self.factor, 1.0)

    @property
    def softmax_scale_factor(self) -> float:
        """What DeepSeek multiplies the attention's softmax scale by (the magnitude of
        `mscale_all_dim`, squared)."""
        if not self.mscale_all_dim:
            return 1.0
        return self.magnitude(self.factor, self.mscale_all_dim) ** 2

    def inverse_frequencies(self, inv_freq_F: Tensor, theta: float) -> Tensor:
        """The interpolated frequencies of the unscaled `inv_freq_F`."""
        pairs = inv_freq_F.numel()
        head_dim, original = 2 * pairs, self.original_max_position_embeddings

        def pair_turning(rotations: float) -> float:
            # the (fractional) pair index that turns `rotations` times over the original context
            return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

        low, high = pair_turning(self.beta_fast), pair_turning(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, head_dim - 1)
        width = (high - low) or 0.001
        ramp_F = ((torch.arange(pairs, dtype=torch.float32) - low) / width).clamp(0, 1)
        return inv_freq_F / self.factor * ramp_F + inv_freq_F * (1 - ramp_F)


def rope_inverse_frequencies(
    head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None
) -> Tensor:
    """`theta^(-2i/D)` for each pair i, rescaled by `scaling` if it is given."""
    inv_freq_F = 1.0 / (
        theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    )
    if scaling is None:
        return inv_freq_F
    if isinstance(scaling, YarnScaling):
        return scaling.inverse_frequencies(inv_freq_F, theta)
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

    def __init__(
        self, head_dim: int, theta: float, scaling: RopeScaling | YarnScaling | None = None
    ) -> None:
        super().__init__()
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling

    def forward(self, positions_BS: Tensor) -> tuple[Tensor, Tensor]:
        """`(cos_BSF, sin_BSF)` in float32 for integer positions `[B, S]` (or `[S]`)."""
        inv_freq_F = rope_inverse_frequencies(self.head_dim, self.theta, self.scaling)
        angles_BSF = positions_BS.float().unsqueeze(-1) * inv_freq_F.to(positions_BS.device)
        if isinstance(self.scaling, YarnScaling) and self.scaling.attention_factor != 1.0:
            factor = self.scaling.attention_factor
            return angles_BSF.cos() * factor, angles_BSF.sin() * factor
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
