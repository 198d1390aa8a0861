"""One matmul per expert over rows grouped by expert, in one kernel where torch has one.

`grouped_matmul(x_AI, w_EIO, counts)` computes `x_e @ w_e` for each expert's contiguous run of
rows; `grouped_weight_grad(a_AI, b_AO, counts)` computes `a_e^T @ b_e` (a weight gradient). They
use `torch._grouped_mm` where the dtype, device and strides allow it, and otherwise a loop of
plain matmuls over the experts (float64, odd widths, CUDA fp32): the same result, E launches.
`grouped_bias_add_` and `grouped_row_sum` are the bias of each expert's rows and its gradient
(the per-expert sum of those rows' output gradients).

Legend: A assignments (rows), E experts, I input width, O output width.
"""

from __future__ import annotations

import torch
from torch import Tensor

from pipekit._torch_private import grouped_mm

__all__ = [
    "grouped_bias_add_",
    "grouped_kernel_applies",
    "grouped_matmul",
    "grouped_row_sum",
    "grouped_weight_grad",
]

_KERNEL_DTYPES = {
    "cpu": (torch.float32, torch.bfloat16, torch.float16),
    "cuda": (torch.bfloat16,),
}


def grouped_kernel_applies(*tensors: Tensor) -> bool:
    """Whether `torch._grouped_mm` takes these operands (dtype, device, 16-byte strides)."""
    if grouped_mm is None:
        return False
    first = tensors[0]
    if first.dtype not in _KERNEL_DTYPES.get(first.device.type, ()):
        return False
    # sm90 only: sm100 has returned non-zero weight gradients for empty groups (pytorch#172439).
    if first.device.type == "cuda" and torch.cuda.get_device_capability(first.device)[0] != 9:
        return False
    alignment = 16 // first.element_size()
    return all(tensor.shape[-1] % alignment == 0 for tensor in tensors)


def _offsets(counts_E: list[int], device: torch.device) -> Tensor:
    return torch.tensor(counts_E, dtype=torch.int64, device=device).cumsum(0).to(torch.int32)


def grouped_matmul(
    x_AI: Tensor, w_EIO: Tensor, counts_E: list[int], out: Tensor | None = None
) -> Tensor:
    """Rows of expert e (the e-th run of `counts_E[e]` rows) times `w_EIO[e]`, into `out`."""
    if x_AI.shape[0] and grouped_kernel_applies(x_AI, w_EIO, w_EIO.transpose(-2, -1)):
        result_AO = grouped_mm(x_AI, w_EIO, offs=_offsets(counts_E, x_AI.device))
        return result_AO if out is None else out.copy_(result_AO)
    out_AO = x_AI.new_empty(x_AI.shape[0], w_EIO.shape[-1]) if out is None else out
    start = 0
    for expert, count in enumerate(counts_E):
        torch.mm(x_AI[start : start + count], w_EIO[expert], out=out_AO[start : start + count])
        start += count
    return out_AO


def grouped_weight_grad(a_AI: Tensor, b_AO: Tensor, counts_E: list[int]) -> Tensor:
    """`a_e^T @ b_e` per expert: [E, I, O], zero for an expert with no rows."""
    # No rows at all: a zero-length contraction, which the CUDA kernel rejects.
    if a_AI.shape[0] and grouped_kernel_applies(a_AI, b_AO):
        return grouped_mm(a_AI.t(), b_AO, offs=_offsets(counts_E, a_AI.device))
    out_EIO = a_AI.new_zeros(len(counts_E), a_AI.shape[-1], b_AO.shape[-1])
    start = 0
    for expert, count in enumerate(counts_E):
        if count:
            torch.mm(
                a_AI[start : start + count].t(), b_AO[start : start + count], out=out_EIO[expert]
            )
        start += count
    return out_EIO


def _lengths(counts_E: list[int], device: torch.device) -> Tensor:
    return torch.tensor(counts_E, dtype=torch.int64, device=device)


def grouped_bias_add_(out_AO: Tensor, b_EO: Tensor, counts_E: list[int]) -> Tensor:
    """Add `b_EO[e]` to each row of expert e in `out_AO`, in place; returns `out_AO`."""
    rows = out_AO.shape[0]
    if rows:
        lengths_E = _lengths(counts_E, out_AO.device)
        out_AO.add_(b_EO.repeat_interleave(lengths_E, dim=0, output_size=rows))
    return out_AO


def grouped_row_sum(x_AO: Tensor, counts_E: list[int]) -> Tensor:
    """The sum of each expert's rows, [E, O] (zero for an expert with no rows): a bias's
    gradient from its output's, in one segmented reduction."""
    if not x_AO.shape[0]:
        return x_AO.new_zeros(len(counts_E), x_AO.shape[-1])
    lengths_E = _lengths(counts_E, x_AO.device)
    return torch.segment_reduce(x_AO, "sum", lengths=lengths_E, axis=0)
