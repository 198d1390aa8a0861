"""FlexAttention backend: the training kernel on CUDA, an inference kernel on CPU.

`flex_attention` and `create_block_mask` are each wrapped by `torch.compile` once per process
(`compiled_flex_attention`, `_compiled_block_mask`); every call and every module instance shares
them, so a model compiles per distinct shape and mask, not per layer or per call.

Differentiability: on CUDA both outputs carry gradients (FlexAttention's backward accepts a
gradient for the log-sum-exp), so partial results over KV chunks are merged by plain autograd.
CPU limits in torch 2.13, designed around here: compiled FlexAttention on CPU runs inference
only, has no backward at all, and cannot return the lse. On CPU this backend therefore refuses
inputs that require grad (use the "cpu" backend to train) and takes the lse from the tiled CPU
flash kernel on the same mask: exact and never a full-sequence score matrix, but it is a second
attention pass, so flex on CPU is a path for checking the CUDA kernel's numbers and for
inference, not a fast one. Eager FlexAttention could return the lse but materialises the scores.

The CPU kernel cannot be trusted everywhere: on CPUs with AVX2 and no AVX-512, torch 2.13's
generated code returns wrong rows (errors as large as the values, sometimes NaN) for head dims
below 32 at many sequence lengths, and which rows go wrong changes from run to run. So on CPU
this backend (1) refuses head_dim < 32 on every CPU, so a program behaves the same on every
machine, and (2) checks every output against the CPU kernel's output of the same call (computed
anyway for the lse, so the check costs one comparison), raising `FlexKernelMismatchError` instead
of returning wrong values on a CPU or shape nobody has swept. A one-time probe per shape would
not do: a run that happens to read the right values proves nothing about the next one.

Score modifications (a pattern's bias or soft cap, `pipekit.attention.kernels.score_mod`) go to
FlexAttention as its `score_mod`; on CPU the reference output and lse come from the `cpu`
backend, which computes them by materialising the chunk's scores.

Legend: B batch, H query heads, G kv heads, S queries, K keys, D head dim.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import (
    AuxRequest,
    BlockMask,
    create_block_mask,
    flex_attention,
)

from pipekit._torch_private import more_recompiles
from pipekit.attention.kernels._tiles import mask_dependence
from pipekit.attention.kernels.cpu_flash import CpuFlashBackend
from pipekit.attention.kernels.score_mod import split_score_mod
from pipekit.attention.masks import MaskMod

__all__ = [
    "MIN_CPU_HEAD_DIM",
    "MIN_CUDA_HEAD_DIM",
    "FlexBackend",
    "FlexKernelMismatchError",
    "check_flex_against_reference",
    "compiled_flex_attention",
    "refuse_unsupported_cuda_shape",
]

# Smallest head dim the compiled CPU kernel is used for. Swept with torch 2.13.0 on AVX2 code
# generation (`python -m pipekit.bench flex-cpu`; causal and no mask, float32, lengths 8 to
# 2048): head dims 8 and 16 were wrong at lengths from 8 to 1000 (errors up to 0.7·max|v|, or
# NaN); 4, 12, 24 and 32 to 128 were right at every length. Below 32 is refused with a margin.
MIN_CPU_HEAD_DIM = 32

# Smallest head dim torch's CUDA FlexAttention kernel lowers (inductor raises "NYI: embedding
# dimension of the query, key, and value must be at least 16" below it; seen on an H200 with
# torch 2.11).
MIN_CUDA_HEAD_DIM = 16

# How far the flex output may lie from the CPU kernel's, as a fraction of max |v| (each output
# row is a convex combination of rows of v, so |out| <= max |v|). Two correct kernels differ by
# accumulation-order rounding: about 1e-6 in float32 and one or two output ulps (2^-8 = 3.9e-3
# for bfloat16, 2^-11 for float16) in half precision. The kernel's failures are of order 1.
_MISMATCH_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2, torch.float16: 1e-2}


class FlexKernelMismatchError(RuntimeError):
    """Compiled FlexAttention on CPU disagreed with the CPU kernel on the same call."""


def _cpu_name() -> str:
    capability = torch.backends.cpu.get_cpu_capability()
    return f"this CPU ({capability} kernels, torch {torch.__version__})"


def _refuse_untrusted_cpu_shape(q_BHSD: Tensor) -> None:
    head_dim = q_BHSD.shape[-1]
    if head_dim < MIN_CPU_HEAD_DIM:
        raise ValueError(
            f"attention backend 'flex' on CPU refuses head_dim={head_dim}: below "
            f"{MIN_CPU_HEAD_DIM}, torch's compiled CPU FlexAttention returns wrong values on AVX2 "
            "CPUs; use backend='cpu' (or 'auto', which picks it on CPU)"
        )


def refuse_unsupported_cuda_shape(q_BHSD: Tensor) -> None:
    """One line before compiling, instead of an inductor lowering error deep in a step."""
    head_dim = q_BHSD.shape[-1]
    if head_dim < MIN_CUDA_HEAD_DIM:
        raise ValueError(
            f"attention backend 'flex' on CUDA needs head_dim >= {MIN_CUDA_HEAD_DIM}, got "
            f"{head_dim}: torch's FlexAttention kernel does not lower smaller heads; use fewer, "
            "wider heads (dim / n_heads)"
        )


def check_flex_against_reference(
    out_BHSD: Tensor, reference_out_BHSD: Tensor, v_BGKD: Tensor
) -> None:
    """Raise `FlexKernelMismatchError` unless `out` equals the CPU kernel's `reference_out`
    within the dtype's tolerance (NaN where the reference is finite counts as a mismatch)."""
    tolerance = _MISMATCH_TOLERANCE.get(out_BHSD.dtype, 1e-4)
    value_scale = v_BGKD.abs().amax().float().clamp_min(torch.finfo(torch.float32).tiny)
    error_BHSD = (out_BHSD.float() - reference_out_BHSD.float()).abs() / value_scale
    if bool((error_BHSD <= tolerance).all()):
        return
    wrong = int((~(error_BHSD <= tolerance)).sum())
    raise FlexKernelMismatchError(
        f"attention backend 'flex' returned wrong values on {_cpu_name()}: {wrong} of "
        f"{error_BHSD.numel()} outputs of q {tuple(out_BHSD.shape)} {out_BHSD.dtype} differ "
        f"from the cpu kernel by more than {tolerance:g}·max|v| (largest "
        f"{error_BHSD.nan_to_num(float('inf')).max().item():.3g}); use backend='cpu'"
    )


