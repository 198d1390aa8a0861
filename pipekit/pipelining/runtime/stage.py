"""A torch `PipelineStage` that runs slices against a chunked KV cache.

torch's runtime calls `forward_one_chunk(unit)` and `backward_one_chunk(unit)` with unit indices
(`pipekit.pipelining.schedules.units`). This subclass turns a unit into (microbatch, slice),
hands the stage's model the slice's attention context (its microbatch's KV cache, as the
pipeline's extensions wrap it), runs the slice inside its microbatch's sequence scope (so losses
of sums over the sequence, as MoE load balancing, are the whole sequence's:
`pipekit.layers.sequence_statistics`), and releases the slice's cached chunks right after its
backward. With one slice per microbatch it is an ordinary stage with causal (document-aware)
attention, so torch's own schedules run on it too.

Shapes are given statically, so torch never runs the extra metadata-inference forward that
would touch the KV cache outside a real unit. Slices of different lengths (equal-cost slicing)
get receive buffers of their own length.

Legend: B microbatch rows, S slice length, D model dim, V vocabulary.
"""

from __future__ import annotations

import contextlib
import itertools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import ChunkedKVCache
from pipekit.layers.sequence_statistics import SequenceStatistics, sequence_scope
from pipekit.memory.tracker import track_tensor, untrack_tensor
from pipekit.pipelining._torch_runtime import (
    ReceiveBuffersHook,
    resize_receive_buffers,
    stage_saved_inputs,
)
from pipekit.pipelining.actions import (
    BACKWARD,
    FORWARD,
    INPUT_BACKWARD,
    WEIGHT_BACKWARD,
    Action,
    ComputationType,
)
from pipekit.pipelining.runtime.extension import PipelineExtension
from pipekit.pipelining.schedules.units import unit_microbatch_and_slice

__all__ = ["SlicedPipelineStage", "StageShapes", "check_stage_slices"]


class StageShapes:
    """Static shapes of a unit at a stage boundary: tokens `[B, S]` into the first stage,
    hidden states `[B, S, D]` between stages, logits `[B, S, V]` out of the last. When a
    pipeline feature holds the embedding (`embedding_outside`) or the output layer
    (`output_outside`) outside the stages, the first stage takes or the last gives hidden
    states. Floating examples require grad: torch
    sizes the gradient buffers of a boundary only for those. `slice_lengths`: the tokens of each
    slice (S of its units; a context-parallel rank's share of `context_parallel`); the examples
    have the longest."""

    def __init__(
        self,
        rows: int,
        slice_lengths: Sequence[int],
        model_dim: int,
        vocab_size: int,
        dtype: torch.dtype,
        *,
        embedding_outside: bool = False,
        output_outside: bool = False,
        sequence_shards: int = 1,
        context_parallel: int = 1,
    ) -> None:
        self.rows, self.slice_lengths = rows, tuple(slice_lengths)
        self.model_dim, self.vocab_size, self.dtype = model_dim, vocab_size, dtype
        self.embedding_outside, self.output_outside = embedding_outside, output_outside
        self.sequence_shards = sequence_shards
        self.context_parallel = context_parallel

    @property
    def slice_bounds(self) -> tuple[int, ...]:
        """The slices' token offsets in the whole sequence (every cp rank's tokens)."""
        return tuple(
            itertools.accumulate(
                (length * self.context_parallel for length in self.slice_lengths), initial=0
            )
        )

    @property
    def slice_length(self) -> int:
        """Tokens of the longest slice."""
        return max(self.slice_lengths)

    def hidden_tokens(self, slice_index: int) -> int:
        """Tokens of slice `slice_index` in this rank's hidden states (its share under sequence
        parallelism)."""
        return self.slice_lengths[slice_index] // self.sequence_shards

    def stage_input(self, is_first: bool, device: torch.device) -> torch.Tensor:
        """The first stage takes token ids (embeddings when the embedding is outside); the
        others take hidden states."""
        if is_first and not self.embedding_outside:
            return torch.empty(self.rows, self.slice_length, dtype=torch.long, device=device)
        return self.hidden(device)

    def stage_output(self, is_last: bool, device: torch.device) -> torch.Tensor:
        """The last stage gives logits (hidden states when the output layer is outside); the
        others give hidden states."""
        if is_last and not self.output_outside:
            size = (self.rows, self.slice_length, self.vocab_size)
            return torch.empty(size, dtype=self.dtype, device=device, requires_grad=True)
        return self.hidden(device)

    def hidden(self, device: torch.device, tokens: int | None = None) -> torch.Tensor:
        """Hidden states of one unit of `tokens` (default: the longest slice's), requiring grad
        (a boundary torch sends gradients over); under sequence parallelism, this rank's share
        of its tokens."""
        tokens = self.slice_length // self.sequence_shards if tokens is None else tokens
        size = (self.rows, tokens, self.model_dim)
        return torch.empty(size, dtype=self.dtype, device=device, requires_grad=True)


