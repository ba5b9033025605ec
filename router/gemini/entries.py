"""The Gemini context cache map: live cachedContents references and rejected prefixes.

One ordered map, keyed by (backend, prefix digest), holds both kinds of entry under one
``max_entries`` bound, least recently used first:

* live — a cachedContents resource the router created, with its expiry (monotonic clock);
* rejected — a prefix Google refused (or a create that failed), kept for
  ``negative_ttl_seconds`` so the router does not retry it on every request.

When a new entry needs room, rejected entries past their time go first, then the least
recently used entry of either kind. Evicted live entries are returned to the caller, which
deletes their remote resources (storage is billed per token-hour until then). The map does
no I/O and never blocks: the lifecycle manager owns every network call.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

__all__ = ["CacheEntry", "CacheKey", "ContextCacheMap", "Lookup"]

CacheKey = tuple[str, bytes]
"""(backend name, prefix digest): a cachedContents resource belongs to one API key."""

_EXPIRY_MARGIN_S = 2.0
"""A reference this close to its expiry is treated as gone: the request would race it."""


@dataclass(slots=True)
class CacheEntry:
    backend: str
    digest: bytes
    name: str | None
    """``cachedContents/{id}`` for a live entry; ``None`` for a rejected prefix."""
    expires_at: float
    """Monotonic seconds: the resource's expiry, or the end of the rejection."""
    ttl_s: float = 0.0
    token_count: int = 0
    """Tokens the resource holds (its ``usageMetadata.totalTokenCount``)."""
    extending: bool = False
    """A TTL extension (PATCH) is in flight."""

    @property
    def live(self) -> bool:
        return self.name is not None


Lookup = Literal["hit", "negative", "miss"]


class ContextCacheMap:
    """LRU map of live and rejected entries sharing one bound; see the module docstring."""

    __slots__ = ("_entries", "max_entries", "negatives")

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[CacheKey, CacheEntry] = OrderedDict()
        self.negatives = 0
        """Rejected entries currently held (a gauge, kept exact on every change)."""

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def live_count(self) -> int:
        return len(self._entries) - self.negatives

    def entries(self) -> list[CacheEntry]:
        return list(self._entries.values())

    def lookup(self, key: CacheKey, now: float) -> tuple[Lookup, CacheEntry | None]:
        """Classify ``key``; an expired entry is dropped and reads as a miss."""
        entry = self._entries.get(key)
        if entry is None:
            return "miss", None
        if entry.live:
            if entry.expires_at - now > _EXPIRY_MARGIN_S:
                self._entries.move_to_end(key)
                return "hit", entry
        elif entry.expires_at > now:
            return "negative", entry
        self._remove(key)
        return "miss", None

    def put_live(
        self,
        key: CacheKey,
        name: str,
        expires_at: float,
        ttl_s: float,
        token_count: int,
        now: float,
    ) -> list[CacheEntry]:
        """Record a created resource; returns the live entries evicted to make room."""
        entry = CacheEntry(key[0], key[1], name, expires_at, ttl_s, token_count)
        return self._put(key, entry, now)

    def put_negative(self, key: CacheKey, until: float, now: float) -> list[CacheEntry]:
        """Record a rejected prefix until ``until``; returns evicted live entries."""
        return self._put(key, CacheEntry(key[0], key[1], None, until), now)

    def drop(self, key: CacheKey, name: str | None = None) -> CacheEntry | None:
        """Forget ``key`` (only if it still names ``name``, when given)."""
        entry = self._entries.get(key)
        if entry is None or (name is not None and entry.name != name):
            return None
        self._remove(key)
        return entry

    def clear(self) -> list[CacheEntry]:
        """Forget everything; returns the live entries (their resources are to be deleted)."""
        live = [e for e in self._entries.values() if e.live]
        self._entries.clear()
        self.negatives = 0
        return live

    def _remove(self, key: CacheKey) -> None:
        entry = self._entries.pop(key)
        if not entry.live:
            self.negatives -= 1

    def _put(self, key: CacheKey, entry: CacheEntry, now: float) -> list[CacheEntry]:
        evicted: list[CacheEntry] = []
        old = self._entries.get(key)
        if old is not None:
            self._remove(key)
            if old.live and old.name != entry.name:
                evicted.append(old)
        if len(self._entries) >= self.max_entries:
            self._purge_expired_negatives(now)
        while len(self._entries) >= self.max_entries:
            _, victim = self._entries.popitem(last=False)
            if victim.live:
                evicted.append(victim)
            else:
                self.negatives -= 1
        self._entries[key] = entry
        if not entry.live:
            self.negatives += 1
        return evicted

    def _purge_expired_negatives(self, now: float) -> None:
        stale = [k for k, e in self._entries.items() if not e.live and e.expires_at <= now]
        for k in stale:
            self._remove(k)
