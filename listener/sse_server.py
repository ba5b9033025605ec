"""The listener's HTTP server (aiohttp): SSE event streams, health, stats, metrics.

Routes:

* ``GET /events/{backend}`` — ``text/event-stream`` of the backend's records from the
  ``EventHub``. Resumes after the ``Last-Event-ID`` header, or the ``last_event_id``
  query parameter when the header is absent (the header wins: browsers' EventSource sends
  it on reconnect). A stream idle for ``heartbeat_interval`` gets a comment
  (``bus.sse.encode_comment``). It ends cleanly when the client disconnects, after the
  explicit ``buffer_overflow`` error record, or on shutdown. Unknown backend: 404 with an
  OpenAI-style error body; ``max_subscribers`` streams already open: 503. A write the
  client's socket does not take within ``write_timeout`` (a client that stopped reading)
  disconnects it and counts it in ``stalled_subscribers``: its backlog (a resync block's
  snapshot) and queue are released instead of held for as long as the client lives.
* ``GET /snapshot/{backend}`` — ``{"backend", "event_id", "events": [...]}``: the
  backend's current prefixes and conversation keys as the ``cache_created`` /
  ``chain_created`` events of a resync block, and the id of the last record they reflect
  (``EventHub.snapshot``). The router's anti-entropy check compares its index with it.
  Unknown backend: 404.
* ``GET /health`` — ``{"status": "ok", "epoch": ..., "backends": [...]}``.
* ``GET /stats`` — ``{"epoch", "sources": <stats provider>, "hub": EventHub.stats()}``.
* ``GET /metrics`` — Prometheus text from a registry of this server's own. Label values
  are only the hub's configured backend names, never request data.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import orjson
from aiohttp import web
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bus.errors import BUFFER_OVERFLOW
from bus.sse import encode_comment

from .snapshot import snapshot_body
from .stream import EventHub, StatsProvider, Subscription

__all__ = ["METRICS_CONTENT_TYPE", "ListenerMetrics", "SseServer", "numeric_leaves", "sse_batches"]

log = logging.getLogger("continuum.listener.sse")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_HEARTBEAT = encode_comment("heartbeat")
_SSE_HEADERS = {
    "Content-Type": "text/event-stream",
    "Cache-Control": "no-cache",
    "X-Accel-Buffering": "no",  # nginx: do not buffer the stream
}
_STAT_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,63}\Z")


def _error(status: int, message: str, type_: str) -> web.Response:
    body = {"error": {"message": message, "type": type_, "param": None, "code": status}}
    return web.Response(status=status, body=orjson.dumps(body), content_type="application/json")


async def sse_batches(
    sub: Subscription, heartbeat_interval: float, batch_limit: int = 256
) -> AsyncGenerator[list[bytes], None]:
    """The records of one subscription exactly as ``GET /events/{backend}`` sends them.

    Each batch is the SSE records available at once (up to ``batch_limit``), or a
    heartbeat comment after ``heartbeat_interval`` seconds of idleness; it ends after the
    subscription ends (the ``buffer_overflow`` error record included). The SSE server
    writes each batch joined into one chunk; the event bus (``listener/push``)
    frames the same records into ``StreamData``, so both transports carry the same bytes
    from one code path.
    """
    heartbeat = [_HEARTBEAT]
    while True:
        try:
            async with asyncio.timeout(heartbeat_interval):
                batch = await sub.batch(batch_limit)
        except TimeoutError:
            yield heartbeat
            continue
        if not batch:
            return
        yield [r.sse for r in batch]


def numeric_leaves(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    """``(name, number)`` of every numeric leaf of a stats dict, nested keys joined by _."""
    if isinstance(value, bool):
        yield prefix, float(value)
    elif isinstance(value, (int, float)):
        yield prefix, float(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            if isinstance(k, str):
                yield from numeric_leaves(f"{prefix}_{k}" if prefix else k, v)


class ListenerMetrics(Collector):
    """Reads the hub and the sources' stats at scrape time (no per-event bookkeeping).

    Hub series: ``continuum_kv_listener_events_published_total``, ``..._overflows_total``,
    ``..._resync_blocks_total``, ``..._resyncs_published_total`` (counters), and the gauges
    ``..._event_seq``, ``..._history_records``, ``..._subscribers``; all labelled
    ``backend``. Each numeric leaf ``k`` of the stats provider's dict for a configured
    backend becomes ``continuum_kv_listener_source_<k>`` (a counter if ``k`` ends in
    ``_total``, else a gauge); keys that are not metric names are skipped. The SSE
    server's own counters (``server_counters``) become
    ``continuum_kv_listener_sse_<name>_total``, without labels.
    """

    def __init__(
        self,
        hub: EventHub,
        stats_provider: StatsProvider | None = None,
        server_counters: dict[str, int] | None = None,
    ) -> None:
        self._hub = hub
        self._stats = stats_provider
        self._server_counters = server_counters

    def collect(self) -> Iterator[Metric]:
        backends = self._hub.stats()["backends"]
        p = "continuum_kv_listener_"
        for counter, count in (self._server_counters or {}).items():
            yield CounterMetricFamily(f"{p}sse_{counter}", f"SSE {counter}.", value=count)
        counters = (
            ("events_published", "published", "Events appended to the backend's sequence."),
            ("overflows", "overflows", "Subscribers closed with buffer_overflow."),
            ("resync_blocks", "resync_blocks", "Resync+snapshot blocks sent to subscribers."),
            ("resyncs_published", "resyncs_published", "Shared resync events published."),
        )
        for name, key, doc in counters:
            fam = CounterMetricFamily(p + name, doc, labels=["backend"])
            for be, st in backends.items():
                fam.add_metric([be], st[key])
            yield fam
        gauges = (
            ("event_seq", "seq", "Sequence number of the backend's latest event."),
            ("history_records", "history", "Records held in the backend's history ring."),
            ("subscribers", "subscribers", "Open streams of the backend."),
        )
        for name, key, doc in gauges:
            g = GaugeMetricFamily(p + name, doc, labels=["backend"])
            for be, st in backends.items():
                g.add_metric([be], st[key])
            yield g
        if self._stats is None:
            return
        try:
            source_stats = self._stats()
        except Exception:  # a scrape must not fail because one provider did
            log.exception("stats provider failed")
            return
        series: dict[str, list[tuple[str, float]]] = {}
        for be in backends:
            for key, value in numeric_leaves("", source_stats.get(be) or {}):
                if _STAT_NAME_RE.match(key):
                    series.setdefault(key, []).append((be, value))
        for key in sorted(series):
            if key.endswith("_total"):
                fam2: Metric = CounterMetricFamily(
                    f"{p}source_{key[: -len('_total')]}",
                    f"Source counter {key}.",
                    labels=["backend"],
                )
            else:
                fam2 = GaugeMetricFamily(
                    f"{p}source_{key}", f"Source value {key}.", labels=["backend"]
                )
            for be, value in series[key]:
                fam2.add_metric([be], value)  # type: ignore[attr-defined]
            yield fam2


class SseServer:
    """aiohttp server of one ``EventHub``.

    Args:
        hub: The hub whose backends are served.
        heartbeat_interval: Seconds of idleness before a heartbeat comment.
        stats_provider: Per-source counters for ``/stats`` and ``/metrics``.
        batch_limit: Most records written per socket write.
        max_subscribers: Event streams open at once; one more gets 503.
        write_timeout: Seconds one write may wait for the client's socket to take it.
    """

    def __init__(
        self,
        hub: EventHub,
        *,
        heartbeat_interval: float = 15.0,
        stats_provider: StatsProvider | None = None,
        batch_limit: int = 256,
        max_subscribers: int = 256,
        write_timeout: float = 30.0,
    ) -> None:
        if max_subscribers < 1 or write_timeout <= 0:
            raise ValueError("max_subscribers and write_timeout must be positive")
        self.hub = hub
        self.heartbeat_interval = heartbeat_interval
        self._stats = stats_provider
        self._batch_limit = batch_limit
        self.max_subscribers = max_subscribers
        self.write_timeout = write_timeout
        self._subs: set[Subscription] = set()
        self._runner: web.AppRunner | None = None
        self.counters = {"refused_subscribers": 0, "stalled_subscribers": 0}
        """Streams refused at the cap; subscribers disconnected for not reading."""
        self.registry = CollectorRegistry()
        self.registry.register(ListenerMetrics(hub, stats_provider, self.counters))
        self.port: int | None = None
        """The bound port once started."""

    def make_app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/events/{backend}", self._events)
        app.router.add_get("/snapshot/{backend}", self._snapshot)
        app.router.add_get("/health", self._health)
        app.router.add_get("/stats", self._stats_handler)
        app.router.add_get("/metrics", self._metrics)
        return app

    async def start(self, host: str, port: int) -> int:
        """Bind and serve; returns the bound port (``port`` 0 = any free port)."""
        runner = web.AppRunner(
            self.make_app(), handler_cancellation=True, access_log=None, shutdown_timeout=5.0
        )
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        await site.start()
        self._runner = runner
        addresses = runner.addresses
        self.port = int(addresses[0][1]) if addresses else port
        return self.port

    async def stop(self) -> None:
        """End every open stream, then close the server. Idempotent."""
        for sub in list(self._subs):
            sub.close("shutdown")
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()

    @property
    def open_streams(self) -> int:
        return len(self._subs)

    # -- handlers --------------------------------------------------------------------------

    async def _events(self, request: web.Request) -> web.StreamResponse:
        backend = request.match_info["backend"]
        if backend not in self.hub:
            known = ", ".join(self.hub.backends) or "none"
            return _error(404, f"unknown backend {backend!r} (configured: {known})", "not_found")
        if len(self._subs) >= self.max_subscribers:
            self.counters["refused_subscribers"] += 1
            n = self.max_subscribers
            return _error(
                503,
                f"{n} event streams are open, the most max_subscribers ({n}) allows; retry later",
                "overloaded",
            )
        last_id = request.headers.get("Last-Event-ID")
        if last_id is None:
            last_id = request.query.get("last_event_id")
        sub = self.hub.subscribe(backend, last_id)
        self._subs.add(sub)
        resp = web.StreamResponse(status=200, headers=_SSE_HEADERS)
        timeout = self.write_timeout
        try:
            async with asyncio.timeout(timeout):
                await resp.prepare(request)
            async for batch in sse_batches(sub, self.heartbeat_interval, self._batch_limit):
                async with asyncio.timeout(timeout):
                    await resp.write(b"".join(batch))
            if sub.close_reason == BUFFER_OVERFLOW:
                log.warning("closed a slow subscriber of %s: buffer_overflow", backend)
            with contextlib.suppress(ConnectionError):
                async with asyncio.timeout(timeout):
                    await resp.write_eof()
        except ConnectionError:
            log.debug("subscriber of %s disconnected", backend)
        except TimeoutError:
            self.counters["stalled_subscribers"] += 1
            log.warning(
                "disconnected a subscriber of %s: its socket took no bytes for %g s",
                backend,
                timeout,
            )
            if request.transport is not None:
                request.transport.abort()
        finally:
            sub.close()
            self._subs.discard(sub)
        return resp

    async def _snapshot(self, request: web.Request) -> web.Response:
        backend = request.match_info["backend"]
        if backend not in self.hub:
            known = ", ".join(self.hub.backends) or "none"
            return _error(404, f"unknown backend {backend!r} (configured: {known})", "not_found")
        body = snapshot_body(self.hub, backend)
        return web.Response(body=body, content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        body = {"status": "ok", "epoch": self.hub.epoch, "backends": list(self.hub.backends)}
        return web.Response(body=orjson.dumps(body), content_type="application/json")

    async def _stats_handler(self, request: web.Request) -> web.Response:
        sources: dict[str, Any] = {}
        if self._stats is not None:
            try:
                sources = self._stats()
            except Exception as exc:
                log.exception("stats provider failed")
                return _error(500, f"stats provider failed: {exc}", "internal_error")
        sse = {"open_streams": len(self._subs), **self.counters}
        body = {"epoch": self.hub.epoch, "sources": sources, "hub": self.hub.stats(), "sse": sse}
        return web.Response(
            body=orjson.dumps(body, default=str, option=orjson.OPT_NON_STR_KEYS),
            content_type="application/json",
        )

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(self.registry), headers={"Content-Type": METRICS_CONTENT_TYPE}
        )
