"""`python scripts/cuda_offload_check.py` (needs a CUDA device): activation offload into pinned
host memory. A float32 step of 16384 x 2048 activations offloads everything movable after its
forward, then either reloads it ahead of the backward (the copy runs on a side stream: the
call returns before the bytes arrive) or lets the backward read each storage back late. Prints
whether every gradient equals the run without offload, the device memory before and after the
offload, and how long the reload call and its copy took. Not part of the CPU test suite.
"""

import time

import torch

from pipekit.memory.offload import ActivationOffloader
from pipekit.memory.offload_store import PinnedHostStore, store_for

if not torch.cuda.is_available():
    raise SystemExit(
        "scripts/cuda_offload_check.py needs a CUDA device; "
        "tests/pipelining/test_activation_offload.py checks the CPU path"
    )
dev = torch.device("cuda")
print(torch.__version__, torch.cuda.get_device_name())


def step(
    offloader: ActivationOffloader | None, reload: bool, size: int = 2048, rows: int = 16384
) -> tuple[list[torch.Tensor], dict[str, float]]:
    """One step; with an offloader, everything movable goes to the store after the forward."""
    torch.manual_seed(0)
    ws = [torch.randn(size, size, device=dev, requires_grad=True) for _ in range(4)]
    x = torch.randn(rows, size, device=dev, requires_grad=True)

    def fwd():
        h = torch.tanh(x @ ws[0])
        s = h * 2.0
        return sum((s @ w).sin().sum() for w in ws[1:])

    info: dict[str, float] = {}
    if offloader is None:
        loss = fwd()
    else:
        with offloader.saving("u"):
            loss = fwd()
        torch.cuda.synchronize()
        info["before"] = torch.cuda.memory_allocated()
        offloader.offload("u", 1.0)
        torch.cuda.synchronize()
        torch.empty(1, device=dev)  # lets the allocator settle freed blocks
        info["after"] = torch.cuda.memory_allocated()
        if reload:
            start = time.perf_counter()
            offloader.reload("u")
            info["reload_call_s"] = time.perf_counter() - start
            torch.cuda.synchronize()
            info["reload_done_s"] = time.perf_counter() - start
    loss.backward()
    torch.cuda.synchronize()
    return [x.grad, *[w.grad for w in ws]], info


ref, _ = step(None, True)
store = store_for(dev)
assert isinstance(store, PinnedHostStore)
for label, reload in (("prefetched", True), ("late", False)):
    off = ActivationOffloader(store_for(dev))
    grads, info = step(off, reload)
    exact = all(torch.equal(a, b) for a, b in zip(grads, ref, strict=True))
    print(
        label,
        "exact:",
        exact,
        "moved MiB:",
        off.stats.offloaded_bytes / 2**20,
        "allocated MiB before/after offload:",
        info["before"] / 2**20,
        info["after"] / 2**20,
        "late reloads:",
        off.stats.late_reloads,
        "reload call/done s:",
        info.get("reload_call_s"),
        info.get("reload_done_s"),
    )
