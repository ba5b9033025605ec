"""Tier 4 inside the router: index, event consumers, scorer and salts, started as one.

Built only when ``prefix_routing.enabled`` and ``kv_cache_index.enabled`` are both true
(the scorer needs prefix keys). ``kv_cache_index`` is restart-only, so this object lives
as long as the process.

This is where the KV index (``router.kvindex``, which knows nothing of where its events
come from) meets ingestion (``router.ingest``, which knows nothing of the index but an
``apply`` callable) and push mode's event bus hub (built once by the process and handed
in: the opener of every ``transport: event_bus`` source).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from bus.salt import encode_salt, load_secret

from .config import RouterConfig
from .config.models import EventSourceConfig
from .ingest import KvEventConsumerManager, StreamOpener
from .kvindex import IndexStats, apply_event, apply_events, build_kv_index
from .kvindex.scorer import KvOverlapScorer

if TYPE_CHECKING:
    from .eventbus.hub import EventBusHub

__all__ = ["KvRuntime"]

log = logging.getLogger("continuum.kvindex")


class KvRuntime:
    def __init__(
        self,
        config: RouterConfig,
        on_decision: Callable[[str, str, float | None], None] | None = None,
        pools: Any = None,
        event_bus: EventBusHub | None = None,
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
        self.salt_secret: bytes | None = None
        if kv.salt_secret_file or kv.salt_secret_env:
            self.salt_secret = load_secret(kv.salt_secret_file, kv.salt_secret_env)
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
        if self._cleanup is not None:
            self._cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._cleanup
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

    def salt_for(self, backend_name: str, backend_type: str, opt_in: bool) -> bool:
        return self.salt_secret is not None and (backend_type == "trtllm" or opt_in)

    def make_salt(self, backend: str, prefix_key: bytes, caller_salt: str | None) -> str:
        assert self.salt_secret is not None
        return encode_salt(self.salt_secret, backend, prefix_key, caller_salt)

    # -- admin ---------------------------------------------------------------------

    async def index_stats(self) -> dict[str, Any]:
        return self._index_dict(await self.index.stats())

    @staticmethod
    def _index_dict(st: IndexStats | None) -> dict[str, Any]:
        if st is None:
            return {}
        return {
            "prefix_count": st.prefix_count,
            "entry_count": st.entry_count,
            "total_hits": st.total_hits,
            "total_evictions": st.total_evictions,
            "fallback_active": bool(st.fallback_active),
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """Sync view for the Prometheus collector (index figures: the latest ``stats()``,
        refreshed by the sweep and by admin reads)."""
        snap: dict[str, Any] = {
            "consumers": self._consumer_stats(),
            "index": self._index_dict(self.index.last_stats),
        }
        if self.event_bus is not None:
            snap["event_bus"] = self.event_bus.stats()
        return snap

    def _consumer_stats(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for name, c in self.consumers.stats().items():
            out[name] = {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
        return out

    @staticmethod
    def _iso(t: Any) -> str | None:
        if t is None:
            return None
        if isinstance(t, dt.datetime):
            return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        if isinstance(t, (int, float)):
            return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        return str(t)

    async def admin_stats(self) -> dict[str, Any]:
        kv = self.config
        index = {k: v for k, v in (await self.index_stats()).items() if k != "fallback_active"}
        return {
            "enabled": True,
            "config": {
                "backend": kv.backend,
                "max_entries": kv.max_entries,
                "entry_ttl_seconds": kv.entry_ttl_seconds,
                "event_sources_count": len(kv.event_sources),
                "scoring": {
                    "overlap_weight": kv.scoring.overlap_weight,
                    "load_weight": kv.scoring.load_weight,
                    "health_weight": kv.scoring.health_weight,
                    "min_overlap_threshold": kv.scoring.min_overlap_threshold,
                },
            },
            "index": index,
            "event_sources": [
                {
                    "backend_name": name,
                    "connected": bool(c.get("connected")),
                    "events_received": c.get("received", 0),
                    "events_dropped": c.get("dropped", 0),
                    "last_event_at": self._iso(c.get("last_event_at")),
                    "reconnect_count": c.get("reconnects", 0),
                }
                for name, c in self._consumer_stats().items()
            ],
            "routing_decisions": {
                "kv_aware": self.kv_aware,
                "fallback": self.fallback,
                "total": self.kv_aware + self.fallback,
            },
            "query_latency_count": self.queries,
            "overlap_score_count": self.overlap_scores,
            **({"event_bus": self.event_bus.stats()} if self.event_bus is not None else {}),
        }

    def admin_backends(self) -> dict[str, Any]:
        return {
            "enabled": True,
            "backends": [
                {
                    "backend_name": name,
                    "connection": {
                        "connected": bool(c.get("connected")),
                        "reconnect_count": c.get("reconnects", 0),
                        "last_event_at": self._iso(c.get("last_event_at")),
                    },
                    "events": {
                        "received": c.get("received", 0),
                        "processed": c.get("processed", 0),
                        "dropped": c.get("dropped", 0),
                        "index_created": c.get("index_created", 0),
                        "index_evicted": c.get("index_evicted", 0),
                    },
                }
                for name, c in self._consumer_stats().items()
            ],
        }

    async def clear(self) -> dict[str, Any]:
        before = (await self.index.stats()).entry_count
        cleared = await self.index.clear()
        await self.index.stats()  # refreshes the metrics' view
        return {"success": True, "entries_before_clear": before, "cleared_entries": cleared}
