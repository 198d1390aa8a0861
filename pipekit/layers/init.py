"""Initialisation: the convention every pipekit module follows, and seeding by module name.

Every pipekit module with parameters has `reset_parameters(init_std=..., output_std=None)`:
weights that read the residual stream are drawn with `init_std`, weights that write back into it
(attention's and the FFN's output projections) with `output_std` (default `init_std`), so a deep
model can scale its residual writes down; norms set their weights to one and ignore both.

`seeded(seed, name, device)` makes one module's draw depend on (seed, module name) only, not on
which other modules exist or were drawn first: a pipeline stage, a vocabulary shard or a
sharded model initialised alone gets exactly the whole model's values.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor, nn

__all__ = ["name_seed", "seeded", "trunc_normal_"]


def trunc_normal_(tensor: Tensor, std: float, generator: torch.Generator | None = None) -> Tensor:
    """Normal(0, std) truncated at ±3 std, in place."""
    return nn.init.trunc_normal_(tensor, std=std, a=-3 * std, b=3 * std, generator=generator)


def name_seed(seed: int, name: str) -> int:
    """A 63-bit seed determined by (seed, name) alone."""
    digest = hashlib.sha256(f"{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@contextmanager
def seeded(seed: int, name: str, device: torch.device) -> Iterator[None]:
    """Seed the generators for one module's init from (seed, name); restore them afterwards.

    Only the CPU generator and `device`'s are seeded, not every backend's as `torch.manual_seed`
    does: on a machine without an accelerator, that queues a seeding per backend with a formatted
    stack trace each, milliseconds per module under a deep stack.
    """
    accelerators = [device] if device.type not in ("cpu", "meta") else []
    device_type = device.type if accelerators else "cuda"
    module_seed = name_seed(seed, name)
    with torch.random.fork_rng(devices=accelerators, device_type=device_type):
        torch.default_generator.manual_seed(module_seed)
        if accelerators:
            backend = torch.get_device_module(device.type)
            with backend.device(device):
                backend.manual_seed(module_seed)
        yield
