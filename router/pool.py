"""Backends at run time: live load, health, latency and success rate.

The in-flight gauge is the single load signal of the router: CHWBL bounds on it and the
KV scorer (Tier 4) reads it, so both see the same number. Health is decided by active
probes plus consecutive connect failures seen by the proxy (a connect success resets the
count).

A backend's state is one of:

* ``healthy``: a candidate;
* ``unhealthy``: its active probe failed; the probe brings it back;
* ``ejected``: ``unhealthy_threshold`` consecutive connect failures took it out. With an
  active probe the probe brings it back. Without one (``anthropic`` and ``gemini`` have no
  probe, and no backend has one while health checks are off) nothing would ever look at it
  again, so after ``ejection_cooldown_ms`` it turns
* ``half_open``: a candidate again, on trial: the next connect success makes it healthy,
  the next failure ejects it for another cool-down.

Cool-downs are checked lazily where candidates are computed (one comparison while some
backend waits, none otherwise), against an injectable clock, so no timer task exists.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Literal

import orjson

from bus.tasks import cancel_and_wait

from .config import BackendConfig, HealthCheckConfig
from .upstream import UpstreamClient, UpstreamError

__all__ = ["BACKEND_STATES", "ENDPOINT_TYPES", "Backend", "BackendPool", "BackendState", "Endpoint"]

log = logging.getLogger("continuum.pool")

Endpoint = Literal["chat", "anthropic", "embeddings", "completions", "responses"]
BackendState = Literal["healthy", "unhealthy", "ejected", "half_open"]
BACKEND_STATES: tuple[BackendState, ...] = ("healthy", "unhealthy", "ejected", "half_open")

ENDPOINT_TYPES: dict[str, frozenset[str]] = {
    "chat": frozenset(("openai", "vllm", "sglang", "trtllm", "gemini")),
    "anthropic": frozenset(("anthropic",)),
    "embeddings": frozenset(("openai", "vllm", "sglang", "gemini")),
    "completions": frozenset(("openai", "vllm", "sglang", "trtllm")),
    "responses": frozenset(("openai", "vllm", "sglang")),
}

_DEFAULT_HEALTH_PATH = {
    "vllm": "/health",
    "sglang": "/health",
    "trtllm": "/health",
    "openai": "/v1/models",
}

_SUCCESS_WINDOW = 100
_LATENCY_ALPHA = 0.3


class Backend:
    """Mutable run-time state of one configured backend."""

    __slots__ = (
        "_outcome_pos",
        "_outcomes",
        "_successes",
        "api_key",
        "config",
        "consecutive_failures",
        "consecutive_successes",
        "discovered_models",
        "healthy",
        "in_flight",
        "index",
        "latency_ewma",
        "latency_samples",
        "name",
        "retry_at",
        "state",
        "type",
        "url",
    )

    def __init__(self, config: BackendConfig, index: int) -> None:
        self.name = config.name
        self.index = index
        """Stable small integer: bit position in candidate masks, ring owner id."""
        self.in_flight = 0
        self.healthy = True
        """A candidate: ``state`` is healthy or half_open."""
        self.state: BackendState = "healthy"
        self.retry_at: float | None = None
        """When an ejected backend without a probe turns half-open (pool clock)."""
        self.latency_ewma = 0.0
        self.latency_samples = 0
        self.consecutive_failures = 0
        self.consecutive_successes = 0
        self.discovered_models: frozenset[str] = frozenset()
        self._outcomes = bytearray(b"\x01" * _SUCCESS_WINDOW)
        self._outcome_pos = 0
        self._successes = _SUCCESS_WINDOW
        self.configure(config)

    def configure(self, config: BackendConfig) -> None:
        self.config = config
        self.type = config.type
        self.url = config.url
        self.api_key = os.environ.get(config.api_key_env) if config.api_key_env else None

    @property
    def models(self) -> frozenset[str]:
        return frozenset(self.config.models) if self.config.models else self.discovered_models

    def serves(self, model: str) -> bool:
        if self.config.models:
            return model in self.config.models
        return model in self.discovered_models

    @property
    def success_rate(self) -> float:
        """Share of the last 100 proxied requests that got a non-5xx answer."""
        return self._successes / _SUCCESS_WINDOW

    def record_outcome(self, ok: bool) -> None:
        pos = self._outcome_pos
        old = self._outcomes[pos]
        new = 1 if ok else 0
        self._outcomes[pos] = new
        self._successes += new - old
        self._outcome_pos = (pos + 1) % _SUCCESS_WINDOW

    def record_latency(self, seconds: float) -> None:
        if self.latency_samples == 0:
            self.latency_ewma = seconds
        else:
            self.latency_ewma += _LATENCY_ALPHA * (seconds - self.latency_ewma)
        self.latency_samples += 1


class BackendPool:
    """All configured backends, candidate lookup, and the health-check loop."""

    def __init__(
        self,
        backends: Iterable[BackendConfig],
        health: HealthCheckConfig,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._clock = clock
        self._retry_due: float | None = None
        """The earliest ``retry_at`` of any backend; None when none waits."""
        self._by_name: dict[str, Backend] = {}
        self.backends: list[Backend] = []
        self.health = health
        self._next_index = 0
        self._candidates: dict[tuple[str, str], tuple[tuple[Backend, ...], int]] = {}
        self._listeners: list[Callable[[], None]] = []
        self._task: asyncio.Task[None] | None = None
        self._client: UpstreamClient | None = None
        self.update(list(backends), health)

    # -- configuration -------------------------------------------------------------

    def update(self, configs: list[BackendConfig], health: HealthCheckConfig) -> None:
        """Apply a (re)loaded backend list; unchanged backends keep their live state."""
        self.health = health
        keep: dict[str, Backend] = {}
        for cfg in configs:
            b = self._by_name.get(cfg.name)
            if b is None:
                b = Backend(cfg, self._next_index)
                self._next_index += 1
            else:
                b.configure(cfg)
            keep[cfg.name] = b
        self._by_name = keep
        self.backends = list(keep.values())
        # Health checks may have been switched on or off: a backend out of rotation either
        # waits for its probe or for a cool-down, never for nothing.
        now = self._clock()
        for b in self.backends:
            if b.healthy:
                continue
            if self.has_probe(b):
                b.retry_at = None
            elif b.retry_at is None:
                b.retry_at = now + self.health.ejection_cooldown_ms / 1000
        self._schedule()
        self._changed()

    def on_change(self, callback: Callable[[], None]) -> None:
        """Called after membership or health changes (the ring rebuilds on it)."""
        self._listeners.append(callback)

    def _changed(self) -> None:
        self._candidates.clear()
        for cb in self._listeners:
            cb()

    def get(self, name: str) -> Backend | None:
        return self._by_name.get(name)

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.backends]

    # -- candidates ----------------------------------------------------------------

    def candidates(self, model: str, endpoint: Endpoint) -> tuple[tuple[Backend, ...], int]:
        """Enabled, healthy, public backends of the endpoint's types serving ``model``.

        Returns the tuple and its bit mask over ``Backend.index``. Cached until the next
        membership or health change, so the hot path does no filtering.
        """
        if self._retry_due is not None:
            self.refresh()
        key = (model, endpoint)
        hit = self._candidates.get(key)
        if hit is not None:
            return hit
        types = ENDPOINT_TYPES[endpoint]
        found = tuple(
            b
            for b in self.backends
            if b.healthy
            and b.config.enabled
            and not b.config.internal
            and b.type in types
            and b.serves(model)
        )
        mask = 0
        for b in found:
            mask |= 1 << b.index
        if len(self._candidates) > 4096:
            self._candidates.clear()
        self._candidates[key] = (found, mask)
        return found, mask

    def knows_model(self, model: str, endpoint: Endpoint) -> bool:
        """Whether any enabled public backend (healthy or not) serves ``model``."""
        types = ENDPOINT_TYPES[endpoint]
        return any(
            b.config.enabled and not b.config.internal and b.type in types and b.serves(model)
            for b in self.backends
        )

    def models(self) -> list[tuple[str, str]]:
        """(model, owned_by backend type) of healthy public backends, deduplicated."""
        self.refresh()
        seen: dict[str, str] = {}
        for b in self.backends:
            if b.healthy and b.config.enabled and not b.config.internal:
                for m in sorted(b.models):
                    seen.setdefault(m, b.type)
        return sorted(seen.items())

    # -- passive health ------------------------------------------------------------

    def connect_failed(self, b: Backend) -> None:
        b.consecutive_successes = 0
        b.consecutive_failures += 1
        if b.state == "half_open":
            log.warning("backend %s failed its half-open retry: ejected again", b.name)
            self._take_out(b, "ejected")
        elif b.healthy and b.consecutive_failures >= self.health.unhealthy_threshold:
            log.warning(
                "backend %s ejected after %d consecutive connect failures",
                b.name,
                b.consecutive_failures,
            )
            self._take_out(b, "ejected")

    def connect_succeeded(self, b: Backend) -> None:
        """The backend answered (any status): the failure count starts again."""
        b.consecutive_failures = 0
        if b.state == "half_open":
            log.info("backend %s passed its half-open retry: healthy again", b.name)
            self._put_back(b)

    def has_probe(self, b: Backend) -> bool:
        """Whether the health-check loop probes ``b`` (and so decides when it is back)."""
        return self.health.enabled and self._probe_path(b) is not None

    def now(self) -> float:
        """The pool clock ``retry_at`` is measured on."""
        return self._clock()

    def refresh(self) -> None:
        """Turn ejected backends whose cool-down is over half-open."""
        due = self._retry_due
        if due is None:
            return
        now = self._clock()
        if now < due:
            return
        for b in self.backends:
            if b.retry_at is not None and b.retry_at <= now:
                log.info("backend %s cool-down over: half-open retry", b.name)
                b.retry_at = None
                b.state = "half_open"
                b.healthy = True
        self._schedule()
        self._changed()

    def _take_out(self, b: Backend, state: BackendState) -> None:
        b.state = state
        b.healthy = False
        if self.has_probe(b):
            b.retry_at = None
        else:
            b.retry_at = self._clock() + self.health.ejection_cooldown_ms / 1000
        self._schedule()
        self._changed()

    def _put_back(self, b: Backend) -> None:
        b.state = "healthy"
        b.healthy = True
        b.retry_at = None
        self._schedule()
        self._changed()

    def _schedule(self) -> None:
        self._retry_due = min(
            (b.retry_at for b in self.backends if b.retry_at is not None), default=None
        )

    # -- active health -------------------------------------------------------------

    async def start(self, client: UpstreamClient) -> None:
        """Probe every backend once (so model discovery is done before traffic), then loop."""
        self._client = client
        await self.check_all(initial=True)
        if self.health.enabled:
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait(self._task, log=log)
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.health.interval_ms / 1000)
            try:
                await self.check_all()
            except Exception:  # a probe bug must never end health checking
                log.exception("health check round failed")

    async def check_all(self, initial: bool = False) -> None:
        """Probe every enabled backend; on the first round one failure marks it down."""
        targets = [b for b in self.backends if b.config.enabled]
        if targets:
            await asyncio.gather(*(self._check(b, initial) for b in targets))

    def _probe_path(self, b: Backend) -> str | None:
        if b.config.health_path:
            return b.config.health_path
        if not b.config.models and b.type in ("openai", "vllm", "sglang", "trtllm"):
            return "/v1/models"  # discovery doubles as the probe
        return _DEFAULT_HEALTH_PATH.get(b.type)

    async def _check(self, b: Backend, initial: bool = False) -> None:
        path = self._probe_path(b)
        if path is None or (not self.health.enabled and b.config.models):
            return
        assert self._client is not None
        headers = {"Authorization": f"Bearer {b.api_key}"} if b.api_key else {}
        ok = False
        try:
            resp = await self._client.request(
                b.name,
                "GET",
                b.url + path,
                headers,
                client_timeout=self.health.timeout_ms / 1000,
            )
            body = await resp.read()
            ok = 200 <= resp.status < 300
            if ok and path == "/v1/models":
                self._discover(b, body)
        except UpstreamError as exc:
            log.debug("probe of %s failed: %s", b.name, exc.detail)
        except Exception as exc:
            log.debug("probe of %s failed: %r", b.name, exc)
        if ok:
            b.consecutive_failures = 0
            b.consecutive_successes += 1
            if not b.healthy and b.consecutive_successes >= self.health.healthy_threshold:
                log.info("backend %s is healthy again", b.name)
                self._put_back(b)
        else:
            b.consecutive_successes = 0
            b.consecutive_failures += 1
            if b.healthy and (initial or b.consecutive_failures >= self.health.unhealthy_threshold):
                log.warning("backend %s marked unhealthy (probe %s failed)", b.name, path)
                self._take_out(b, "unhealthy")

    def _discover(self, b: Backend, body: bytes) -> None:
        try:
            data = orjson.loads(body)
            ids = frozenset(
                m["id"]
                for m in data.get("data", [])
                if isinstance(m, dict) and isinstance(m.get("id"), str)
            )
        except (orjson.JSONDecodeError, AttributeError, TypeError):
            return
        if ids != b.discovered_models:
            b.discovered_models = ids
            self._changed()
