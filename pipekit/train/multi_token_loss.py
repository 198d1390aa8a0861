"""The trainer's side of multi-token prediction: each forward states the batch's targets
(`pipekit.layers.multi_token_prediction`; a pipeline's last stage takes each unit's part of
them, `pipekit.pipelining.features.multi_token_units`), and the step reports the extra loss as
its own metric, `mtp_loss`: the mean token cross-entropy of the depths, over the step's label
tokens (the main loss's normaliser), before the weight lambda."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict
from torch import Tensor

from pipekit.layers.multi_token_prediction import sequence_targets

__all__ = ["MultiTokenLoss"]


class MultiTokenLoss:
    """Targets for the forwards of a model with `depth` multi-token prediction modules (the
    whole model's, the same on every rank), and their metric."""

    def __init__(self, depth: int) -> None:
        self.depth = depth
        self._sums: list[Tensor] = []
        self.metrics: dict[str, float] = {}
        """The last training step's `mtp_loss`; empty without multi-token prediction."""

    @contextlib.contextmanager
    def targets(self, batch: TensorDict, global_tokens: Tensor) -> Iterator[None]:
        """Around one micro-batch's forward (or pipeline step): the extra loss weighted as its
        token losses, in training (a validation forward outside pipelines runs the main model
        alone)."""
        if not self.depth or not torch.is_grad_enabled():
            yield
            return
        scale = 1.0 / float(global_tokens)
        documents = batch.get("document_ids", None)
        with sequence_targets(
            batch["tokens"], batch["labels"], documents, self.depth, scale
        ) as targets:
            yield
        self._sums.extend(targets.loss_sums)

    def end_step(
        self, sum_over_ranks: Callable[[Tensor], Tensor], global_tokens: Tensor, training: bool
    ) -> None:
        """After the micro-batches of a step (every rank calls it): `metrics` from their loss
        sums when `training`. Ranks without the extra modules (a pipeline's other stages)
        add nothing."""
        sums = self._sums
        self._sums = []
        if not (self.depth and training):
            return
        sums_D = torch.stack(sums).sum(0) if sums else torch.zeros(self.depth)
        total_D = sum_over_ranks(sums_D.double())
        self.metrics = {"mtp_loss": float(total_D.mean() / global_tokens)}
