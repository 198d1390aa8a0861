"""Qwen3 and Qwen3-MoE: args and flavors, the models, and their Hugging Face formats."""

from pipekit.families.qwen3.args import (
    QWEN3_FLAVORS,
    QWEN3_MOE_FLAVORS,
    Qwen3Args,
    Qwen3MoEArgs,
    qwen3_flavor,
    qwen3_moe_flavor,
)
from pipekit.families.qwen3.model import Qwen3, Qwen3Attention, Qwen3MoE

__all__ = [
    "QWEN3_FLAVORS",
    "QWEN3_MOE_FLAVORS",
    "Qwen3",
    "Qwen3Args",
    "Qwen3Attention",
    "Qwen3MoE",
    "Qwen3MoEArgs",
    "qwen3_flavor",
    "qwen3_moe_flavor",
]
