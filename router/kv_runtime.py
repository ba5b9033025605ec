"""Tier 4 inside the router: index, event consumers and scorer, started as one.

Built only when ``prefix_routing.enabled`` and ``kv_cache_index.enabled`` are both true
(the scorer needs prefix keys). ``kv_cache_index`` is restart-only, so this object lives
as long as the process.

This is where the KV index (``router.kvindex``, which knows nothing of where its events
come from) meets ingestion (``router.ingest``, which knows nothing of the index but an
``apply`` callable) and push mode's session registry (built once by the process and handed
in: the opener of every ``transport: event_bus`` source).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable
from typing import Any

from bus.tasks import cancel_and_wait

from .config import RouterConfig
from .config.models import EventSourceConfig
from .eventbus.sessions import SessionRegistry
from .ingest import KvEventConsumerManager, StreamOpener
from .kvindex import IndexStats, apply_event, apply_events, build_kv_index
from .kvindex.scorer import KvOverlapScorer

__all__ = ["KvRuntime", "index_figures"]

log = logging.getLogger("continuum.kvindex")


class KvRuntime:
    def __init__(
        self,
        config: RouterConfig,
        on_decision: Callable[[str, str, float | None], None] | None = None,
        pools: Any = None,
        event_bus: SessionRegistry | None = None,
    ) -> None:
        """
        Args:
            on_decision: ``(decision, tier, score)`` of every scorer decision (metrics).
            pools: the router's one ``RedisPools``: the index shares the response cache's
                pool.
            event_bus: push mode's session registry (None without ``dynamo.event_bus``):
                it opens the streams of ``transport: event_bus`` sources. Built once for
                the process (the bus server registers sessions in the same one); never
                closed here.
        """
        kv = config.kv_cache_index
        self.config = kv
        self.index = build_kv_index(kv, config.response_cache.redis, pools=pools)
        self.kv_aware = 0
        self.fallback = 0
        self.overlap_scores = 0
        self.queries = 0
        self._on_decision = on_decision
        self.scorer = KvOverlapScorer(self.index, kv.scoring, on_decision=self._decision)
        self.event_bus = event_bus
        # ``kv_cache_index`` is restart-only, so the offloading settings are bound once.
        offloading = kv.storage_offloading
        self.consumers = KvEventConsumerManager(
            kv.event_sources,
            functools.partial(apply_event, self.index, offloading=offloading),
            stream_opener_factory=self._stream_opener,
            apply_many=functools.partial(apply_events, self.index, offloading=offloading),
        )
        self._cleanup: asyncio.Task[None] | None = None
        sc = kv.scoring
        log.info(
            "KV scorer: overlap_weight=%g load_weight=%g health_weight=%g "
            "min_overlap_threshold=%g gpu_tier_weight=%g storage_tier_weight=%g",
            sc.overlap_weight,
            sc.load_weight,
            sc.health_weight,
            sc.min_overlap_threshold,
            sc.gpu_tier_weight,
            sc.storage_tier_weight,
        )

    def _stream_opener(self, source: EventSourceConfig) -> StreamOpener | None:
        if source.transport == "event_bus" and self.event_bus is not None:
            return self.event_bus.opener(source.backend_name)
        return None

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.consumers.start()
        self._cleanup = asyncio.get_running_loop().create_task(self._cleanup_loop())

    async def stop(self) -> None:
        await cancel_and_wait(self._cleanup, log=log)
        await self.consumers.stop()
        await self.index.close()

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_interval_ms / 1000)
            try:
                removed = await self.index.cleanup_expired()
                if removed:
                    log.debug("expired %d KV index entries", removed)
                await self.index.stats()  # refreshes index.last_stats, which metrics read
            except Exception:  # the sweep must never die
                log.exception("KV index cleanup failed")

    # -- events and decisions ------------------------------------------------------

    def _decision(self, decision: str, tier: str, score: float | None) -> None:
        self.queries += 1
        if decision == "kv_aware":
            self.kv_aware += 1
            self.overlap_scores += 1
        else:
            self.fallback += 1
        if self._on_decision is not None:
            self._on_decision(decision, tier, score)

    # -- what admin, gRPC and metrics read ---------------------------------------

    def consumer_stats(self) -> dict[str, dict[str, Any]]:
        """Every event source's counters (``ConsumerStats`` fields), by backend name."""
        return {
            name: {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
            for name, c in self.consumers.stats().items()
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """Sync view for the Prometheus collector (index figures: the latest ``stats()``,
        refreshed by the sweep and by admin reads)."""
        snap: dict[str, Any] = {
            "consumers": self.consumer_stats(),
            "index": index_figures(self.index.last_stats),
        }
        if self.event_bus is not None:
            snap["event_bus"] = self.event_bus.stats()
        return snap


def index_figures(st: IndexStats | None) -> dict[str, Any]:
    """The index's counts as the admin JSON and the metrics name them."""
    if st is None:
        return {}
    return {
        "prefix_count": st.prefix_count,
        "entry_count": st.entry_count,
        "total_hits": st.total_hits,
        "total_evictions": st.total_evictions,
        "fallback_active": bool(st.fallback_active),
    }
