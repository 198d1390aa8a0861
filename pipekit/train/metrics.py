"""Training metrics: FLOPs per token, MFU, memory, and the console/JSONL logger.

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

import json
import logging
import os
import resource
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pipekit.models.spec import ModelShape, ModelStructure
from pipekit.moe.layer import MoE

logger = logging.getLogger(__name__)

__all__ = [
    "MetricsLogger",
    "measure_matmul_flops",
    "memory_stats",
    "tensor_bytes",
    "training_flops_per_token",
]


def training_flops_per_token(
    model: nn.Module, shape: ModelShape, structure: ModelStructure, seq_len: int
) -> float:
    """FLOPs of one trained token (see the module docstring for the formula)."""
    embedding = getattr(model, structure.embedding, None)
    tied = shape.tied_embeddings
    skip = {id(embedding.weight)} if embedding is not None and not tied else set()
    active_share = _expert_active_share(model)
    matmul_params = sum(
        p.numel() * active_share.get(id(p), 1.0)
        for p in _unique(model.parameters())
        if p.dim() >= 2 and id(p) not in skip
    )
    attention = 6.0 * shape.num_layers * shape.num_heads * shape.head_dim * (seq_len + 1)
    return 6.0 * matmul_params + attention


def _expert_active_share(model: nn.Module) -> dict[int, float]:
    """id(expert weight) -> the share of it one token runs through."""
    shares = {}
    for module in model.modules():
        if isinstance(module, MoE):
            args = module.args
            per_token = args.capacity_factor if args.router == "expert_choice" else args.top_k
            for param in module.experts.parameters():
                shares[id(param)] = per_token / args.num_experts
    return shares


def _unique(params: Any) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for param in params:
        seen.setdefault(id(param), param)
    return list(seen.values())


def measure_matmul_flops(size: int = 1024, seconds: float = 0.5) -> float:
    """This process's float32 matmul throughput (FLOP/s) with its current thread count."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    calls, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
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
    """Rank 0 logs one console line per logged step and appends it to a JSONL file."""

    def __init__(self, path: str | os.PathLike[str], enabled: bool) -> None:
        self.enabled = enabled
        self.path = Path(path)
        if enabled:
            self.path.parent.mkdir(parents=True, exist_ok=True)

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        shown = "  ".join(
            f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in record.items()
        )
        logger.info("%s", shown)
        with self.path.open("a") as handle:
            handle.write(json.dumps(record) + "\n")
