"""`[debug] deterministic`: the same job gives the same bits run after run, on any device.

pipekit's own draws are reproducible already: every rank seeds `job.seed` (sharded init needs
identical draws on every rank), the data loader's order is a function of `(seed, epoch)` and a
batch a function of the step (loader workers draw no random numbers), and checkpoints carry
the random states. What varies is the kernels: on CUDA, atomics-based reductions (scatter,
index_add, some backward passes), cuBLAS's workspace choice and cuDNN's autotuner. This turns
them off, and fills uninitialised memory (NaN for floats), so that a read of memory never
written shows as NaN instead of passing by chance.
"""

from __future__ import annotations

import os

import torch

__all__ = ["CUBLAS_WORKSPACE", "use_deterministic"]

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's fixed workspace for deterministic results (CUDA's documented setting)."""


def use_deterministic(enabled: bool) -> None:
    """Turn deterministic kernels on for this process (before any CUDA work: cuBLAS reads its
    workspace setting at its first call), or leave torch's defaults when not `enabled`."""
    if not enabled:
        return
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
