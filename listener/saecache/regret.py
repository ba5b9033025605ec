"""SAECache, LRU and LFU as experts, weighted by their regret (LeCaR's scheme).

The safeguard of :mod:`.guard` predicts which policy would do better from shadow caches
of a key sample, then switches the whole cache's order; out of sample it lost more than
it saved (``bench/RESULTS.md``, robustness grid): a switch leaves the cache holding the
old policy's blocks, and the shadows score block hits where requests get prefix hits.
This one learns from the cache's own misses instead, and never switches wholesale:

* Each eviction follows one expert, SAECache (its own order), LRU (least recently used
  evictable block, the deeper first on ties: vLLM's free queue) or LFU (fewest
  accesses, then least recent), drawn with probability ``weights``. When all name the
  same block, there is nothing to learn.
* The block evicted goes into the history of every expert that named it (a ghost list
  of at most ``history`` times the capacity each, oldest out first).
* A miss on a block found in an expert's history is that expert's regret: its weight
  is multiplied by ``exp(-learning_rate * discount ** age)``, ``age`` counted in
  evictions since the block left, ``discount = 0.005 ** (1 / capacity)`` (a regret a
  cache's worth of evictions old counts 0.5 %), and the weights renormalised (with a
  floor, so no expert is ever ruled out).

Where SAECache's structure pays, the others' choices come back as misses and their
weights fall; where it does not, SAECache's do. Every expert sees every block, so the
orders of those not followed are always current: a change of weight takes effect at the
next eviction, with no rebuild.

**Cost.** Per access, what SAECache costs and a counter, plus two heap pushes when a
block becomes evictable (O(log n)); per eviction every expert's victim (SAECache's scan
and two heap tops) and one random draw; per miss three dictionary lookups. Memory: a
counter per block, two heap entries per evictable block, and the three histories
(``history`` x capacity keys each).

Deterministic for a given ``seed``.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from .policy import SaeCache, SaeConfig, _Blk
from .types import Queue, TokenType

__all__ = ["RegretConfig", "RegretSaeCache"]

_SAE, _LRU, _LFU = 0, 1, 2
_EXPERTS = (_SAE, _LRU, _LFU)


@dataclass(frozen=True, slots=True)
class RegretConfig:
    """Tunables of the blend (fixed for every workload)."""

    learning_rate: float = 0.45
    """LeCaR's lambda: how far one regret moves the weights."""
    history: float = 1.0
    """Each expert's ghost list, as a multiple of the cache's capacity."""
    floor: float = 0.01
    """The least weight an expert keeps."""
    seed: int = 0
    """Seed of the draws."""


