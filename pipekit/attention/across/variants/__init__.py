"""pipekit's context-parallel variants, registered in the order that breaks ties of equal
bytes (K/V passing needs no merge; commutated no all-to-all)."""

from pipekit.attention.across.variant_table import register_context_parallel_variant
from pipekit.attention.across.variants.auto import AUTO
from pipekit.attention.across.variants.commutated import COMMUTATED
from pipekit.attention.across.variants.hierarchical import HIERARCHICAL
from pipekit.attention.across.variants.kv_passing import KV_PASSING
from pipekit.attention.across.variants.ring import RING
from pipekit.attention.across.variants.ulysses import ULYSSES

__all__ = ["AUTO", "COMMUTATED", "HIERARCHICAL", "KV_PASSING", "RING", "ULYSSES"]

for _variant in (KV_PASSING, COMMUTATED, ULYSSES, HIERARCHICAL, RING, AUTO):
    register_context_parallel_variant(_variant)
