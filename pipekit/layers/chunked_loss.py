"""The output projection and cross-entropy computed a chunk of tokens at a time, forward and
backward, so that no more than one chunk's logits ever exist.

Unchunked, the output layer of a 128K-vocabulary model makes `N x V` logits for N tokens (16 GiB
in float32 at 32K tokens), keeps them for the backward and makes their gradient there. Here the
tokens are cut into chunks of `chunk_tokens`; for each, the forward computes the chunk's logits,
the logits transforms, the token-sum cross-entropy and at once its gradients with respect to
the chunk's hidden states and the projection's weight (and bias), then frees the logits. The
backward only scales those gradients by the loss's incoming gradient. The cost is the memory of
one chunk's logits (and their gradient) plus a gradient the size of the hidden states and one
the size of the weight; the FLOPs are the unchunked ones.

A weight that is a DTensor sharded on the vocabulary (tensor parallelism) gives each chunk's
logits as vocabulary shards, and the cross-entropy runs under torch's `loss_parallel()`, as the
unchunked head's does. Without gradients (validation) the chunks compute the loss alone.

Legend: N tokens, D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.distributed.tensor import DTensor, Replicate

from pipekit._torch_private import loss_parallel_once
from pipekit.layers.loss import token_sum_cross_entropy

__all__ = ["chunked_linear_cross_entropy", "head_peak_bytes"]

Transform = Callable[[Tensor], Tensor]


def _chunk_loss_sum(
    hidden_cD: Tensor,
    labels_c: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None,
    transforms: Sequence[Transform],
) -> Tensor:
    """The token-sum cross-entropy of one chunk, through the projection and the transforms."""
    if isinstance(weight_VD, DTensor):  # vocabulary shards: every rank holds the whole chunk
        hidden_cD = DTensor.from_local(
            hidden_cD, weight_VD.device_mesh, [Replicate()] * weight_VD.device_mesh.ndim,
            run_check=False,
        )  # fmt: skip
    logits_cV = F.linear(hidden_cD, weight_VD, bias_V)
    for transform in transforms:
        logits_cV = transform(logits_cV)
    return token_sum_cross_entropy(logits_cV.unsqueeze(0), labels_c.unsqueeze(0), 1.0)


def _loss_parallel_if_sharded(weight_VD: Tensor) -> contextlib.AbstractContextManager[None]:
    """torch's loss parallelism around a chunk's cross-entropy, forward and backward, when the
    weight (so the logits) is split by vocabulary."""
    return loss_parallel_once() if isinstance(weight_VD, DTensor) else contextlib.nullcontext()


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Forward: the loss sum and every gradient, chunk by chunk; backward: those, scaled."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        transforms: Sequence[Transform],
        chunk_tokens: int,
        hidden_ND: Tensor,
        labels_N: Tensor,
        weight_VD: Tensor,
        bias_V: Tensor | None,
    ) -> Tensor:
        grad_hidden_ND = torch.empty_like(hidden_ND)
        grad_weight_VD = torch.zeros_like(weight_VD)
        grad_bias_V = torch.zeros_like(bias_V) if bias_V is not None else None
        loss_sum = hidden_ND.new_zeros(
            (), dtype=torch.promote_types(hidden_ND.dtype, torch.float32)
        )
        for start in range(0, hidden_ND.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            with torch.enable_grad(), _loss_parallel_if_sharded(weight_VD):
                hidden_cD = hidden_ND[start:stop].detach().requires_grad_()
                weight = weight_VD.detach().requires_grad_()
                bias = bias_V.detach().requires_grad_() if bias_V is not None else None
                loss = _chunk_loss_sum(hidden_cD, labels_N[start:stop], weight, bias, transforms)
                inputs = [hidden_cD, weight] + ([bias] if bias is not None else [])
                grads = torch.autograd.grad(loss, inputs)
            grad_hidden_ND[start:stop] = grads[0]
            grad_weight_VD += grads[1]
            if grad_bias_V is not None:
                grad_bias_V += grads[2]
            loss_sum += loss.detach()
        ctx.save_for_backward(grad_hidden_ND, grad_weight_VD, grad_bias_V)
        return loss_sum

    @staticmethod
    def backward(ctx: Any, grad_loss: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        grad_hidden_ND, grad_weight_VD, grad_bias_V = ctx.saved_tensors
        scaled_bias = grad_bias_V * grad_loss if grad_bias_V is not None else None
        return None, None, grad_hidden_ND * grad_loss, None, grad_weight_VD * grad_loss, scaled_bias


def chunked_linear_cross_entropy(
    hidden_ND: Tensor,
    labels_N: Tensor,
    weight_VD: Tensor,
    bias_V: Tensor | None = None,
    transforms: Sequence[Transform] = (),
    chunk_tokens: int = 1024,
) -> Tensor:
    """`sum over tokens of CE(transforms(hidden @ weight.T + bias), labels)` (labels of
    `IGNORE_INDEX` skipped), as `token_sum_cross_entropy` of the whole logits would give it,
    holding one chunk's logits at a time. `hidden_ND` is plain (this rank's tokens); each
    transform must act on every logit alone (the model contract's `logits_transforms`)."""
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens={chunk_tokens} must be >= 1")
    needs_grad = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden_ND, weight_VD, bias_V)
    )
    if needs_grad:
        return _ChunkedLinearCrossEntropy.apply(
            tuple(transforms), chunk_tokens, hidden_ND, labels_N, weight_VD, bias_V
        )
    loss_sum = hidden_ND.new_zeros((), dtype=torch.promote_types(hidden_ND.dtype, torch.float32))
    with _loss_parallel_if_sharded(weight_VD):
        for start in range(0, hidden_ND.shape[0], chunk_tokens):
            stop = start + chunk_tokens
            loss_sum += _chunk_loss_sum(
                hidden_ND[start:stop], labels_N[start:stop], weight_VD, bias_V, transforms
            )
    return loss_sum


def head_peak_bytes(
    tokens: int, vocab: int, dim: int, chunk_tokens: int | None = None, element_bytes: int = 4
) -> int:
    """The head's peak bytes beyond its inputs, forward and backward. Unchunked
    (`chunk_tokens=None`): the logits, the cross-entropy's log-probabilities and the logits'
    gradient, all N x V at once. Chunked: those three for one chunk of C tokens, with the
    chunk's gradients as autograd returns them (C x D and V x D) beside the two kept for the
    backward (N x D and V x D)."""
    if chunk_tokens is None:
        return element_bytes * 3 * tokens * vocab
    chunk = min(chunk_tokens, tokens)
    return element_bytes * (3 * chunk * vocab + chunk * dim + tokens * dim + 2 * vocab * dim)
