"""`[training] loss_chunk_tokens = N`: a job's output layer and loss computed N tokens at a
time (`pipekit.layers.chunked_loss`), so no rank ever holds more than N tokens' logits.

For the forward, the model's output layer is replaced by a head that takes the hidden states
and applies the output layer's weight (and bias), the logits transforms (set to None in the
model meanwhile, as on a stage without them) and the token-sum cross-entropy, chunk by chunk,
returning the loss sum where the logits would be. It runs inside the model's forward, where
FSDP has gathered the output layer's weight, and its gradients reach that weight as the
unchunked layer's do. It needs an output layer that computes `hidden @ weight.T + bias`: an
`nn.Linear`, whose forward pipekit can reproduce; any other is refused before launch.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate

from pipekit.attention.context import AttentionContext
from pipekit.config.loader import ConfigError
from pipekit.layers.chunked_loss import chunked_linear_cross_entropy
from pipekit.models.spec import ModelStructure

__all__ = ["ChunkedOutputLoss", "check_chunked_output"]


def check_chunked_output(
    chunk_tokens: int, structure: ModelStructure, model: nn.Module, pipeline_degree: int
) -> None:
    """ConfigError unless the job can chunk its head: no pipeline (a pipeline's last stage
    computes the loss per microbatch or slice, whose logits the slices already bound), and an
    output layer of `model` (the whole model, on the meta device) the chunked head computes
    exactly."""
    if chunk_tokens < 0:
        raise ConfigError(f"[training] loss_chunk_tokens={chunk_tokens} must be >= 0 (0 = off)")
    if not chunk_tokens:
        return
    if pipeline_degree > 1:
        raise ConfigError(
            f"[training] loss_chunk_tokens={chunk_tokens} chunks the head of a job without a "
            f"pipeline; with pipeline_parallel_degree={pipeline_degree} bound the logits by "
            "more slices (num_slices) or split them across the pipeline (vocab_parallel), "
            "and set loss_chunk_tokens = 0"
        )
    extra = [name for name in structure.multi_token_prediction if getattr(model, name, None)]
    if extra:
        raise ConfigError(
            f"[training] loss_chunk_tokens={chunk_tokens} replaces the output layer, which "
            f"multi-token prediction ({', '.join(extra)}) also runs; set loss_chunk_tokens = 0 "
            "or the model's mtp_depth = 0"
        )
    output = getattr(model, structure.output, None)
    plain_linear = isinstance(output, nn.Linear) and type(output).forward is nn.Linear.forward
    if not plain_linear:
        raise ConfigError(
            f"[training] loss_chunk_tokens={chunk_tokens} computes the output layer as "
            f"hidden @ weight.T + bias, but this model's {structure.output!r} is a "
            f"{type(output).__name__} with a forward of its own; set loss_chunk_tokens = 0"
        )


class _ChunkedHead(nn.Module):
    """Stands in for the output layer during a forward: computes the loss sum from the hidden
    states it is given, with the output layer's weight as it is at that moment (inside the
    model's forward, where FSDP has gathered it), and applies the logits transforms itself."""

    def __init__(self, output: nn.Linear, transforms: list[nn.Module], chunk_tokens: int) -> None:
        super().__init__()
        # plain references, not submodules: the parameters stay where the model holds them
        self._output, self._transforms = [output], transforms
        self.chunk_tokens = chunk_tokens
        self.labels_N: Tensor | None = None

    def forward(self, hidden_BSD: Tensor) -> Tensor:
        assert self.labels_N is not None  # set by ChunkedOutputLoss around the forward
        if isinstance(hidden_BSD, DTensor):  # sequence parallel: every tp rank takes all
            replicated = [Replicate()] * hidden_BSD.device_mesh.ndim
            hidden_BSD = hidden_BSD.redistribute(placements=replicated).to_local()
        output = self._output[0]
        return chunked_linear_cross_entropy(
            hidden_BSD.flatten(0, 1), self.labels_N, output.weight, output.bias,
            self._transforms, self.chunk_tokens,
        )  # fmt: skip


class ChunkedOutputLoss:
    """The loss of `model` on a micro-batch, its head computed `chunk_tokens` at a time: for
    the forward the output layer is swapped for a `_ChunkedHead` and the transforms set to None
    (the head applies them), so the model returns the loss sum."""

    def __init__(self, model: nn.Module, structure: ModelStructure, chunk_tokens: int) -> None:
        self.model, self.structure = model, structure
        transforms = [getattr(model, name) for name in structure.logits_transforms]
        self.head = _ChunkedHead(getattr(model, structure.output), transforms, chunk_tokens)

    def __call__(
        self,
        tokens_BS: Tensor,
        positions_BS: Tensor,
        context: AttentionContext,
        labels_BS: Tensor,
        normaliser: Tensor,
    ) -> Tensor:
        """`sum of token losses / normaliser`, as the unchunked model and loss give it."""
        structure, model = self.structure, self.model
        kept = {
            name: getattr(model, name) for name in (structure.output, *structure.logits_transforms)
        }
        setattr(model, structure.output, self.head)
        for name in structure.logits_transforms:
            setattr(model, name, None)
        self.head.labels_N = labels_BS.flatten()
        try:
            loss_sum = model(tokens_BS, positions_BS, context)
        finally:
            self.head.labels_N = None
            for name, module in kept.items():
                setattr(model, name, module)
        return loss_sum / normaliser
