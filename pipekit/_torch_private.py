"""Every private torch API pipekit uses, in one place (read from torch 2.13.0).

A torch upgrade that moves or changes one of these touches this file only.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch._dynamo
from torch import nn
from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir
from torch.distributed import _functional_collectives as functional_collectives
from torch.distributed._composable import checkpoint as _composable_checkpoint
from torch.distributed._composable.replicate_with_fsdp import replicate as fsdp_replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp._common_utils import collect_grad_tensors, replace_grad_tensors
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard as StridedShard
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.checkpoint import SAC_IGNORED_OPS

__all__ = [
    "ATTENTION_KERNEL_OPS",
    "FUNCTIONAL_COLLECTIVE_OPS",
    "REDISTRIBUTE_LOGGER",
    "BufferDtypesKept",
    "StridedShard",
    "TorchDispatchMode",
    "checkpoint_module_activations",
    "collect_grad_tensors",
    "concatenate_meshes",
    "cpu_flash_attention_backward",
    "cpu_flash_attention_forward",
    "dump_cuda_memory_snapshot",
    "flatten_mesh",
    "fsdp_replicate",
    "functional_collectives",
    "grouped_mm",
    "ignore_profiler_markers_in_selective_checkpointing",
    "inductor_cache_dir",
    "is_autograd_view",
    "local_shape_and_offset",
    "loss_parallel_once",
    "more_recompiles",
    "muon_adjusted_lr",
    "muon_defaults",
    "muon_orthogonalise",
    "record_cuda_memory_history",
    "replace_grad_tensors",
    "simulated_rank",
    "storage_holders",
    "tree_leaves",
]

# TorchDispatchMode (torch.utils._python_dispatch): intercepts every ATen op of a block; the
# live-tensor tracker uses it. tree_leaves (torch.utils._pytree): the
# tensors of a nested structure. functional_collectives (torch.distributed._functional_
# collectives): the traceable collectives DTensor runs, patched by the tensor-parallel bench
# to count bytes.

ATTENTION_KERNEL_OPS = (
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
)
"""The fused attention kernels (private ATen ops), whose outputs selective checkpointing keeps."""

FUNCTIONAL_COLLECTIVE_OPS = tuple(
    getattr(torch.ops._c10d_functional, name).default
    for name in (
        "all_gather_into_tensor",
        "reduce_scatter_tensor",
        "all_reduce",
        "all_to_all_single",
    )
)
"""The functional collectives DTensor and FSDP2 run (`_c10d_functional`): kept, never rerun."""

REDISTRIBUTE_LOGGER = "torch.distributed.tensor._redistribute"
"""The logger DTensor's redistribution warns through."""


def ignore_profiler_markers_in_selective_checkpointing() -> None:
    """Let selective checkpointing skip torch's profiler ranges (`SAC_IGNORED_OPS`).

    A recompute runs inside the backward, where FSDP2 marks its hooks' work with other profiler
    ranges than in the forward; the markers carry no data, so the recompute need not match them
    (selective checkpointing refuses any op the forward did not run). Idempotent; called when
    selective checkpointing is set up, not at import.
    """
    profiler = torch.ops.profiler
    SAC_IGNORED_OPS.update(
        (
            profiler._record_function_enter.default,
            profiler._record_function_enter_new.default,
            profiler._record_function_exit.default,
            profiler._record_function_exit._RecordFunction,
        )
    )


def record_cuda_memory_history(enabled: bool) -> None:
    """Start (up to a million events) or stop recording CUDA allocations for a snapshot."""
    if enabled:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    else:
        torch.cuda.memory._record_memory_history(enabled=None)


def dump_cuda_memory_snapshot(path: str) -> None:
    """Write the recorded CUDA allocation history (for pytorch.org/memory_viz)."""
    torch.cuda.memory._dump_snapshot(path)


# (q, k, v, dropout_p=0., is_causal=False, *, attn_mask=None, scale=None) -> (out, logsumexp).
# Rows with no allowed key come back with out = 0 and logsumexp = 0 (not -inf).
cpu_flash_attention_forward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

# (grad_out, q, k, v, out, logsumexp, dropout_p, is_causal, *, attn_mask=None, scale=None)
#   -> (grad_q, grad_k, grad_v); uses the given out and logsumexp as they are.
cpu_flash_attention_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward

# (a, b, offs=int32 cumulative group ends) -> one matmul per group in one kernel. 2-D x 3-D:
# rows of `a` grouped; 2-D x 2-D: the shared inner dim grouped (a weight gradient, 3-D result).
# float32/bfloat16/float16 on CPU; bfloat16 on CUDA (sm90+); strides must be 16-byte multiples.
# None where this torch build lacks it.
grouped_mm = getattr(torch, "_grouped_mm", None)

# (global_shape, mesh, placements) -> (local shape, global offset) of this rank's DTensor shard,
# uneven shards included (a rank outside the mesh or past the end gets size 0).
local_shape_and_offset = compute_local_shape_and_global_offset


