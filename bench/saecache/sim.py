"""Block-level prefix-cache simulator and the policies it compares.

The cache holds at most ``capacity`` blocks of 16 tokens, hash-chained as in vLLM. A
request looks up its prompt's longest cached block prefix (at most ``(n - 1) // 16``
blocks count as hits: the last prompt token is always recomputed), pins those blocks,
computes and inserts the rest (evicting as needed; when every cached block is in use the
remaining blocks are computed but not cached), then inserts the blocks its output
completes, and releases everything tail first. Blocks in use are never evicted.

Policies (all see the same calls):

* ``lru`` — vLLM's free-block queue: a released block goes to the tail, tail block of a
  request first, so a request's deeper blocks leave before its shared root; the head is
  evicted. A hit takes a block out of the queue.
* ``lfu`` — fewest accesses first (ties: least recent), among evictable leaves.
* ``min`` — Belady's MIN: the block whose next access is furthest away (ties: deeper
  first), among evictable leaves. Needs the trace's future, precomputed by ``next_uses``.
* ``sae`` — :class:`listener.saecache.SaeCache`.
* ``guard`` — :class:`listener.saecache.guard.GuardedSaeCache` (SAECache that follows
  LRU or LFU where its sampled shadows say they do better).

**Modelled TTFT** (Qwen2.5-1.5B-class prefill on one A40-class GPU):
``ttft = 20 ms + uncached tokens / 12000 tok/s + cached tokens * 1 µs`` — prefill time
proportional to the uncached tokens, plus a fixed scheduling/sampling cost and a small
cost for attending over cached context. No queueing is modelled.
"""

from __future__ import annotations

import heapq
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from listener.saecache import SaeCache, SaeConfig, SessionClass
from listener.saecache.classify import classify
from listener.saecache.guard import GuardConfig, GuardedSaeCache

from .trace import BLOCK, Request

__all__ = [
    "HINTS",
    "TRUE_CLASS",
    "TTFT_BASE_S",
    "TTFT_CACHED_S",
    "TTFT_PER_TOKEN_S",
    "LfuPolicy",
    "LruPolicy",
    "MinPolicy",
    "Result",
    "SaePolicy",
    "next_uses",
    "replay",
]

TTFT_BASE_S = 0.020
TTFT_PER_TOKEN_S = 1.0 / 12000.0
TTFT_CACHED_S = 1e-6
_INF = float("inf")


@dataclass(slots=True)
class Result:
    policy: str
    capacity: int
    prompt_tokens: int = 0
    hit_tokens: int = 0
    ttft_sum: float = 0.0
    requests: int = 0
    accesses: int = 0
    evictions: int = 0
    seconds: float = 0.0
    evict_seconds: float = 0.0
    max_cached: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def ttft_ms(self) -> float:
        return 1000.0 * self.ttft_sum / self.requests if self.requests else 0.0

    @property
    def us_per_access(self) -> float:
        return 1e6 * self.seconds / self.accesses if self.accesses else 0.0

    @property
    def us_per_eviction(self) -> float:
        return 1e6 * self.evict_seconds / self.evictions if self.evictions else 0.0


class _Policy:
    """What the simulator calls; ``ctx`` is the request and the block index."""

    name = "base"

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def begin(self, req: Request, i: int) -> None:
        """A request starts (``i``: its index in the trace)."""

    def hit(self, key: int, req: Request, j: int) -> None: ...
    def insert(self, key: int, parent: int | None, req: Request, j: int) -> None: ...
    def release(self, key: int) -> None: ...
    def evict(self, now: float) -> Hashable | None: ...


class LruPolicy(_Policy):
    name = "lru"

    def __init__(self) -> None:
        self._cached: dict[int, int] = {}  # key -> refs
        self._free: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._cached

    def hit(self, key: int, req: Request, j: int) -> None:
        self._cached[key] += 1
        self._free.pop(key, None)

    def insert(self, key: int, parent: int | None, req: Request, j: int) -> None:
        self._cached[key] = 1

    def release(self, key: int) -> None:
        refs = self._cached[key] - 1
        self._cached[key] = refs
        if refs == 0:
            self._free[key] = None

    def evict(self, now: float) -> Hashable | None:
        if not self._free:
            return None
        key, _ = self._free.popitem(last=False)
        del self._cached[key]
        return key


