"""Which context-parallel variant runs, and the rules on cp settings.

The variants (`CONTEXT_PARALLEL_VARIANTS`) and their checks, the bytes each moves per slice
(`context_parallel_bytes`), and the one dispatcher that resolves "auto" by those bytes, inside
pipelines (per slice) and outside them (`context_parallel_variant`). Job validation, the
pipeline plan, the attention contexts and the benches all read this module.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor

__all__ = [
    "CONTEXT_PARALLEL_VARIANTS",
    "check_context_parallel_split",
    "check_context_parallel_variant",
    "choose_context_parallel",
    "context_parallel_bytes",
    "context_parallel_variant",
    "hierarchical_bytes",
]


CONTEXT_PARALLEL_VARIANTS = ("auto", "commutated", "hierarchical", "kv_passing", "ring", "ulysses")
"""How cp ranks exchange attention; "auto" picks per slice by bytes; "ring" (whole sequences
only, `pipekit.attention.ring`) passes K/V around the ranks with overlap; "hierarchical"
(`pipekit.attention.hierarchical`) runs Ulysses inside groups of `cp_ulysses` ranks and
another variant across them."""


def check_context_parallel_variant(variant: str) -> None:
    """ValueError unless `variant` is one of `CONTEXT_PARALLEL_VARIANTS` (the one place the
    choice is checked: job validation and the pipeline plan both call this)."""
    if variant not in CONTEXT_PARALLEL_VARIANTS:
        raise ValueError(
            f"cp_variant={variant!r} is not one of {', '.join(CONTEXT_PARALLEL_VARIANTS)}"
        )


def check_context_parallel_split(seq_len: int, cp: int, num_slices: int = 1) -> None:
    """ValueError unless each of `num_slices` slices of a `seq_len`-token sequence cuts into
    2 x cp equal pieces, two per cp rank for equal causal work (the one rule, for context
    parallelism inside pipelines and outside)."""
    pieces = 2 * cp * num_slices
    if seq_len % pieces:
        factors, part = (
            ("2 x cp x num_slices", "slice") if num_slices > 1 else ("2 x cp", "sequence")
        )
        nearest = max(pieces, seq_len // pieces * pieces)
        raise ValueError(
            f"training.seq_len={seq_len} must be a multiple of {factors} = {pieces}: context "
            f"parallelism cuts every {part} into 2 x cp = {2 * cp} equal pieces (two per rank, "
            f"for equal causal work); try seq_len = {nearest}, or change cp or num_slices"
        )


def context_parallel_bytes(
    variant: str,
    *,
    slice_index: int,
    slice_tokens: int,
    cp: int,
    q_heads: int,
    kv_heads: int,
    head_dim: int,
    element_bytes: int = 2,
    keys_are_values: bool = False,
    ulysses_size: int = 1,
) -> float:
    """Bytes one rank sends for one layer's attention of slice `slice_index` (0-based) of
    `slice_tokens` tokens over `cp` ranks, forward only. Commutated: its queries out and the
    peers' partial outputs and lse back, `(cp-1)/cp · T · (2·h_q·d + h_q)` elements, constant
    over slices. KV passing: the keys and values of the slice and of every cached one,
    `(cp-1)/cp · (j+1) · T · 2·h_kv·d`. Ulysses: its tokens' q, k, v out to the head owners
    and their outputs back, `(cp-1)/cp · T/cp · (2·h_q + 2·h_kv)·d`; kv heads fewer than the
    ranks are all-gathered instead, `(cp-1)/cp · T · 2·h_kv·d` of them. `keys_are_values`
    (multi-head latent attention's latent form: one tensor is both) halves what K/V passing
    and Ulysses send of them. Hierarchical (groups of `ulysses_size` ranks): Ulysses within a
    group on its tokens, plus the cheaper of commutated and K/V passing across the groups on
    the group's heads (`hierarchical_bytes` names the variant across)."""
    if variant == "hierarchical":
        return hierarchical_bytes(
            "auto", slice_index=slice_index, slice_tokens=slice_tokens, cp=cp, q_heads=q_heads,
            kv_heads=kv_heads, head_dim=head_dim, element_bytes=element_bytes,
            keys_are_values=keys_are_values, ulysses_size=ulysses_size,
        )  # fmt: skip
    kv_tensors = 1 if keys_are_values else 2
    share = (cp - 1) / cp * slice_tokens * element_bytes
    if variant == "commutated":
        return share * (2 * q_heads * head_dim + q_heads)
    if variant == "kv_passing":
        return share * (slice_index + 1) * kv_tensors * kv_heads * head_dim
    if variant == "ulysses":
        kv_share = share / cp if kv_heads % cp == 0 else share  # all-to-all, or all-gather
        return (share / cp * 2 * q_heads + kv_share * kv_tensors * kv_heads) * head_dim
    raise ValueError(
        f"context parallel variant {variant!r}: choose 'commutated', 'kv_passing', 'ulysses' "
        "or 'hierarchical'"
    )


def hierarchical_bytes(across: str, *, ulysses_size: int, cp: int, **shape: int) -> float:
    """Bytes one rank sends under hierarchical context parallelism (`context_parallel_bytes`'
    keywords): Ulysses over its group of `ulysses_size` ranks on the group's `slice_tokens x u /
    cp` tokens, then `across` ("ring" moves what K/V passing does; "auto" the cheaper of
    commutated and K/V passing) over the `cp / u` groups on `1 / u` of the heads (the kv heads
    fewer than a group: one, gathered whole)."""
    groups, kv_heads = cp // ulysses_size, shape["kv_heads"]
    group_tokens = shape["slice_tokens"] * ulysses_size // cp
    within = context_parallel_bytes(
        "ulysses", **{**shape, "slice_tokens": group_tokens}, cp=ulysses_size
    )
    heads = {
        "q_heads": shape["q_heads"] // ulysses_size,
        "kv_heads": kv_heads // ulysses_size if kv_heads % ulysses_size == 0 else 1,
    }
    variants = {"auto": ("commutated", "kv_passing"), "ring": ("kv_passing",)}.get(
        across, (across,)
    )
    return within + min(
        context_parallel_bytes(variant, **{**shape, **heads}, cp=groups) for variant in variants
    )


_TIE_ORDER = ("kv_passing", "commutated", "ulysses", "hierarchical")
"""Among variants moving equal bytes: KV passing needs no merge; commutated no all-to-all."""


def choose_context_parallel(
    variants: Sequence[str] = ("commutated", "kv_passing"), **shape: int
) -> str:
    """Of `variants`, the one that moves the fewest bytes for this slice
    (`context_parallel_bytes`' keywords); ties by `_TIE_ORDER`."""
    ordered = sorted(variants, key=_TIE_ORDER.index)
    return min(ordered, key=lambda variant: context_parallel_bytes(variant, **shape))


def context_parallel_variant(
    variant: str,
    q_BHSD: Tensor,
    k_BGSD: Tensor,
    *,
    slice_index: int,
    slice_tokens: int,
    cp: int,
    whole_sequence: bool = False,
    keys_are_values: bool = False,
    ulysses_size: int = 1,
) -> str:
    """The variant a slice's attention runs by: `variant`, or for "auto" the one that moves
    fewer bytes for these queries and keys (`choose_context_parallel`; on a `whole_sequence`
    also Ulysses where the heads split over the ranks, and hierarchical with groups of
    `ulysses_size` ranks where they split over a group). The one dispatcher of context
    parallelism, inside pipelines (per slice) and outside them (one slice)."""
    if variant != "auto":
        return variant
    variants = ["commutated", "kv_passing"]
    heads = (q_BHSD.shape[1], k_BGSD.shape[1])
    if whole_sequence and _heads_split(*heads, cp):
        variants.append("ulysses")
    if whole_sequence and 1 < ulysses_size < cp and _heads_split(*heads, ulysses_size):
        variants.append("hierarchical")
    return choose_context_parallel(
        variants,
        slice_index=slice_index,
        slice_tokens=slice_tokens,
        cp=cp,
        q_heads=q_BHSD.shape[1],
        kv_heads=k_BGSD.shape[1],
        head_dim=q_BHSD.shape[-1],
        element_bytes=q_BHSD.element_size(),
        keys_are_values=keys_are_values,
        ulysses_size=ulysses_size,
    )


def _heads_split(query_heads: int, kv_heads: int, ranks: int) -> bool:
    """Whether Ulysses can reshard these heads over `ranks` (`check_ulysses_heads`' rule)."""
    return query_heads % ranks == 0 and (kv_heads % ranks == 0 or ranks % kv_heads == 0)
