"""Switch a model's norms and SwiGLUs to their plain autograd-op forms.

The memory-efficient forms (`rms_norm`, `swiglu`) are the defaults; the plain ones give the
same values and gradients and save more. Benchmarks and tests compare the two on one model.
"""

from __future__ import annotations

from torch import nn

from pipekit.layers.norms import RMSNorm, rms_norm, rms_norm_reference
from pipekit.layers.swiglu import FeedForward, swiglu, swiglu_reference

__all__ = ["set_memory_efficient"]


def set_memory_efficient(model: nn.Module, enabled: bool) -> None:
    """Every `RMSNorm` and `FeedForward` of `model` in its memory-efficient form, or not."""
    for module in model.modules():
        if isinstance(module, RMSNorm):
            module.norm = rms_norm if enabled else rms_norm_reference
        elif isinstance(module, FeedForward):
            module.gate = swiglu if enabled else swiglu_reference
