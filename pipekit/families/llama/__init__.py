"""Llama 3 dense model: args and flavors, the model, and its Hugging Face adapter."""

from pipekit.families.llama.args import LLAMA_FLAVORS, LlamaArgs, RopeScaling, llama_flavor
from pipekit.families.llama.model import Llama, TransformerBlock

__all__ = ["LLAMA_FLAVORS", "Llama", "LlamaArgs", "RopeScaling", "TransformerBlock", "llama_flavor"]