class _LeafHeap(_Policy):
    """Evictable leaves in a lazy heap keyed by ``_key``; children counted per block."""

    def __init__(self) -> None:
        # key -> [refs, children, parent, seq, score...]
        self._b: dict[int, list] = {}
        self._heap: list[tuple] = []
        self._seq = 0

    def __len__(self) -> int:
        return len(self._b)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._b

    def _score(self, rec: list) -> tuple:
        raise NotImplementedError

    def _touch(self, rec: list, req: Request, j: int) -> None: ...

    def hit(self, key: int, req: Request, j: int) -> None:
        rec = self._b[key]
        rec[0] += 1
        rec[3] = 0
        self._touch(rec, req, j)

    def insert(self, key: int, parent: int | None, req: Request, j: int) -> None:
        rec = [1, 0, parent, 0, 0, 0.0, 0]
        self._b[key] = rec
        if parent is not None:
            p = self._b.get(parent)
            if p is not None:
                p[1] += 1
                p[3] = 0
        self._touch(rec, req, j)

    def release(self, key: int) -> None:
        rec = self._b[key]
        rec[0] -= 1
        if rec[0] == 0 and rec[1] == 0:
            self._push(key, rec)

    def _push(self, key: int, rec: list) -> None:
        self._seq += 1
        rec[3] = self._seq
        heapq.heappush(self._heap, (*self._score(rec), self._seq, key))

    def evict(self, now: float) -> Hashable | None:
        heap, b = self._heap, self._b
        while heap:
            entry = heapq.heappop(heap)
            key = entry[-1]
            rec = b.get(key)
            if rec is None or rec[3] != entry[-2]:
                continue
            del b[key]
            parent = rec[2]
            if parent is not None:
                p = b.get(parent)
                if p is not None:
                    p[1] -= 1
                    if p[1] == 0 and p[0] == 0:
                        self._push(parent, p)
            return key
        return None


class LfuPolicy(_LeafHeap):
    name = "lfu"

    def _touch(self, rec: list, req: Request, j: int) -> None:
        rec[4] += 1
        rec[5] = req.t

    def _score(self, rec: list) -> tuple:
        return (rec[4], rec[5])


class MinPolicy(_LeafHeap):
    """Belady's MIN; ``uses[i][j]`` is the next request index touching block j of request i."""

    name = "min"

    def __init__(self, uses: list[list[float]]) -> None:
        super().__init__()
        self._uses = uses
        self._i = 0

    def begin(self, req: Request, i: int) -> None:
        self._i = i

    def _touch(self, rec: list, req: Request, j: int) -> None:
        rec[5] = -self._uses[self._i][j]
        rec[6] = -j

    def _score(self, rec: list) -> tuple:
        return (rec[5], rec[6])


TRUE_CLASS: dict[str, SessionClass] = {
    "chat": SessionClass.CHAT,
    "reasoning": SessionClass.CHAT,
    "agent": SessionClass.AGENT,
    "single": SessionClass.SINGLE,
}
"""The session class each trace kind really is."""
HINTS = ("tools", "true", "derived", "none")


