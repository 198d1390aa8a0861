"""Llama with mixture-of-experts FFNs (Mixtral-like): args and flavors, and the model."""

from pipekit.families.llama_moe.args import LLAMA_MOE_FLAVORS, LlamaMoEArgs, llama_moe_flavor
from pipekit.families.llama_moe.model import LlamaMoE

__all__ = ["LLAMA_MOE_FLAVORS", "LlamaMoE", "LlamaMoEArgs", "llama_moe_flavor"]
