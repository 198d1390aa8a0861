"""The single-process reference step and the comparison every parallel layout is held to.

A parity check runs one step of a model under a parallel layout (`pipekit.testing.
data_parallel`, `pipekit.testing.pipeline`) and here on one process, on the same weights (drawn
from one seed, as every layout draws them) and the same batch (`parity_batch`), and compares the
loss and every gradient (`compare`: gradients on the scale of the reference's largest). In
float64 a correct layout agrees to about 1e-12; a wrong one (a gradient not summed, a module on
the wrong stage) is off by far more than 1e-6.

The reference runs the batch as row blocks (`microbatches`): MoE auxiliary losses take their
load-balancing statistics per forward, so the reference's blocks must be the parallel run's
microbatches (for data parallelism, each data rank's rows; for a pipeline, each data rank's
microbatches); slices do not matter, since the pipeline computes those losses over the whole
microbatch. Results are (loss or None, {name: gradient}); a vocabulary-parallel rank reports its
rows as (start, end, gradient).
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
from dataclasses import dataclass
from typing import Any

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from pipekit.attention.context import CausalAttention
from pipekit.layers.loss import IGNORE_INDEX, count_label_tokens, token_sum_cross_entropy
from pipekit.layers.multi_token_prediction import (
    MultiTokenTargets,
    prediction_depth,
    sequence_targets,
)
from pipekit.models.spec import ModelSpec, ModelStructure
from pipekit.moe.aux_loss import aux_loss_scale

__all__ = [
    "Comparison",
    "Result",
    "build_model",
    "compare",
    "full_gradient",
    "max_relative_difference",
    "parity_batch",
    "reference_step",
    "training_targets",
]

Result = tuple[float | None, dict[str, Any]]
"""One rank's step: its loss (None where another rank reports it) and its gradients by
parameter name, each a full tensor or, for vocabulary rows, (start, end, rows)."""


def build_model(spec: ModelSpec, args: Any, seed: int, dtype: torch.dtype) -> nn.Module:
    """The whole model in `dtype`, drawn from `seed` in that dtype (as every layout draws it)."""
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    model.to_empty(device="cpu")
    model.init_weights(seed=seed)
    return model


def parity_batch(vocab_size: int, rows: int, seq_len: int, seed: int = 7) -> TensorDict:
    """Two packed documents per row (split at a row-dependent point), some labels ignored."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels = torch.randint(0, vocab_size, (rows, seq_len), generator=generator)
    labels[:, ::5] = IGNORE_INDEX
    split_BS = (5 + 3 * torch.arange(rows)).unsqueeze(1) % seq_len
    index_S = torch.arange(seq_len)
    document_ids = (index_S >= split_BS).long()
    positions = torch.where(index_S >= split_BS, index_S - split_BS, index_S)
    return TensorDict(
        tokens=tokens,
        labels=labels,
        positions=positions,
        document_ids=document_ids,
        batch_size=[rows, seq_len],
    )


