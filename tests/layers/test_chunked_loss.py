"""The chunked output projection and cross-entropy: float64 parity with the unchunked head
(loss and the gradients of hidden states, weight and bias) through logits transforms and
ignored labels, on one process and with the weight split by vocabulary over 2 tensor-parallel
ranks; the bytes it holds, measured against its formula and the unchunked head's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.tensor.parallel import loss_parallel

import pipekit.layers.chunked_loss as chunked_loss
from pipekit.layers.chunked_loss import chunked_linear_cross_entropy, head_peak_bytes
from pipekit.layers.loss import IGNORE_INDEX, token_sum_cross_entropy
from pipekit.memory.live_tensors import PeakTensorMemory
from pipekit.testing import run_on_ranks


def _softcap(logits: torch.Tensor) -> torch.Tensor:
    return 5.0 * torch.tanh(logits / 5.0)


def _inputs(tokens: int = 37, dim: int = 8, vocab: int = 50, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(tokens, dim, generator=generator, dtype=torch.float64)
    weight = torch.randn(vocab, dim, generator=generator, dtype=torch.float64)
    bias = torch.randn(vocab, generator=generator, dtype=torch.float64)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    labels[3:11] = IGNORE_INDEX  # a masked span (a prompt under the chat loss mask)
    return hidden, weight, bias, labels


def _unchunked(hidden, weight, bias, labels, transforms=(_softcap,)):
    logits = F.linear(hidden, weight, bias)
    for transform in transforms:
        logits = transform(logits)
    return token_sum_cross_entropy(logits.unsqueeze(0), labels.unsqueeze(0), 1.0)


def _loss_and_grads(loss_fn, hidden, weight, bias):
    leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
    loss = loss_fn(*leaves)
    return (loss.detach(), *torch.autograd.grad(0.37 * loss, leaves))


@pytest.mark.parametrize("chunk_tokens", [1, 8, 37, 64])
def test_chunked_head_equals_the_whole_head_fp64(chunk_tokens):
    hidden, weight, bias, labels = _inputs()
    expected = _loss_and_grads(lambda h, w, b: _unchunked(h, w, b, labels), hidden, weight, bias)
    got = _loss_and_grads(
        lambda h, w, b: chunked_linear_cross_entropy(h, labels, w, b, (_softcap,), chunk_tokens),
        hidden, weight, bias,
    )  # fmt: skip
    for want, have in zip(expected, got, strict=True):
        assert torch.allclose(have, want, rtol=1e-12, atol=1e-12)
    with torch.no_grad():  # validation: the loss alone, no gradients kept
        loss = chunked_linear_cross_entropy(hidden, labels, weight, bias, (_softcap,), 8)
    assert torch.allclose(loss, expected[0], rtol=1e-12, atol=0)


def test_a_chunk_that_skips_the_transforms_breaks_parity(monkeypatch):
    """Ablation: the transforms are part of what each chunk computes."""
    hidden, weight, bias, labels = _inputs()
    expected = _unchunked(hidden, weight, bias, labels)
    real = chunked_loss._chunk_loss_sum
    monkeypatch.setattr(
        chunked_loss, "_chunk_loss_sum", lambda h, y, w, b, transforms: real(h, y, w, b, ())
    )
    broken = chunked_linear_cross_entropy(hidden, labels, weight, bias, (_softcap,), 8)
    assert not torch.allclose(broken, expected, rtol=1e-3)


def _tensor_parallel_head(rank: int, world_size: int) -> list[float]:
    """The weight and bias split by vocabulary rows over the ranks (the output layer under
    tensor parallelism): the chunked loss and gradients against the whole head's on one rank."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world_size,), mesh_dim_names=("tp",))
    hidden, weight, bias, labels = _inputs(vocab=52)
    expected = _loss_and_grads(lambda h, w, b: _unchunked(h, w, b, labels), hidden, weight, bias)
    hidden_leaf = hidden.clone().requires_grad_()
    weight_leaf = distribute_tensor(weight, mesh, [Shard(0)]).requires_grad_()
    bias_leaf = distribute_tensor(bias, mesh, [Shard(0)]).requires_grad_()
    with loss_parallel():
        loss = chunked_linear_cross_entropy(
            hidden_leaf, labels, weight_leaf, bias_leaf, (_softcap,), 8
        )
        grads = torch.autograd.grad(0.37 * loss, [hidden_leaf, weight_leaf, bias_leaf])
    got = (loss.detach(), grads[0], grads[1].full_tensor(), grads[2].full_tensor())
    return [float((have - want).abs().max()) for want, have in zip(expected, got, strict=True)]


def test_chunked_head_with_vocabulary_shards_equals_the_whole_head_fp64():
    for differences in run_on_ranks(_tensor_parallel_head, 2):
        assert max(differences) <= 1e-12, differences


def test_the_head_holds_one_chunks_logits_as_its_formula_says():
    """Bytes measured on CPU (every tensor the ops allocate, by storage) for the unchunked and
    the chunked head, forward and backward: each equals its formula; chunked at 512 of 4096
    tokens it holds 7x less."""
    tokens, dim, vocab, chunk = 4096, 16, 4096, 512
    generator = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=generator, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=generator, requires_grad=True)
    labels = torch.randint(0, vocab, (tokens,), generator=generator)
    peaks = {}
    for chunk_tokens in (None, chunk):
        with PeakTensorMemory() as memory:
            if chunk_tokens is None:
                loss = _unchunked(hidden, weight, None, labels, ())
            else:
                loss = chunked_linear_cross_entropy(hidden, labels, weight, None, (), chunk_tokens)
            loss.backward()
        peaks[chunk_tokens] = memory.peak_bytes
        formula = head_peak_bytes(tokens, vocab, dim, chunk_tokens)
        assert abs(memory.peak_bytes - formula) <= 64, (chunk_tokens, memory.peak_bytes, formula)
    assert peaks[None] > 7 * peaks[chunk]
