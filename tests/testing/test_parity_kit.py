"""`pipekit.testing`, the parity kit itself: how `compare` judges a gradient, and that its
layout helpers refuse what the trainer refuses.

A gradient is judged on the scale of the reference's largest gradient: a key projection's bias
has a zero gradient in exact arithmetic (softmax is unchanged by a constant added to all of a
query's scores), so both runs give rounding noise there, which is not a failure; a gradient
that is genuinely wrong, a small one included, still fails and is the one named. The helpers
run the job's layout rules before any process group exists, so they raise the job's one-line
error in this process (tp that splits a multi-query model's single key/value head, tp over an
MoE without sequence parallelism)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from tiny_models import TINY_LLAMA
from torch import Tensor, nn

import examples.custom_model.model as custom
from pipekit.config import ConfigError, load_job_config
from pipekit.models import get_model_spec, register_model
from pipekit.testing import (
    Result,
    compare,
    data_parallel_model,
    data_parallel_step,
    parity_batch,
    pipeline_layout,
    pipeline_step,
)
from pipekit.train.job import validate_job

DIM, HEADS, VOCAB, ROWS, SEQ_LEN = 16, 2, 32, 4, 16


class _KeyBiasAttention(nn.Module):
    """Embedding, one causal attention layer with biased projections and no positions, output
    layer: the key bias adds the same score to every key of a query."""

    def __init__(self, explicit_softmax: bool) -> None:
        super().__init__()
        self.explicit_softmax = explicit_softmax
        self.embedding = nn.Embedding(VOCAB, DIM)
        self.wq, self.wk, self.wv = (nn.Linear(DIM, DIM) for _ in range(3))
        self.output = nn.Linear(DIM, VOCAB)

    def forward(self, tokens_BS: Tensor) -> Tensor:
        x_BSD = self.embedding(tokens_BS)
        q, k, v = (
            w(x_BSD).unflatten(-1, (HEADS, -1)).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        if self.explicit_softmax:  # another kernel, as a parallel layout may run
            scores_BHSS = q @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
            causal_SS = torch.ones(SEQ_LEN, SEQ_LEN, dtype=torch.bool).tril()
            out_BHSK = scores_BHSS.masked_fill(~causal_SS, -torch.inf).softmax(-1) @ v
        else:
            out_BHSK = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.output(x_BSD + out_BHSK.transpose(1, 2).flatten(2))


def _step(explicit_softmax: bool) -> Result:
    """The loss and gradients of one batch on weights drawn from one seed; the two kernels
    agree in exact arithmetic and differ by rounding."""
    torch.manual_seed(0)
    model = _KeyBiasAttention(explicit_softmax).double()
    with torch.no_grad():
        for linear in (model.wq, model.wk, model.wv):
            linear.bias.normal_()
    batch = parity_batch(VOCAB, ROWS, SEQ_LEN)
    logits = model(batch["tokens"])
    loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="sum")
    loss.backward()
    return loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_a_gradient_zero_in_exact_arithmetic_is_judged_on_the_models_gradient_scale() -> None:
    reference, (loss, grads) = _step(False), _step(True)
    key_bias, wanted = grads["wk.bias"], reference[1]["wk.bias"]
    largest = max(grad.abs().max() for grad in reference[1].values())
    assert wanted.abs().max() < 1e-14 * largest  # zero up to rounding
    # against its own largest entry, the rounding noise reads as a difference of order 1
    assert (key_bias - wanted).abs().max() / wanted.abs().max() > 1e-2
    comparison = compare([(loss, grads)], reference)
    assert comparison.within(1e-10) and comparison.gradient < 1e-14, comparison


@pytest.mark.parametrize(
    ("parameter", "wrong"),
    [
        ("wk.weight", lambda grad: 0.99 * grad),  # a small gradient, 1% off
        ("wk.bias", lambda grad: grad + 1e-8),  # zero in exact arithmetic, and not zero
    ],
)
def test_a_wrong_gradient_fails_and_is_named_beside_rounding_noise(
    parameter: str, wrong: Callable[[Tensor], Tensor]
) -> None:
    reference, (loss, grads) = _step(False), _step(True)
    largest = max(grad.abs().max() for grad in reference[1].values())
    assert reference[1]["wk.weight"].abs().max() < 0.2 * largest  # not the largest gradient
    comparison = compare([(loss, {**grads, parameter: wrong(grads[parameter])})], reference)
    assert not comparison.within(1e-10), comparison
    assert comparison.parameter == parameter, comparison


MQA = TINY_LLAMA.with_updates(n_kv_heads=1)
MOE = custom.TinyGPTArgs(dim=32, n_layers=2, n_heads=2, vocab_size=64, max_seq_len=64)
BATCH = parity_batch(64, 4, 16)
SLICED = {"pipeline_schedule": "sliced", "num_slices": 2, "microbatches": 2}
HELPERS: dict[str, Callable[..., Any]] = {
    "data_parallel_step": lambda spec, args, **keys: data_parallel_step(
        0, 2, spec, args, BATCH, **keys
    ),
    "data_parallel_model": lambda spec, args, **keys: data_parallel_model(2, spec, args, **keys),
    "pipeline_step": lambda spec, args, **keys: pipeline_step(
        0, 4, spec, args, BATCH, **SLICED, **keys
    ),
    "pipeline_layout": lambda spec, args, **keys: pipeline_layout(
        4, spec, args, BATCH.batch_size, **SLICED, **keys
    ),
}
"""Each helper called on rank 0 outside any process group: a layout that got past the rules
would fail building its mesh instead."""
CASES = {
    "mqa_over_tp": ("llama", MQA, {"tp": 2}),
    "moe_tp_without_sequence_parallel": (
        "tiny_gpt",
        MOE,
        {"tp": 2, "sequence_parallel": False},
    ),
}


def _job_error(family: str, args: Any, keys: dict[str, Any]) -> str:
    """What validate_job says about the same model and layout on 2 ranks."""
    register_model(dataclasses.replace(get_model_spec(family), name=f"{family}_parity_kit",
                                       flavors={"tiny": args}), replace=True)  # fmt: skip
    overrides = [f"--parallelism.{key}={str(value).lower()}" for key, value in keys.items()]
    config = load_job_config([f"--model.name={family}_parity_kit", "--model.flavor=tiny",
                              "--training.seq_len=16", *overrides])  # fmt: skip
    with pytest.raises(ConfigError) as error:
        validate_job(config, 2, check_files=False)
    return str(error.value)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("helper", HELPERS)
def test_the_layout_helpers_refuse_what_the_job_refuses_with_its_line(
    helper: str, case: str
) -> None:
    family, args, keys = CASES[case]
    message = _job_error(family, args, keys)
    assert message.startswith("[parallelism] tp=2") and "\n" not in message, message
    with pytest.raises(ConfigError) as error:
        HELPERS[helper](get_model_spec(family), args, **keys)
    assert str(error.value) == message
