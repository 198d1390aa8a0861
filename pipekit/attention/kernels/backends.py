"""Attention backends: what a kernel must provide, the registry, and the automatic choice.

Every backend computes one query block against one KV chunk with the signature
`forward_chunk(q_BHSD, k_BGKD, v_BGKD, mask, scale) -> (out_BHSD, lse_BHS)` and is differentiable
in one of two ways, declared by `lse_has_grad`:
- True: both outputs carry gradients; chunks are merged by autograd (`flex` on CUDA).
- False: lse has no gradient; the backend also provides `backward_chunk`, and attention over
  chunks is one autograd function that calls it with the merged out and lse (`cpu`).

`"auto"` picks `flex` on CUDA and `cpu` on CPU: on CPU, flex runs the CPU kernel as well (for
its lse and to check its output), so it is never the faster choice there, and it refuses head
dims its kernel gets wrong (`pipekit.attention.kernels.flex`). `use_backend(name)` overrides the
automatic choice for a region of code.
`ring_backend` turns a backend of the first kind into one of the second (`AutogradRingBackend`),
for code that needs per-chunk backwards (context exchange).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol, runtime_checkable

import torch
from torch import Tensor

from pipekit.attention.kernels.cpu_flash import CpuFlashBackend
from pipekit.attention.kernels.flex import FlexBackend
from pipekit.attention.masks import MaskMod

__all__ = [
    "AttentionBackend",
    "AutogradRingBackend",
    "RingBackend",
    "attention_work_block",
    "available_backends",
    "get_backend",
    "ring_backend",
    "select_backend",
    "use_backend",
]


@runtime_checkable
class AttentionBackend(Protocol):
    """A kernel for one (query block, KV chunk) pair."""

    name: str
    lse_has_grad: bool
    work_block: int
    """Tokens per side of the tiles the kernel computes whole, skipping only tiles no query
    sees: what a query's attention costs is the keys of its tiles (`attention.work`)."""

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]: ...


@runtime_checkable
class RingBackend(AttentionBackend, Protocol):
    """A backend whose lse has no gradient: it differentiates each chunk given merged results."""

    def backward_chunk(
        self,
        grad_out_BHSD: Tensor,
        q_BHSD: Tensor,
        k_BGKD: Tensor,
        v_BGKD: Tensor,
        out_BHSD: Tensor,
        lse_BHS: Tensor,
        mask: MaskMod | None,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]: ...


class AutogradRingBackend:
    """`backward_chunk` for a backend whose lse carries a gradient: differentiate the chunk's
    forward again, weighted by how much the chunk contributed to the merged result.

    With `w_c = exp(lse_c - lse)` the merged output is `O = sum_c w_c o_c`, so the chunk's
    outputs get `dL/do_c = w_c dO` and `dL/dlse_c = w_c (dO . (o_c - O))`. This lets FlexAttention
    (CUDA) serve lent attention, whose gradients arrive chunk by chunk on another rank.
    """

    lse_has_grad = False

    def __init__(self, backend: AttentionBackend) -> None:
        if not backend.lse_has_grad:
            raise TypeError(
                f"attention backend {backend.name!r}: neither backward_chunk nor an lse with a "
                "gradient, so its chunks cannot be differentiated one by one"
            )
        self.backend, self.name = backend, backend.name
        self.work_block = backend.work_block

    def forward_chunk(
        self, q_BHSD: Tensor, k_BGKD: Tensor, v_BGKD: Tensor, mask: MaskMod | None, scale: float
    ) -> tuple[Tensor, Tensor]:
        with torch.no_grad():
            return self.backend.forward_chunk(q_BHSD, k_BGKD, v_BGKD, mask, scale)

    def backward_chunk(
        self,
        grad_out_BHSD: Tensor,
        q_BHSD: Tensor,
        k_BGKD: Tensor,
        v_BGKD: Tensor,
        out_BHSD: Tensor,
        lse_BHS: Tensor,
        mask: MaskMod | None,
        scale: float,
    ) -> tuple[Tensor, Tensor, Tensor]:
        inputs = [t.detach().requires_grad_() for t in (q_BHSD, k_BGKD, v_BGKD)]
        with torch.enable_grad():
            chunk_out_BHSD, chunk_lse_BHS = self.backend.forward_chunk(*inputs, mask, scale)
        contributes = torch.isfinite(chunk_lse_BHS) & torch.isfinite(lse_BHS)
        weight_BHS = torch.where(contributes, torch.exp(chunk_lse_BHS.detach() - lse_BHS), 0.0)
        grad_chunk_out = (weight_BHS.unsqueeze(-1) * grad_out_BHSD).to(chunk_out_BHSD.dtype)
        moved_BHS = (grad_out_BHSD * (chunk_out_BHSD.detach() - out_BHSD)).sum(-1)
        grad_chunk_lse = (weight_BHS * moved_BHS).to(chunk_lse_BHS.dtype)
        grad_q, grad_k, grad_v = torch.autograd.grad(
            (chunk_out_BHSD, chunk_lse_BHS), inputs, (grad_chunk_out, grad_chunk_lse)
        )
        return grad_q, grad_k, grad_v


def ring_backend(backend: AttentionBackend) -> RingBackend:
    """`backend` if it has `backward_chunk`, else `AutogradRingBackend(backend)`."""
    if isinstance(backend, RingBackend):
        return backend
    return AutogradRingBackend(backend)


_BACKENDS: dict[str, AttentionBackend] = {"cpu": CpuFlashBackend(), "flex": FlexBackend()}
_forced_backend: str | None = None


def available_backends() -> list[str]:
    """Backend names accepted by `get_backend`, plus "auto"."""
    return [*sorted(_BACKENDS), "auto"]


def get_backend(name: str) -> AttentionBackend:
    """A backend by name (not "auto"), with an error listing the valid names."""
    if name not in _BACKENDS:
        raise ValueError(
            f"unknown attention backend {name!r}; choose one of {available_backends()}"
        )
    return _BACKENDS[name]


def select_backend(name: str, *tensors: Tensor) -> AttentionBackend:
    """Resolve `name` ("auto" included) for attention over these tensors."""
    if name != "auto":
        return get_backend(name)
    return get_backend(_auto_name(tensors[0].device.type))


def _auto_name(device_type: str) -> str:
    """What "auto" means on `device_type`: the backend `use_backend` forces, else flex on
    CUDA and the CPU kernel elsewhere."""
    return _forced_backend or ("flex" if device_type == "cuda" else "cpu")


def attention_work_block(name: str, device_type: str = "cpu") -> int:
    """The tile side of backend `name` ("auto": the one `select_backend` picks for tensors on
    `device_type`), for cost models that count the keys a kernel computes."""
    return get_backend(_auto_name(device_type) if name == "auto" else name).work_block


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Make "auto" resolve to `name` inside the block (e.g. avoid compiling flex in a CPU tool)."""
    global _forced_backend
    get_backend(name)
    previous, _forced_backend = _forced_backend, name
    try:
        yield
    finally:
        _forced_backend = previous
