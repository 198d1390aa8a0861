"""Text generation from pipekit and Hugging Face checkpoints (`python -m pipekit.generate`)."""

from pipekit.generate.decode import Sampling, decode_tokens
from pipekit.generate.load import LoadedModel, load_for_generation

__all__ = ["LoadedModel", "Sampling", "decode_tokens", "load_for_generation"]