def reference_step(
    spec: ModelSpec,
    args: Any,
    batch: TensorDict,
    *,
    microbatches: int = 1,
    seed: int = 3,
    dtype: torch.dtype = torch.float64,
    model: nn.Module | None = None,
) -> Result:
    """One process: the batch as `microbatches` row blocks in order, every block's loss over
    the batch's label count, its aux losses (statistics over the block) weighted
    1/microbatches. The model is `model` if given (its weights made elsewhere, e.g. upcycled),
    else drawn from `seed`."""
    if model is None:
        model = build_model(spec, args, seed, dtype)
    normaliser = count_label_tokens(batch["labels"])
    total = torch.zeros((), dtype=torch.float64)
    for part in batch.split(batch.batch_size[0] // microbatches):
        targets = training_targets(part, normaliser, model, spec.structure)
        with aux_loss_scale(1.0 / microbatches), targets:
            logits = model(part["tokens"], part["positions"], CausalAttention(part["document_ids"]))
        loss = token_sum_cross_entropy(logits, part["labels"], normaliser)
        loss.backward()
        total += loss.detach()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    return total.item(), grads


def training_targets(
    part: TensorDict, normaliser: Tensor, model: nn.Module, structure: ModelStructure
) -> contextlib.AbstractContextManager[MultiTokenTargets | None]:
    """The targets `model`'s multi-token prediction trains on in a step over `part` (none for a
    model without it), weighted as the token losses: over the batch's label count."""
    depth = prediction_depth(model, structure.multi_token_prediction)
    if not depth:
        return contextlib.nullcontext()
    return sequence_targets(
        part["tokens"], part["labels"], part["document_ids"], depth, 1.0 / float(normaliser)
    )


@dataclass(frozen=True)
class Comparison:
    """How far a parallel step is from the reference: the loss relative to the reference loss,
    every gradient relative to the reference's largest gradient entry over the whole model (a
    NaN difference stays NaN, and fails every tolerance).

    One scale for every gradient, because rounding error follows the size of the numbers a
    gradient is computed from, not the size of the result: a gradient that is zero in exact
    arithmetic (a key projection's bias: softmax ignores a constant added to every score of a
    query) comes out as rounding noise, which against its own largest entry reads as a
    difference of about 1. Against the model's largest gradient the noise is ~1e-16, while a
    gradient that is genuinely wrong is off by a fraction of that scale (a dropped or doubled
    term, a missing reduction) and fails."""

    loss: float
    """Relative difference of the loss (the largest over the ranks that report one)."""
    gradient: float
    """Largest difference of any gradient entry any rank reports, over the reference's largest
    gradient entry of any parameter."""
    parameter: str
    """The parameter of that gradient."""
    missing: tuple[str, ...]
    """Parameters no rank reported a gradient for (a layout that lost them)."""

    @property
    def worst(self) -> float:
        """The larger of the two differences."""
        return _larger(self.loss, self.gradient)

    def within(self, tolerance: float) -> bool:
        """Whether both differences are at most `tolerance` and every parameter was reported."""
        return self.worst <= tolerance and not self.missing


def compare(results: list[Result], reference: Result) -> Comparison:
    """Every rank's result against the reference: the loss, every gradient each rank reports
    (whole, or its vocabulary rows) on the scale of the reference's largest gradient (see
    `Comparison`), and the parameters none reports."""
    ref_loss, ref_grads = reference
    differences = [abs(loss - ref_loss) / abs(ref_loss) for loss, _ in results if loss is not None]
    loss_difference = functools.reduce(_larger, differences) if differences else math.nan
    scale = _gradient_scale(ref_grads)
    worst, worst_name = 0.0, ""
    seen: set[str] = set()
    for _, grads in results:
        for name, grad in grads.items():
            seen.add(name)
            want = ref_grads[name]
            if isinstance(grad, tuple):  # vocabulary rows
                start, end, grad = grad
                want = want[start:end]
            difference = (grad - want).abs().max().item() / scale
            larger = not difference <= worst  # larger, or NaN
            if not math.isnan(worst) and (larger or not worst_name):
                worst, worst_name = difference, name
    missing = tuple(sorted(set(ref_grads) - seen))
    return Comparison(loss_difference, worst, worst_name, missing)


def max_relative_difference(results: list[Result], reference: Result) -> float:
    """The larger of the loss's relative difference and the gradients' difference on the
    reference's largest gradient (`compare`); every parameter must be reported, by one rank or
    by row shards (one without a gradient is not)."""
    losses = [loss for loss, _ in results if loss is not None]
    assert len(losses) == 1 or all(loss == losses[0] for loss in losses), losses
    comparison = compare(results, reference)
    assert not comparison.missing, f"parameters not reported: {list(comparison.missing)}"
    return comparison.worst


def full_gradient(grad: Tensor) -> Tensor:
    """A gradient as one whole tensor (a DTensor gathered, a plain tensor copied)."""
    return grad.full_tensor() if hasattr(grad, "full_tensor") else grad.clone()


def _larger(first: float, second: float) -> float:
    """max() that keeps a NaN (plain max drops it when it comes second)."""
    return math.nan if math.isnan(first) or math.isnan(second) else max(first, second)


def _gradient_scale(grads: dict[str, Tensor]) -> float:
    """The largest |entry| of any gradient (the scale `compare` judges gradients on); the
    smallest positive float when every gradient is zero, so any difference then fails."""
    largest = max((grad.abs().max().item() for grad in grads.values() if grad.numel()), default=0)
    return max(largest, sys.float_info.min)
