"""Every private torch API pipekit uses, in one place (read from torch 2.13.0).

A torch upgrade that moves or changes one of these touches this file only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch._dynamo

__all__ = ["cpu_flash_attention_backward", "cpu_flash_attention_forward", "more_recompiles"]

# (q, k, v, dropout_p=0., is_causal=False, *, attn_mask=None, scale=None) -> (out, logsumexp).
# Rows with no allowed key come back with out = 0 and logsumexp = 0 (not -inf).
cpu_flash_attention_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None)
#   -> (grad_q, grad_k, grad_v); uses the given out and logsumexp as they are.
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


@contextlib.contextmanager
def more_recompiles(limit: int) -> Iterator[None]:
    """Raise dynamo's per-function recompile limit (default 8) inside the block.

    A compiled kernel recompiles per distinct mask_mod and shape; past the limit dynamo silently
    runs the function eagerly, which for FlexAttention materialises the full score matrix.
    """
    with torch._dynamo.config.patch(recompile_limit=limit):
        yield
