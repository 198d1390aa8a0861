"""What the search prices a layout on: one accelerator's memory, peak FLOP/s and links.

Built-in profiles carry the vendors' public figures (dense bf16 peak without sparsity, NVLink
bandwidth per direction, one 400 Gb/s or 200 Gb/s NIC per device, host link of the PCIe
generation); `efficiency` is the share of the peak that large matmuls reach in training (a
stated assumption, not a measurement: 0.5 is what well-tuned Megatron-class runs report for
dense models on Hopper). Every field can be overridden from the command line. On a CPU the
profile is measured (`measured_cpu_profile`): one rank's float32 matmul FLOP/s at one thread
(shared when there are more ranks than cores), a gloo send/receive between two local
processes (its bandwidth and a small message's latency), and, by the search, the job's own
block's fixed cost per pass.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from pipekit.distributed.process_group import free_local_port, join_local_gloo
from pipekit.memory_plan.forked import map_in_forked_children
from pipekit.train.metrics import measure_matmul_flops

__all__ = ["DEVICE_PROFILES", "DeviceProfile", "device_profile", "measured_cpu_profile"]

_GB = 10**9
_GIB = 2**30


@dataclass(frozen=True)
class DeviceProfile:
    """One device and the links between devices."""

    name: str
    memory_bytes: int
    """Memory of one device the job may use."""
    peak_flops: float
    """Peak matmul FLOP/s of one device in the compute dtype."""
    efficiency: float
    """Share of the peak that the model's matmuls and attention reach."""
    intra_node_bandwidth: float
    """Bytes/s one device sends to a peer in its node (one direction)."""
    inter_node_bandwidth: float
    """Bytes/s one device sends to a peer in another node (one direction)."""
    host_bandwidth: float
    """Bytes/s between one device and host memory (activation offload)."""
    devices_per_node: int
    link_latency_s: float = 10e-6
    """Seconds one message costs whatever its size."""
    block_overhead_s: float = 0.0
    """Seconds one block's forward and backward take whatever their tokens (launches, Python):
    measured from the job's own block on a CPU, where it dominates small passes; 0 for the
    built-in accelerators (a stated simplification: kernels there are long)."""
    collectives_in_pass: bool = False
    """The passes' rate was measured with tp's and cp's collectives running (a CPU, per job):
    their bytes and latency are not priced again."""
    selective_recompute_share: float = 0.1
    """Time of what selective checkpointing recomputes (norms, activations, element-wise ops),
    as a share of a block's forward time: a stated assumption."""

    @property
    def sustained_flops(self) -> float:
        return self.peak_flops * self.efficiency

    def bandwidth(self, span: int) -> float:
        """Bytes/s of a group whose ranks lie `span` consecutive ranks apart or less: within a
        node when `span <= devices_per_node`."""
        return (
            self.intra_node_bandwidth
            if span <= self.devices_per_node
            else self.inter_node_bandwidth
        )


_H100 = DeviceProfile(
    name="h100",
    memory_bytes=80 * _GIB,
    peak_flops=989e12,
    efficiency=0.5,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    host_bandwidth=64 * _GB,
    devices_per_node=8,
)
DEVICE_PROFILES: dict[str, DeviceProfile] = {
    profile.name: profile
    for profile in (
        _H100,
        dataclasses.replace(_H100, name="h200", memory_bytes=141 * _GB),
        dataclasses.replace(
            _H100,
            name="a100",
            peak_flops=312e12,
            intra_node_bandwidth=300 * _GB,
            inter_node_bandwidth=25 * _GB,
            host_bandwidth=32 * _GB,
        ),
        dataclasses.replace(
            _H100,
            name="b200",
            memory_bytes=180 * _GB,
            peak_flops=2250e12,
            intra_node_bandwidth=900 * _GB,
        ),
    )
}
"""Built-in accelerators by name (public datasheet figures)."""


def device_profile(
    name: str, ranks_per_machine: int | None = None, **overrides: float | int
) -> DeviceProfile:
    """A built-in profile (or "cpu": measured here, for `ranks_per_machine` ranks sharing this
    machine) with `overrides` (DeviceProfile fields)."""
    if name == "cpu":
        base = measured_cpu_profile(ranks_per_machine)
    elif name in DEVICE_PROFILES:
        base = DEVICE_PROFILES[name]
    else:
        known = ", ".join([*DEVICE_PROFILES, "cpu"])
        raise ValueError(f"device {name!r} has no profile; use one of {known}, or override fields")
    fields = {field.name for field in dataclasses.fields(DeviceProfile)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(
            f"device profile has no field {', '.join(unknown)}; fields: {sorted(fields)}"
        )
    return dataclasses.replace(base, **overrides)


_CPU_MEASURED: list[tuple[float, float]] = []
"""(matmul FLOP/s of one thread, gloo bytes/s), measured once per process."""


def measured_cpu_profile(ranks_per_machine: int | None = None) -> DeviceProfile:
    """This machine as `ranks_per_machine` (default: its cores) CPU "devices": one rank's
    float32 matmul FLOP/s at one thread (efficiency 1: the measurement is what a rank
    reaches), memory shared equally, a gloo send/receive of 8 MiB between two local processes
    for every link."""
    if not _CPU_MEASURED:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            flops = measure_matmul_flops(torch.device("cpu"), torch.float32, seconds=0.3)
        finally:
            torch.set_num_threads(threads)
        _CPU_MEASURED.append((flops, *_gloo_link()))
    flops, bandwidth, latency = _CPU_MEASURED[0]
    cores = max(1, len(os.sched_getaffinity(0)))
    ranks = ranks_per_machine or cores
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return DeviceProfile(
        name="cpu",
        memory_bytes=memory // ranks,
        peak_flops=flops * min(1.0, cores / ranks),  # ranks beyond the cores share them
        efficiency=1.0,
        intra_node_bandwidth=bandwidth,
        inter_node_bandwidth=bandwidth,
        host_bandwidth=bandwidth,
        devices_per_node=ranks,
        link_latency_s=latency,
    )


def _gloo_link(nbytes: int = 8 << 20, repeats: int = 5) -> tuple[float, float]:
    """(bytes/s, seconds of a 4-byte message) of gloo send/receive between two forked local
    processes: the receiver's times."""
    port = free_local_port()
    calls = [(rank, port, nbytes, repeats) for rank in range(2)]
    large_s, small_s = map_in_forked_children(_exchange, calls, 2)[1]
    return nbytes / large_s, small_s


def _exchange(rank: int, port: int, nbytes: int, repeats: int) -> tuple[float, float]:
    """This rank's fastest (large, small) message time after one untimed exchange each."""
    join_local_gloo(rank, 2, port)
    try:
        seconds = []
        for payload in (torch.zeros(nbytes // 4), torch.zeros(1)):
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                start = time.perf_counter()
                if rank == 0:
                    dist.send(payload, 1)
                else:
                    dist.recv(payload, 0)
                times.append(time.perf_counter() - start)
            seconds.append(min(times[1:]))
    finally:
        dist.destroy_process_group()
    return seconds[0], seconds[1]
