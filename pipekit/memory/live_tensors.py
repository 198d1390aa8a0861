"""Peak bytes of the tensors a block of code allocates, counted by storage, on any device.

`PeakTensorMemory` is a dispatch mode: every tensor an operator returns is looked at, and a
storage not seen before is counted (views and in-place results share a storage and count once)
until it is freed. The peak of that sum is what the block needed on top of what existed before
it: on CPU, where no caching allocator keeps statistics, it is the figure that says how much
activation and buffer memory a step takes. Tensors the block receives from outside (parameters,
gradients that already exist) are not counted.
"""

from __future__ import annotations

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

__all__ = ["PeakTensorMemory"]


class PeakTensorMemory(TorchDispatchMode):
    """`with PeakTensorMemory() as memory: ...`; then `memory.peak_bytes`."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.current_bytes = 0
        self.peak_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        grew = False
        for leaf in tree_leaves(out):
            if isinstance(leaf, torch.Tensor) and leaf.device.type != "meta":
                grew |= self._track(leaf)
        if grew:
            self._release_freed()
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        return out

    def _track(self, tensor: torch.Tensor) -> bool:
        storage = tensor.untyped_storage()
        key = storage._cdata
        known = self._live.get(key)
        if known is not None and not known[0].expired():
            return False
        self._live[key] = (StorageWeakRef(storage), storage.nbytes())
        self.current_bytes += storage.nbytes()
        return True

    def _release_freed(self) -> None:
        for key, (ref, nbytes) in list(self._live.items()):
            if ref.expired():
                del self._live[key]
                self.current_bytes -= nbytes
