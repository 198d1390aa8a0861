"""What the tests against transformers (the reference implementation of the Hugging Face
layouts) share: tiny configs, weights spread wide enough that any mapping mistake shows in the
logits, and checkpoints edited in place to make bad input."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

TINY_HF_CONFIG: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=100,
    intermediate_size=96,
    max_position_embeddings=256,
)
LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}


def spread_weights(model: nn.Module, seed: int = 0) -> None:
    """Larger random weights than an init's: norms in [0.5, 1.5), the rest in [-0.15, 0.15)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.rand(param.shape, generator=generator, dtype=param.dtype)
            param.copy_(0.5 + noise if "norm" in name else (noise - 0.5) * 0.3)


def save_transformers_model(
    model_class: Any, config: Any, directory: Path, dtype: torch.dtype = torch.float32, **save: Any
) -> Any:
    """A transformers model of `config` with spread weights, written by its own
    `save_pretrained` in `dtype` (`save` passes e.g. max_shard_size); returns the model."""
    model = model_class(config).eval()
    spread_weights(model)
    model.to(dtype).save_pretrained(directory, **save)
    return model


def rewrite_weights(directory: Path, edit: Callable[[dict[str, torch.Tensor]], object]) -> None:
    """Apply `edit` to the state dict in directory/model.safetensors."""
    path = directory / "model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})
