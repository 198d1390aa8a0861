"""The trainer's side of multi-token prediction: each forward states the batch's targets
(`pipekit.layers.multi_token_prediction`), and the step reports the extra loss as its own
metric, `mtp_loss`: the mean token cross-entropy of the depths, over the step's label tokens
(the main loss's normaliser), before the weight lambda."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from tensordict import TensorDict
from torch import Tensor, nn

from pipekit.layers.multi_token_prediction import multi_token_targets
from pipekit.models.spec import ModelStructure

__all__ = ["MultiTokenLoss"]


class MultiTokenLoss:
    """Targets for the forwards of a model with multi-token prediction, and its metric."""

    def __init__(self, model: nn.Module, structure: ModelStructure) -> None:
        self.enabled = any(
            getattr(model, name, None) is not None for name in structure.multi_token_prediction
        )
        self._sums: list[Tensor] = []
        self.metrics: dict[str, float] = {}
        """The last training step's `mtp_loss`; empty without multi-token prediction."""

    @contextlib.contextmanager
    def targets(self, batch: TensorDict, global_tokens: Tensor) -> Iterator[None]:
        """Around one micro-batch's forward: the extra loss weighted as its token losses (in
        training only: a validation forward runs the main model alone)."""
        if not self.enabled or not torch.is_grad_enabled():
            yield
            return
        with multi_token_targets(
            batch["tokens"], batch["labels"], batch["document_ids"], 1.0 / float(global_tokens)
        ) as targets:
            yield
        self._sums.extend(targets.loss_sums)

    def end_step(
        self, sum_over_ranks: Callable[[Tensor], Tensor], global_tokens: Tensor, training: bool
    ) -> None:
        """After the micro-batches of a step (every rank calls it): `metrics` from their
        loss sums when `training` (a validation step ran none)."""
        if not (self.enabled and training):
            return
        sums_D = torch.stack(self._sums).sum(0)  # every rank ran at least one forward
        self._sums = []
        self.metrics = {"mtp_loss": float(sum_over_ranks(sums_D.double()).mean() / global_tokens)}
