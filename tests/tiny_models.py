"""The tiny float32 Llama that the distributed tests share."""

from __future__ import annotations

import torch
from torch import nn

from models.llama import Llama, LlamaArgs

TINY_LLAMA = LlamaArgs(
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    vocab_size=64,
    ffn_dim=48,
    rope_scaling=None,
    rope_theta=10000.0,
    max_seq_len=64,
)


def tiny_llama(seed: int = 0, tied: bool = False) -> nn.Module:
    """TINY_LLAMA built on meta, materialised on CPU and initialised from `seed`."""
    with torch.device("meta"):
        model = Llama(TINY_LLAMA.with_updates(tie_embeddings=tied))
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model
