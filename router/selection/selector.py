"""Backend selection: the KV scorer seam, then the configured strategy.

Pipeline (reference docs, "Backend 선택 파이프라인"): when a prefix key exists and a
scorer is registered, the scorer may pick a backend (its best composite score above
its threshold); otherwise the configured ``selection_strategy`` decides. The scorer is
registered by Tier 4; Tier 1 runs without one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ..config import RouterConfig
from ..hll import HyperLogLog
from ..kvindex.cost import ChainView, RequestChain
from ..pool import Backend, BackendPool
from .ring import HashRing
from .strategies import (
    STRATEGY_CLASSES,
    ConsistentHash,
    PrefixAwareHash,
    SelectionContext,
    Strategy,
)

__all__ = ["BackendScorer", "ChainScorer", "RoutingCounts", "Selector"]


class BackendScorer(Protocol):
    """Tier 4's hook: return a backend it is confident about, or ``None`` to defer."""

    async def choose(self, prefix_key: bytes, candidates: Sequence[Backend]) -> Backend | None: ...


class ChainScorer(Protocol):
    """Conversation-depth routing's hook (``router.kvindex.cost.ConversationScorer``)."""

    async def assess(self, chain: RequestChain, candidates: Sequence[Backend]) -> ChainView: ...
    def decide(self, view: ChainView, candidates: Sequence[Backend]) -> Backend | None: ...
    async def routed(self, view: ChainView, backend: Backend) -> int: ...


class RoutingCounts:
    """PrefixAwareHash decisions since start, for /admin/prefix-routing/stats."""

    __slots__ = ("fallback", "overflow", "prefix_hash", "unique")

    def __init__(self) -> None:
        self.prefix_hash = 0
        self.overflow = 0
        self.fallback = 0
        self.unique = HyperLogLog()

    @property
    def total(self) -> int:
        return self.prefix_hash + self.overflow + self.fallback


class Selector:
    """Owns the strategy and the ring; rebuilt pieces are swapped, never mutated."""

    def __init__(
        self,
        pool: BackendPool,
        config: RouterConfig,
        on_prefix_decision: Callable[[str, Backend], None] | None = None,
    ) -> None:
        self.pool = pool
        self.counts = RoutingCounts()
        self.scorer: BackendScorer | None = None
        self.conversation: ChainScorer | None = None
        """Runs first for a request with a prompt chain (registered by Tier 4)."""
        self._on_prefix_decision = on_prefix_decision
        self._ring: HashRing | None = None
        self._ring_key: tuple[tuple[str, ...], int] | None = None
        self.strategy: Strategy
        self.configure(config)
        pool.on_change(self._membership_changed)

    def configure(self, config: RouterConfig) -> None:
        """Apply (re)loaded selection settings; the ring is rebuilt only if it changed."""
        self.config = config
        self._rebuild_ring()
        name = config.selection_strategy
        cls = STRATEGY_CLASSES[name]
        current = getattr(self, "strategy", None)
        if name == "PrefixAwareHash":
            self.strategy = PrefixAwareHash(
                self.ring, config.prefix_routing.load_factor_epsilon, self._record
            )
        elif name == "ConsistentHash":
            self.strategy = ConsistentHash(self.ring)
        elif current is None or current.name != name:
            self.strategy = cls()

    def _membership_changed(self) -> None:
        ring = self._rebuild_ring()
        if ring and isinstance(self.strategy, (PrefixAwareHash, ConsistentHash)):
            self.strategy.ring = self._ring  # type: ignore[assignment]

    def _rebuild_ring(self) -> bool:
        members = [b for b in self.pool.backends if b.config.enabled and not b.config.internal]
        vnodes = self.config.prefix_routing.virtual_nodes
        key = (tuple(b.name for b in members), vnodes)
        if key == self._ring_key and self._ring is not None:
            return False
        self._ring = HashRing(members, vnodes)
        self._ring_key = key
        return True

    @property
    def ring(self) -> HashRing:
        assert self._ring is not None
        return self._ring

    def _record(self, decision: str, backend: Backend, ctx: SelectionContext) -> None:
        counts = self.counts
        if decision == "prefix_hash":
            counts.prefix_hash += 1
        elif decision == "overflow":
            counts.overflow += 1
        else:
            counts.fallback += 1
        if ctx.prefix_key is not None:
            counts.unique.add_digest(ctx.prefix_key)
        if self._on_prefix_decision is not None:
            self._on_prefix_decision(decision, backend)

    async def select(
        self, candidates: Sequence[Backend], mask: int, ctx: SelectionContext
    ) -> Backend:
        conversation = self.conversation
        if conversation is not None and ctx.chain is not None:
            return await self._select_by_chain(conversation, candidates, mask, ctx)
        if len(candidates) == 1 and not isinstance(self.strategy, PrefixAwareHash):
            return candidates[0]
        if self.scorer is not None and ctx.prefix_key is not None:
            chosen = await self.scorer.choose(ctx.prefix_key, candidates)
            if chosen is not None:
                return chosen
        return self.strategy.select(candidates, mask, ctx)

    async def _select_by_chain(
        self,
        conversation: ChainScorer,
        candidates: Sequence[Backend],
        mask: int,
        ctx: SelectionContext,
    ) -> Backend:
        """The lowest-cost backend for the chain; the strategy when nobody holds any of it
        (not the prefix scorer: the chain knows more than the prefix).
        Either way the chosen backend is recorded as holding the chain (predict on route),
        so the next request of the conversation follows it before its events arrive."""
        assert ctx.chain is not None
        view = ctx.view = await conversation.assess(ctx.chain, candidates)
        chosen = conversation.decide(view, candidates)
        if chosen is None:
            chosen = (
                candidates[0]
                if len(candidates) == 1
                else self.strategy.select(candidates, mask, ctx)
            )
        await conversation.routed(view, chosen)
        return chosen
