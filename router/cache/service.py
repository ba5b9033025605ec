"""The response cache as the router uses it: lookup before routing, write-back after.

Stored values carry a one-byte kind, ``J`` (a JSON chat completion) or ``S`` (the SSE
bytes of a complete stream), so a streaming request is never answered with a JSON body
or the other way round; a kind mismatch is a miss. Write-backs run as background tasks
(bounded): the client's response never waits for, or fails because of, the store.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any, Literal

from ..config import ResponseCacheConfig
from .response import cache_key, ineligible_reason, tenant_of

__all__ = ["CacheLookup", "ResponseCacheService"]

log = logging.getLogger("continuum.cache")

_MAX_PENDING_WRITES = 256


class CacheLookup:
    __slots__ = ("body", "key", "result")

    def __init__(
        self, result: Literal["hit", "miss", "skip"], key: str | None, body: bytes | None
    ) -> None:
        self.result = result
        self.key = key
        self.body = body


class ResponseCacheService:
    def __init__(
        self,
        config: ResponseCacheConfig,
        store: Any,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self._on_result = on_result
        self.hits = 0
        self.misses = 0
        self.skips = 0
        self._pending: set[asyncio.Task[None]] = set()

    def _count(self, result: str) -> None:
        if result == "hit":
            self.hits += 1
        elif result == "miss":
            self.misses += 1
        else:
            self.skips += 1
        if self._on_result is not None:
            self._on_result(result)

    async def lookup(
        self, body: Mapping[str, Any], headers: Mapping[str, str], stream: bool
    ) -> CacheLookup:
        if ineligible_reason(body) is not None:
            self._count("skip")
            return CacheLookup("skip", None, None)
        key = cache_key(body, tenant_of(headers))
        try:
            blob = await self.store.get(key)
        except Exception:  # a store failure is a miss, never a failed request
            log.warning("response cache read failed", exc_info=True)
            blob = None
        want = b"S" if stream else b"J"
        if blob is not None and blob[:1] == want:
            self._count("hit")
            return CacheLookup("hit", key, blob[1:])
        self._count("miss")
        return CacheLookup("miss", key, None)

    def writer(self, key: str) -> Callable[[bytes, bool], None]:
        """A write-back callback for the proxy (complete 200 bodies only)."""

        def store(data: bytes, stream: bool) -> None:
            if len(self._pending) >= _MAX_PENDING_WRITES:
                return  # the store is slower than traffic: skip rather than queue forever
            blob = (b"S" if stream else b"J") + data
            task = asyncio.get_running_loop().create_task(self._write(key, blob))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        return store

    async def _write(self, key: str, blob: bytes) -> None:
        try:
            await self.store.set(key, blob, self.config.ttl_seconds)
        except Exception:
            log.warning("response cache write failed", exc_info=True)

    def limit(self, stream: bool) -> int:
        return self.config.max_stream_buffer_size if stream else self.config.max_response_size

    async def admin_stats(self) -> dict[str, Any]:
        cfg = self.config
        st = await self.store.stats()
        total = self.hits + self.misses + self.skips
        looked = self.hits + self.misses
        out: dict[str, Any] = {
            "enabled": cfg.enabled,
            "backend_type": cfg.backend,
            "entries": getattr(st, "entries", 0) or 0,
            "capacity": cfg.capacity,
            "requests": {
                "hit": self.hits,
                "miss": self.misses,
                "skip": self.skips,
                "total": total,
            },
            "hit_rate": f"{(self.hits / looked) if looked else 0.0:.4f}",
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
            out["redis"] = {
                "connections": getattr(st, "connections", {"active": 0, "idle": 0}),
                "fallback_active": bool(getattr(st, "fallback_active", False)),
                "errors": {
                    "connection": errors.get("connection", 0),
                    "timeout": errors.get("timeout", 0),
                    "other": errors.get("other", 0),
                },
            }
        return out

    async def invalidate(self, request: Mapping[str, Any]) -> dict[str, Any] | None:
        """``{"clear_all": true}`` or ``{"key": "<64 hex>"}``; None for a bad request."""
        if request.get("clear_all") is True:
            cleared = await self.store.clear()
            return {"success": True, "action": "clear_all", "cleared_entries": cleared}
        key = request.get("key")
        if isinstance(key, str) and len(key) == 64:
            removed = await self.store.delete(key.lower())
            return {"success": True, "action": "key", "cleared_entries": 1 if removed else 0}
        return None

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.store.close()
