""" "auto": per slice, whichever candidate variant moves the fewest bytes (inside a pipeline
commutated or K/V passing; on whole sequences also Ulysses and hierarchical where the heads
split); lending slices of context exchange run commutated."""

from __future__ import annotations

from torch import Tensor

from pipekit.attention.across.slice_attention import ContextParallelSliceAttention
from pipekit.attention.across.variant_table import (
    ContextParallelVariant,
    VariantRules,
    WholeSequenceCall,
    resolve_over_group,
)
from pipekit.attention.across.variants.hierarchical import check_groups

__all__ = ["AUTO"]


def _whole_sequence(call: WholeSequenceCall) -> Tensor:
    ulysses_size = call.hierarchy.ulysses_size if call.hierarchy is not None else 1
    entry = resolve_over_group("auto", call, whole_sequence=True, ulysses_size=ulysses_size)
    return entry.attend_whole_sequence(call)


def _check(rules: VariantRules) -> None:
    if rules.ulysses_size:  # outside pipelines: hierarchical is a candidate
        check_groups(rules)


AUTO = ContextParallelVariant(
    name="auto",
    summary="per slice, the candidate that moves the fewest bytes",
    whole_sequence=_whole_sequence,
    slice_context=ContextParallelSliceAttention,
    check=_check,
    lends=True,
    takes_groups=lambda rules: not rules.pipeline,
    chooses=True,
)
