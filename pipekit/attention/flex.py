"""FlexAttention backend: the training kernel on CUDA, an inference kernel on CPU.

`flex_attention` and `create_block_mask` are each wrapped by `torch.compile` once per process
(`compiled_flex_attention`, `_compiled_block_mask`); every call and every module instance shares
them, so a model compiles per distinct shape and mask, not per layer or per call.

Differentiability: on CUDA both outputs carry gradients (FlexAttention's backward accepts a
gradient for the log-sum-exp), so partial results over KV chunks are merged by plain autograd.
CPU limits in torch 2.13, designed around here: compiled FlexAttention on CPU runs inference
only, has no backward at all, and cannot return the lse. On CPU this backend therefore refuses
inputs that require grad (use the "cpu" backend to train) and takes the lse from the tiled CPU
flash kernel on the same mask: exact and never a full-sequence score matrix, but it is a second
attention pass, so flex on CPU is a path for checking the CUDA kernel's numbers and for
inference, not a fast one. Eager FlexAttention could return the lse but materialises the scores.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from pipekit._torch_private import more_recompiles
from pipekit.attention._tiles import mask_dependence
from pipekit.attention.cpu_flash import CpuFlashBackend
from pipekit.attention.masks import MaskMod

__all__ = ["FlexBackend", "compiled_flex_attention"]


# Each distinct mask_mod and shape is one compiled variant; a real job has a handful, a test
# suite or a tool that sees many sequence lengths has more than dynamo's default of 8. Shapes
# are static: with automatic dynamic shapes, torch 2.13 generates CPU flex code that fails to build.
_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    compiled = torch.compile(fn, dynamic=False)

    def call_compiled(*args: object, **kwargs: object) -> object:
        with more_recompiles(_RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return call_compiled


def compiled_flex_attention() -> Callable[..., object]:
    """`flex_attention`, compiled once per process (static shapes)."""
    return _compiled(flex_attention)


def _compiled_block_mask() -> Callable[..., BlockMask]:
    return _compiled(create_block_mask)


class FlexBackend:
    """Compiled FlexAttention with a BlockMask built from the mask_mod (cached for one mask)."""

    name = "flex"
    lse_has_grad = True

    def __init__(self) -> None:
        self._last_block_mask: tuple[tuple[object, ...], MaskMod, BlockMask] | None = None
        self._cpu_lse = CpuFlashBackend()

    def block_mask(self, mask: MaskMod, q_BHSD: Tensor, k_BGKD: Tensor) -> BlockMask:
        """The BlockMask of `mask` for these shapes; the last one is reused, since every layer
        of a model asks for the same mask in turn."""
        batch, heads, q_len, _ = q_BHSD.shape
        key = (id(mask), batch, heads, q_len, k_BGKD.shape[2], q_BHSD.device)
        if self._last_block_mask is not None and self._last_block_mask[0] == key:
            return self._last_block_mask[2]
        per_batch, per_head = mask_dependence(mask, batch, heads, q_BHSD.device)
        block_mask = _compiled_block_mask()(
            mask,
            batch if per_batch else None,
            heads if per_head else None,
            q_len,
            k_BGKD.shape[2],
            device=q_BHSD.device,
        )
        self._last_block_mask = (key, mask, block_mask)  # holding `mask` keeps its id unique
        return block_mask

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """`(out_BHSD, lse_BHS)`; differentiable in both on CUDA, inference only on CPU."""
        block_mask = None if mask is None else self.block_mask(mask, q_BHSD, k_BGKD)
        enable_gqa = q_BHSD.shape[1] != k_BGKD.shape[1]
        if q_BHSD.device.type != "cpu":
            out_BHSD, aux = compiled_flex_attention()(
                q_BHSD,
                k_BGKD,
                v_BGKD,
                block_mask=block_mask,
                scale=scale,
                enable_gqa=enable_gqa,
                return_aux=AuxRequest(lse=True),
            )
            return out_BHSD, aux.lse
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BGKD, v_BGKD)):
            raise RuntimeError(
                "attention backend 'flex' has no backward on CPU (torch 2.13 FlexAttention is "
                "inference-only there); train on CPU with backend='cpu' or 'auto'"
            )
        out_BHSD = compiled_flex_attention()(
            q_BHSD, k_BGKD, v_BGKD, block_mask=block_mask, scale=scale, enable_gqa=enable_gqa
        )
        return out_BHSD, self._cpu_lse.forward_chunk(q_BHSD, k_BGKD, v_BGKD, mask, scale)[1]
