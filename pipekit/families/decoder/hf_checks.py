"""What differs between the tensors a checkpoint (or a model) holds and those expected: one
line listing the missing, unexpected and mis-shaped names, each list cut at a readable length."""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["name_and_shape_problems"]

_LISTED_NAMES = 20


def name_and_shape_problems(
    found: Mapping[str, tuple[int, ...]], expected: Mapping[str, tuple[int, ...]]
) -> str:
    """'' when `found` has exactly the expected names and shapes, else what is wrong."""
    missing = sorted(expected.keys() - found.keys())
    unexpected = sorted(found.keys() - expected.keys())
    mismatched = [
        f"{name} expected {list(expected[name])}, got {list(found[name])}"
        for name in sorted(expected.keys() & found.keys())
        if found[name] != expected[name]
    ]
    parts = [
        f"{label} ({len(items)}): {_listing(items)}"
        for label, items in (
            ("missing tensors", missing),
            ("unexpected tensors", unexpected),
            ("shape mismatches", mismatched),
        )
        if items
    ]
    return "; ".join(parts)


def _listing(items: list[str]) -> str:
    shown = ", ".join(items[:_LISTED_NAMES])
    hidden = len(items) - _LISTED_NAMES
    return f"{shown}, ... ({hidden} more)" if hidden > 0 else shown
