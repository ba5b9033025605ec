"""The safeguard: SAECache that follows LRU or LFU where they do better.

SAECache's structure (queues, timing, continuation) pays on some workloads and costs a
few points on others, and which ones is not known in advance: it changes with the trace's
gap distribution, prompt sharing and capacity. ``GuardedSaeCache`` measures, online, what
each of the three policies would hit on the current workload and evicts in the order of
the one that is ahead.

**Shadows on a sample of keys.** One key in ``sample`` (a fixed hash of the key, as in
SHARDS-style spatial sampling: a sampled key keeps its whole access stream, so its reuse
distance relative to the scaled capacity is preserved) is also fed to three small
shadow caches of ``capacity / sample`` blocks: a full ``SaeCache``, an LRU and an LFU.
With ``min_shadow`` set, a small cache samples more keys so that a shadow holds at least
that many blocks (fewer make the scores noisy).
Every sampled access scores a hit for each shadow that holds the key. Scores are summed
per ``window`` sampled accesses and decayed by half each window. The capacity is the
largest number of blocks the cache held when it evicted or was told of an eviction (the
caller's capacity, which the cache is never told); until then nothing is evicted anywhere.

**The order of the leader.** The cache keeps SAECache's own state (so it can return to
it at any time) and, while LRU or LFU leads, that policy's order over the same evictable
blocks: LRU oldest access first, deeper block first on ties (vLLM's free queue), LFU
fewest accesses, then oldest. Each window the mode becomes the shadow with the best
score if it beats the current mode's by more than ``margin`` of the window's sampled
accesses (a ratchet against noise); SAECache is the starting mode. A switch builds the
new order from the evictable blocks (O(n), at most once per window). ``victim``,
``evict`` and ``rank`` use the current mode's order; everything else is ``SaeCache``'s.

**Cost.** Per access, one hash and a counter more than SAECache (while LRU or LFU
leads, one heap push when a block becomes evictable: O(log n)) plus, for one access in
``sample``, a SAECache, LRU and LFU update on caches ``sample`` times smaller. Memory:
one counter per block, one heap entry per evictable block while a baseline leads, and
the shadows' ``1 / sample`` share.

**Measured** (bench/RESULTS.md, saecache, robustness grid): on the tuning traces it
lifted the worst cell from -0.9 to -0.5 points below the better baseline; on the
evaluation grid it did not: its worst cell is lower than plain SAECache's (a switch
leaves the cache holding the old policy's blocks for a while, and the shadows score block
hits, not the prefix hits a request gets). Hence off by default in the listener.

Deterministic for a given ``seed`` (it salts the sampling hash) on keys whose ``hash`` is
(integers, tuples of integers: the block hashes engines report).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable
from dataclasses import dataclass, replace
from enum import IntEnum

from .policy import SaeCache, SaeConfig, _Blk
from .types import Queue, SessionClass, TokenType

__all__ = ["GuardConfig", "GuardedSaeCache", "Mode"]

_MASK = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15


class Mode(IntEnum):
    SAE = 0
    LRU = 1
    LFU = 2


@dataclass(slots=True)
class GuardConfig:
    """Tunables of the safeguard (fixed for every workload)."""

    sample: int = 8
    """At most one key in ``sample`` feeds the shadow caches (1: every key, exact but
    costly)."""
    min_shadow: int = 1
    """Blocks a shadow holds at least: a cache smaller than ``sample * min_shadow``
    samples more keys (all of them below ``2 * min_shadow``). 512 makes small caches'
    scores less noisy but costs them up to a second full SAECache (see bench/RESULTS.md:
    the default keeps the cost within 20x LRU's)."""
    window: int = 512
    """Sampled accesses per decision; the scores halve every window."""
    margin: float = 0.002
    """How far (a share of the window's sampled accesses) a shadow must lead to switch."""
    seed: int = 0
    """Salt of the sampling hash."""


class _Heap:
    """A min-heap of shadow keys with lazy deletion (``stamp`` marks the live entry)."""

    __slots__ = ("_heap", "_seq", "stamp")

    def __init__(self) -> None:
        self._heap: list[tuple] = []
        self._seq = 0
        self.stamp: dict[Hashable, int] = {}

    def __len__(self) -> int:
        return len(self.stamp)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.stamp

    def discard(self, key: Hashable) -> None:
        self.stamp.pop(key, None)

    def push(self, key: Hashable, *order: float) -> None:
        self._seq += 1
        self.stamp[key] = self._seq
        heapq.heappush(self._heap, (*order, self._seq, key))

    def pop(self) -> Hashable | None:
        """Drop and return the lowest live key (None when empty)."""
        heap, stamp = self._heap, self.stamp
        while heap:
            entry = heapq.heappop(heap)
            key = entry[-1]
            if stamp.get(key) == entry[-2]:
                del stamp[key]
                return key
        return None


class _ShadowLru(_Heap):
    def access(self, key: Hashable, offset: int, now: float) -> bool:
        hit = key in self.stamp
        self.push(key, now, -offset)
        return hit


class _ShadowLfu(_Heap):
    __slots__ = ("_count",)

    def __init__(self) -> None:
        super().__init__()
        self._count: dict[Hashable, int] = {}

    def access(self, key: Hashable, offset: int, now: float) -> bool:
        hit = key in self.stamp
        n = self._count.get(key, 0) + 1 if hit else 1
        self._count[key] = n
        self.push(key, n, now, -offset)
        return hit

    def pop(self) -> Hashable | None:
        key = super().pop()
        if key is not None:
            del self._count[key]
        return key

    def discard(self, key: Hashable) -> None:
        super().discard(key)
        self._count.pop(key, None)


class GuardedSaeCache(SaeCache):
    """``SaeCache`` whose eviction order falls back to LRU or LFU where they win."""

    def __init__(self, config: SaeConfig | None = None, guard: GuardConfig | None = None):
        super().__init__(config)
        g = self.guard = guard if guard is not None else GuardConfig()
        if g.sample < 1 or g.window < 1:
            raise ValueError("guard sample and window must be positive")
        self.mode = Mode.SAE
        self.switches = 0
        self.capacity = 0
        self._salt = (g.seed * _GOLDEN + 0x5AEC) & _MASK
        self._order: list[tuple] = []  # LRU or LFU entries (..., seq, block), lazy deletion
        self._count: dict[Hashable, int] = {}
        shadow_cfg = replace(self.cfg, ghost_capacity=max(1, self.cfg.ghost_capacity // g.sample))
        self._sae = SaeCache(shadow_cfg)
        self._slru = _ShadowLru()
        self._slfu = _ShadowLfu()
        self._scap = 0
        self._window = [0.0, 0.0, 0.0]
        self.scores = [0.0, 0.0, 0.0]
        self._sampled_n = 0
        self._norm = 0.0
        self.sample = 1  # every key until the capacity is known

    # -- what the caller reports ------------------------------------------------------

    def begin_request(
        self, session: Hashable, now: float, hint: SessionClass = SessionClass.UNKNOWN
    ) -> SessionClass:
        self._sae.begin_request(session, now, hint)
        return super().begin_request(session, now, hint)

    def insert(
        self,
        key: Hashable,
        parent: Hashable | None,
        *,
        ttype: TokenType,
        offset: int,
        now: float,
        session: Hashable = None,
        pinned: bool = True,
        queue: Queue | None = None,
    ) -> None:
        known = key in self._blocks
        super().insert(
            key,
            parent,
            ttype=ttype,
            offset=offset,
            now=now,
            session=session,
            pinned=pinned,
            queue=queue,
        )
        if not known:
            self._count[key] = 1
            self._shadow(key, parent, int(ttype), offset, now, session)

    def hit(
        self, key: Hashable, *, now: float, session: Hashable = None, pinned: bool = True
    ) -> bool:
        b = self._blocks.get(key)
        if b is None:
            return False
        self._count[key] += 1
        self._shadow(key, None, b.ttype, b.offset, now, session)
        return super().hit(key, now=now, session=session, pinned=pinned)

    def remove(self, key: Hashable) -> bool:
        self._saw_full()
        return super().remove(key)

    def evict(self, now: float) -> Hashable | None:
        self._saw_full()
        return super().evict(now)

    def clear(self) -> None:
        super().clear()
        self._order.clear()
        self._count.clear()

    # -- shadows ----------------------------------------------------------------------

    def _sampled(self, key: Hashable) -> bool:
        n = self.sample
        if n == 1:
            return True
        return ((((hash(key) ^ self._salt) * _GOLDEN) & _MASK) >> 48) * n < (1 << 16)

    def _saw_full(self) -> None:
        n = len(self._blocks)
        if n <= self.capacity:
            return
        first = self.capacity == 0
        self.capacity = n
        if first:
            g = self.guard
            self.sample = max(1, min(g.sample, n // max(1, g.min_shadow)))
            if self.sample > 1:
                self._thin()
        self._scap = max(1, round(n / self.sample))

    def _thin(self) -> None:
        """Drop the keys the sample no longer keeps from the shadows (once, at the first
        eviction: until then they held every key)."""
        sae = self._sae
        for key in [k for k in sae._blocks if not self._sampled(k)]:
            sae.remove(key)
        for shadow in (self._slru, self._slfu):
            for key in [k for k in shadow.stamp if not self._sampled(k)]:
                shadow.discard(key)

    def _shadow(
        self,
        key: Hashable,
        parent: Hashable | None,
        ttype: int,
        offset: int,
        now: float,
        session: Hashable,
    ) -> None:
        if not self._sampled(key):
            return
        sae, cap = self._sae, self._scap
        w = self._window
        if key in sae:
            w[0] += 1.0
            sae.hit(key, now=now, session=session, pinned=False)
        else:
            if cap:
                while len(sae) >= cap and sae.evict(now) is not None:
                    pass
            sae.insert(
                key,
                parent if parent in sae else None,
                ttype=ttype,  # type: ignore[arg-type]
                offset=offset,
                now=now,
                session=session,
                pinned=False,
            )
        if self._slru.access(key, offset, now):
            w[1] += 1.0
        if cap:
            while len(self._slru) > cap:
                self._slru.pop()
        if self._slfu.access(key, offset, now):
            w[2] += 1.0
        if cap:
            while len(self._slfu) > cap:
                self._slfu.pop()
        self._sampled_n += 1
        if self._sampled_n >= self.guard.window:
            self._decide()

    def _decide(self) -> None:
        s, w = self.scores, self._window
        for i in range(3):
            s[i] = 0.5 * s[i] + w[i]
        self._norm = 0.5 * self._norm + self._sampled_n
        self._window = [0.0, 0.0, 0.0]
        self._sampled_n = 0
        lead = max(range(3), key=lambda i: (s[i], -i))
        cur = int(self.mode)
        if lead != cur and s[lead] - s[cur] > self.guard.margin * self._norm:
            self.mode = Mode(lead)
            self.switches += 1
            self._rebuild()

    # -- the orders -------------------------------------------------------------------

    def _push(self, b: _Blk) -> None:
        super()._push(b)
        mode = self.mode
        if mode == Mode.SAE:
            return
        order = self._order
        if len(order) > 2 * len(self._blocks) + 1024:  # stale entries: amortised O(1)
            self._rebuild()
        elif mode == Mode.LRU:
            heapq.heappush(order, (b.last, -b.offset, b.seq, b))
        else:
            heapq.heappush(order, (self._count.get(b.key, 1), b.last, -b.offset, b.seq, b))

    def _rebuild(self) -> None:
        """The current mode's order over every evictable block (on a switch): O(n)."""
        live = [
            e[2]
            for lists in self._heaps
            for heap in lists.values()
            for e in heap
            if e[1] == e[2].seq
        ]
        order: list[tuple] = []
        if self.mode == Mode.LRU:
            order = [(b.last, -b.offset, b.seq, b) for b in live]
        elif self.mode == Mode.LFU:
            count = self._count
            order = [(count.get(b.key, 1), b.last, -b.offset, b.seq, b) for b in live]
        heapq.heapify(order)
        self._order = order

    def _unlink(self, b: _Blk) -> None:
        self._count.pop(b.key, None)
        super()._unlink(b)

    def _victim(self, now: float) -> _Blk | None:
        mode = self.mode
        if mode == Mode.SAE:
            return super()._victim(now)
        heap = self._order
        while heap:
            e = heap[0]
            b = e[-1]
            if e[-2] == b.seq:
                return b
            heapq.heappop(heap)
        return None

    def _rkey(self, b: _Blk, now: float) -> tuple[int, float]:
        if self.mode == Mode.LRU:
            return 0, b.last
        if self.mode == Mode.LFU:
            return self._count.get(b.key, 1), b.last
        return super()._rkey(b, now)
