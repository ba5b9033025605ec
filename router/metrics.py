"""Prometheus metrics of the router, on a registry of its own.

Label values come only from allow-lists (configured backend names, fixed enums, a fixed
set of status codes), never from request data, so a client cannot explode cardinality.
Label children are cached: ``labels()`` is too slow for the per-request path.
Gauges that mirror live state (in-flight, health) are read at scrape time by a
collector instead of being updated per request.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from .pool import BACKEND_STATES, BackendPool

__all__ = ["CONTENT_TYPE", "RouterMetrics"]

disable_created_metrics()  # the _created series double the scrape for no use here

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_STATUSES = frozenset(
    (
        "200",
        "400",
        "401",
        "403",
        "404",
        "408",
        "409",
        "413",
        "422",
        "429",
        "500",
        "502",
        "503",
        "504",
    )
)
_ENDPOINTS = frozenset(("chat", "anthropic", "embeddings", "completions", "responses"))
_DECISIONS = ("prefix_hash", "overflow", "fallback")
_CONVERSATION_OUTCOMES = ("chosen", "tie", "none_held")
_NO_BACKEND = "none"

_ERROR_BUCKETS = (-16384, -4096, -1024, -256, -64, -16, 0, 16, 64, 256, 1024, 4096, 16384)
"""Reported minus predicted cached tokens: symmetric, x4 steps (a chunk is ~256 tokens)."""
_ERROR_BOUNDS = (*(floatToGoString(b) for b in _ERROR_BUCKETS), "+Inf")

_LATENCY_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1,
    2.5,
    5,
    10,
    30,
    60,
    120,
    300,
)


_REJECT_REASONS = ("body_timeout", "overloaded", "too_large")


class _PoolCollector(Collector):
    def __init__(self, pool_ref: Callable[[], BackendPool]) -> None:
        self._pool_ref = pool_ref

    def collect(self) -> Iterator[Any]:
        pool = self._pool_ref()
        dist = GaugeMetricFamily(
            "continuum_prefix_routing_backend_distribution",
            "In-flight requests per backend: the load CHWBL bounds.",
            labels=["backend"],
        )
        in_flight = GaugeMetricFamily(
            "continuum_backend_in_flight_requests",
            "Requests currently proxied to each backend.",
            labels=["backend"],
        )
        healthy = GaugeMetricFamily(
            "continuum_backend_healthy",
            "1 when the backend passes health checks (state healthy).",
            labels=["backend"],
        )
        state = GaugeMetricFamily(
            "continuum_backend_state",
            "1 for the backend's current state: healthy, unhealthy (probe failing), ejected "
            "(consecutive connect failures), half_open (on trial after the cool-down).",
            labels=["backend", "state"],
        )
        success = GaugeMetricFamily(
            "continuum_backend_success_rate",
            "Share of the last 100 requests answered without a 5xx or transport error.",
            labels=["backend"],
        )
        pool.refresh()
        for b in pool.backends:
            dist.add_metric([b.name], b.in_flight)
            in_flight.add_metric([b.name], b.in_flight)
            healthy.add_metric([b.name], 1.0 if b.state == "healthy" else 0.0)
            for s in BACKEND_STATES:
                state.add_metric([b.name, s], 1.0 if b.state == s else 0.0)
            success.add_metric([b.name], b.success_rate)
        yield dist
        yield in_flight
        yield healthy
        yield state
        yield success


def _anti_entropy_metrics(ae: Any) -> Iterator[Any]:
    """The anti-entropy check (``router.kvindex.anti_entropy.AntiEntropy``): divergence of
    each backend's entries (both kinds of keys) at its last settled check, checks by
    outcome, repairs."""
    div = GaugeMetricFamily(
        "continuum_kv_index_divergence",
        "Entries the router's KV indexes (prefix and conversation keys) lack (missing) or "
        "hold beyond (extra) the listener's snapshot of the backend, at the last settled "
        "anti-entropy check.",
        labels=["backend", "kind"],
    )
    checks = CounterMetricFamily(
        "continuum_kv_anti_entropy_checks",
        "Anti-entropy checks by outcome: settled (compared at the snapshot's position), "
        "unsettled (events kept moving), failed (no snapshot).",
        labels=["backend", "outcome"],
    )
    repairs = CounterMetricFamily(
        "continuum_kv_anti_entropy_repairs",
        "Streams resynced after two divergent checks in a row (anti_entropy.repair).",
        labels=["backend"],
    )
    for backend in ae.backends:
        found = ae.last.get(backend)
        if found is not None:
            div.add_metric([backend, "missing"], found.total_missing)
            div.add_metric([backend, "extra"], found.total_extra)
        for outcome, n in ae.checks[backend].items():
            checks.add_metric([backend, outcome], n)
        repairs.add_metric([backend], ae.repairs[backend])
    yield div
    yield checks
    yield repairs


class _KvCollector(Collector):
    """Tier 4 state read at scrape time: consumer counters and index size."""

    def __init__(self, source: Callable[[], dict[str, Any]]) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        snap = self._source()
        dropped = CounterMetricFamily(
            "continuum_kv_event_dropped",
            "KV events lost or refused per backend, by reason: invalid (a record that is no "
            "event), oversized (a record over 1 MiB), stream_overflow (the listener closed "
            "the stream: the router read too slowly), resync (a snapshot replaced held "
            "state: events were lost upstream). sum by (backend) shows backpressure.",
            labels=["backend", "reason"],
        )
        connected = GaugeMetricFamily(
            "continuum_kv_consumer_connected",
            "1 while the router's event stream from the listener is connected.",
            labels=["backend"],
        )
        received = CounterMetricFamily(
            "continuum_kv_events_received", "KV events received per backend.", labels=["backend"]
        )
        for name, c in snap.get("consumers", {}).items():
            oversized = c.get("overflows", 0)
            for reason, n in (
                ("invalid", c.get("dropped", 0) - oversized),
                ("oversized", oversized),
                ("stream_overflow", c.get("stream_overflows", 0)),
                ("resync", c.get("resync_losses", 0)),
            ):
                dropped.add_metric([name, reason], n)
            connected.add_metric([name], 1.0 if c.get("connected") else 0.0)
            received.add_metric([name], c.get("received", 0))
        yield dropped
        yield connected
        yield received
        index = snap.get("index", {})
        yield GaugeMetricFamily(
            "continuum_kv_index_prefixes", "Prefixes in the KV index.", index.get("prefix_count", 0)
        )
        yield GaugeMetricFamily(
            "continuum_kv_index_entries",
            "(prefix, backend) entries in the KV index.",
            index.get("entry_count", 0),
        )
        yield GaugeMetricFamily(
            "continuum_kv_index_fallback_active",
            "1 while the Redis KV index serves from its in-memory fallback.",
            1.0 if index.get("fallback_active") else 0.0,
        )
        yield CounterMetricFamily(
            "continuum_kv_index_fallback_switches",
            "Switches of the Redis KV index to its in-memory fallback (outages, failovers).",
            index.get("fallback_count", 0),
        )
        chain = snap.get("chain_index")
        if chain is not None:
            yield GaugeMetricFamily(
                "continuum_kv_chain_index_keys",
                "Prompt chain keys in the conversation index.",
                chain.get("prefix_count", 0),
            )
            yield GaugeMetricFamily(
                "continuum_kv_chain_index_entries",
                "(chain key, backend) entries in the conversation index, predictions included.",
                chain.get("entry_count", 0),
            )
            yield GaugeMetricFamily(
                "continuum_kv_chain_index_fallback_active",
                "1 while the Redis conversation index serves from its in-memory fallback.",
                1.0 if chain.get("fallback_active") else 0.0,
            )
        capped = snap.get("conversation_capped")
        if capped is not None:
            yield CounterMetricFamily(
                "continuum_kv_conversation_capped",
                "Conversation-depth decisions where every backend holding the most of the "
                "chain was at the bounded-load cap, so one holding less took the request.",
                capped,
            )
        prefill = GaugeMetricFamily(
            "continuum_kv_in_flight_prefill_tokens",
            "Prompt tokens each backend is still prefilling for requests in flight (the "
            "conversation cost model's load).",
            labels=["backend"],
        )
        for name, n in sorted(snap.get("prefill_tokens", {}).items()):
            prefill.add_metric([name], n)
        yield prefill
        bus = snap.get("event_bus")
        if bus is not None:
            yield from _event_bus_metrics(bus)
        ae = snap.get("anti_entropy")
        if ae is not None:
            yield from _anti_entropy_metrics(ae)


class _ConversationSeries(Collector):
    """The series conversation-depth routing updates on every routed chat request:
    decisions by outcome, predicted and reported cached tokens and the prediction error
    histogram, per backend label. Kept as plain integers on the event loop and turned into
    the same series as ``Counter`` and ``Histogram`` children would give at scrape time:
    the children cost a lock per increment and a Python loop over the buckets per
    observation, several times the bookkeeping itself on this path."""

    def __init__(self) -> None:
        self.outcomes = dict.fromkeys(_CONVERSATION_OUTCOMES, 0)
        self.predictions: dict[str, list[int]] = {}
        """Per backend label: predicted tokens, reported tokens, then the error histogram's
        count per bucket (``_ERROR_BUCKETS`` and +Inf; not cumulative)."""

    def row(self, label: str) -> list[int]:
        row = self.predictions.get(label)
        if row is None:
            row = self.predictions[label] = [0] * (3 + len(_ERROR_BUCKETS))
        return row

    def collect(self) -> Iterator[Any]:
        decisions = CounterMetricFamily(
            "continuum_kv_conversation_decisions",
            "Conversation-depth scorer decisions: chosen (lowest cost), tie (the lowest cost "
            "shared) or none_held (no candidate holds any of the chain); the last two leave "
            "the choice to the strategy. Also counted in "
            "continuum_kv_index_routing_decisions (kv_aware / fallback).",
            labels=["outcome"],
        )
        for outcome, n in self.outcomes.items():
            decisions.add_metric([outcome], n)
        yield decisions
        predicted = CounterMetricFamily(
            "continuum_kv_predicted_cached_tokens",
            "Prompt tokens the router expected the chosen backend to reuse (held in the index).",
            labels=["backend"],
        )
        reported = CounterMetricFamily(
            "continuum_kv_reported_cached_tokens",
            "Prompt tokens the backend reported reused (usage.prompt_tokens_details."
            "cached_tokens), for the same requests.",
            labels=["backend"],
        )
        name = "continuum_kv_prediction_error_tokens"
        error = Metric(
            name,
            "Reported minus predicted cached tokens per request (negative: the index "
            "promised tokens the engine did not reuse).",
            "histogram",
        )
        for label, row in self.predictions.items():
            predicted.add_metric([label], row[0])
            reported.add_metric([label], row[1])
            acc = 0
            for bound, n in zip(_ERROR_BOUNDS, row[2:], strict=True):
                acc += n
                error.add_sample(f"{name}_bucket", {"backend": label, "le": bound}, acc)
            # No _sum: Histogram leaves it out when a bucket bound is negative.
            error.add_sample(f"{name}_count", {"backend": label}, acc)
        yield predicted
        yield reported
        yield error


def _event_bus_metrics(bus: dict[str, Any]) -> Iterator[Any]:
    """Push mode (``dynamo.event_bus``): sessions and streams, from the registry's counters."""
    yield GaugeMetricFamily(
        "continuum_event_bus_open_sessions",
        "Listener sessions open on the event bus.",
        len(bus["sessions"]),
    )
    sessions = CounterMetricFamily(
        "continuum_event_bus_sessions",
        "Event bus sessions by outcome: opened, rejected (authentication or authorisation), "
        "forbidden (ended by a hot reload).",
        labels=["outcome"],
    )
    for outcome in ("opened", "rejected", "forbidden"):
        sessions.add_metric([outcome], bus.get(f"sessions_{outcome}", 0))
    yield sessions
    yield CounterMetricFamily(
        "continuum_event_bus_subscribes",
        "Streams the router asked a listener for.",
        bus.get("subscribes", 0),
    )
    yield CounterMetricFamily(
        "continuum_event_bus_no_session",
        "Source requests no live listener session announced (retried at a flat interval).",
        bus.get("no_session", 0),
    )
    yield CounterMetricFamily(
        "continuum_event_bus_calls_over_cap",
        "Session/Stream calls refused RESOURCE_EXHAUSTED at max_sessions / max_streams.",
        bus.get("calls_over_cap", 0),
    )
    closes = CounterMetricFamily(
        "continuum_event_bus_stream_closes",
        "Event bus streams ended, by reason: buffer_overflow, draining, unsubscribed, error,"
        " rejected (by the router), other (any other text the listener sent).",
        labels=["reason"],
    )
    for reason, n in sorted(bus.get("stream_closes", {}).items()):
        closes.add_metric([reason], n)
    yield closes


