"""Activation bytes per token of a model's blocks and of its head, measured, not modelled.

Each distinct kind of block (a dense block, an MoE block: blocks whose parameters have the same
names and shapes are one kind) is run at the model's real width on two short sequences in the
compute dtype, on the CPU: the bytes autograd saves for its backward (`ActivationMemoryTracker`,
by storage, weights excluded) grow linearly with the tokens (the attention kernels save q, k, v,
the output and the log-sum-exp, never the score matrix), and the slope between the two lengths
is the per-token cost at any length. What a block's backward adds comes from its live bytes over
its forward and its backward to the input (`PeakTensorMemory`), moment by moment: the largest
slope of any moment. The peak's own slope would not do: at a few tokens the peak is the moment
with the largest constant (an MoE backward's weight-sized gradient buffers), at real lengths the
moment whose bytes grow fastest, and only the latter matters. What does not
grow with the tokens (a RoPE table, a CPU kernel's packed copy of a weight) drops out. Large
weights are a constant (their values change no tensor's size); small ones (routers) are random,
so an MoE block routes as in training.
The head (the blocks' successors and the output layer, with the loss) is measured the same two
ways: what it saves for backward (the final norm's input, the loss's float32 log-probabilities)
and its peak over its forward and the backward to its input (`PeakTensorMemory`; its weight
gradients are a term of their own): its logits, their float32 loss copy and their gradient.
Under tensor parallelism a block is measured as one tp rank runs it: split by the family's plan
over a simulated tp group (torch's "fake" process group, in a forked child), so its bytes are
one rank's heads and FFN share, and with sequence parallelism one rank's share of the residual
stream and the norms; the head stays whole on every tp rank, as it trains.
One block of a kind exists at a time, so probing a 70B-class model needs one block's weights in
the compute dtype (about 1.7 GB) and the head's (about 2 GB), not the model's; it takes about a
minute for an 8B model on 2 CPU cores (bf16 matrix products on a CPU without bf16 units are
slow). An MoE block whose experts weigh more than 2 GiB is measured at the two smallest expert
counts its router accepts and extrapolated on the line through them (its bytes per token grow
linearly with the count: the router's scores).

Legend: D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import loss_parallel

from pipekit._torch_private import checkpoint_module_activations, simulated_rank
from pipekit.attention.kv_cache import ChunkedKVCache
from pipekit.distributed.tensor_parallel import apply_tensor_parallel
from pipekit.layers.loss import token_sum_cross_entropy
from pipekit.memory.live_tensors import PeakTensorMemory, kept_bytes
from pipekit.memory.tracker import SAVED, ActivationMemoryTracker
from pipekit.memory_plan.forked import in_forked_child
from pipekit.models.materialize import local_tensor
from pipekit.models.spec import ModelSpec
from pipekit.models.stage_module import build_stage_module
from pipekit.moe.layer import MoE
from pipekit.moe.routers import SigmoidTopKRouter

__all__ = ["ActivationProfile", "TensorSplit", "give_probe_weights", "profile_activations"]

_PROBE_TOKENS = (2, 6)
"""Two sequence lengths; bytes per token is the slope between them."""
_EXPERT_BYTES_BUDGET = 2 << 30
"""One MoE layer's experts weighing more than this (compute dtype) are probed at smaller
counts: a real-size DeepSeek-V3 block's 256 experts are 22 GB in bf16."""
_INIT_STD = 0.02
_RANDOM_UP_TO = 1 << 20
"""Parameters of at most this many elements (routers) are drawn at random."""


@dataclass(frozen=True)
class TensorSplit:
    """How the job splits its blocks over tensor-parallel ranks."""

    tp: int = 1
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def sequence_shards(self) -> int:
        """Ranks the residual stream is split over by sequence."""
        return self.tp if self.sequence_parallel else 1


@dataclass(frozen=True)
class ActivationProfile:
    """Measured bytes per token (compute dtype)."""

    block_bytes: dict[str, float]
    """Block name -> bytes it saves for backward per token."""
    backward_bytes: float
    """Most bytes per token one block's backward needs beyond what it saved (its activations'
    gradients and their temporaries; weight gradients are a term of their own)."""
    head_bytes_per_row: float
    """Peak bytes of the head's forward and backward per token and per output row."""
    head_saved_bytes_per_row: float
    """Bytes the head (with the loss) saves for backward per token and per output row; the
    logits themselves are not among them (the loss keeps its log-probabilities)."""
    input_bytes: int
    """Bytes of one token's hidden state (what a checkpointed block keeps)."""
    kv_bytes: dict[str, float]
    """Block name -> bytes of its K and V per token (what a KV cache holds)."""
    kv_heads: dict[str, int]
    """Block name -> kv heads its attention hands a KV cache (one for a latent)."""


