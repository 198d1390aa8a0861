"""Multi-token prediction (DeepSeek-V3): D extra modules that predict tokens t+2 .. t+D+1.

Depth k (1..D) takes the previous depth's hidden state h^{k-1} of token t (h^0: the main
model's final, normalised hidden state, the output layer's input) and the embedding of token
t+k, and predicts token t+k+1:

    h'^k = eh_proj([enorm(embed(t+k)); hnorm(h^{k-1})])      a [2D -> D] projection
    h^k  = block(h'^k)                                        one transformer block
    logits^k = head(norm(h^k))                                the model's output layer

The embedding and the output layer are the main model's (one weight; a pipeline's last stage
holds a copy of the embedding kept equal to it). The extra loss is lambda / D x sum_k CE^k, the
cross-entropy summed over depth k's targets, and it joins the step's loss with the main loss's
normaliser (the step's label tokens). Targets of depth k are the labels k positions on: the
last k positions of a row, positions whose target lies in another packed document, and
positions whose label there is ignored (a chat prompt) are left out.

The model's forward returns the main logits only; generation never runs the extra modules. In
training the trainer states the batch's tokens, labels and document ids, with the D positions
after each forward's tokens (`sequence_targets` for whole rows; a pipeline's last stage takes
each slice's part, which reaches into the next slice: `pipelining.features.multi_token_units`),
and the forward attaches the weighted extra loss to the logits it returns (as MoE auxiliary
losses are: `pipekit.layers.attached_loss`), so every loss function and schedule that
backpropagates through the logits trains the extra modules too.

Legend (shape suffixes): B batch, S tokens of the forward, T = S + the number of depths,
D model dim, V vocabulary; in the text, D is the number of depths (DeepSeek-V3's notation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
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
    "current_targets",
    "depth_targets",
    "multi_token_targets",
    "prediction_depth",
    "sequence_targets",
]


@dataclass
class MultiTokenTargets:
    """What the extra modules learn from in one forward of S tokens, and what they report.
    The tensors run D positions past the forward's tokens (T = S + D): the tokens, labels and
    document ids that follow (in the next slice of a sliced pipeline), or padding at the end
    of the row (label ignored, document id -1)."""

    tokens_BT: Tensor
    labels_BT: Tensor
    document_ids_BT: Tensor | None
    loss_scale: float
    """Weight of a summed token loss in the step's loss (1 / the step's label tokens)."""
    loss_sums: list[Tensor] = field(default_factory=list)
    """Per depth, the summed cross-entropy of each forward run under these targets (detached)."""


_TARGETS: ContextVar[MultiTokenTargets | None] = ContextVar("multi_token_targets", default=None)


@contextlib.contextmanager
def multi_token_targets(
    tokens_BT: Tensor,
    labels_BT: Tensor,
    document_ids_BT: Tensor | None,
    loss_scale: float,
) -> Iterator[MultiTokenTargets]:
    """Within this context, a model with multi-token prediction adds its extra loss; the
    yielded object collects the per-depth loss sums."""
    targets = MultiTokenTargets(tokens_BT, labels_BT, document_ids_BT, loss_scale)
    token = _TARGETS.set(targets)
    try:
        yield targets
    finally:
        _TARGETS.reset(token)


def current_targets() -> MultiTokenTargets | None:
    """The targets `multi_token_targets` set around this point, if any."""
    return _TARGETS.get()


def prediction_depth(model: nn.Module, names: Sequence[str]) -> int:
    """D of `model`'s multi-token prediction modules (`ModelStructure.multi_token_prediction`
    names them); 0 without them."""
    return sum(len(module) for name in names if (module := getattr(model, name, None)) is not None)


def _padded(x_BS: Tensor, depth: int, fill: int) -> Tensor:
    return torch.cat([x_BS, x_BS.new_full((x_BS.shape[0], depth), fill)], dim=1)


def sequence_targets(
    tokens_BS: Tensor,
    labels_BS: Tensor,
    document_ids_BS: Tensor | None,
    depth: int,
    loss_scale: float,
) -> contextlib.AbstractContextManager[MultiTokenTargets]:
    """`multi_token_targets` for a forward of whole rows: nothing follows them."""
    return multi_token_targets(
        _padded(tokens_BS, depth, 0),
        _padded(labels_BS, depth, IGNORE_INDEX),
        None if document_ids_BS is None else _padded(document_ids_BS, depth, -1),
        loss_scale,
    )


def _ahead(x_BT: Tensor, k: int, length: int) -> Tensor:
    """The `length` positions k on."""
    return x_BT[:, k : k + length]


def depth_targets(labels_BT: Tensor, document_ids_BT: Tensor | None, k: int, length: int) -> Tensor:
    """Depth k's targets for the first `length` positions: the labels k positions on, ignored
    where they lie in another document (or past the row: padding)."""
    targets_BS = _ahead(labels_BT, k, length)
    if document_ids_BT is not None:
        other_document = _ahead(document_ids_BT, k, length) != document_ids_BT[:, :length]
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
        length = h_BSD.shape[1]
        if targets.tokens_BT.shape[1] != length + len(self):
            raise ValueError(
                f"multi-token targets of {targets.tokens_BT.shape[1]} positions for a forward of "
                f"{length} tokens and {len(self)} depths; give the tokens, labels and document "
                "ids of the forward and the depth positions after it"
            )
        sums = []
        for k, depth in enumerate(self.values(), start=1):
            next_tokens_BS = _ahead(targets.tokens_BT, k, length)
            h_BSD = depth(h_BSD, embedding(next_tokens_BS), *block_args)
            depth_targets_BS = depth_targets(targets.labels_BT, targets.document_ids_BT, k, length)
            sums.append(token_sum_cross_entropy(head(depth.norm(h_BSD)), depth_targets_BS, 1.0))
        targets.loss_sums.append(torch.stack([loss.detach() for loss in sums]))
        extra = torch.stack(sums).sum() * (self.loss_weight / len(self))
        return attach_loss(logits_BSV, extra, targets.loss_scale)
