"""Training metrics: FLOPs per token, MFU, memory, and the rank-0 logger (console and writers).

FLOPs per trained token (forward + backward = 3x forward), for a decoder with `N` matmul
parameters (every weight matrix, output projection included, token embedding excluded):
    6 N  +  6 L H d (S + 1)
The second term is causal attention: per layer and head, QK^T and PV cost 4 d FLOPs per attended
key in the forward, and a causal query attends to (S + 1) / 2 keys on average. In an MoE layer a
token runs through k of the E experts, so expert weights count k / E of their size (the capacity
factor for expert-choice routing).
MFU = achieved FLOP/s / (peak FLOP/s per rank x ranks).
"""

from __future__ import annotations

import logging
import resource
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.moe.layer import MoE
from pipekit.train.metric_writers import MetricWriter

logger = logging.getLogger(__name__)

__all__ = [
    "MetricsLogger",
    "attention_to_linear_flops",
    "console_line",
    "measure_matmul_flops",
    "memory_stats",
    "tensor_bytes",
    "training_flops_per_token",
]


def training_flops_per_token(
    model: nn.Module, shape: ModelShape, structure: ModelStructure, seq_len: int
) -> float:
    """FLOPs of one trained token (see the module docstring for the formula)."""
    attention = 6.0 * _attention_flops_per_matmul_param(shape, seq_len)
    return 6.0 * _matmul_params(model, shape, structure) + attention


def attention_to_linear_flops(
    model: nn.Module, shape: ModelShape, structure: ModelStructure, seq_len: int
) -> float:
    """Causal attention's FLOPs over the matmuls' FLOPs, for whole sequences of `seq_len` (what
    equal-cost slicing balances): `L H d (S + 1) / N` with the module docstring's symbols."""
    return _attention_flops_per_matmul_param(shape, seq_len) / _matmul_params(
        model, shape, structure
    )


def _attention_flops_per_matmul_param(shape: ModelShape, seq_len: int) -> float:
    """Attention's forward FLOPs per token, in units of 2 FLOPs (one multiply-add), as a
    matmul parameter costs per token."""
    return shape.num_layers * shape.num_heads * shape.head_dim * (seq_len + 1)


def _matmul_params(model: nn.Module, shape: ModelShape, structure: ModelStructure) -> float:
    """N: the weight matrices' parameters a token runs through (the module docstring's)."""
    embedding = getattr(model, structure.embedding, None)
    tied = shape.tied_embeddings
    skip = {id(embedding.weight)} if embedding is not None and not tied else set()
    active_share = _expert_active_share(model)
    return sum(
        p.numel() * active_share.get(id(p), 1.0)
        for p in _unique(model.parameters())
        if p.dim() >= 2 and id(p) not in skip
    )


def _expert_active_share(model: nn.Module) -> dict[int, float]:
    """id(expert weight) -> the share of it one token runs through."""
    shares = {}
    for module in model.modules():
        if isinstance(module, MoE):
            args = module.args
            per_token = args.capacity_factor if args.router == "expert_choice" else args.top_k
            for name, param in module.experts.named_parameters():
                # expert biases are 2-D ([E, F]) but no matmul: a token runs through none
                shares[id(param)] = 0.0 if name.startswith("b") else per_token / args.num_experts
    return shares


def _unique(params: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for param in params:
        seen.setdefault(id(param), param)
    return list(seen.values())


def measure_matmul_flops(
    device: torch.device | None = None, dtype: torch.dtype = torch.float32, seconds: float = 0.5
) -> float:
    """This process's matmul throughput (FLOP/s) on `device` (default CPU, with its current
    thread count) in `dtype`: the peak MFU is reported against, measured on the machine that
    trains rather than looked up. Measured once per process (and kept across a fork) for each
    device, dtype and thread count."""
    device = device or torch.device("cpu")
    key = (str(device), dtype, torch.get_num_threads(), seconds)
    if key not in _MEASURED_FLOPS:
        _MEASURED_FLOPS[key] = _time_matmuls(device, dtype, seconds)
    return _MEASURED_FLOPS[key]


_MEASURED_FLOPS: dict[tuple[str, torch.dtype, int, float], float] = {}


def _time_matmuls(device: torch.device, dtype: torch.dtype, seconds: float) -> float:
    size = 1024 if device.type == "cpu" else 8192
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))

    def finish() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    a @ b
    finish()
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        finish()
        calls += 1
    return 2.0 * size**3 * calls / (time.perf_counter() - start)


def tensor_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of this rank's parameters, gradients and optimizer states (local shards)."""

    def local_bytes(tensor: torch.Tensor) -> int:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        return local.numel() * local.element_size()

    total = 0
    for param in _unique(model.parameters()):
        total += local_bytes(param)
        if param.grad is not None:
            total += local_bytes(param.grad)
    for state in optimizer.state.values():
        total += sum(local_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def memory_stats(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """CUDA: max allocated; CPU: resident set size (peak) and tracked tensor bytes, in GiB."""
    gib = 2.0**30
    if torch.cuda.is_available():
        return {"cuda_max_allocated_gib": torch.cuda.max_memory_allocated() / gib}
    peak_rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {
        "peak_rss_gib": peak_rss_kib * 1024 / gib,
        "tensor_gib": tensor_bytes(model, optimizer) / gib,
    }


class MetricsLogger:
    """Rank 0's metric records: one console line each, and every configured writer."""

    def __init__(self, writers: list[MetricWriter], total_steps: int) -> None:
        self.writers = writers
        self.total_steps = total_steps

    def log(self, record: dict[str, Any]) -> None:
        logger.info("%s", console_line(record, self.total_steps))
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        for writer in self.writers:
            writer.close()


def console_line(record: dict[str, Any], total_steps: int) -> str:
    """`step 10/100  loss 3.214  ...  eta 1m20s`: what a person watching the job reads (a
    validation record shows its `val_loss`)."""
    step = record["step"]
    parts = [f"step {step}/{total_steps}"]
    for key, shown in _CONSOLE_FIELDS:
        if key in record:
            parts.append(shown(record[key]))
    memory = record.get("cuda_max_allocated_gib", record.get("peak_rss_gib"))
    if memory is not None:
        parts.append(f"memory {memory:.2f} GiB")
    if "step_time_s" in record:
        parts.append(f"eta {_duration((total_steps - step) * record['step_time_s'])}")
    return "  ".join(parts)


_CONSOLE_FIELDS: tuple[tuple[str, Callable[[float], str]], ...] = (
    ("loss", lambda value: f"loss {value:.4f}"),
    ("mtp_loss", lambda value: f"mtp_loss {value:.4f}"),
    ("val_loss", lambda value: f"val_loss {value:.4f}"),
    ("grad_norm", lambda value: f"grad_norm {value:.3g}"),
    ("lr", lambda value: f"lr {value:.3g}"),
    ("tokens_per_s_per_device", lambda value: f"tokens/s/device {value:.4g}"),
    ("mfu", lambda value: f"mfu {100 * value:.2f}%"),
)


def _duration(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{secs:02d}s"