def profile_activations(
    spec: ModelSpec,
    args: object,
    dtype: torch.dtype,
    tokens: tuple[int, int] = _PROBE_TOKENS,
    configure: Callable[[nn.Module], object] | None = None,
    split: TensorSplit = TensorSplit(),
    selective: bool = False,
) -> ActivationProfile:
    """Measure `spec.build(args)`'s blocks and head in `dtype` at the two lengths `tokens`;
    `configure(block)` sets a block up as the job runs it (its MoE execution); `split`: the
    blocks as one tensor-parallel rank runs them (bytes per token of the whole sequence);
    `selective`: the blocks op-level checkpointed, their bytes what that keeps. Experts too
    heavy to build on this machine are probed at two smaller counts (`_fewer_experts`)."""
    with torch.device("meta"):
        model = spec.build(args).to(dtype)
    fewer = _fewer_experts(model, args)
    if fewer is not None:
        options = {"tokens": tokens, "configure": configure, "split": split, "selective": selective}
        (small, large), counts = fewer
        profiles = [profile_activations(spec, a, dtype, **options) for a in (small, large)]
        return _extrapolated(*profiles, counts)
    structure = spec.structure
    shape = spec.shape(args)
    names = [structure.block_name(index) for index in range(shape.num_layers)]
    kinds: dict[tuple, _BlockProbe] = {}
    block_bytes, kv_bytes, kv_heads = {}, {}, {}
    for name in names:
        kind = _kind(model.get_submodule(name))
        if kind not in kinds:
            block = build_stage_module(model, [*structure.shared, name])
            setup = _with_selective_checkpointing(configure) if selective else configure
            if split.tp == 1:
                kinds[kind] = _probe_block(block, shape.dim, dtype, tokens, setup, selective)
            else:
                kinds[kind] = in_forked_child(
                    _probe_split_block, block, spec, split, shape.dim, dtype, tokens, setup,
                    selective,
                )  # fmt: skip
        block_bytes[name] = kinds[kind].saved
        kv_bytes[name], kv_heads[name] = kinds[kind].kv_cache, kinds[kind].kv_heads
    head_names = [structure.output, *structure.logits_transforms]
    if shape.tied_embeddings:  # the output's weight is the embedding's; the probe's input is
        head_names.append(structure.embedding)  # hidden states, so the embedding never runs
    head = build_stage_module(model, [*structure.shared, *structure.after_blocks, *head_names])
    head_args = (head, shape.dim, shape.vocab_size, dtype, tokens)
    if split.tp == 1:
        head_saved, head_peak = _probe_head(*head_args)
    else:
        head_saved, head_peak = in_forked_child(_probe_split_head, spec, split, *head_args)
    return ActivationProfile(
        block_bytes=block_bytes,
        backward_bytes=max(probe.working - probe.saved for probe in kinds.values()),
        head_bytes_per_row=head_peak / shape.vocab_size,
        head_saved_bytes_per_row=head_saved / shape.vocab_size,
        input_bytes=shape.dim * dtype.itemsize // split.sequence_shards,
        kv_bytes=kv_bytes,
        kv_heads=kv_heads,
    )


