"""The table of context-parallel variants: one `ContextParallelVariant` entry per way cp ranks
exchange attention, and the functions everything else reads it through.

An entry holds all that pipekit needs of a variant: the bytes one rank sends per layer and slice
(what "auto" and the benches compare), its attention over a whole sequence (jobs without a
pipeline), its attention per slice inside a sliced pipeline (over token-shard caches, or a
context that wraps the stage's KV cache), its rules, and which ranks its pipeline cache splits
heads over (the memory plan). Job validation, the pipeline feature, the attention contexts, the
memory plan and the layout search read entries only, so adding a variant is one module that
calls `register_context_parallel_variant` (pipekit's own: `pipekit.attention.across.variants`).

Legend: B batch, H query heads, G kv heads, S tokens, D head dim.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch.distributed as dist
from torch import Tensor

from pipekit.attention.across.hierarchical import HierarchicalGroups
from pipekit.attention.across.token_shards import CachedShard, TokenShard
from pipekit.attention.context_protocol import AttentionContext
from pipekit.attention.kernels.backends import AttentionBackend
from pipekit.attention.kv_cache import SliceAttention
from pipekit.attention.patterns import AttentionPattern

__all__ = [
    "CachedShardAttention",
    "ContextParallelVariant",
    "SliceSharding",
    "VariantRules",
    "WholeSequenceCall",
    "auto_candidates",
    "check_context_parallel",
    "check_context_parallel_split",
    "choose_context_parallel",
    "context_parallel_bytes",
    "context_parallel_variant",
    "context_parallel_variant_entry",
    "context_parallel_variant_names",
    "register_context_parallel_variant",
    "resolve_over_group",
]


class CachedShardAttention(Protocol):
    """Attention of this rank's queries (`shard`) over every rank of `group`'s cached token
    shards (`cache`: this rank's chunks, its own last): `(out_BHSD, lse_BHS)`.
    `drop_remote` is the ablation that keeps this rank's chunks only."""

    def __call__(
        self,
        q_BHSD: Tensor,
        shard: TokenShard,
        cache: Sequence[CachedShard],
        group: dist.ProcessGroup | None,
        *,
        scale: float | None = None,
        backend: str | AttentionBackend = "auto",
        drop_remote: bool = False,
        pattern: AttentionPattern | None = None,
        sinks_H: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]: ...


@dataclass(frozen=True)
class WholeSequenceCall:
    """One layer's attention of a rank's share of whole sequences over `group`."""

    q_BHSD: Tensor
    k_BGSD: Tensor
    v_BGSD: Tensor
    shard: TokenShard
    group: dist.ProcessGroup | None
    scale: float
    backend: str | AttentionBackend = "auto"
    pattern: AttentionPattern | None = None
    sinks_H: Tensor | None = None
    hierarchy: HierarchicalGroups | None = None


@dataclass(frozen=True)
class VariantRules:
    """What a variant's rules see: the cp ranks, a tensor-parallel rank's heads, hierarchical
    settings (`ulysses_size` 0: unset), and where it runs."""

    cp: int
    query_heads: int
    kv_heads: int
    ulysses_size: int = 0
    across: str = "auto"
    pipeline: bool = False
    context_exchange: bool = False


class SliceSharding(Protocol):
    """A sliced pipeline's context parallelism as a slice's attention sees it: the cp `group`
    (`cp` ranks, this one `rank`), the `variant` asked for, where the microbatch's slices
    start and end (`slice_bounds`, all ranks' shares counted), and, for hierarchical variants,
    the Ulysses and across groups."""

    group: dist.ProcessGroup
    variant: str
    cp: int
    rank: int
    slice_bounds: tuple[int, ...]
    drop_remote: bool
    hierarchy: HierarchicalGroups | None

    def rank_tokens(self, slice_index: int) -> Tensor:
        """`[cp, S]`: every cp rank's sequence indices in the slice, by rank."""
        ...

    def slice_tokens(self, slice_index: int) -> Tensor:
        """This rank's sequence indices in the slice."""
        ...

    def variant_of(
        self, slice_index: int, q_BHSD: Tensor, k_BGSD: Tensor, keys_are_values: bool = False
    ) -> str:
        """The variant the slice runs by (per slice for one that resolves)."""
        ...


SliceContextFactory = Callable[[SliceAttention, SliceSharding, int], AttentionContext]
"""(the stage's KV-cache context of a unit, the pipeline's cp sharding, the slice index) ->
the unit's attention context (`ContextParallelSliceAttention` for token-shard caches)."""


def _no_rules(rules: VariantRules) -> None:
    """A variant that runs wherever its attention does."""


def _never(rules: VariantRules) -> bool:
    return False


@dataclass(frozen=True)
class ContextParallelVariant:
    """One way for cp ranks to attend to each other's tokens.

    `sent_bytes` takes `context_parallel_bytes`' keywords. `whole_sequence` attends a whole
    sequence's share (None: by `cached_shards` over one chunk). `cached_shards` attends over
    token-shard caches, which lets a pipeline choose it per slice. `slice_context` wraps the
    stage's KV-cache context of a unit in a sliced pipeline (`ContextParallelSliceAttention`
    over token-shard caches; another for a cache holding e.g. head shards); None: the variant
    runs outside pipelines only. `auto_candidate(query_heads, kv_heads,
    cp, ulysses_size, whole_sequence)`: whether "auto" may pick it there. `head_ranks`: the
    ranks a pipeline's cache splits heads over (None: it holds token shards). `lends`: context
    exchange may lend this rank's shares of earlier slices (its cache stays home).
    `takes_groups`: whether it reads `cp_ulysses` / `cp_across`. `chooses`: the variant picks
    another per slice, by bytes, among the candidates ("auto")."""

    name: str
    summary: str
    sent_bytes: Callable[..., float] | None = None
    cached_shards: CachedShardAttention | None = None
    whole_sequence: Callable[[WholeSequenceCall], Tensor] | None = None
    slice_context: SliceContextFactory | None = None
    check: Callable[[VariantRules], None] = _no_rules
    auto_candidate: Callable[[int, int, int, int, bool], bool] | None = None
    head_ranks: Callable[[VariantRules], int] | None = None
    lends: bool = False
    takes_groups: Callable[[VariantRules], bool] = _never
    chooses: bool = False

    @property
    def in_pipelines(self) -> bool:
        """Whether a sliced pipeline can run it."""
        return self.slice_context is not None

    def attend_whole_sequence(self, call: WholeSequenceCall) -> Tensor:
        """This rank's tokens' output `[B, H, S, D]` over the whole sequence."""
        if self.whole_sequence is not None:
            return self.whole_sequence(call)
        if self.cached_shards is None:
            raise ValueError(f"cp_variant={self.name!r} has no whole-sequence attention")
        cache = [CachedShard(call.k_BGSD, call.v_BGSD, call.shard)]
        return self.cached_shards(
            call.q_BHSD, call.shard, cache, call.group, scale=call.scale, backend=call.backend,
            pattern=call.pattern, sinks_H=call.sinks_H,
        )[0]  # fmt: skip


_VARIANTS: dict[str, ContextParallelVariant] = {}
"""By name, in registration order (which breaks ties of equal bytes)."""


def register_context_parallel_variant(variant: ContextParallelVariant) -> ContextParallelVariant:
    """Add `variant` to the table (ValueError if its name is taken); returns it."""
    if variant.name in _VARIANTS:
        raise ValueError(f"a context-parallel variant named {variant.name!r} is registered")
    _VARIANTS[variant.name] = variant
    return variant


def context_parallel_variant_names() -> tuple[str, ...]:
    """Every registered variant's name, sorted."""
    return tuple(sorted(_VARIANTS))


def context_parallel_variant_entry(name: str) -> ContextParallelVariant:
    """The entry named `name`; ValueError naming the choices otherwise."""
    if name not in _VARIANTS:
        raise ValueError(
            f"cp_variant={name!r} is not one of {', '.join(sorted(_VARIANTS))}; choose one, or "
            "register yours with register_context_parallel_variant"
        )
    return _VARIANTS[name]


def check_context_parallel_split(
    seq_len: int, cp: int, num_slices: int = 1, pieces_per_rank: int = 2
) -> None:
    """ValueError unless each of `num_slices` slices of a `seq_len`-token sequence cuts into
    `cp x pieces_per_rank` equal pieces (two per cp rank: head and tail, for equal causal work;
    under cp_balance = "documents", cp_balance_pieces per rank, dealt by work)."""
    pieces = pieces_per_rank * cp * num_slices
    if seq_len % pieces:
        per_rank = "2" if pieces_per_rank == 2 else "cp_balance_pieces"
        factors = f"{per_rank} x cp" + (" x num_slices" if num_slices > 1 else "")
        part = "slice" if num_slices > 1 else "sequence"
        nearest = max(pieces, seq_len // pieces * pieces)
        raise ValueError(
            f"training.seq_len={seq_len} must be a multiple of {factors} = {pieces}: context "
            f"parallelism cuts every {part} into {pieces_per_rank} x cp = "
            f"{pieces_per_rank * cp} equal pieces ({pieces_per_rank} per rank, for equal "
            f"attention work); try seq_len = {nearest}, or change cp"
            + (", cp_balance_pieces" if pieces_per_rank != 2 else "")
            + " or num_slices"
        )


def check_context_parallel(name: str, rules: VariantRules) -> None:
    """ValueError naming the fix unless variant `name` can run under `rules` (the one check,
    inside pipelines and outside): it exists, runs where it is asked to, lends where context
    exchange needs it, takes `cp_ulysses` only if it uses groups, and its own rules hold."""
    variant = context_parallel_variant_entry(name)
    if rules.pipeline and not variant.in_pipelines:
        inside = [n for n, v in sorted(_VARIANTS.items()) if v.in_pipelines]
        raise ValueError(
            f"cp_variant={name!r} runs on whole sequences, outside pipelines; inside a "
            f"pipeline use {', '.join(inside)}"
        )
    if rules.context_exchange and not variant.lends:
        lenders = [n for n, v in sorted(_VARIANTS.items()) if v.lends]
        raise ValueError(
            f"context_exchange = true with cp_variant={name!r}: a lending slice hands its peer "
            "this rank's token shares of earlier slices, which stay home only where lending "
            f"slices run commutated; use cp_variant = {' or '.join(map(repr, lenders))}"
        )
    if rules.ulysses_size and not variant.takes_groups(rules):
        takers = [n for n, v in sorted(_VARIANTS.items()) if v.takes_groups(rules)]
        raise ValueError(
            f"cp_ulysses = {rules.ulysses_size} sets the groups of cp_variant="
            f"{' or '.join(map(repr, takers))} here, not of {name!r}; set one of those or "
            "cp_ulysses = 0"
        )
    variant.check(rules)


def context_parallel_bytes(variant: str, **shape: float) -> float:
    """Bytes one rank sends for one layer's attention of a slice, forward only, by `variant`'s
    rule. Keywords: `slice_index` (0-based), `slice_tokens` (the whole slice, all cp ranks'
    tokens), `cp`, `q_heads`, `kv_heads`, `head_dim`, and optionally `element_bytes` (2),
    `keys_are_values` (one tensor is both: multi-head latent attention's latent form) and
    `ulysses_size` (hierarchical groups)."""
    entry = context_parallel_variant_entry(variant)
    if entry.sent_bytes is None:
        priced = [n for n, v in sorted(_VARIANTS.items()) if v.sent_bytes is not None]
        raise ValueError(
            f"context parallel variant {variant!r} has no bytes rule: choose "
            f"{', '.join(map(repr, priced))}"
        )
    return entry.sent_bytes(**{"element_bytes": 2, "keys_are_values": False, **shape})


def choose_context_parallel(variants: Sequence[str] | None = None, **shape: float) -> str:
    """Of `variants` (None: those "auto" takes per slice), the one that moves the fewest bytes
    for this slice (`context_parallel_bytes`' keywords); ties by registration order."""
    if variants is None:
        variants = auto_candidates(0, 0, int(shape["cp"]), 1, whole_sequence=False)
    ordered = sorted(variants, key=list(_VARIANTS).index)
    return min(ordered, key=lambda variant: context_parallel_bytes(variant, **shape))


def auto_candidates(
    query_heads: int, kv_heads: int, cp: int, ulysses_size: int, whole_sequence: bool
) -> list[str]:
    """The variants "auto" may pick for these heads and ranks (on a `whole_sequence`, or per
    slice of a pipeline), in registration order."""
    return [
        name
        for name, v in _VARIANTS.items()
        if v.auto_candidate is not None
        and v.auto_candidate(query_heads, kv_heads, cp, ulysses_size, whole_sequence)
    ]


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
    """The variant a slice's attention runs by: `variant`, or, for one that `chooses`
    ("auto"), the candidate that moves the fewest bytes for these queries and keys (on a
    `whole_sequence` also those that reshard heads). The one dispatcher, inside pipelines (per
    slice) and outside them (one slice); every cp rank sees the same shapes, so chooses
    alike."""
    entry = context_parallel_variant_entry(variant)
    if not entry.chooses:
        return variant
    heads = (q_BHSD.shape[1], k_BGSD.shape[1])
    return choose_context_parallel(
        auto_candidates(*heads, cp, ulysses_size, whole_sequence),
        slice_index=slice_index, slice_tokens=slice_tokens, cp=cp, q_heads=heads[0],
        kv_heads=heads[1], head_dim=q_BHSD.shape[-1], element_bytes=q_BHSD.element_size(),
        keys_are_values=keys_are_values, ulysses_size=ulysses_size,
    )  # fmt: skip


def resolve_over_group(
    variant: str, call: WholeSequenceCall, whole_sequence: bool, ulysses_size: int = 1
) -> ContextParallelVariant:
    """The entry `call`'s tokens attend by over `call.group`, one slice being the whole
    sequence."""
    ranks = dist.get_world_size(call.group)
    name = context_parallel_variant(
        variant, call.q_BHSD, call.k_BGSD, slice_index=0,
        slice_tokens=call.q_BHSD.shape[2] * ranks, cp=ranks, whole_sequence=whole_sequence,
        keys_are_values=call.v_BGSD is call.k_BGSD, ulysses_size=ulysses_size,
    )  # fmt: skip
    return context_parallel_variant_entry(name)
