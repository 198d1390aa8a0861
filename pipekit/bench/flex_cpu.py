"""`python -m pipekit.bench flex-cpu`: where compiled FlexAttention on this CPU is wrong.

torch 2.13's compiled CPU FlexAttention returns wrong values for some head dims on some CPUs
(AVX2 ones). The flex backend refuses head dims below `MIN_CPU_HEAD_DIM` on CPU and checks every
output against the CPU kernel; this sweep shows whether that rule covers the machine it runs on.
It calls the compiled kernel directly (no guard, no check), over head dim x length x mask, a few
calls per case with fresh inputs (the wrong rows change from call to call), and compares each
output with a float64 reference. A case is wrong when some output is more than 1e-3·max|v| off.

To sweep another CPU's code path, set ATEN_CPU_CAPABILITY (e.g. avx2): inductor then generates
code for it. The bench then keeps its compiled kernels in a cache of their own, because torch
2.13's inductor cache key leaves the capability out and a kernel built for one capability gives
wrong values or crashes under the other.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

from pipekit._torch_private import inductor_cache_dir, more_recompiles
from pipekit.attention import causal_mask
from pipekit.attention.kernels.flex import MIN_CPU_HEAD_DIM, FlexBackend, compiled_flex_attention
from pipekit.bench.report import machine_description, print_result, print_table

__all__ = ["main"]

_WRONG = 1e-3
_MASKS = {"causal": causal_mask, "none": None}


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",")]


def _cache_for_this_capability() -> contextlib.AbstractContextManager[None]:
    """A cache of its own when ATEN_CPU_CAPABILITY picks another code path than the CPU's best."""
    capability = os.environ.get("ATEN_CPU_CAPABILITY")
    if not capability:
        return contextlib.nullcontext()
    return inductor_cache_dir(str(Path(tempfile.gettempdir()) / f"pipekit_inductor_{capability}"))


def _relative_error(head_dim: int, length: int, mask_name: str, args: argparse.Namespace) -> float:
    """Largest |flex - exact| / max|v| over the case's calls (inf for NaN)."""
    dtype = getattr(torch, args.dtype)
    worst = 0.0
    for seed in range(args.calls):
        gen = torch.Generator().manual_seed(seed)
        shape = (args.batch, args.heads, length, head_dim)
        q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
        mask = _MASKS[mask_name]
        block_mask = None if mask is None else FlexBackend().block_mask(mask, q, k)
        with torch.no_grad():
            out = compiled_flex_attention()(q, k, v, block_mask=block_mask)
        exact = F.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=mask is not None
        )
        error = ((out.double() - exact).abs() / v.double().abs().max()).max().item()
        worst = max(worst, error if error == error else float("inf"))  # NaN -> inf
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipekit.bench flex-cpu", description=__doc__)
    parser.add_argument("--head-dims", type=_ints, default=_ints("8,16,24,32,64,128"))
    parser.add_argument("--lengths", type=_ints, default=_ints("8,24,40,72,130,264,520,1000"))
    parser.add_argument("--masks", default="causal,none", help="comma list of causal, none")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--calls", type=int, default=2, help="calls per case, fresh inputs each")
    args = parser.parse_args(argv)
    masks = args.masks.split(",")
    if unknown := [m for m in masks if m not in _MASKS]:
        parser.error(f"--masks: unknown {unknown}; choose from {sorted(_MASKS)}")
    cases = len(masks) * len(args.head_dims) * len(args.lengths)
    with _cache_for_this_capability(), more_recompiles(cases + 8):  # one variant per case
        _sweep(args, masks)


def _sweep(args: argparse.Namespace, masks: list[str]) -> None:
    print(f"{machine_description()}; {args.dtype}, B={args.batch}, H={args.heads}")
    print(f"cells: max |flex - exact| / max|v| over {args.calls} calls; wrong above {_WRONG:g}")
    wrong_cases, wrong_admitted, cases = [], [], 0
    for mask_name in masks:
        rows = []
        for head_dim in args.head_dims:
            errors = [_relative_error(head_dim, n, mask_name, args) for n in args.lengths]
            cases += len(errors)
            for length, error in zip(args.lengths, errors, strict=True):
                if error > _WRONG:
                    wrong_cases.append((mask_name, head_dim, length))
                    if head_dim >= MIN_CPU_HEAD_DIM:
                        wrong_admitted.append((mask_name, head_dim, length))
            admitted = "yes" if head_dim >= MIN_CPU_HEAD_DIM else "refused"
            rows.append([mask_name, head_dim, admitted, *(f"{e:.1e}" for e in errors)])
        print_table(["mask", "head_dim", "guard", *(f"S={n}" for n in args.lengths)], rows)
    if wrong_admitted:
        print(f"wrong and admitted by the guard (mask, head_dim, length): {wrong_admitted}")
    print_result(
        capability=torch.backends.cpu.get_cpu_capability(),
        cases=cases,
        wrong=len(wrong_cases),
        wrong_admitted=len(wrong_admitted),
    )