class RouterMetrics:
    def __init__(self, pool_ref: Callable[[], BackendPool]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self._pool_ref = pool_ref
        self.prefix_requests = Counter(
            "continuum_prefix_routing_requests",
            "PrefixAwareHash decisions (prefix_hash, overflow, fallback); counted once per "
            "selection and only when PrefixAwareHash runs.",
            ["strategy"],
            registry=self.registry,
        )
        self._decisions = {d: self.prefix_requests.labels(d) for d in _DECISIONS}
        self.requests = Counter(
            "continuum_requests",
            "Client requests by endpoint, backend and HTTP status.",
            ["endpoint", "backend", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "continuum_request_duration_seconds",
            "Time from request received to response headers (streams: first byte).",
            ["endpoint", "backend", "status"],
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.http_rejected = Counter(
            "continuum_http_rejected",
            "Requests answered by the HTTP server itself: body_timeout (408), overloaded "
            "(503, over server.max_concurrent_requests), too_large (413).",
            ["reason"],
            registry=self.registry,
        )
        self._rejected = {r: self.http_rejected.labels(r) for r in _REJECT_REASONS}
        self.http_in_flight = Gauge(
            "continuum_http_requests_in_flight",
            "Requests the HTTP server is handling, reading their bodies included.",
            registry=self.registry,
        )
        self.config_reloads = Counter(
            "continuum_config_reloads",
            "Hot reloads (SIGHUP or file change): applied, or rejected (the running config "
            "kept: invalid file, unreadable or not UTF-8, or a failure applying it).",
            ["result"],
            registry=self.registry,
        )
        self._reload_results = {
            True: self.config_reloads.labels("applied"),
            False: self.config_reloads.labels("rejected"),
        }
        self.upstream_retries = Counter(
            "continuum_upstream_retries",
            "Requests retried on another backend after a connect failure.",
            ["backend"],
            registry=self.registry,
        )
        self.kv_decisions = Counter(
            "continuum_kv_index_routing_decisions",
            "Selections where the KV scorer ran: kv_aware (it chose) or fallback (strategy).",
            ["decision", "tier"],
            registry=self.registry,
        )
        self._kv_children = {
            (d, t): self.kv_decisions.labels(d, t)
            for d in ("kv_aware", "fallback")
            for t in ("gpu_hot", "storage_warm", "none")
        }
        self.kv_overlap = Histogram(
            "continuum_kv_index_overlap_score",
            "Winning composite score of kv_aware decisions.",
            buckets=(0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0),
            registry=self.registry,
        )
        self.conversation = _ConversationSeries()
        """Conversation-depth routing's per-request series (plain integers, read at scrape
        time by a collector)."""
        self._prediction_rows: dict[str, list[int]] = {}
        """Each recorded backend's row of ``conversation.predictions`` (by its label)."""
        self.registry.register(self.conversation)
        self.registry.register(_PoolCollector(pool_ref))
        self._children: dict[tuple[str, str, str], tuple[Any, Any]] = {}

    def prefix_decision(self, decision: str) -> None:
        self._decisions[decision].inc()

    def _backend_label(self, backend: str | None) -> str:
        if backend is None:
            return _NO_BACKEND
        pool = self._pool_ref()
        return backend if pool.get(backend) is not None else _NO_BACKEND

    def observe(self, endpoint: str, backend: str | None, status: int, seconds: float) -> None:
        key = (endpoint, backend or _NO_BACKEND, str(status))
        pair = self._children.get(key)
        if pair is None:
            ep = endpoint if endpoint in _ENDPOINTS else "other"
            st = key[2] if key[2] in _STATUSES else "other"
            label = (ep, self._backend_label(backend), st)
            pair = (self.requests.labels(*label), self.latency.labels(*label))
            if len(self._children) > 10_000:
                self._children.clear()
            self._children[key] = pair
        pair[0].inc()
        pair[1].observe(seconds)

    def kv_decision(self, decision: str, tier: str, score: float | None) -> None:
        self._kv_children[(decision, tier if tier in ("gpu_hot", "storage_warm") else "none")].inc()
        if score is not None:
            self.kv_overlap.observe(score)

    def kv_conversation_decision(self, outcome: str) -> None:
        outcomes = self.conversation.outcomes
        if outcome in outcomes:
            outcomes[outcome] += 1

    def kv_prediction(self, backend: str, predicted: int, reported: int) -> None:
        """One answered request: predicted and reported cached tokens (``KvRuntime``'s
        ``on_prediction``)."""
        row = self._prediction_rows.get(backend)
        if row is None:
            row = self.conversation.row(self._backend_label(backend))
            if len(self._prediction_rows) < 4096:
                self._prediction_rows[backend] = row
        row[0] += predicted if predicted > 0 else 0
        row[1] += reported if reported > 0 else 0
        row[2 + bisect_left(_ERROR_BUCKETS, reported - predicted)] += 1

    def _cache_metrics(self) -> None:
        if hasattr(self, "cache_requests"):
            return
        self.cache_requests = Counter(
            "continuum_response_cache_requests",
            "Chat completions by response cache result: hit, miss, or skip (not cacheable).",
            ["result"],
            registry=self.registry,
        )
        self._cache_results = {r: self.cache_requests.labels(r) for r in ("hit", "miss", "skip")}
        self.cache_redis_latency = Histogram(
            "continuum_cache_redis_latency_seconds",
            "Redis command latency of the response cache.",
            ["operation"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.1, 1.0),
            registry=self.registry,
        )
        self.cache_redis_errors = Counter(
            "continuum_cache_redis_errors",
            "Redis errors of the response cache by kind (connection, timeout, other).",
            ["kind"],
            registry=self.registry,
        )
        self.cache_fallback = Gauge(
            "continuum_cache_fallback_active",
            "1 while the response cache serves from its in-memory fallback (Redis down).",
            registry=self.registry,
        )
        self.cache_fallback_switches = Counter(
            "continuum_cache_fallback_switches",
            "Switches of the response cache to its in-memory fallback (outages, failovers).",
            registry=self.registry,
        )

    def cache_result(self, result: str) -> None:
        self._cache_results[result].inc()

    def cache_store_hooks(self) -> dict[str, Any]:
        """Callables the cache store feeds; label values restricted to fixed sets."""
        from .cache.store import ERROR_KINDS, OPERATIONS

        self._cache_metrics()
        latencies = {op: self.cache_redis_latency.labels(op) for op in (*OPERATIONS, "other")}
        errors = {k: self.cache_redis_errors.labels(k) for k in (*ERROR_KINDS, "other")}

        def latency(operation: str, seconds: float) -> None:
            latencies.get(operation, latencies["other"]).observe(seconds)

        def error(kind: str) -> None:
            errors.get(kind, errors["other"]).inc()

        def fallback(active: bool) -> None:
            self.cache_fallback.set(1 if active else 0)
            if active:
                self.cache_fallback_switches.inc()

        return {"observe_latency": latency, "count_error": error, "on_fallback_change": fallback}

    def attach_kv(self, source: Callable[[], dict[str, Any]]) -> None:
        self.registry.register(_KvCollector(source))

    def config_reload(self, applied: bool) -> None:
        self._reload_results[applied].inc()

    def rejected(self, reason: str) -> None:
        self._rejected[reason].inc()

    def attach_http(self, in_flight: Callable[[], int]) -> None:
        """The HTTP server's in-flight count, read at scrape time."""
        self.http_in_flight.set_function(in_flight)

    def retry(self, backend: str) -> None:
        self.upstream_retries.labels(self._backend_label(backend)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
