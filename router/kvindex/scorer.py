"""KvOverlapScorer: pick the backend that really holds a request's prefix (Tier 4).

For each candidate backend with an index entry for the prefix::

    final = overlap_weight * (raw_overlap * tier_multiplier)
          + load_weight    * (1 - load_ratio)
          + health_weight  * health

* ``raw_overlap``     = token_count / the largest token_count among the candidates' entries;
* ``tier_multiplier`` = ``gpu_tier_weight`` (GpuHot) or ``storage_tier_weight`` (StorageWarm);
* ``load_ratio``      = in_flight / the largest in_flight among the candidates (0 if all idle);
* ``health``          = the backend's rolling success rate.

A backend without an entry, or whose tier-weighted overlap is under
``min_overlap_threshold``, scores 0 and is excluded, so an idle uncached backend can never
win on load and health alone. The pool takes the best only when it is strictly above
``DEFAULT_SCORER_THRESHOLD`` (0.3); otherwise the configured strategy decides.

Two phases, as the reference design: ``prepare()`` awaits the index query and snapshots
the in-flight gauge once, cached for 100 ms per prefix, so every candidate of one
scoring pass is compared at the same instant; ``score()`` / ``score_with_tier()`` are
synchronous reads of that snapshot.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..config import ScoringConfig
from ..pool import Backend
from .base import IndexEntry, KvIndex, StorageTier

__all__ = ["DEFAULT_SCORER_THRESHOLD", "KvOverlapScorer", "Prepared"]

DEFAULT_SCORER_THRESHOLD = 0.3
_PREPARE_TTL_S = 0.1
_MAX_PREPARED = 10_000


@dataclass(slots=True)
class Prepared:
    """One prefix's index entries and the in-flight snapshot taken with them."""

    expires: float
    entries: dict[str, IndexEntry]
    in_flight: dict[str, int]
    max_tokens: int = 0
    """Largest token_count among the candidates' entries (the overlap normaliser)."""
    max_load: int = 0
    """Largest in-flight count among the candidates (the load normaliser)."""

    @classmethod
    def build(
        cls, expires: float, entries: dict[str, IndexEntry], candidates: Sequence[Backend]
    ) -> Prepared:
        in_flight = {b.name: b.in_flight for b in candidates}
        max_tokens = max(
            (entries[b.name].token_count for b in candidates if b.name in entries), default=0
        )
        return cls(expires, entries, in_flight, max_tokens, max(in_flight.values(), default=0))


class KvOverlapScorer:
    def __init__(
        self,
        index: KvIndex,
        scoring: ScoringConfig,
        *,
        on_decision: Callable[[str, str, float | None], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        threshold: float = DEFAULT_SCORER_THRESHOLD,
    ) -> None:
        self.index = index
        self.scoring = scoring
        self.threshold = threshold
        self._on_decision = on_decision
        self._clock = clock
        self._prepared: dict[str, Prepared] = {}

    async def prepare(self, prefix_hash: str, candidates: Sequence[Backend]) -> Prepared:
        now = self._clock()
        p = self._prepared.get(prefix_hash)
        if p is not None and p.expires > now:
            return p
        found = await self.index.query_backends(prefix_hash)
        p = Prepared.build(now + _PREPARE_TTL_S, {e.backend: e for e in found}, candidates)
        if len(self._prepared) >= _MAX_PREPARED:
            self._prepared.clear()
        self._prepared[prefix_hash] = p
        return p

    def components(
        self, p: Prepared, backend: Backend
    ) -> tuple[float, float, float, float, StorageTier | None]:
        """(final, tier-weighted overlap, 1 - load_ratio, health, tier); final 0 = excluded."""
        entry = p.entries.get(backend.name)
        if entry is None:
            return 0.0, 0.0, 0.0, 0.0, None
        sc = self.scoring
        max_tokens = p.max_tokens
        max_load = p.max_load
        if max_tokens <= 0:
            return 0.0, 0.0, 0.0, 0.0, None
        mult = sc.gpu_tier_weight if entry.tier is StorageTier.GPU_HOT else sc.storage_tier_weight
        overlap = entry.token_count / max_tokens * mult
        own = p.in_flight.get(backend.name, backend.in_flight)
        idle = 1.0 - (own / max_load if max_load else 0.0)
        try:
            health = backend.success_rate
        except Exception:  # never block or fail a request on the health read
            health = 1.0
        if overlap < sc.min_overlap_threshold:
            return 0.0, overlap, idle, health, entry.tier
        final = sc.overlap_weight * overlap + sc.load_weight * idle + sc.health_weight * health
        return final, overlap, idle, health, entry.tier

    def score_with_tier(self, p: Prepared, backend: Backend) -> tuple[float, StorageTier | None]:
        """The composite score and the tier it was read from, in one read of the snapshot."""
        final, _, _, _, tier = self.components(p, backend)
        return final, (tier if final > 0.0 else None)

    def score(self, p: Prepared, backend: Backend) -> float:
        return self.score_with_tier(p, backend)[0]

    async def choose(self, prefix_key: bytes, candidates: Sequence[Backend]) -> Backend | None:
        """The Selector's hook: the best backend above the threshold, else None."""
        p = await self.prepare(prefix_key.hex(), candidates)
        best: Backend | None = None
        best_score = 0.0
        best_tier: StorageTier | None = None
        if p.entries:
            for b in candidates:
                s, tier = self.score_with_tier(p, b)
                if s > best_score:
                    best, best_score, best_tier = b, s, tier
        if best is not None and best_score > self.threshold:
            if self._on_decision is not None:
                self._on_decision("kv_aware", best_tier.value if best_tier else "none", best_score)
            return best
        if self._on_decision is not None:
            self._on_decision("fallback", "none", None)
        return None
