"""``SaePruningPolicy``: the chain tracker prunes what SAECache ranks lowest.

``listener.chains.ChainTracker`` bounds its memory (``max_tracked_blocks``,
``max_retained_tokens``) by pruning single entries in a ``PruningPolicy``'s order; the
default is LRU. Under a flood of one-off chains LRU prunes the blocks of a shared system
prompt as soon as the flood outlasts the gap between two of its uses, and when a prefix's
last block goes the router loses that prefix (``cache_evicted``) although the engine
still holds it. This policy ranks tracked blocks with SAECache instead:

* **structure** — a block reused after it was added: touched a second time (re-stored, or
  a second chain grew from it: another request shares it; the first touch is usually its
  own chain growing and only refreshes it). Shared system-prompt chains live here; its
  positional decay keeps the shallow blocks (offset = ``start // 16``) longest;
* **evict-first** — a block never reused since it was added (the tracker has not seen
  that anyone needs it).

``UNATTRIBUTED`` blocks (the router can never use them) are pruned before any of these,
oldest first, outside SAECache.

The evict-first queue is not strict here, its weight starts at 1/4 (a block nobody reused
yet is worth a quarter of a reused one of the same age) and is learned like the others:
a stale shared block still goes before a fresh one, so new chains (and the ``PENDING``
blocks waiting for their prefix) are not starved by old reuse. That weight is what keeps
a shared prompt through a flood, so this policy turns queue weights on
(``use_queue_weights=True``) although ``SaeConfig`` leaves them off: the traces that
turned them off measured engine block eviction, not the tracker's two queues.

Every block has token type ``USER`` (the tracker does not know token roles). Time is the
policy's clock (``time.monotonic`` by default, injectable for tests). Blocks are ranked
independently (the tracker keeps no parent links for keyed blocks, and it handles a
pruned block's pending children itself), so a victim always exists while a block is
tracked. Each call is O(1) amortised; ``victim`` is O(L + log n) (see ``policy``).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from listener.chains import TrackedBlock

from .policy import SaeCache, SaeConfig, SaeParams
from .types import Queue, TokenType

__all__ = ["SaePruningPolicy"]

_UNATTRIBUTED = 2  # listener.chains.UNATTRIBUTED (not imported: chains imports policies)
_OFFSET_TOKENS = 16


class _Other:
    """The session of a reuse: never equal to a block's owner, so reuse marks it shared."""

    __slots__ = ()


_REUSE = _Other()


class SaePruningPolicy:
    """SAECache order for ``ChainTracker`` (implements ``listener.chains.PruningPolicy``).

    Args:
        clock: seconds, monotonic; ``time.monotonic`` by default.
        config: SAECache configuration (default: no ghost list, since a pruned block that
            comes back is a new ``TrackedBlock``; evict-first not strict, and queue
            weights on with evict-first's starting at 1/4).
    """

    def __init__(
        self,
        clock: Callable[[], float] = time.monotonic,
        config: SaeConfig | None = None,
    ) -> None:
        if config is None:
            config = SaeConfig(
                ghost_capacity=0,
                window=256,
                strict_evict_first=False,
                use_queue_weights=True,
                # the histogram timings were measured on engine caches (bench/saecache),
                # not on the tracker's flood; the pruning figures are the log-normal's
                use_empirical_timing=False,
                use_structure_wait=False,
                params=SaeParams(queue_weights=[0.25, 1.0, 1.0, 1.0]),
            )
        self._clock = clock
        self._all = SaeCache(config)
        self._holders = SaeCache(config)
        self._useless: OrderedDict[TrackedBlock, None] = OrderedDict()
        self._touches: dict[TrackedBlock, int] = {}

    def _insert(self, cache: SaeCache, block: TrackedBlock, now: float) -> None:
        cache.insert(
            block,
            None,
            ttype=TokenType.USER,
            offset=block.start // _OFFSET_TOKENS,
            now=now,
            session=block,
            pinned=False,
            queue=Queue.EVICT_FIRST,
        )

    def _unattributed(self, block: TrackedBlock) -> None:
        self._all.remove(block)
        self._holders.remove(block)
        self._useless[block] = None

    def added(self, block: TrackedBlock) -> None:
        if block.state == _UNATTRIBUTED:
            self._useless[block] = None
            return
        now = self._clock()
        self._insert(self._all, block, now)
        if block.tokens is not None:
            self._insert(self._holders, block, now)

    def touched(self, block: TrackedBlock) -> None:
        if block in self._useless:
            return
        if block.state == _UNATTRIBUTED:
            self._unattributed(block)
            return
        now = self._clock()
        n = self._touches.get(block, 0) + 1
        self._touches[block] = n
        for cache in (self._all, self._holders):
            if block not in cache:
                continue
            if n == 1:  # its own chain grew (or one re-store): refreshed, not yet shared
                cache.remove(block)
                self._insert(cache, block, now)
            else:  # reused: moves to the structure queue
                cache.hit(block, now=now, session=_REUSE, pinned=False)

    def released(self, block: TrackedBlock) -> None:
        self._holders.remove(block)
        if block.state == _UNATTRIBUTED and block not in self._useless:
            self._unattributed(block)

    def removed(self, block: TrackedBlock) -> None:
        self._touches.pop(block, None)
        self._all.remove(block)
        self._holders.remove(block)
        self._useless.pop(block, None)

    def victim(self, *, holding_tokens: bool = False) -> TrackedBlock | None:
        if holding_tokens:
            return self._holders.victim(self._clock())  # type: ignore[return-value]
        if self._useless:
            return next(iter(self._useless))
        return self._all.victim(self._clock())  # type: ignore[return-value]

    def clear(self) -> None:
        self._all.clear()
        self._holders.clear()
        self._useless.clear()
        self._touches.clear()
