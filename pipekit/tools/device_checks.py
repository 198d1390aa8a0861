"""The checks of `python scripts/gpu_check.py`: every path that only a GPU runs, once, against
a reference computed another way on the same inputs.

Each check takes the device and returns a `CheckResult`: the largest relative error against its
reference, the tolerance it must stay under, and a few words of what it measured. On a CPU the
same checks run where torch can run them there (FlexAttention forward only, float8 emulated,
no streams or pinned memory): that is how the suite tests them; the figures that matter come
from a GPU.

Relative errors are `max |a - b| / max |b|` over every compared tensor.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipekit.attention.kernels.backends import get_backend
from pipekit.attention.masks import causal_mask
from pipekit.memory.offload import ActivationOffloader
from pipekit.memory.offload_store import store_for
from pipekit.models import get_model_spec
from pipekit.moe import MoE, MoEArgs
from pipekit.moe.execution import ExpertExecution
from pipekit.moe.grouped_mm import grouped_kernel_applies, grouped_matmul, grouped_weight_grad
from pipekit.train.compile import compile_blocks
from pipekit.train.float8 import apply_float8

__all__ = ["CHECKS", "CheckResult", "norm_error", "relative_error", "timed"]


@dataclass(frozen=True)
class CheckResult:
    """One check's outcome: `error` must stay under `tolerance`."""

    error: float
    tolerance: float
    detail: str

    @property
    def passed(self) -> bool:
        return math.isfinite(self.error) and self.error <= self.tolerance


def relative_error(actual: list[Tensor], expected: list[Tensor]) -> float:
    """The largest `max |a - b| / max |b|` over the pairs (float64, on the CPU)."""
    worst = 0.0
    for a, b in zip(actual, expected, strict=True):
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        scale = b64.abs().max().clamp_min(1e-30)
        worst = max(worst, float((a64 - b64).abs().max() / scale))
    return worst


def norm_error(actual: list[Tensor], expected: list[Tensor]) -> float:
    """The largest `||a - b|| / ||b||` over the pairs: the measure for low-precision formats,
    whose elementwise error is their rounding step (float8's is 6%) but whose error overall
    is far smaller (10^(-SQNR/20))."""
    worst = 0.0
    for a, b in zip(actual, expected, strict=True):
        a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
        worst = max(worst, float((a64 - b64).norm() / b64.norm().clamp_min(1e-30)))
    return worst


def _generator(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def flex_attention(device: torch.device) -> CheckResult:
    """Compiled FlexAttention against a float64 softmax on the same inputs: output and lse,
    and on CUDA the gradients of q, k and v through both (the lse's included); forward only
    on the CPU, where FlexAttention has no backward. The output is also checked against the
    `cpu` kernel."""
    batch, heads, kv_heads, seq, head_dim = 1, 4, 2, 256, 64
    g = _generator()
    q = torch.randn(batch, heads, seq, head_dim, generator=g)
    k, v = (torch.randn(batch, kv_heads, seq, head_dim, generator=g) for _ in range(2))
    grad_out, grad_lse = torch.randn(q.shape, generator=g), torch.randn(q.shape[:3], generator=g)
    scale = head_dim**-0.5
    with_grad = device.type == "cuda"
    inputs = [t.to(device).requires_grad_(with_grad) for t in (q, k, v)]
    out, lse = get_backend("flex").forward_chunk(*inputs, causal_mask, scale)
    cpu_out, _ = get_backend("cpu").forward_chunk(q, k, v, causal_mask, scale)
    reference = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = _softmax_attention(*reference, scale)
    actual, expected = [out, lse], [ref_out, ref_lse]
    if with_grad:
        grads = torch.autograd.grad(
            (out, lse), inputs, (grad_out.to(device, out.dtype), grad_lse.to(device))
        )
        ref_grads = torch.autograd.grad((ref_out, ref_lse), reference, (grad_out, grad_lse))
        actual, expected = [*actual, *grads], [*expected, *ref_grads]
    error = max(relative_error(actual, expected), relative_error([out], [cpu_out]))
    what = "forward, backward and lse gradient" if with_grad else "forward (CPU: no backward)"
    return CheckResult(error, 1e-4, f"{what}; S={seq}, H={heads}/{kv_heads}, D={head_dim}")


def _softmax_attention(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """Causal grouped-query attention by its definition: output and log-sum-exp."""
    repeat = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)
    scores = (q @ k.transpose(-2, -1)) * scale
    future = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).triu(1)
    scores = scores.masked_fill(future, float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.softmax(scores, -1) @ v, lse


def compiled_blocks(device: torch.device) -> CheckResult:
    """The debug Llama with compiled blocks (`[compile] enable`) against the eager model: the
    loss and every gradient of one forward and backward, float32."""
    spec = get_model_spec("llama")
    torch.manual_seed(0)
    eager = spec.build(spec.flavor("debug")).to(device)
    compiled = copy.deepcopy(eager)
    compile_blocks(list(compiled.layers.values()))
    tokens = torch.randint(0, 256, (2, 128), generator=_generator()).to(device)
    results = []
    for model in (eager, compiled):
        logits = model(tokens)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens.flatten())
        loss.backward()
        results.append([loss, *(p.grad for p in model.parameters())])
    error = relative_error(results[1], results[0])
    return CheckResult(error, 1e-3, "debug Llama, loss and every gradient, float32")


