"""What several variants' bytes rules share: a rank's share of a slice and the K/V tensors."""

from __future__ import annotations

__all__ = ["kv_tensor_count", "sent_share"]


def sent_share(slice_tokens: float, cp: int, element_bytes: int) -> float:
    """Bytes per element-column that one rank sends of a slice's tokens to the other `cp - 1`:
    `(cp-1)/cp · slice_tokens · element_bytes`."""
    return (cp - 1) / cp * slice_tokens * element_bytes


def kv_tensor_count(keys_are_values: bool) -> int:
    """Keys and values are two tensors, or one (multi-head latent attention's latent form)."""
    return 1 if keys_are_values else 2