class RegretSaeCache(SaeCache):
    """``SaeCache`` whose evictions follow SAECache, LRU or LFU, weighted by regret."""

    def __init__(self, config: SaeConfig | None = None, regret: RegretConfig | None = None):
        super().__init__(config)
        r = self.regret = regret if regret is not None else RegretConfig()
        if r.learning_rate <= 0 or r.history <= 0 or not 0 <= r.floor < 1 / 3:
            raise ValueError(
                "regret: learning_rate and history must be positive, floor in [0, 1/3)"
            )
        self.weights = [1 / 3, 1 / 3, 1 / 3]
        """SAECache's, LRU's and LFU's shares of the evictions where they disagree."""
        self.capacity = 0
        """The most blocks held when an eviction was asked for (the caller's capacity)."""
        self.followed = [0, 0, 0]
        """Evictions where the experts disagreed, by the one followed."""
        self.regrets = [0, 0, 0]
        """Misses on a block an expert had named for eviction, by expert."""
        self._lru: list[tuple[float, int, int, _Blk]] = []
        self._lfu: list[tuple[int, float, int, int, _Blk]] = []
        self._count: dict[Hashable, int] = {}
        self._hist: tuple[OrderedDict[Hashable, int], ...] = tuple(OrderedDict() for _ in _EXPERTS)
        self._clock = 0
        self._named: tuple[int, ...] = ()
        self._chosen = -1
        self._discount = 1.0
        self._rng = random.Random(r.seed)

    # -- what the caller reports ------------------------------------------------------

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
        if key not in self._blocks:
            self._learn(key)
            self._count[key] = 0  # the hit or insert below counts it
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
        if key in self._blocks and self._count.get(key) == 0:
            self._count[key] = 1

    def hit(
        self, key: Hashable, *, now: float, session: Hashable = None, pinned: bool = True
    ) -> bool:
        if key in self._blocks:
            self._count[key] = self._count.get(key, 0) + 1
        return super().hit(key, now=now, session=session, pinned=pinned)

    def evict(self, now: float) -> Hashable | None:
        self._saw(len(self._blocks))
        key = super().evict(now)
        if key is not None:
            self._clock += 1
            if self._chosen >= 0:
                self.followed[self._chosen] += 1
                cap = max(1, int(self.regret.history * self.capacity))
                for expert in self._named:
                    hist = self._hist[expert]
                    hist[key] = self._clock
                    if len(hist) > cap:
                        hist.popitem(last=False)
        return key

    def remove(self, key: Hashable) -> bool:
        self._saw(len(self._blocks))
        return super().remove(key)

    def clear(self) -> None:
        super().clear()
        self._lru.clear()
        self._lfu.clear()
        self._count.clear()
        for h in self._hist:
            h.clear()

    # -- learning ---------------------------------------------------------------------

    def _saw(self, n: int) -> None:
        if n > self.capacity:
            self.capacity = n
            self._discount = 0.005 ** (1.0 / n)

    def _learn(self, key: Hashable) -> None:
        """A miss: every expert that named ``key`` for eviction loses weight."""
        w = self.weights
        hit = False
        for expert in _EXPERTS:
            left = self._hist[expert].pop(key, None)
            if left is None:
                continue
            hit = True
            self.regrets[expert] += 1
            w[expert] *= math.exp(
                -self.regret.learning_rate * self._discount ** (self._clock - left)
            )
        if hit:
            total = w[0] + w[1] + w[2]
            low = self.regret.floor
            for i in _EXPERTS:
                w[i] = max(low, w[i] / total)
            total = w[0] + w[1] + w[2]
            for i in _EXPERTS:
                w[i] /= total

    # -- the orders -------------------------------------------------------------------

    def _push(self, b: _Blk) -> None:
        super()._push(b)
        lru, lfu = self._lru, self._lfu
        if len(lru) > 2 * len(self._blocks) + 1024:  # stale entries: amortised O(1)
            self._lru = lru = [e for e in lru if e[2] == e[3].seq]
            heapq.heapify(lru)
            self._lfu = lfu = [e for e in lfu if e[3] == e[4].seq]
            heapq.heapify(lfu)
        heapq.heappush(lru, (b.last, -b.offset, b.seq, b))
        heapq.heappush(lfu, (self._count.get(b.key, 1), b.last, -b.offset, b.seq, b))

    def _unlink(self, b: _Blk) -> None:
        self._count.pop(b.key, None)
        super()._unlink(b)

    @staticmethod
    def _top(heap: list) -> _Blk | None:  # type: ignore[type-arg]
        while heap:
            e = heap[0]
            b: _Blk = e[-1]
            if e[-2] == b.seq:
                return b
            heapq.heappop(heap)
        return None

    def _victim(self, now: float) -> _Blk | None:
        named = (super()._victim(now), self._top(self._lru), self._top(self._lfu))
        self._chosen = -1
        if named[0] is None or named[1] is None or named[2] is None:
            return next((b for b in named if b is not None), None)
        if named[0] is named[1] is named[2]:
            return named[0]
        x = self._rng.random()
        w = self.weights
        pick = _SAE if x < w[0] else _LRU if x < w[0] + w[1] else _LFU
        chosen = named[pick]
        self._chosen = pick
        self._named = tuple(e for e in _EXPERTS if named[e] is chosen)
        return chosen

    def _rkey(self, b: _Blk, now: float) -> tuple[int, float]:
        lead = max(_EXPERTS, key=lambda e: self.weights[e])
        if lead == _LRU:
            return 0, b.last
        if lead == _LFU:
            return self._count.get(b.key, 1), b.last
        return super()._rkey(b, now)