def grouped_experts(device: torch.device) -> CheckResult:
    """`grouped_matmul` and `grouped_weight_grad` in bfloat16 (`torch._grouped_mm` where it
    applies) against float64 matmuls expert by expert, one expert with no rows."""
    experts, width, out_width = 4, 128, 256
    counts = [96, 0, 32, 128]
    g = _generator()
    x = torch.randn(sum(counts), width, generator=g)
    w = torch.randn(experts, width, out_width, generator=g) / width**0.5
    grad = torch.randn(sum(counts), out_width, generator=g)
    x_dev, w_dev, grad_dev = (t.to(device, torch.bfloat16) for t in (x, w, grad))
    out = grouped_matmul(x_dev, w_dev, counts)
    weight_grad = grouped_weight_grad(x_dev, grad_dev, counts)
    starts = [sum(counts[:e]) for e in range(experts)]
    rows = [slice(start, start + count) for start, count in zip(starts, counts, strict=True)]
    x64, w64, g64 = (t.to(torch.bfloat16).double() for t in (x, w, grad))
    ref_out = torch.cat([x64[r] @ w64[e] for e, r in enumerate(rows)])
    ref_grad = torch.stack([x64[r].T @ g64[r] for r in rows])
    kernel = "the grouped kernel" if grouped_kernel_applies(x_dev, w_dev) else "a loop of mm"
    error = relative_error([out, weight_grad], [ref_out, ref_grad])
    return CheckResult(error, 2e-2, f"bfloat16 through {kernel}, counts {counts}")


def mpipemoe(device: torch.device) -> CheckResult:
    """A MoE layer's experts in 4 pipelined partitions, with shared buffers (S3) and with
    activations offloaded on a side stream into pinned memory (S4), against one partition:
    the output and every gradient, float32."""
    torch.manual_seed(0)
    args = MoEArgs(num_experts=8, top_k=2, z_loss_weight=0.0, load_balance_weight=0.0)
    moe = MoE(256, 512, args).to(device)
    moe.reset_parameters(0.05, 0.05)
    x = torch.randn(4, 256, 256, generator=_generator()).to(device)

    def run(partitions: int, reuse: str) -> list[Tensor]:
        moe.zero_grad()
        moe.execution = ExpertExecution(partitions=partitions, memory_reuse=reuse)
        inputs = x.clone().requires_grad_()
        out = moe(inputs)
        (out * torch.linspace(-1, 1, out.numel(), device=device).view_as(out)).sum().backward()
        return [out, inputs.grad, *(p.grad.clone() for p in moe.parameters())]

    reference = run(1, "none")
    error = max(relative_error(run(4, reuse), reference) for reuse in ("S3", "S4"))
    return CheckResult(error, 1e-4, "8 experts top-2, 1024 tokens; partitions 4 with S3 and S4")


