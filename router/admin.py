"""``/admin/*``: every admin route and its JSON document, in one place.

Documents are shaped exactly as the reference documentation shows them (field names,
string-formatted rates). Every ``/admin`` path, known or not, is behind the admin token
(:meth:`AdminApi.authorize`, checked by the dispatcher before routing). A feature that is
off answers its stats route with ``{"enabled": false}`` (the Gemini context cache: its
whole document with zero counts) and its mutating routes with 409, except the Gemini
clear, which answers the reference's ``{"success": false, "error": ...}``.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Awaitable, Callable, Mapping
from typing import Any

import orjson

from .admin_auth import AdminToken
from .cache.service import ResponseCacheService
from .config import RouterConfig
from .conversation import ConversationKeys
from .errors import openai_error
from .gemini import GeminiService
from .gemini.manager import Counters
from .http.types import Request, Response
from .kv_runtime import KvRuntime, index_figures
from .pool import BackendPool
from .selection import RoutingCounts

__all__ = ["AdminApi"]

_JSON_HEADERS = [("content-type", "application/json")]

Route = Callable[[Request], Awaitable[Response]]


def _json(doc: Mapping[str, Any]) -> Response:
    return Response(200, orjson.dumps(doc), list(_JSON_HEADERS))


def _disabled() -> Response:
    return _json({"enabled": False})


def _iso(t: Any) -> str | None:
    """``2026-01-01T00:00:00Z`` from a datetime or Unix seconds."""
    if t is None:
        return None
    if isinstance(t, dt.datetime):
        return t.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    if isinstance(t, (int, float)):
        return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return str(t)


class AdminApi:
    """The admin routes over the parts they report on.

    Args:
        config: the running config, read per request.
        token: the admin bearer token.
        pool: backends and their in-flight counts.
        counts: PrefixAwareHash's decisions (``Selector.counts``).
        cache: the response cache service, once built (``Router.apply_config`` sets it
            when a reload turns the cache on).
        kv: Tier 4, when enabled.
        gemini: the Gemini service, when configured.
        conversation: the prompt-chain renderer of conversation-depth routing, when on.
    """

    def __init__(
        self,
        *,
        config: Callable[[], RouterConfig],
        token: AdminToken,
        pool: BackendPool,
        counts: RoutingCounts,
        cache: ResponseCacheService | None = None,
        kv: KvRuntime | None = None,
        gemini: GeminiService | None = None,
        conversation: ConversationKeys | None = None,
    ) -> None:
        self._config = config
        self._token = token
        self._pool = pool
        self._counts = counts
        self.cache = cache
        self._kv = kv
        self._gemini = gemini
        self._conversation = conversation

    def routes(self) -> dict[tuple[str, str], Route]:
        return {
            ("GET", "/admin/backends"): self.backends,
            ("GET", "/admin/prefix-routing/stats"): self.prefix_routing_stats,
            ("GET", "/admin/kv-index/stats"): self.kv_stats,
            ("GET", "/admin/kv-index/backends"): self.kv_backends,
            ("POST", "/admin/kv-index/clear"): self.kv_clear,
            ("GET", "/admin/response-cache/stats"): self.cache_stats,
            ("POST", "/admin/response-cache/invalidate"): self.cache_invalidate,
            ("GET", "/admin/gemini-context-cache/stats"): self.gemini_stats,
            ("POST", "/admin/gemini-context-cache/clear"): self.gemini_clear,
        }

    def authorize(self, req: Request) -> Response | None:
        """None when the request may proceed, else the 401 to answer with."""
        if self._token.allows(req.headers.get("authorization")):
            return None
        return openai_error(
            401,
            "admin endpoints require 'Authorization: Bearer <admin token>'",
            "authentication_error",
            "unauthorized",
            headers=[("www-authenticate", "Bearer")],
        )

    # -- backends ------------------------------------------------------------------

    async def backends(self, req: Request) -> Response:
        """Every configured backend's health state, for an operator asking why one gets
        no traffic; ``retry_in_ms`` counts down an ejection's cool-down (null otherwise)."""
        pool = self._pool
        pool.refresh()
        now = pool.now()
        return _json(
            {
                "backends": [
                    {
                        "name": b.name,
                        "type": b.type,
                        "enabled": b.config.enabled,
                        "state": b.state,
                        "consecutive_failures": b.consecutive_failures,
                        "retry_in_ms": (
                            max(0, round((b.retry_at - now) * 1000))
                            if b.retry_at is not None
                            else None
                        ),
                        "active_probe": pool.has_probe(b),
                        "in_flight_requests": b.in_flight,
                        "success_rate": f"{b.success_rate:.4f}",
                    }
                    for b in pool.backends
                ]
            }
        )

    # -- Tier 1 --------------------------------------------------------------------

    async def prefix_routing_stats(self, req: Request) -> Response:
        """``overflow_rate`` is a string with 4 decimals."""
        pr = self._config().prefix_routing
        counts = self._counts
        total = counts.total
        return _json(
            {
                "enabled": pr.enabled,
                "config": {
                    "max_prefix_length": pr.max_prefix_length,
                    "load_factor_epsilon": pr.load_factor_epsilon,
                    "virtual_nodes": pr.virtual_nodes,
                    "anthropic_cache_control_injection": pr.anthropic_cache_control_injection,
                },
                "routing_decisions": {
                    "total": total,
                    "prefix_hash": counts.prefix_hash,
                    "overflow": counts.overflow,
                    "fallback": counts.fallback,
                    "overflow_rate": f"{(counts.overflow / total) if total else 0.0:.4f}",
                },
                "backend_distribution": [
                    {"backend": b.name, "in_flight_requests": b.in_flight}
                    for b in self._pool.backends
                ],
                "unique_prefixes": counts.unique.count(),
            }
        )

    # -- Tier 4 --------------------------------------------------------------------

    async def kv_stats(self, req: Request) -> Response:
        """Tier 4's document; ``prediction_accuracy`` (per backend: predicted and reported
        cached tokens, their mean absolute error and ``accuracy``, see
        ``router.kvindex.accuracy``) and, with conversation routing on, ``conversation``
        (its config, the chain index's counts, the cost scorer's decisions and
        predictions, the cached-token sums over all backends) come after the reference's
        fields."""
        kv = self._kv
        if kv is None:
            return _disabled()
        cfg = kv.config
        index = index_figures(await kv.index.stats())
        index.pop("fallback_active", None)
        index.pop("fallback_count", None)
        doc: dict[str, Any] = {
            "enabled": True,
            "config": {
                "backend": cfg.backend,
                "max_entries": cfg.max_entries,
                "entry_ttl_seconds": cfg.entry_ttl_seconds,
                "event_sources_count": len(cfg.event_sources),
                "scoring": {
                    "overlap_weight": cfg.scoring.overlap_weight,
                    "load_weight": cfg.scoring.load_weight,
                    "health_weight": cfg.scoring.health_weight,
                    "min_overlap_threshold": cfg.scoring.min_overlap_threshold,
                },
            },
            "index": index,
            "event_sources": [
                {
                    "backend_name": name,
                    "connected": bool(c.get("connected")),
                    "events_received": c.get("received", 0),
                    "events_dropped": c.get("dropped", 0),
                    "last_event_at": _iso(c.get("last_event_at")),
                    "reconnect_count": c.get("reconnects", 0),
                }
                for name, c in kv.consumer_stats().items()
            ],
            "routing_decisions": {
                "kv_aware": kv.kv_aware,
                "fallback": kv.fallback,
                "total": kv.kv_aware + kv.fallback,
            },
            "query_latency_count": kv.queries,
            "overlap_score_count": kv.overlap_scores,
        }
        if kv.event_bus is not None:
            doc["event_bus"] = kv.event_bus.stats()
        if kv.anti_entropy is not None:
            doc["anti_entropy"] = {
                "interval_seconds": cfg.anti_entropy.interval_seconds,
                "repair": cfg.anti_entropy.repair,
                "backends": kv.anti_entropy.document(),
            }
        doc["prediction_accuracy"] = kv.accuracy.document()
        scorer, chains = kv.conversation, kv.chain_index
        if scorer is not None and chains is not None:
            conv = cfg.conversation
            st = await chains.stats()
            decisions = dict(scorer.decisions)
            total = kv.accuracy.total()
            doc["conversation"] = {
                "enabled": True,
                "config": {
                    "chunk_bytes": conv.chunk_bytes,
                    "max_entries": conv.max_entries,
                    "predict_ttl_seconds": scorer.predict_ttl,
                    "templates_count": len(conv.templates),
                    "scoring": conv.scoring.model_dump(),
                },
                "index": {
                    "key_count": st.prefix_count,
                    "entry_count": st.entry_count,
                    "total_hits": st.total_hits,
                    "total_evictions": st.total_evictions,
                    "queries": chains.queries,
                },
                "routing_decisions": {
                    **decisions,
                    "total": sum(decisions.values()),
                    # every deepest holder at the load cap: one holding less chosen
                    "capped": scorer.capped,
                },
                "predictions": {
                    "keys_written": scorer.predicted_keys,
                    "write_errors": scorer.prediction_errors,
                },
                # prompts worth only their shared prefix stay on their home engine
                "prompts": scorer.prompt_kinds(),
                "cached_tokens": {
                    "requests": total.requests,
                    "predicted_tokens": total.predicted_tokens,
                    "reported_tokens": total.reported_tokens,
                    "accuracy": f"{total.accuracy:.4f}",
                },
                "in_flight_prefill_tokens": kv.prefill_load.snapshot(),
            }
            if self._conversation is not None:
                doc["conversation"]["rendering"] = self._conversation.stats()
        return _json(doc)

    async def kv_backends(self, req: Request) -> Response:
        kv = self._kv
        if kv is None:
            return _disabled()
        backends = [
            {
                "backend_name": name,
                "connection": {
                    "connected": bool(c.get("connected")),
                    "reconnect_count": c.get("reconnects", 0),
                    "last_event_at": _iso(c.get("last_event_at")),
                },
                "events": {
                    "received": c.get("received", 0),
                    "processed": c.get("processed", 0),
                    "dropped": c.get("dropped", 0),
                    "index_created": c.get("index_created", 0),
                    "index_evicted": c.get("index_evicted", 0),
                    "resyncs": c.get("resyncs", 0),
                    "stream_overflows": c.get("stream_overflows", 0),
                    "resync_losses": c.get("resync_losses", 0),
                },
                "view_incomplete": bool(c.get("view_incomplete")),
            }
            for name, c in kv.consumer_stats().items()
        ]
        return _json({"enabled": True, "backends": backends})

    async def kv_clear(self, req: Request) -> Response:
        kv = self._kv
        if kv is None:
            return openai_error(409, "the KV cache index is not enabled", code="kv_index_disabled")
        before = (await kv.index.stats()).entry_count
        cleared = await kv.index.clear()
        await kv.index.stats()  # refreshes the metrics' view
        doc: dict[str, Any] = {
            "success": True,
            "entries_before_clear": before,
            "cleared_entries": cleared,
        }
        if kv.chain_index is not None:
            doc["cleared_chain_entries"] = await kv.chain_index.clear()
            await kv.chain_index.stats()
        return _json(doc)

    # -- Tiers 2 and 3 -------------------------------------------------------------

    async def cache_stats(self, req: Request) -> Response:
        cache = self.cache
        if cache is None:
            return _disabled()
        cfg = cache.config
        st = await cache.store.stats()
        hits, misses, skips = cache.hits, cache.misses, cache.skips
        looked = hits + misses
        doc: dict[str, Any] = {
            "enabled": cfg.enabled,
            "backend_type": cfg.backend,
            "entries": getattr(st, "entries", 0) or 0,
            "capacity": cfg.capacity,
            "requests": {"hit": hits, "miss": misses, "skip": skips, "total": looked + skips},
            "hit_rate": f"{(hits / looked) if looked else 0.0:.4f}",
            "evictions": getattr(st, "evictions", 0),
            "size_bytes": getattr(st, "size_bytes", 0) or 0,
            "config": {
                "backend": cfg.backend,
                "ttl": cfg.ttl,
                "capacity": cfg.capacity,
                "max_response_size": cfg.max_response_size,
                "max_stream_buffer_size": cfg.max_stream_buffer_size,
            },
        }
        if cfg.backend == "redis":
            errors = getattr(st, "errors_by_kind", None) or {}
            doc["redis"] = {
                "connections": getattr(st, "connections", {"active": 0, "idle": 0}),
                "fallback_active": bool(getattr(st, "fallback_active", False)),
                "fallback_count": getattr(st, "fallback_count", 0),
                "errors": {
                    "connection": errors.get("connection", 0),
                    "timeout": errors.get("timeout", 0),
                    "other": errors.get("other", 0),
                },
            }
        return _json(doc)

    async def cache_invalidate(self, req: Request) -> Response:
        """``{"clear_all": true}`` or ``{"key": "<64 hex>"}``."""
        cache = self.cache
        if cache is None:
            return openai_error(409, "the response cache is not enabled", code="cache_disabled")
        try:
            body = orjson.loads(req.body)
        except orjson.JSONDecodeError as exc:
            return openai_error(400, f"request body is not valid JSON: {exc}", code="invalid_json")
        if not isinstance(body, dict):
            return openai_error(400, "request body must be a JSON object", code="invalid_json")
        if body.get("clear_all") is True:
            cleared = await cache.clear()
            return _json({"success": True, "action": "clear_all", "cleared_entries": cleared})
        key = body.get("key")
        if isinstance(key, str) and len(key) == 64:
            removed = await cache.delete(key.lower())
            return _json({"success": True, "action": "key", "cleared_entries": int(removed)})
        return openai_error(400, 'expected {"clear_all": true} or {"key": "<64 hex cache key>"}')

    # -- Gemini --------------------------------------------------------------------

    async def gemini_stats(self, req: Request) -> Response:
        """The same shape whether the context cache is enabled or not."""
        cache = self._gemini.cache if self._gemini is not None else None
        if cache is not None:
            return _json(cache.stats())
        return _json(
            {
                "enabled": False,
                "config": self._config().gemini_context_cache.model_dump(),
                "entries": 0,
                "negative_entries": 0,
                "in_flight": 0,
                "backends": {},
                "counters": Counters().as_dict(),
            }
        )

    async def gemini_clear(self, req: Request) -> Response:
        cache = self._gemini.cache if self._gemini is not None else None
        if cache is None:
            return _json({"success": False, "error": "Gemini context cache is not enabled"})
        return _json({"success": True, "cleared_entries": await cache.clear()})
