"""The response cache as the router uses it: lookup before routing, write-back after.

Stored values carry a one-byte kind, ``J`` (a JSON chat completion) or ``S`` (the SSE
bytes of a complete stream), so a streaming request is never answered with a JSON body
or the other way round; a kind mismatch is a miss. Write-backs run as background tasks
(bounded): the client's response never waits for, or fails because of, the store.

Order: the exact lookup first; when it misses (or cannot key the request) and the
semantic path is active and the request eligible, the semantic lookup
(:mod:`.semantic`). A request is counted once, by its final result.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine, Mapping
from typing import Any, Literal

from ..config import ResponseCacheConfig
from ..config.models import OptimizationPolicyConfig
from ..http.types import Headers
from .response import cache_key, ineligible_reason, tenant_of
from .semantic import (
    SemanticCache,
    SemanticLookup,
    semantic_active,
    semantic_ineligible_reason,
    semantic_ttl,
)

__all__ = ["CacheLookup", "ResponseCacheService"]

log = logging.getLogger("continuum.cache")

_MAX_PENDING_WRITES = 256


class CacheLookup:
    __slots__ = ("body", "key", "mode", "result", "semantic")

    def __init__(
        self,
        result: Literal["hit", "miss", "skip"],
        key: str | None,
        body: bytes | None,
        mode: Literal["exact", "semantic"] = "exact",
        semantic: SemanticLookup | None = None,
    ) -> None:
        self.result = result
        self.key = key
        """The exact key to store the answer under (None: not exactly cacheable)."""
        self.body = body
        self.mode = mode
        """Which path hit (``X-Cache-Mode: semantic`` for the semantic one)."""
        self.semantic = semantic
        """On a semantic miss: the vector to index the answer under."""


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
        self.policy = OptimizationPolicyConfig()
        """``control_plane.optimization``; replaced whole on reload, read per request."""
        self.semantic: SemanticCache | None = None
        """Set by the router (it needs the backend pool and the upstream client)."""
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

    async def lookup(self, body: Mapping[str, Any], headers: Headers, stream: bool) -> CacheLookup:
        cfg, policy = self.config, self.policy
        if not (policy.cache_enabled and policy.exact_cache):
            self._count("skip")
            return CacheLookup("skip", None, None)
        tenant = tenant_of(headers)
        key: str | None = None
        if ineligible_reason(body) is None:
            key = cache_key(body, tenant)
            try:
                blob = await self.store.get(key)
            except Exception:  # a store failure is a miss, never a failed request
                log.warning("response cache read failed", exc_info=True)
                blob = None
            want = b"S" if stream else b"J"
            if blob is not None and blob[:1] == want:
                self._count("hit")
                return CacheLookup("hit", key, blob[1:])
        sem = self.semantic
        if (
            sem is not None
            and semantic_active(cfg, policy)
            and semantic_ineligible_reason(body, stream, cfg.semantic.max_input_bytes) is None
        ):
            found = await sem.lookup(body, tenant, cfg, policy)
            if found.result == "hit":
                self._count("hit")
                return CacheLookup("hit", key, found.body, "semantic")
            self._count("miss")
            return CacheLookup("miss", key, None, semantic=found if found.storable else None)
        if key is None:
            self._count("skip")
            return CacheLookup("skip", None, None)
        self._count("miss")
        return CacheLookup("miss", key, None)

    def writer(self, key: str) -> Callable[[bytes, bool], None]:
        """A write-back callback for the proxy (complete 200 bodies only)."""

        def store(data: bytes, stream: bool) -> None:
            blob = (b"S" if stream else b"J") + data
            self._spawn(self._write(key, blob))

        return store

    def writer_for(self, lookup: CacheLookup) -> Callable[[bytes, bool], None] | None:
        """The write-back of a miss: exact key, semantic vector, or both; None if neither."""
        exact = self.writer(lookup.key) if lookup.key is not None else None
        pending = lookup.semantic
        if pending is None or self.semantic is None:
            return exact
        semantic = self.semantic
        ttl = semantic_ttl(self.config, self.policy)

        def store(data: bytes, stream: bool) -> None:
            if exact is not None:
                exact(data, stream)
            if not stream:
                self._spawn(semantic.save(pending, data, ttl))

        return store

    def _spawn(self, write: Coroutine[Any, Any, None]) -> None:
        if len(self._pending) >= _MAX_PENDING_WRITES:
            write.close()  # the store is slower than traffic: skip rather than queue forever
            return
        task = asyncio.get_running_loop().create_task(write)
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)

    async def _write(self, key: str, blob: bytes) -> None:
        try:
            await self.store.set(key, blob, self.config.ttl_seconds)
        except Exception:
            log.warning("response cache write failed", exc_info=True)

    def limit(self, stream: bool) -> int:
        return self.config.max_stream_buffer_size if stream else self.config.max_response_size

    async def clear(self) -> int:
        """Forget every stored answer (and every semantic vector); returns how many went."""
        cleared = await self.store.clear()
        if self.semantic is not None:
            self.semantic.clear()
        return cleared

    async def delete(self, key: str) -> bool:
        """Forget the answer stored under one exact key (64 lowercase hex)."""
        return bool(await self.store.delete(key))

    async def close(self) -> None:
        for task in list(self._pending):
            task.cancel()
        await self.store.close()
