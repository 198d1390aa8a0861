"""`[parallelism] layout = "auto"`: the job takes the search's fastest layout that fits the
world size it is launched on, then runs exactly as if that layout had been written by hand.

Every rank must run the same layout, and a measured device profile (on a CPU) may differ
between ranks by noise; so rank 0 searches and hands its choice to the others through the
launcher's store (torchrun's, at `MASTER_ADDR:MASTER_PORT`, the one `init_process_group`
meets in), before any process group exists. Nothing fits: `ConfigError` with one line naming
the smallest shortfall and its fix.
"""

from __future__ import annotations

import dataclasses
import json
import os
from datetime import timedelta

import torch

from pipekit.config.job_config import JobConfig
from pipekit.config.loader import ConfigError
from pipekit.layout_search.candidates import Layout, apply_layout
from pipekit.layout_search.devices import DEVICE_PROFILES, DeviceProfile, device_profile
from pipekit.layout_search.search import Candidate, nothing_fits, search_layouts

__all__ = ["AUTO_LAYOUT_KEY", "choose_layout", "resolve_layout"]

AUTO_LAYOUT_KEY = "pipekit/auto_layout"
"""The store key rank 0 writes its chosen layout under."""


def resolve_layout(
    config: JobConfig, world_size: int, rank: int = 0
) -> tuple[JobConfig, str | None]:
    """`config` unchanged (and None) unless `layout = "auto"`; then `config` with the chosen
    layout's fields (and `layout = "manual"`, so it reads as written by hand) and, on rank 0,
    a line naming the choice and its prediction. Ranks > 0 of a launched job read rank 0's
    choice from the launcher's store."""
    if config.parallelism.layout != "auto":
        return config, None
    description = None
    if rank == 0:
        layout, candidate = choose_layout(config, world_size)
        step = candidate.step
        description = (
            f"layout = auto on {world_size} ranks: {layout.label()} (predicted peak "
            f"{candidate.peak_bytes / 2**30:.3g} GiB per rank, {step.tokens_per_s:.4g} tokens/s, "
            f"MFU {100 * step.mfu:.1f}%, step {step.step_s:.3g} s)"
        )
        if world_size > 1:
            _store(world_size).set(AUTO_LAYOUT_KEY, json.dumps(dataclasses.asdict(layout)))
    else:
        layout = Layout(**json.loads(_store(world_size).get(AUTO_LAYOUT_KEY)))
    return apply_layout(config, layout), description


def choose_layout(config: JobConfig, world_size: int) -> tuple[Layout, Candidate]:
    """The fastest layout that fits (validated as a job), or ConfigError naming the smallest
    shortfall."""
    device = _device(config.parallelism.layout_device, world_size)
    if config.parallelism.layout_memory_gib:
        memory = int(config.parallelism.layout_memory_gib * 2**30)
        device = dataclasses.replace(device, memory_bytes=memory)
    search, result = search_layouts(config, world_size, device)
    kept = search.validated(result, 1)
    if not kept:
        raise ConfigError(f"[parallelism] layout = 'auto': {nothing_fits(result, device)}")
    return kept[0].layout, kept[0]


def _device(name: str, world_size: int) -> DeviceProfile:
    if name == "auto":
        if not torch.cuda.is_available():
            name = "cpu"
        else:
            gpu = torch.cuda.get_device_name().lower()
            matches = [known for known in DEVICE_PROFILES if known in gpu]
            if not matches:
                raise ConfigError(
                    f"[parallelism] layout_device = 'auto' knows no profile for {gpu!r}; set "
                    f"layout_device to one of {', '.join(DEVICE_PROFILES)} (the closest)"
                )
            name = matches[0]
    if name == "cpu":
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        return device_profile("cpu", ranks_per_machine=ranks_here)
    try:
        return device_profile(name)
    except ValueError as error:
        raise ConfigError(f"[parallelism] layout_device: {error}") from None


def _store(world_size: int) -> torch.distributed.Store:
    """A client of the launcher's store (torchrun hosts it; every rank meets there)."""
    from torch.distributed import TCPStore

    return TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world_size,
        is_master=False,
        timeout=timedelta(minutes=10),
    )