class SaePolicy(_Policy):
    """SAECache in the simulator.

    ``hint`` is what the cache is told at a request's start: ``tools`` (the default) the
    agent class when the request declares tools, else nothing; ``true`` the session's
    real class (``TRUE_CLASS``); ``derived`` the class
    ``listener.saecache.classify.classify`` derives from the request's engine-visible
    features; ``none`` nothing. ``predictor`` (first requests told nothing) still applies.
    """

    name = "sae"

    def __init__(
        self,
        config: SaeConfig | None = None,
        predictor: Callable[[Request], SessionClass] | None = None,
        *,
        guarded: bool = False,
        guard: GuardConfig | None = None,
        hint: str = "tools",
    ) -> None:
        if hint not in HINTS:
            raise ValueError(f"hint must be one of {', '.join(HINTS)}")
        self._hint = hint
        self.cache = (
            GuardedSaeCache(config, guard) if guarded or guard is not None else SaeCache(config)
        )
        if guarded or guard is not None:
            self.name = "guard"
        self._predict = predictor
        self._t = 0.0

    def __len__(self) -> int:
        return len(self.cache)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.cache

    def begin(self, req: Request, i: int) -> None:
        self._t = req.t
        mode = self._hint
        if mode == "tools":
            hint = SessionClass.AGENT if req.tools else SessionClass.UNKNOWN
        elif mode == "true":
            hint = TRUE_CLASS[req.kind]
        elif mode == "derived":
            hint = classify(req.engine)
        else:
            hint = SessionClass.UNKNOWN
        if req.first and hint == SessionClass.UNKNOWN and self._predict is not None:
            hint = self._predict(req)
        self.cache.begin_request(req.session, req.t, hint)

    def hit(self, key: int, req: Request, j: int) -> None:
        self.cache.hit(key, now=req.t, session=req.session)

    def insert(self, key: int, parent: int | None, req: Request, j: int) -> None:
        self.cache.insert(
            key,
            parent,
            ttype=req.types[j],  # type: ignore[arg-type]
            offset=j,
            now=req.t,
            session=req.session,
        )

    def release(self, key: int) -> None:
        self.cache.release(key)

    def evict(self, now: float) -> Hashable | None:
        return self.cache.evict(now)


def next_uses(trace: Sequence[Request]) -> list[list[float]]:
    """Per request and block, the index of the next request that touches the block."""
    nxt: dict[int, int] = {}
    out: list[list[float]] = [[] for _ in trace]
    for i in range(len(trace) - 1, -1, -1):
        row = []
        for h in trace[i].blocks:
            row.append(nxt.get(h, _INF))
            nxt[h] = i
        out[i] = row
    return out


def replay(
    trace: Sequence[Request],
    policy: _Policy,
    capacity: int,
    *,
    tick: Callable[[], None] | None = None,
) -> Result:
    """Run ``trace`` through a cache of ``capacity`` blocks under ``policy``."""
    if capacity < 1:
        raise ValueError("capacity must be positive")
    res = Result(policy.name, capacity)
    clock = time.perf_counter
    t_start = clock()
    evict_s = 0.0
    for i, req in enumerate(trace):
        policy.begin(req, i)
        blocks = req.blocks
        n_prompt = req.n_prompt
        max_hit = min(n_prompt, (req.prompt_tokens - 1) // BLOCK) if req.prompt_tokens else 0
        held: list[int] = []
        hit_blocks = 0
        parent: int | None = None
        caching = True
        for j, h in enumerate(blocks):
            res.accesses += 1
            if h in policy:
                policy.hit(h, req, j)
                held.append(h)
                if j < max_hit and hit_blocks == j:
                    hit_blocks += 1
            elif caching:
                while len(policy) >= capacity:
                    t0 = clock()
                    victim = policy.evict(req.t)
                    evict_s += clock() - t0
                    if victim is None:
                        caching = False
                        break
                    res.evictions += 1
                if caching:
                    policy.insert(h, parent, req, j)
                    held.append(h)
            parent = h
        if len(policy) > res.max_cached:
            res.max_cached = len(policy)
        for h in reversed(held):
            policy.release(h)
        hit_tok = hit_blocks * BLOCK
        res.prompt_tokens += req.prompt_tokens
        res.hit_tokens += hit_tok
        res.ttft_sum += (
            TTFT_BASE_S + (req.prompt_tokens - hit_tok) * TTFT_PER_TOKEN_S + hit_tok * TTFT_CACHED_S
        )
        res.requests += 1
        if tick is not None and i % 512 == 0:
            tick()
    res.seconds = clock() - t_start
    res.evict_seconds = evict_s
    return res