def _fewer_experts(
    model: nn.Module, args: Any
) -> tuple[tuple[Any, Any], tuple[int, int, int]] | None:
    """None, or the model args with two smaller expert counts (the two smallest its router
    accepts) and (those counts, the real one), when one MoE layer's experts would weigh more
    than `_EXPERT_BYTES_BUDGET`. A block saves per token the router's scores (a few per
    expert) plus what its top-k experts compute (independent of the count): linear in the
    count, so two counts give the line exactly."""
    moe = getattr(args, "moe", None)
    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if moe is None or not layers:
        return None
    experts = layers[0].experts
    if sum(p.numel() * p.element_size() for p in experts.parameters()) <= _EXPERT_BYTES_BUDGET:
        return None
    counts = []
    first = -(-moe.top_k // moe.num_groups) * moe.num_groups  # at least top-k, whole groups
    for count in range(first, moe.num_experts, moe.num_groups):
        with contextlib.suppress(ValueError):  # the router's limits (top-k, groups)
            counts.append(
                (count, dataclasses.replace(args, moe=dataclasses.replace(moe, num_experts=count)))
            )
        if len(counts) == 2:
            (small, small_args), (large, large_args) = counts
            return (small_args, large_args), (small, large, moe.num_experts)
    return None


def _extrapolated(
    small: ActivationProfile, large: ActivationProfile, counts: tuple[int, int, int]
) -> ActivationProfile:
    """The profile at `counts[2]` experts from the two measured at `counts[0]` and
    `counts[1]`, on the line through them (what does not depend on experts is equal)."""
    step = (counts[2] - counts[0]) / (counts[1] - counts[0])

    def line(at_small: float, at_large: float) -> float:
        return at_small + (at_large - at_small) * step

    return dataclasses.replace(
        large,
        block_bytes={
            name: line(small.block_bytes[name], saved) for name, saved in large.block_bytes.items()
        },
        backward_bytes=line(small.backward_bytes, large.backward_bytes),
    )


def _with_selective_checkpointing(
    configure: Callable[[nn.Module], object] | None,
) -> Callable[[nn.Module], None]:
    """`configure`, then the block checkpointed op by op as `selective` training runs it."""
    from pipekit.train.activation_checkpoint import selective_checkpoint_context

    def setup(block: nn.Module) -> None:
        if configure is not None:
            configure(block)
        checkpoint_module_activations(block, selective_checkpoint_context("matmuls_and_attention"))

    return setup


def _kind(block: nn.Module) -> tuple:
    return tuple((name, tuple(p.shape)) for name, p in block.named_parameters())


def give_probe_weights(module: nn.Module) -> None:
    """Values that make the probe's forward run like a trained model's (any values do: only
    the bytes are measured), buffers the model reads included."""
    module.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in map(local_tensor, module.parameters()):
            if param.ndim == 1:  # norm weights
                param.fill_(1.0)
            elif param.numel() <= _RANDOM_UP_TO:
                param.normal_(0.0, _INIT_STD, generator=generator)
            else:
                param.fill_(_INIT_STD)
        for router in module.modules():  # even selection, nothing counted yet
            if isinstance(router, SigmoidTopKRouter):
                router.expert_bias.zero_()
                router.expert_load.zero_()


def _slope(measure, tokens: tuple[int, int]) -> float:
    """Bytes per token between the two lengths."""
    short, long = tokens
    return (measure(long) - measure(short)) / (long - short)


def _largest_moment_slope(measure, tokens: tuple[int, int]) -> float:
    """Bytes per token of the moment whose live bytes grow fastest between the two lengths
    (`measure(length)` -> a `PeakTensorMemory` with a timeline); the peak's slope if the two
    runs did not dispatch the same operators."""
    short, long = tokens
    for length in tokens:  # a first run at a length sets up caches: more operators
        measure(length)
    at_short, at_long = measure(short), measure(long)
    assert at_short.timeline is not None and at_long.timeline is not None
    if len(at_short.timeline) != len(at_long.timeline):
        return (at_long.peak_bytes - at_short.peak_bytes) / (long - short)
    growth = (b - a for a, b in zip(at_short.timeline, at_long.timeline, strict=True))
    return max(growth) / (long - short)


def _probe_split_block(
    block: nn.Module,
    spec: ModelSpec,
    split: TensorSplit,
    dim: int,
    dtype: torch.dtype,
    tokens: tuple[int, int],
    configure: Callable[[nn.Module], object] | None,
    kept: bool = False,
) -> _BlockProbe:
    """`_probe_block` as tp rank 0 of a simulated group runs the block: its collectives
    return at once, and give tensors of the real shapes."""
    shards = split.sequence_shards
    with simulated_rank(0, split.tp):
        mesh = init_device_mesh("cpu", (split.tp,))
        apply_tensor_parallel(block, mesh, spec, sequence_parallel=split.sequence_parallel)
        lengths = (tokens[0] * shards, tokens[1] * shards)
        return _probe_block(block, dim, dtype, lengths, configure, kept, sequence_shards=shards)


def _kv_cache_bytes(
    block: nn.Module, dim: int, dtype: torch.dtype, sequence_shards: int, rank_tokens: int = 4
) -> tuple[float, int]:
    """Bytes per token the block's attention leaves in a sliced KV cache (what its attention
    hands its context: expanded K/V, or a latent kept once; a tp rank's heads), and its kv
    heads, measured by one forward (no attention: 0 bytes, 0 heads)."""
    cache = ChunkedKVCache(backend="cpu")
    length = rank_tokens * sequence_shards  # every tp rank holds `rank_tokens` of them
    with torch.no_grad():
        hidden_BSD = torch.randn(1, rank_tokens, dim, dtype=dtype)
        block(hidden_BSD, None, cache.slice_context(0, 0))
    heads = [cached.k_BGSD.shape[1] for _, slices in cache.layer_slices(0) for cached in slices]
    return cache.nbytes / length, max(heads, default=0)


@dataclass(frozen=True)
class _BlockProbe:
    """What one kind of block measured, per token."""

    saved: float
    working: float
    kv_cache: float
    kv_heads: int


def _probe_block(
    block: nn.Module,
    dim: int,
    dtype: torch.dtype,
    tokens: tuple[int, int],
    configure: Callable[[nn.Module], object] | None,
    kept: bool = False,
    sequence_shards: int = 1,
) -> _BlockProbe:
    """Bytes per token the block saves, its peak over its forward and its backward to the
    input, and its KV cache's (`_kv_cache_bytes`); under sequence parallelism the block takes
    a rank's `1/sequence_shards` of the tokens. With `kept` the saved bytes are all the
    forward keeps alive (`kept_bytes`: selective checkpointing keeps op outputs outside
    autograd's saved tensors). Weights take no gradient here: their gradients' sizes do not
    grow with the tokens, and would move the peak to a moment that does not."""
    give_probe_weights(block)
    if configure is not None:
        configure(block)
    kv_cache, kv_heads = _kv_cache_bytes(block, dim, dtype, sequence_shards)

    def saved_bytes(length: int) -> int:
        hidden_BSD = torch.randn(1, length // sequence_shards, dim, dtype=dtype)
        if kept:
            hidden_BSD.requires_grad_()
            return kept_bytes(lambda: block(hidden_BSD * 1.0))
        with ActivationMemoryTracker(exclude=list(block.parameters())) as tracker:
            block(hidden_BSD.requires_grad_())
        return tracker.peak_bytes(SAVED)

    def working_bytes(length: int) -> PeakTensorMemory:
        # the input counts, as it does among the saved
        with PeakTensorMemory(timeline=True) as memory:
            size = (1, length // sequence_shards, dim)
            hidden_BSD = torch.randn(size, dtype=dtype, requires_grad=True)
            block(hidden_BSD).backward(torch.ones(size, dtype=dtype))
        return memory

    saved = _slope(saved_bytes, tokens)
    block.requires_grad_(False)
    working = _largest_moment_slope(working_bytes, tokens)
    return _BlockProbe(saved, working, kv_cache, kv_heads)


def _probe_split_head(
    spec: ModelSpec,
    split: TensorSplit,
    head: nn.Module,
    dim: int,
    vocab: int,
    dtype: torch.dtype,
    tokens: tuple[int, int],
) -> tuple[float, float]:
    """`_probe_head` as tp rank 0 of a simulated group runs the head: the final norm on a
    rank's tokens under sequence parallelism, the output layer and the loss on a rank's
    vocabulary shard under loss parallelism."""
    shards = split.sequence_shards
    with simulated_rank(0, split.tp):
        mesh = init_device_mesh("cpu", (split.tp,))
        apply_tensor_parallel(
            head, mesh, spec,
            sequence_parallel=split.sequence_parallel, loss_parallel=split.loss_parallel,
        )  # fmt: skip
        lengths = (tokens[0] * shards, tokens[1] * shards)
        with loss_parallel() if split.loss_parallel else contextlib.nullcontext():
            return _probe_head(head, dim, vocab, dtype, lengths, sequence_shards=shards)


def _probe_head(
    head: nn.Module,
    dim: int,
    vocab: int,
    dtype: torch.dtype,
    tokens: tuple[int, int],
    sequence_shards: int = 1,
) -> tuple[float, float]:
    """(bytes per token the head and loss save, their peak bytes per token over the forward
    and the backward to the input); under sequence parallelism the head takes a rank's
    `1/sequence_shards` of the tokens."""
    give_probe_weights(head)
    head.requires_grad_(False)  # weight gradients are a term of their own, not activations

    def inputs(length: int) -> tuple[Tensor, Tensor]:
        hidden_BSD = torch.randn(1, length // sequence_shards, dim, dtype=dtype)
        return hidden_BSD.requires_grad_(), torch.randint(0, vocab, (1, length))

    def saved_bytes(length: int) -> int:
        hidden_BSD, labels_BS = inputs(length)
        with ActivationMemoryTracker(exclude=list(head.parameters())) as tracker:
            token_sum_cross_entropy(head(hidden_BSD), labels_BS, length)
        return tracker.peak_bytes(SAVED)

    def peak_bytes(length: int) -> int:
        hidden_BSD, labels_BS = inputs(length)  # the stage's output: counted with the unit
        with PeakTensorMemory() as memory:
            token_sum_cross_entropy(head(hidden_BSD), labels_BS, length).backward()
        return memory.peak_bytes

    return _slope(saved_bytes, tokens), _slope(peak_bytes, tokens)
