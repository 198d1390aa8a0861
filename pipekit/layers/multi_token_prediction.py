"""Multi-token prediction (DeepSeek-V3): D extra modules that predict tokens t+2 .. t+D+1.

Depth k (1..D) takes the previous depth's hidden state h^{k-1} of token t (h^0: the main
model's final, normalised hidden state, the output layer's input) and the embedding of token
t+k, and predicts token t+k+1:

    h'^k = eh_proj([enorm(embed(t+k)); hnorm(h^{k-1})])      a [2D -> D] projection
    h^k  = block(h'^k)                                        one transformer block
    logits^k = head(norm(h^k))                                the model's output layer

The embedding and the output layer are the main model's (shared, not copied). The extra loss
is lambda / D x sum_k CE^k, the cross-entropy summed over depth k's targets, and it joins the
step's loss with the main loss's normaliser (the step's label tokens). Targets of depth k are
the labels shifted left by k: the last k positions of a row, positions whose target lies in
another packed document, and positions whose shifted label is ignored (a chat prompt) are left
out.

The model's forward returns the main logits only; generation and evaluation never run the
extra modules. In training the trainer states the batch's tokens, labels and document ids with
`multi_token_targets(...)`, and the forward attaches the weighted extra loss to the logits it
returns (as MoE auxiliary losses are: `pipekit.layers.attached_loss`), so every
loss function and schedule that backpropagates through the logits trains the extra modules too.

Legend: B batch, S sequence, D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from pipekit.layers.attached_loss import attach_loss
from pipekit.layers.init import trunc_normal_
from pipekit.layers.loss import IGNORE_INDEX, token_sum_cross_entropy
from pipekit.layers.norms import RMSNorm

__all__ = [
    "MTPModule",
    "MultiTokenPrediction",
    "MultiTokenTargets",
    "multi_token_targets",
    "shifted_targets",
]


@dataclass
class MultiTokenTargets:
    """What the extra modules learn from in one forward, and what they report."""

    tokens_BS: Tensor
    labels_BS: Tensor
    document_ids_BS: Tensor | None
    loss_scale: float
    """Weight of a summed token loss in the step's loss (1 / the step's label tokens)."""
    loss_sums: list[Tensor] = field(default_factory=list)
    """Per depth, the summed cross-entropy of each forward run under these targets (detached)."""


_TARGETS: ContextVar[MultiTokenTargets | None] = ContextVar("multi_token_targets", default=None)


@contextlib.contextmanager
def multi_token_targets(
    tokens_BS: Tensor,
    labels_BS: Tensor,
    document_ids_BS: Tensor | None,
    loss_scale: float,
) -> Iterator[MultiTokenTargets]:
    """Within this context, a model with multi-token prediction adds its extra loss; the
    yielded object collects the per-depth loss sums."""
    targets = MultiTokenTargets(tokens_BS, labels_BS, document_ids_BS, loss_scale)
    token = _TARGETS.set(targets)
    try:
        yield targets
    finally:
        _TARGETS.reset(token)


def _shifted_left(x_BS: Tensor, k: int, fill: int) -> Tensor:
    """`x_BS` moved k positions to the left along the sequence, the last k filled."""
    out_BS = torch.full_like(x_BS, fill)
    out_BS[:, : x_BS.shape[1] - k] = x_BS[:, k:]
    return out_BS


def shifted_targets(labels_BS: Tensor, document_ids_BS: Tensor | None, k: int) -> Tensor:
    """Depth k's targets: the labels k positions on, ignored where they run past the row or
    into another document."""
    targets_BS = _shifted_left(labels_BS, k, IGNORE_INDEX)
    if document_ids_BS is not None:
        other_document = _shifted_left(document_ids_BS, k, -1) != document_ids_BS
        targets_BS = targets_BS.masked_fill(other_document, IGNORE_INDEX)
    return targets_BS


class MTPModule(nn.Module):
    """One depth: the two norms and projection that merge the hidden state with the next
    token's embedding, a transformer block, and the norm before the shared output layer."""

    def __init__(self, dim: int, norm_eps: float, block: nn.Module) -> None:
        super().__init__()
        self.enorm = RMSNorm(dim, norm_eps)
        self.hnorm = RMSNorm(dim, norm_eps)
        self.eh_proj = nn.Linear(2 * dim, dim, bias=False)
        self.block = block
        self.norm = RMSNorm(dim, norm_eps)

    def reset_parameters(self, init_std: float = 0.02) -> None:
        """Norms to one, the projection and the block by pipekit's convention."""
        for norm in (self.enorm, self.hnorm, self.norm):
            norm.reset_parameters()
        trunc_normal_(self.eh_proj.weight, init_std)
        self.block.reset_parameters()

    def forward(self, h_BSD: Tensor, embedded_BSD: Tensor, *block_args: object) -> Tensor:
        """h^k from h^{k-1} and the embeddings of the tokens k positions on."""
        merged_BSD = self.eh_proj(torch.cat([self.enorm(embedded_BSD), self.hnorm(h_BSD)], -1))
        return self.block(merged_BSD, *block_args)


class MultiTokenPrediction(nn.ModuleDict):
    """The D depths keyed "0".."D-1" (as blocks are: a sharded init sees some of them);
    `attach_loss` runs them in training."""

    def __init__(self, depths: list[MTPModule], loss_weight: float) -> None:
        super().__init__({str(index): depth for index, depth in enumerate(depths)})
        self.loss_weight = loss_weight

    def attach_loss(
        self,
        logits_BSV: Tensor,
        h_BSD: Tensor,
        embedding: nn.Module,
        head: Callable[[Tensor], Tensor],
        *block_args: object,
    ) -> Tensor:
        """`logits_BSV`, carrying lambda / D x sum_k CE^k under the `multi_token_targets` in
        force (unchanged outside one). `h_BSD` is the output layer's input; `head` maps a
        normalised hidden state to logits as the model's output does; `block_args` are what
        the model's blocks take after the hidden state (RoPE, attention context)."""
        targets = _TARGETS.get()
        if targets is None:
            return logits_BSV
        sums = []
        for k, depth in enumerate(self.values(), start=1):
            next_tokens_BS = _shifted_left(targets.tokens_BS, k, 0)
            h_BSD = depth(h_BSD, embedding(next_tokens_BS), *block_args)
            depth_targets_BS = shifted_targets(targets.labels_BS, targets.document_ids_BS, k)
            sums.append(token_sum_cross_entropy(head(depth.norm(h_BSD)), depth_targets_BS, 1.0))
        targets.loss_sums.append(torch.stack([loss.detach() for loss in sums]))
        extra = torch.stack(sums).sum() * (self.loss_weight / len(self))
        return attach_loss(logits_BSV, extra, targets.loss_scale)
