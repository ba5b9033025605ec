"""Lifecycle of router-managed Gemini cachedContents resources.

For a chat completion to a ``type: gemini`` backend whose system prompt is at least
``min_prefix_bytes``:

1. the prefix digest is ``bus.prefix_key.compute_prefix_key(model, "S", system, None)``:
   the Tier 1 key's structure over the whole system prompt (no truncation);
2. a live entry for (backend, digest) is a hit: the caller injects its reference and
   drops the system prompt; with ``extend_on_hit`` and at most 20% of the ttl left, one
   background PATCH extends it;
3. a miss forwards the original request at once and starts one background create per
   (backend, digest) — single flight, bounded by ``create_timeout_ms``;
4. a rejected create (HTTP 400 "too small", or an endpoint without cachedContents)
   puts the digest in the negative cache for ``negative_ttl_seconds``; a transient failure
   (timeout, 5xx, 429) for at most a minute;
5. over ``max_entries`` the least recently used entry goes (expired rejections first) and
   its resource is deleted, best effort, to stop storage billing.

Nothing here is awaited on the request path: ``plan`` is synchronous and every network
call runs in a task this object owns (``close`` cancels them). A failure of cache
management never fails a request, it only costs the cache.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass, fields
from typing import Any

import orjson

from bus.prefix_key import anchor_text, compute_prefix_key
from bus.tasks import cancel_and_wait

from ..config import GeminiContextCacheConfig
from ..pool import Backend
from ..upstream import UpstreamClient, UpstreamError
from .api import (
    CACHED_CONTENTS_PATH,
    model_id,
    model_resource,
    native_headers,
    parse_cached_content,
    resource_path,
    ttl_string,
)
from .entries import CacheEntry, CacheKey, ContextCacheMap

__all__ = [
    "Counters",
    "Eligible",
    "GeminiContextCache",
    "eligible_anthropic_prefix",
    "eligible_prefix",
]

log = logging.getLogger("continuum.gemini")

_EXTEND_AT = 0.2
"""Extend when at most this share of the ttl is left."""
_TRANSIENT_NEGATIVE_S = 60.0
_DELETE_CONCURRENCY = 8
_SYSTEM_ROLES = frozenset(("system", "developer"))


@dataclass(slots=True)
class Counters:
    """The counters of the admin stats and metrics, overall and per backend."""

    hit: int = 0
    miss: int = 0
    ineligible: int = 0
    negative: int = 0
    creates: int = 0
    create_failures: int = 0
    evictions: int = 0
    cached_tokens: int = 0
    extends: int = 0
    stale: int = 0
    """References the backend no longer knew (expired or deleted remotely)."""

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass(frozen=True, slots=True)
class Eligible:
    """A request whose system prompt may be served from a cache."""

    digest: bytes
    model: str
    system: str


def eligible_prefix(body: Mapping[str, Any], model: str, min_prefix_bytes: int) -> Eligible | None:
    """The request's cacheable prefix, or ``None``.

    Eligible: the first message is the only system/developer message, it is all text, at
    least ``min_prefix_bytes`` of UTF-8, and other messages follow; and the request has
    no tools (Gemini refuses ``tools``/``toolConfig`` beside a cache reference: they
    would have to live in the cache too).
    """
    if body.get("tools") or body.get("tool_choice") is not None or body.get("functions"):
        return None
    if body.get("system") is not None:  # not OpenAI's; the digest must be of messages[0]
        return None
    extra = body.get("extra_body")
    google = extra.get("google") if isinstance(extra, dict) else None
    if isinstance(google, dict) and google.get("cached_content") is not None:
        return None  # the caller manages its own cache
    messages = body.get("messages")
    if not isinstance(messages, list) or len(messages) < 2:
        return None
    first = messages[0]
    if not isinstance(first, dict) or first.get("role") not in _SYSTEM_ROLES:
        return None
    content = first.get("content")
    if isinstance(content, list) and not all(
        isinstance(p, dict) and p.get("type", "text") == "text" for p in content
    ):
        return None
    if any(isinstance(m, dict) and m.get("role") in _SYSTEM_ROLES for m in messages[1:]):
        return None
    return _eligible(body, model, min_prefix_bytes)


def eligible_anthropic_prefix(
    body: Mapping[str, Any], model: str, min_prefix_bytes: int
) -> Eligible | None:
    """The same for an Anthropic Messages body: its top-level ``system``, all text.

    The digest equals the OpenAI form's for the same system text, so one resource
    serves both APIs.
    """
    if body.get("tools") or body.get("tool_choice") is not None:
        return None
    system = body.get("system")
    if isinstance(system, list):
        if not all(isinstance(b, dict) and b.get("type") == "text" for b in system):
            return None
    elif not isinstance(system, str):
        return None
    return _eligible(body, model, min_prefix_bytes)


def _eligible(body: Mapping[str, Any], model: str, min_prefix_bytes: int) -> Eligible | None:
    anchor = anchor_text(body)
    if anchor is None or anchor[0] != "S":
        return None
    text = anchor[1]
    # Bytes >= code points, so only a short-looking text needs encoding to be measured.
    if len(text) < min_prefix_bytes and len(text.encode("utf-8", "surrogatepass")) < (
        min_prefix_bytes
    ):
        return None
    mid = model_id(model)
    return Eligible(bytes(compute_prefix_key(mid, "S", text, None)), mid, text)


class GeminiContextCache:
    """The entry map plus every background call that keeps it true; one per router."""

    def __init__(
        self,
        config: GeminiContextCacheConfig,
        client: UpstreamClient,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
    ) -> None:
        self.config = config
        self.client = client
        self.map = ContextCacheMap(config.max_entries)
        self.totals = Counters()
        self.per_backend: dict[str, Counters] = {}
        self._clock = clock
        self._wall = wall
        self._backends: dict[str, Backend] = {}
        self._creating: dict[CacheKey, asyncio.Task[object]] = {}
        self._tasks: set[asyncio.Task[Any]] = set()
        self._generation = 0
        """Bumped by ``clear``: a create that started before must not refill the map."""

    # -- request path (synchronous) ------------------------------------------------

    def _count(self, backend: str, name: str, n: int = 1) -> None:
        setattr(self.totals, name, getattr(self.totals, name) + n)
        c = self.per_backend.get(backend)
        if c is None:
            c = self.per_backend[backend] = Counters()
        setattr(c, name, getattr(c, name) + n)

    def ineligible(self, backend: Backend) -> None:
        self._count(backend.name, "ineligible")

    def plan(self, backend: Backend, prefix: Eligible) -> CacheEntry | None:
        """The live entry to reference for this request, or ``None`` (forward as is).

        A miss starts the single-flight create; a hit may start a ttl extension.
        """
        self._backends[backend.name] = backend
        key = (backend.name, prefix.digest)
        now = self._clock()
        state, entry = self.map.lookup(key, now)
        if state == "hit":
            assert entry is not None
            self._count(backend.name, "hit")
            if (
                self.config.extend_on_hit
                and not entry.extending
                and entry.expires_at - now <= _EXTEND_AT * entry.ttl_s
            ):
                entry.extending = True
                self._spawn(self._extend(backend, key, entry))
            return entry
        if state == "negative":
            self._count(backend.name, "negative")
            return None
        self._count(backend.name, "miss")
        if key not in self._creating:
            task = self._spawn(self._create(backend, key, prefix))
            self._creating[key] = task
        return None

    def served_cached(self, backend: str, tokens: int) -> None:
        """Cached prompt tokens of an answer (router-managed or implicit caching)."""
        if tokens > 0:
            self._count(backend, "cached_tokens", tokens)

    def stale(self, backend: str, digest: bytes, name: str) -> None:
        """The backend no longer knows ``name``: forget it (the caller retries without)."""
        if self.map.drop((backend, digest), name) is not None:
            self._count(backend, "stale")

    # -- background work -------------------------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, object]) -> asyncio.Task[object]:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _create(self, backend: Backend, key: CacheKey, prefix: Eligible) -> None:
        generation = self._generation
        cfg = self.config
        body = {
            "model": model_resource(prefix.model),
            "displayName": "continuum-" + prefix.digest.hex()[:16],
            "systemInstruction": {"parts": [{"text": prefix.system}]},
            "ttl": ttl_string(cfg.ttl_seconds),
        }
        negative_s: float | None = None
        try:
            status, data = await self._call(
                backend, "POST", CACHED_CONTENTS_PATH, orjson.dumps(body)
            )
            if status == 200:
                created = parse_cached_content(data)
            elif status == 429 or status >= 500:
                negative_s = min(float(cfg.negative_ttl_seconds), _TRANSIENT_NEGATIVE_S)
            else:
                # 400 (under the model's minimum token count, ...), or an endpoint that
                # imitates the API without cachedContents (404/405/501): do not retry.
                negative_s = float(cfg.negative_ttl_seconds)
        except (UpstreamError, TimeoutError) as exc:
            log.info("gemini cache create on %s failed: %s", backend.name, exc)
            negative_s = min(float(cfg.negative_ttl_seconds), _TRANSIENT_NEGATIVE_S)
        except ValueError as exc:
            log.warning("gemini cache create on %s: unusable answer: %s", backend.name, exc)
            negative_s = float(cfg.negative_ttl_seconds)
        finally:
            self._creating.pop(key, None)
        now = self._clock()
        if negative_s is not None:
            self._count(backend.name, "create_failures")
            if generation == self._generation:
                self._evicted(self.map.put_negative(key, now + negative_s, now))
            return
        self._count(backend.name, "creates")
        if generation != self._generation:  # cleared meanwhile: do not keep paying for it
            self._spawn(self._delete(backend.name, created.name))
            return
        ttl = float(cfg.ttl_seconds)
        remaining = ttl if created.expire_time is None else created.expire_time - self._wall()
        evicted = self.map.put_live(
            key, created.name, now + min(remaining, ttl), ttl, created.token_count, now
        )
        self._evicted(evicted)

    def _evicted(self, entries: list[CacheEntry]) -> None:
        for e in entries:
            self._count(e.backend, "evictions")
            if e.name is not None:
                self._spawn(self._delete(e.backend, e.name))

    async def _extend(self, backend: Backend, key: CacheKey, entry: CacheEntry) -> None:
        assert entry.name is not None
        ttl = float(self.config.ttl_seconds)
        path = resource_path(entry.name) + "?updateMask=ttl"
        try:
            status, data = await self._call(
                backend, "PATCH", path, orjson.dumps({"ttl": ttl_string(ttl)})
            )
            if status == 200:
                updated = parse_cached_content(data)
                remaining = (
                    ttl if updated.expire_time is None else updated.expire_time - self._wall()
                )
                entry.expires_at = self._clock() + min(remaining, ttl)
                self._count(backend.name, "extends")
            elif status == 404:
                self.stale(backend.name, key[1], entry.name)
        except (UpstreamError, TimeoutError, ValueError) as exc:
            log.info("gemini cache extend on %s failed: %s", backend.name, exc)
        finally:
            entry.extending = False

    async def _delete(self, backend_name: str, name: str) -> bool:
        backend = self._backends.get(backend_name)
        if backend is None:
            return False
        try:
            status, _ = await self._call(backend, "DELETE", resource_path(name), None)
        except (UpstreamError, TimeoutError) as exc:
            log.info("gemini cache delete of %s on %s failed: %s", name, backend_name, exc)
            return False
        return status in (200, 204, 404)

    async def _call(
        self, backend: Backend, method: str, path: str, body: bytes | None
    ) -> tuple[int, bytes]:
        timeout = self.config.create_timeout_ms / 1000
        async with asyncio.timeout(timeout):
            resp = await self.client.request(
                backend.name,
                method,
                backend.url + path,
                native_headers(backend.api_key),
                body,
                client_timeout=timeout,
            )
            return resp.status, await resp.read()

    # -- admin -------------------------------------------------------------------------

    async def clear(self) -> int:
        """Forget every entry and delete every tracked resource (best effort)."""
        self._generation += 1
        live = self.map.clear()
        sem = asyncio.Semaphore(_DELETE_CONCURRENCY)

        async def one(e: CacheEntry) -> None:
            assert e.name is not None
            async with sem:
                await self._delete(e.backend, e.name)

        await asyncio.gather(*(one(e) for e in live))
        return len(live)

    def stats(self) -> dict[str, Any]:
        cfg = self.config
        backends: dict[str, dict[str, int]] = {}
        for name, c in sorted(self.per_backend.items()):
            backends[name] = {**c.as_dict(), "entries": 0, "negative_entries": 0}
        for e in self.map.entries():
            row = backends.setdefault(
                e.backend, {**Counters().as_dict(), "entries": 0, "negative_entries": 0}
            )
            row["entries" if e.live else "negative_entries"] += 1
        return {
            "enabled": True,
            "config": cfg.model_dump(),
            "entries": self.map.live_count,
            "negative_entries": self.map.negatives,
            "in_flight": len(self._creating),
            "backends": backends,
            "counters": self.totals.as_dict(),
        }

    @property
    def in_flight(self) -> int:
        return len(self._creating)

    async def close(self) -> None:
        tasks = list(self._tasks)
        await cancel_and_wait(*tasks)