@contextlib.contextmanager
def simulated_rank(rank: int, world_size: int) -> Iterator[None]:
    """A default process group in which this process is `rank` of `world_size` and every
    collective returns at once without moving data (torch's "fake" backend, from its test
    utilities): enough to build a rank's meshes and shard its model on the meta device."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


@contextlib.contextmanager
def more_recompiles(limit: int) -> Iterator[None]:
    """Raise dynamo's per-function recompile limit (default 8) to at least `limit` inside the
    block (an enclosing block's higher limit stays).

    A compiled kernel recompiles per distinct mask_mod and shape; past the limit dynamo silently
    runs the function eagerly, which for FlexAttention materialises the full score matrix.
    """
    with torch._dynamo.config.patch(
        recompile_limit=max(limit, torch._dynamo.config.recompile_limit)
    ):
        yield


@contextlib.contextmanager
def inductor_cache_dir(directory: str) -> Iterator[None]:
    """Compile into and load from `directory` inside the block (in-memory caches are cleared on
    entry and exit). Setting TORCHINDUCTOR_CACHE_DIR after torch has compiled anything is not
    enough: inductor writes the resolved directory back into the environment on first use."""
    with temporary_cache_dir(directory):
        yield


def checkpoint_module_activations(
    module: nn.Module, context_fn: Callable[[], tuple[Any, Any]] | None = None
) -> None:
    """Recompute `module`'s forward in backward instead of saving its activations (with
    `context_fn`, torch's selective-checkpoint contexts: what they keep is not recomputed).

    The composable API installs hooks instead of wrapping the module, so parameter and
    state-dict names do not change (checkpoints and Hugging Face export stay the same).
    """
    _composable_checkpoint(module, context_fn=context_fn)


# collect_grad_tensors(output) -> the grad-requiring tensors of a module's output (dicts, lists,
# tuples, NamedTuples and dataclasses traversed), and replace_grad_tensors(output, iterator) ->
# the output with them replaced in that order: FSDP2's own walk over a unit's output, where
# it hooks each tensor for its pre-backward all-gather (torch.distributed.fsdp._common_utils).


def is_autograd_view(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is a differentiable view of another (`Tensor._base`): what FSDP2 warns
    about when a unit returns one, since an in-place op on a view drops the hook it places."""
    return tensor._base is not None


# fsdp_replicate(module, *, mesh, mp_policy, ...), imported above: DDP built on FSDP2's
# machinery (torchtitan's choice). Parameters become Replicate DTensors on a 1-D mesh and the
# FSDPParamGroup that fully_shard uses all-reduces their gradients, so mixed precision,
# set_gradient_divide_factor and DCP state dicts behave as with fully_shard, without its
# all-gathers over a size-1 shard. (torch.distributed._composable.replicate is the older
# DDP-based one; not used.)


def flatten_mesh(mesh: DeviceMesh, name: str) -> DeviceMesh:
    """One 1-D mesh over all of `mesh`'s ranks, named `name` (`DeviceMesh._flatten`).

    Keep the returned mesh: slicing a flattened dim back out of the root mesh is deprecated.
    """
    return mesh._flatten(name)


def concatenate_meshes(meshes: list[DeviceMesh]) -> DeviceMesh:
    """One mesh whose dims are the given meshes' dims, in order (`DeviceMesh._concatenate`).

    The meshes must come from the same root mesh and share no dim; their process groups are
    reused, none is created. Gives HSDP its 2-D (replicate, shard) mesh when the shard dim is a
    flattened helper.
    """
    return DeviceMesh._concatenate(meshes)


def muon_orthogonalise(
    matrix: torch.Tensor, coefficients: tuple[float, float, float], steps: int, eps: float
) -> torch.Tensor:
    """`torch.optim.Muon`'s Newton-Schulz iteration of one matrix
    (`torch.optim._muon._zeropower_via_newtonschulz`): pipekit's Muon calls it so that its
    update is torch's, on whatever layout the matrix was gathered from."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    return _zeropower_via_newtonschulz(matrix, coefficients, steps, eps)


def muon_defaults() -> tuple[tuple[float, float, float], float]:
    """`torch.optim.Muon`'s Newton-Schulz coefficients and the epsilon of its normalisation."""
    from torch.optim._muon import DEFAULT_A, DEFAULT_B, DEFAULT_C, EPS

    return (DEFAULT_A, DEFAULT_B, DEFAULT_C), EPS


def muon_adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """`torch.optim.Muon`'s learning rate for a matrix of `shape` (`_muon._adjust_lr`)."""
    from torch.optim._muon import _adjust_lr

    return _adjust_lr(lr, adjust_lr_fn, shape)


@contextlib.contextmanager
def loss_parallel_once() -> Iterator[None]:
    """torch's `loss_parallel()` unless it is on already: it is not re-entrant (its exit
    removes the DTensor loss handlers, `torch.distributed.tensor.parallel.loss`, that an
    enclosing one still needs), and the chunked head runs inside the trainer's."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel.loss import customized_loss_ops, loss_parallel

    handlers = DTensor._op_dispatcher._custom_op_handlers
    active = all(op in handlers for op in customized_loss_ops)
    with contextlib.nullcontext() if active else loss_parallel():
        yield


def storage_holders(tensor: torch.Tensor) -> int:
    """How many tensors (and storage objects) share `tensor`'s storage, this call's temporary
    excluded (`torch._C._storage_Use_Count`): activation offload moves a storage only when the
    saved tensors are all that hold it, so moving it frees its memory."""
    return torch._C._storage_Use_Count(tensor.untyped_storage()._cdata) - 1


class BufferDtypesKept(nn.Module):
    """A module whose buffers named in `kept_dtype_buffers` keep their dtype and values through
    casts (`module.to(torch.bfloat16)`) while moving with the module like any buffer.

    Every cast and move of a module goes through torch's `nn.Module._apply`: it is overridden
    here, after the move, to restore each named buffer from its value before the call."""

    kept_dtype_buffers: tuple[str, ...] = ()

    def _apply(self, fn, recurse=True):  # type: ignore[no-untyped-def] - nn.Module's signature
        before = {name: getattr(self, name) for name in self.kept_dtype_buffers}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = getattr(self, name)
            if new.dtype != old.dtype:
                setattr(self, name, old.to(new.device))
        return self
