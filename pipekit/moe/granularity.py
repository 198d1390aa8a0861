"""MPipeMoE's Algorithm 1: the number of partitions n for a batch of B tokens, searched online.

The best n grows with B (the paper's hypothesis, its Fig. 12), so the batch sizes seen so far
form disjoint ranges, one per n. For a new B:

1. a B seen before is answered from the cache table;
2. a B inside the range of some n gets that n;
3. otherwise trials time each candidate n at B (`trial(B, n)` -> seconds) and the fastest wins;
   its range grows to cover B, or a new range [B, B] is made for it.

Ranges are kept sorted by their lower end, so finding B is a binary search (the paper uses a
binary search tree; both are O(log r) lookups). If widening a range would swallow another n's
range (the hypothesis fails for these B), B is cached alone and the ranges stay as they are.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass

__all__ = ["GranularitySearch", "TokenRange"]


@dataclass
class TokenRange:
    """Batch sizes [lower, upper] that use `partitions`."""

    lower: int
    upper: int
    partitions: int


class GranularitySearch:
    """Algorithm 1: `search(B)` -> n, running `trial(B, n)` only for B outside every range."""

    def __init__(
        self, trial: Callable[[int, int], float], candidates: Sequence[int] = (1, 2, 4, 8)
    ) -> None:
        if not candidates or any(n < 1 for n in candidates):
            raise ValueError(f"partition candidates {list(candidates)} must be positive integers")
        self._trial = trial
        self.candidates = sorted(set(candidates))
        self.cache_table: dict[int, int] = {}
        self.ranges: list[TokenRange] = []
        self.trials_run = 0

    def find(self, batch_tokens: int) -> TokenRange | None:
        """The range holding `batch_tokens`, if any."""
        index = bisect.bisect_right([r.lower for r in self.ranges], batch_tokens) - 1
        if index >= 0 and self.ranges[index].upper >= batch_tokens:
            return self.ranges[index]
        return None

    def search(self, batch_tokens: int) -> int:
        if batch_tokens in self.cache_table:
            return self.cache_table[batch_tokens]
        found = self.find(batch_tokens)
        if found is not None:
            partitions = found.partitions
        else:
            partitions = self._best_by_trials(batch_tokens)
            self._record(batch_tokens, partitions)
        self.cache_table[batch_tokens] = partitions
        return partitions

    def _best_by_trials(self, batch_tokens: int) -> int:
        timings = {}
        for partitions in self.candidates:
            if partitions <= max(batch_tokens, 1):
                timings[partitions] = self._trial(batch_tokens, partitions)
                self.trials_run += 1
        return min(timings, key=lambda n: (timings[n], n))

    def _record(self, batch_tokens: int, partitions: int) -> None:
        own = next((r for r in self.ranges if r.partitions == partitions), None)
        if own is None:
            bisect.insort(
                self.ranges,
                TokenRange(batch_tokens, batch_tokens, partitions),
                key=lambda r: r.lower,
            )
            return
        lower, upper = min(own.lower, batch_tokens), max(own.upper, batch_tokens)
        if any(r is not own and r.lower <= upper and r.upper >= lower for r in self.ranges):
            return  # not monotone here: keep B in the cache table only
        own.lower, own.upper = lower, upper
        self.ranges.sort(key=lambda r: r.lower)