def activation_offload(device: torch.device) -> CheckResult:
    """Everything movable a forward saved moved off the device (pinned host memory on CUDA),
    reloaded ahead of the backward: the gradients equal the run without, bit for bit, and the
    bytes did move."""
    g = _generator()
    weights = [torch.randn(512, 512, generator=g) / 512**0.5 for _ in range(3)]
    x = torch.randn(2048, 512, generator=g)

    def step(offloader: ActivationOffloader | None) -> list[Tensor]:
        params = [w.to(device).requires_grad_() for w in weights]
        inputs = x.to(device).requires_grad_()

        def forward() -> Tensor:
            hidden = torch.tanh(inputs @ params[0])
            return sum(((hidden * 2.0) @ w).sin().sum() for w in params[1:])

        if offloader is None:
            loss = forward()
        else:
            with offloader.saving("unit"):
                loss = forward()
            offloader.offload("unit", 1.0)
            offloader.reload("unit")
        loss.backward()
        return [inputs.grad, *(p.grad for p in params)]

    offloader = ActivationOffloader(store_for(device))
    moved = step(offloader)
    reference = step(None)
    exact = all(torch.equal(a, b) for a, b in zip(moved, reference, strict=True))
    moved_mib = offloader.stats.offloaded_bytes / 2**20
    error = relative_error(moved, reference) if exact and moved_mib > 0 else math.inf
    store = type(offloader.store).__name__
    return CheckResult(error, 0.0, f"{moved_mib:.1f} MiB through {store}, gradients bitwise")


def low_precision_linear(device: torch.device) -> CheckResult:
    """A two-layer MLP in bfloat16, and through torchao's float8 (tensorwise; emulated off
    CUDA), against float64: output and gradients within each format's rounding (norm error,
    as a fraction of its bound: 1e-2 for bf16; 0.15 for float8, whose 3-bit mantissa alone
    gives about 5% on each product and 7% on the gradients of this MLP)."""
    g = _generator()
    mlp = nn.Sequential(nn.Linear(256, 512, bias=False), nn.GELU(), nn.Linear(512, 256, bias=False))
    with torch.no_grad():
        for layer in (mlp[0], mlp[2]):
            layer.weight.copy_(
                torch.randn(layer.weight.shape, generator=g) / layer.in_features**0.5
            )
    x = torch.randn(512, 256, generator=g)

    def run(model: nn.Module, dtype: torch.dtype) -> list[Tensor]:
        inputs = x.to(device, dtype).requires_grad_()
        out = model(inputs)
        out.float().square().mean().backward()
        return [out, inputs.grad, *(p.grad for p in model.parameters())]

    reference = run(copy.deepcopy(mlp).double(), torch.float64)
    bf16 = norm_error(run(copy.deepcopy(mlp).to(device, torch.bfloat16), torch.bfloat16), reference)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # CPU: emulated
    float8 = copy.deepcopy(mlp).to(device, dtype)
    structure = get_model_spec("llama").structure
    converted = apply_float8(float8, "tensorwise", structure, device.type)
    fp8 = norm_error(run(float8, dtype), reference)
    error = max(bf16 / 1e-2, fp8 / 0.15)  # each against its own format's bound
    detail = (
        f"norm error bf16 {bf16:.1e} (< 1e-2), float8 {fp8:.1e} (< 0.15), {len(converted)} layers"
    )
    return CheckResult(error, 1.0, detail)


CHECKS: dict[str, Callable[[torch.device], CheckResult]] = {
    "flex_attention": flex_attention,
    "compiled_blocks": compiled_blocks,
    "grouped_experts": grouped_experts,
    "mpipemoe": mpipemoe,
    "activation_offload": activation_offload,
    "low_precision_linear": low_precision_linear,
}
"""Every check by name, in the order the command runs them."""


def timed(
    check: Callable[[torch.device], CheckResult], device: torch.device
) -> tuple[CheckResult, float]:
    """The check's result and its seconds (the device synchronised at the end)."""
    start = time.perf_counter()
    result = check(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return result, time.perf_counter() - start
