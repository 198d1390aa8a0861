"""`python -m pipekit.bench attention`: attention kernels against torch's SDPA.

One causal problem (default B=1, H=8, S=2048, D=64, float32). Forward time per call of the CPU
training backend and of compiled FlexAttention (forward only on CPU: the inference path; its lse
comes from an extra CPU-kernel pass, included in its time, which also checks its output; the
bare kernel is timed too), and forward+backward of the CPU backend,
each beside `scaled_dot_product_attention` on the same tensors; max abs error of the output
against a float64 dense reference. Head dims below 32 are refused: flex on CPU refuses them
(its kernel is wrong there on AVX2 CPUs), so there would be nothing to compare.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from pipekit.attention import attention, causal_mask, get_backend
from pipekit.attention.kernels.flex import MIN_CPU_HEAD_DIM, compiled_flex_attention
from pipekit.bench.report import machine_description, print_result, print_table, time_call

__all__ = ["main"]


def _reference_out(
    q_BHSD: torch.Tensor, k_BHSD: torch.Tensor, v_BHSD: torch.Tensor
) -> torch.Tensor:
    q, k, v = (t.double() for t in (q_BHSD, k_BHSD, v_BHSD))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m pipekit.bench attention", description=__doc__)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.head_dim < MIN_CPU_HEAD_DIM:
        parser.error(
            f"--head-dim {args.head_dim}: flex on CPU refuses head dims below "
            f"{MIN_CPU_HEAD_DIM}; pick {MIN_CPU_HEAD_DIM} or more"
        )

    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v = (torch.randn(shape, generator=gen) for _ in range(3))
    reference = _reference_out(q, k, v)

    def max_err(out: torch.Tensor) -> float:
        return (out.double() - reference).abs().max().item()

    with torch.no_grad():
        sdpa_fwd = time_call(
            lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=args.repeats
        )
        sdpa_err = max_err(F.scaled_dot_product_attention(q, k, v, is_causal=True))
        results = {}
        for backend in ("cpu", "flex"):  # flex compiles on its first (warm-up) call
            seconds = time_call(
                lambda b=backend: attention(q, k, v, causal_mask, backend=b), repeats=args.repeats
            )
            results[backend] = (
                seconds,
                max_err(attention(q, k, v, causal_mask, backend=backend)[0]),
            )
        flex_block_mask = get_backend("flex").block_mask(causal_mask, q, k)
        flex_kernel_only = time_call(
            lambda: compiled_flex_attention()(q, k, v, block_mask=flex_block_mask),
            repeats=args.repeats,
        )

    q_grad, k_grad, v_grad = (t.clone().requires_grad_() for t in (q, k, v))
    grad_out = torch.randn(shape, generator=gen)
    sdpa_train = time_call(
        lambda: F.scaled_dot_product_attention(q_grad, k_grad, v_grad, is_causal=True).backward(
            grad_out
        ),
        repeats=args.repeats,
    )
    cpu_train = time_call(
        lambda: attention(q_grad, k_grad, v_grad, causal_mask, backend="cpu")[0].backward(grad_out),
        repeats=args.repeats,
    )

    print(machine_description())
    print(
        f"causal attention B={args.batch} H={args.heads} S={args.seq} D={args.head_dim} float32, "
        f"median of {args.repeats}"
    )
    print_table(
        ["kernel", "pass", "ms/call", "vs sdpa", "max abs err vs fp64"],
        [
            ["sdpa", "fwd", sdpa_fwd * 1e3, 1.0, sdpa_err],
            [
                "cpu",
                "fwd",
                results["cpu"][0] * 1e3,
                results["cpu"][0] / sdpa_fwd,
                results["cpu"][1],
            ],
            [
                "flex (compiled)",
                "fwd",
                results["flex"][0] * 1e3,
                results["flex"][0] / sdpa_fwd,
                results["flex"][1],
            ],
            [
                "flex kernel, no lse",
                "fwd",
                flex_kernel_only * 1e3,
                flex_kernel_only / sdpa_fwd,
                "-",
            ],
            ["sdpa", "fwd+bwd", sdpa_train * 1e3, 1.0, "-"],
            ["cpu", "fwd+bwd", cpu_train * 1e3, cpu_train / sdpa_train, "-"],
        ],
    )
    print_result(
        backend="cpu",
        fwd_ratio_vs_sdpa=results["cpu"][0] / sdpa_fwd,
        max_err=results["cpu"][1],
        train_ratio_vs_sdpa=cpu_train / sdpa_train,
        flex_fwd_ratio_vs_sdpa=results["flex"][0] / sdpa_fwd,
        flex_max_err=results["flex"][1],
    )