# Each distinct mask_mod and shape is one compiled variant; a real job has a handful, a test
# suite or a tool that sees many sequence lengths has more than dynamo's default of 8. Shapes
# are static: with automatic dynamic shapes, torch 2.13 generates CPU flex code that fails to build.
_RECOMPILE_LIMIT = 64


@functools.cache
def _compiled(fn: Callable[..., object]) -> Callable[..., object]:
    compiled = torch.compile(fn, dynamic=False)

    def call_compiled(*args: object, **kwargs: object) -> object:
        with more_recompiles(_RECOMPILE_LIMIT):
            return compiled(*args, **kwargs)

    return call_compiled


def compiled_flex_attention() -> Callable[..., object]:
    """`flex_attention`, compiled once per process (static shapes)."""
    return _compiled(flex_attention)


def _compiled_block_mask() -> Callable[..., BlockMask]:
    return _compiled(create_block_mask)


class FlexBackend:
    """Compiled FlexAttention with a BlockMask built from the mask_mod (cached for one mask)."""

    name = "flex"
    lse_has_grad = True
    work_block = 128
    """Tokens per side of the blocks it computes whole: `create_block_mask`'s default."""

    def __init__(self) -> None:
        self._last_block_mask: tuple[tuple[object, ...], MaskMod, BlockMask] | None = None
        self._cpu_reference = CpuFlashBackend()  # gives the lse and checks the output

    def block_mask(self, mask: MaskMod, q_BHSD: Tensor, k_BGKD: Tensor) -> BlockMask:
        """The BlockMask of `mask` for these shapes; the last one is reused, since every layer
        of a model asks for the same mask in turn."""
        batch, heads, q_len, _ = q_BHSD.shape
        key = (id(mask), batch, heads, q_len, k_BGKD.shape[2], q_BHSD.device)
        if self._last_block_mask is not None and self._last_block_mask[0] == key:
            return self._last_block_mask[2]
        per_batch, per_head = mask_dependence(mask, batch, heads, q_BHSD.device)
        block_mask = _compiled_block_mask()(
            mask,
            batch if per_batch else None,
            heads if per_head else None,
            q_len,
            k_BGKD.shape[2],
            device=q_BHSD.device,
        )
        self._last_block_mask = (key, mask, block_mask)  # holding `mask` keeps its id unique
        return block_mask

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        """`(out_BHSD, lse_BHS)`; differentiable in both on CUDA, inference only on CPU."""
        on_cpu = q_BHSD.device.type == "cpu"
        if on_cpu:
            if torch.is_grad_enabled() and any(t.requires_grad for t in (q_BHSD, k_BGKD, v_BGKD)):
                raise RuntimeError(
                    "attention backend 'flex' has no backward on CPU (torch 2.13 FlexAttention is "
                    "inference-only there); train on CPU with backend='cpu' or 'auto'"
                )
            _refuse_untrusted_cpu_shape(q_BHSD)
        else:
            refuse_unsupported_cuda_shape(q_BHSD)
        mask_mod, score_mod = split_score_mod(mask, q_BHSD.shape[1])
        block_mask = None if mask_mod is None else self.block_mask(mask_mod, q_BHSD, k_BGKD)
        options = {
            "block_mask": block_mask,
            "score_mod": score_mod,
            "scale": scale,
            "enable_gqa": q_BHSD.shape[1] != k_BGKD.shape[1],
        }
        if not on_cpu:
            out_BHSD, aux = compiled_flex_attention()(
                q_BHSD, k_BGKD, v_BGKD, return_aux=AuxRequest(lse=True), **options
            )
            return out_BHSD, aux.lse
        out_BHSD = compiled_flex_attention()(q_BHSD, k_BGKD, v_BGKD, **options)
        reference_out_BHSD, lse_BHS = self._cpu_reference.forward_chunk(
            q_BHSD, k_BGKD, v_BGKD, mask, scale
        )
        check_flex_against_reference(out_BHSD, reference_out_BHSD, v_BGKD)
        return out_BHSD, lse_BHS
