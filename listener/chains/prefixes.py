"""Per-prefix block counts, and the ``KvEvent``s that announce how they changed.

The router does not see blocks, only prefixes. Per prefix the ledger counts the keyed GPU
and non-GPU blocks and the deepest of each (``Prefix``); whoever changes a count puts the
prefix in ``touched``. After every engine batch (or attribution) ``flush`` emits, for each
touched prefix, the difference from what it last announced:

* ``cache_created`` (tier gpu) when a prefix gains GPU blocks or its chain grows;
* ``cache_offloaded`` (tier storage) while only non-GPU copies exist;
* ``cache_evicted`` when its last block is gone (and the prefix is forgotten).

A prefix whose chain shrinks within its tier announces nothing. ``snapshot`` replays
exactly the announced state (what a subscriber that joins or resyncs starts from).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from bus.events import KvEvent

__all__ = ["Prefix", "PrefixLedger"]


class Prefix:
    """Per-prefix block counts and what was last announced for it."""

    __slots__ = (
        "gpu_hw",
        "gpu_refs",
        "hex",
        "key",
        "sent_count",
        "sent_tier",
        "storage_hw",
        "storage_refs",
    )

    def __init__(self, key: bytes) -> None:
        self.key, self.hex = key, key.hex()
        self.gpu_refs = self.gpu_hw = self.storage_refs = self.storage_hw = 0
        self.sent_tier: str | None = None
        self.sent_count = 0


class CountedBlock(Protocol):
    """What the ledger reads of a keyed block (``blocks.TrackedBlock`` is one)."""

    @property
    def prefix(self) -> Prefix | None: ...
    @property
    def tier(self) -> str: ...
    @property
    def depth(self) -> int: ...


class PrefixLedger:
    """The prefixes of one source's keyed blocks, and what subscribers were told of them.

    ``touched`` keeps its identity for the ledger's lifetime: the block store and the
    tracker's fast path hold it and add to it directly (one dict store per change).
    """

    def __init__(self, backend: str, emit: Callable[[KvEvent], None]) -> None:
        self.backend = backend
        self._emit = emit
        self.prefixes: dict[bytes, Prefix] = {}
        self.touched: dict[Prefix, None] = {}
        """Prefixes whose counts changed since the last ``flush`` (insertion-ordered)."""

    def prefix(self, key: bytes) -> Prefix:
        """The counts of ``key``, created empty on first use."""
        p = self.prefixes.get(key)
        if p is None:
            p = self.prefixes[key] = Prefix(key)
        return p

    def account(self, b: CountedBlock, sign: int) -> None:
        """Count keyed block ``b`` in (``sign`` 1) or out (-1) of its prefix."""
        p = b.prefix
        assert p is not None
        if b.tier == "gpu":
            p.gpu_refs += sign
            p.gpu_hw = max(p.gpu_hw, b.depth) if p.gpu_refs else 0
        else:
            p.storage_refs += sign
            p.storage_hw = max(p.storage_hw, b.depth) if p.storage_refs else 0
        self.touched[p] = None

    def flush(self) -> None:
        """Announce what changed since the last announcement."""
        touched = self.touched
        if not touched:
            return
        changed = list(touched)
        touched.clear()
        for p in changed:
            if p.gpu_refs + p.storage_refs == 0:
                if self.prefixes.get(p.key) is p:
                    del self.prefixes[p.key]
                if p.sent_tier is not None:
                    self._emit(KvEvent("cache_evicted", self.backend, p.hex))
                continue
            tier, count = ("gpu", p.gpu_hw) if p.gpu_refs else ("storage", p.storage_hw)
            if tier != p.sent_tier or count > p.sent_count:
                p.sent_tier, p.sent_count = tier, count
                self._emit(self._announce(p))

    def _announce(self, p: Prefix) -> KvEvent:
        kind = "cache_created" if p.sent_tier == "gpu" else "cache_offloaded"
        return KvEvent(kind, self.backend, p.hex, p.sent_count, p.sent_tier)  # type: ignore[arg-type]

    def snapshot(self) -> list[KvEvent]:
        """The announced state of every live prefix, as created/offloaded events."""
        return [self._announce(p) for p in self.prefixes.values() if p.sent_tier is not None]

    def clear(self) -> None:
        """Forget every prefix without events (the source resyncs its subscribers)."""
        self.prefixes.clear()
        self.touched.clear()

    def check_invariants(self, refs: dict[bytes, list[int]]) -> None:
        """``refs``: per prefix key, the keyed [GPU, non-GPU] blocks recounted from scratch."""
        assert set(refs) == set(self.prefixes)
        for k, (gpu, storage) in refs.items():
            p = self.prefixes[k]
            assert (p.gpu_refs, p.storage_refs) == (gpu, storage)