class SlicedPipelineStage(ReceiveBuffersHook):
    """A stage whose units are slices; its model takes `(x, positions=, attention_context=)`."""

    def __init__(
        self,
        stage_module: nn.Module,
        stage_index: int,
        num_stages: int,
        device: torch.device,
        shapes: StageShapes,
        num_slices: int = 1,
        group: dist.ProcessGroup | None = None,
        backend: str | AttentionBackend = "auto",
    ) -> None:
        if len(shapes.slice_lengths) != num_slices:
            raise ValueError(
                f"StageShapes gives {len(shapes.slice_lengths)} slice lengths for num_slices="
                f"{num_slices}; give one per slice"
            )
        meta = torch.device("meta")
        super().__init__(
            stage_module,
            stage_index,
            num_stages,
            device,
            input_args=shapes.stage_input(stage_index == 0, meta),
            output_args=shapes.stage_output(stage_index == num_stages - 1, meta),
            group=group,
        )
        self.num_slices, self.shapes = num_slices, shapes
        self.kv_cache = ChunkedKVCache(backend, slice_bounds=shapes.slice_bounds)
        self.microbatch_bounds: tuple[tuple[int, ...], ...] | None = None
        """This step's slice bounds per microbatch, when each microbatch is cut by its own
        documents (`use_microbatch_bounds`); None: every microbatch as `shapes` says."""
        self.sequence_statistics: dict[int, SequenceStatistics] = {}
        """Per microbatch: the sums its slices recorded for losses over the whole sequence."""
        self.extensions: Sequence[PipelineExtension] = ()
        """Set by the schedule: the pipeline's features, asked for each forward's context."""
        self.action_observer: Callable[[Action, float, float], None] | None = None
        """Called with (action, start, end) after each F, B, I or W (`tools.trace`)."""

    def use_microbatch_bounds(self, bounds: Sequence[Sequence[int]]) -> None:
        """Cut this step's microbatches at `bounds` (one tuple of n + 1 offsets of the whole
        sequence each, every cp rank's tokens counted): the receive buffers of every unit take
        its slice's length, and the KV cache places each slice where it lies."""
        self.microbatch_bounds = tuple(tuple(each) for each in bounds)
        self.kv_cache.microbatch_bounds = self.microbatch_bounds
        if self.args_recv_info or self.grad_recv_info:  # prepared by an earlier step
            self.after_receive_buffers()

    def unit_tokens(self, unit: int) -> int:
        """Tokens of unit `unit` in this rank's hidden states (its context- and
        sequence-parallel share)."""
        microbatch, slice_index = unit_microbatch_and_slice(unit, self.num_slices)
        if self.microbatch_bounds is None:
            return self.shapes.hidden_tokens(slice_index)
        bounds = self.microbatch_bounds[microbatch]
        shares = self.shapes.context_parallel * self.shapes.sequence_shards
        return (bounds[slice_index + 1] - bounds[slice_index]) // shares

    def after_receive_buffers(self) -> None:
        """Each unit's activation and gradient receive buffers sized to its slice."""
        if self.microbatch_bounds is not None or len(set(self.shapes.slice_lengths)) > 1:
            resize_receive_buffers(self, self.unit_tokens)

    def forward_one_chunk(
        self,
        fwd_chunk_id: int,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        save_forward_output: bool = True,
    ) -> Any:
        """Forward of one unit with its slice's attention context from the stage's KV cache."""
        microbatch, slice_index = unit_microbatch_and_slice(fwd_chunk_id, self.num_slices)
        stage_kwargs = dict(kwargs or {})
        document_ids_BS = stage_kwargs.pop("document_ids", None)
        context = self.kv_cache.slice_context(microbatch, slice_index, document_ids_BS)
        for extension in self.extensions:
            context = extension.stage_context(
                self.stage_index, fwd_chunk_id, self.has_backward, context
            )
        stage_kwargs["attention_context"] = context
        with self._sequence(microbatch, slice_index), contextlib.ExitStack() as scopes:
            for extension in self.extensions:
                scopes.enter_context(
                    extension.forward_scope(self.stage_index, fwd_chunk_id, self.has_backward)
                )
            output = self._observed(
                FORWARD,
                fwd_chunk_id,
                lambda: super(SlicedPipelineStage, self).forward_one_chunk(
                    fwd_chunk_id, args, stage_kwargs, save_forward_output
                ),
            )
        for extension in self.extensions:
            extension.after_forward(self.stage_index, fwd_chunk_id, context)
        if self.has_backward:
            for tensor in self._stage_inputs(fwd_chunk_id):
                track_tensor("stage_inputs", tensor)
            for tensor in self.kv_cache.slice_tensors(microbatch, slice_index):
                track_tensor("kv_cache", tensor)
        return output

    def backward_one_chunk(
        self,
        bwd_chunk_id: int,
        loss: torch.Tensor | None = None,
        full_backward: bool = True,
        last_backward: bool = False,
    ) -> None:
        """Backward of one unit (recomputed if checkpointed), then its cached chunks are freed."""
        if not full_backward and self.num_slices > 1:
            raise ValueError(
                "sliced stages need full backward actions (B): a split input/weight backward "
                "(I/W) does not carry the KV-cache gradients; use a schedule without I/W actions"
            )
        microbatch, slice_index = unit_microbatch_and_slice(bwd_chunk_id, self.num_slices)
        stage_inputs = self._stage_inputs(bwd_chunk_id)
        self.kv_cache.recomputing = (microbatch, slice_index)  # activation checkpointing
        try:
            with self._sequence(microbatch, slice_index):  # a recomputed forward records again
                self._observed(
                    BACKWARD if full_backward else INPUT_BACKWARD,
                    bwd_chunk_id,
                    lambda: super(SlicedPipelineStage, self).backward_one_chunk(
                        bwd_chunk_id, loss, full_backward, last_backward
                    ),
                )
        finally:
            self.kv_cache.recomputing = None
        for tensor in stage_inputs:
            untrack_tensor("stage_inputs", tensor)
        for tensor in self.kv_cache.slice_tensors(microbatch, slice_index):
            untrack_tensor("kv_cache", tensor)
        self.kv_cache.release(microbatch, slice_index)

    def backward_weight_one_chunk(self, bwd_chunk_id: int, last_backward: bool = False) -> None:
        """Weight-gradient part of a split backward (unsliced stages only)."""
        self._observed(
            WEIGHT_BACKWARD,
            bwd_chunk_id,
            lambda: super(SlicedPipelineStage, self).backward_weight_one_chunk(
                bwd_chunk_id, last_backward
            ),
        )

    def _sequence(self, microbatch: int, slice_index: int) -> Any:
        statistics = self.sequence_statistics.setdefault(microbatch, SequenceStatistics())
        return sequence_scope(statistics, slice_index)

    def _observed(self, kind: ComputationType, unit: int, run: Callable[[], Any]) -> Any:
        """Run one action, named for torch.profiler traces; with an observer, time it (on
        CUDA, between device syncs)."""
        microbatch, slice_index = unit_microbatch_and_slice(unit, self.num_slices)
        where = f"stage {self.stage_index} microbatch {microbatch} slice {slice_index}"
        with record_function(f"pipekit: {kind.value} {where}"):
            return self._timed(kind, unit, run)

    def _timed(self, kind: ComputationType, unit: int, run: Callable[[], Any]) -> Any:
        if self.action_observer is None:
            return run()
        synchronize = self.device.type == "cuda"
        if synchronize:
            torch.cuda.synchronize(self.device)
        start = time.perf_counter()
        output = run()
        if synchronize:
            torch.cuda.synchronize(self.device)
        self.action_observer(Action(self.stage_index, kind, unit), start, time.perf_counter())
        return output

    def clear_runtime_states(self) -> None:
        """Between steps: torch's per-step state, the whole KV cache, the sequences' sums."""
        super().clear_runtime_states()
        self.kv_cache.clear()
        self.sequence_statistics.clear()

    def _stage_inputs(self, unit: int) -> list[torch.Tensor]:
        """The received activations of a unit (the first stage's token ids are not counted)."""
        if self.is_first:
            return []
        return [
            t
            for t in stage_saved_inputs(self, unit)
            if isinstance(t, torch.Tensor) and t.is_floating_point()
        ]


def check_stage_slices(stages: Sequence[SlicedPipelineStage], num_slices: int) -> None:
    """A schedule and its stages must agree on how many slices a microbatch has."""
    for stage in stages:
        if stage.num_slices != num_slices:
            raise ValueError(
                f"stage {stage.stage_index} was built for {stage.num_slices} slices, the "
                f"schedule for {num_slices}; build both from the same num_slices"
            )
