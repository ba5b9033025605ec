"""Conversation-depth routing's per-request series: kept as plain integers and read at
scrape time, they must expose exactly what prometheus_client's Counter and Histogram
children gave (the dashboards and alerts read those series)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from router.config import parse_config
from router.metrics import _CONVERSATION_OUTCOMES, _ERROR_BUCKETS, RouterMetrics
from router.pool import BackendPool

NAMES = ("a", "b")


def metrics() -> RouterMetrics:
    cfg, _ = parse_config(
        {"backends": [{"name": n, "url": f"http://h:{i + 1}"} for i, n in enumerate(NAMES)]}
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    return RouterMetrics(lambda: pool)


def reference(
    records: list[tuple[str, int, int]], outcomes: list[str]
) -> tuple[CollectorRegistry, str]:
    """The same records through prometheus_client's own children, as the router had them."""
    reg = CollectorRegistry(auto_describe=True)
    decisions = Counter("continuum_kv_conversation_decisions", "d", ["outcome"], registry=reg)
    children = {o: decisions.labels(o) for o in _CONVERSATION_OUTCOMES}
    predicted = Counter("continuum_kv_predicted_cached_tokens", "p", ["backend"], registry=reg)
    reported = Counter("continuum_kv_reported_cached_tokens", "r", ["backend"], registry=reg)
    error = Histogram(
        "continuum_kv_prediction_error_tokens",
        "e",
        ["backend"],
        buckets=_ERROR_BUCKETS,
        registry=reg,
    )
    for o in outcomes:
        if o in children:
            children[o].inc()
    for backend, p, r in records:
        label = backend if backend in NAMES else "none"
        predicted.labels(label).inc(max(0, p))
        reported.labels(label).inc(max(0, r))
        error.labels(label).observe(r - p)
    return reg, generate_latest(reg).decode()


def samples(text: str) -> set[str]:
    return {line for line in text.splitlines() if line and not line.startswith("#")}


def ours(m: RouterMetrics) -> set[str]:
    prefixes = (
        "continuum_kv_conversation_decisions",
        "continuum_kv_predicted_cached_tokens",
        "continuum_kv_reported_cached_tokens",
        "continuum_kv_prediction_error_tokens",
    )
    return {s for s in samples(m.render().decode()) if s.startswith(prefixes)}


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(("a", "b", "gone")),
            st.integers(-10, 40_000),
            st.integers(-10, 40_000),
        ),
        max_size=30,
    ),
    st.lists(st.sampled_from((*_CONVERSATION_OUTCOMES, "bogus")), max_size=10),
)
def test_the_series_are_the_ones_prometheus_children_give(
    records: list[tuple[str, int, int]], outcomes: list[str]
) -> None:
    m = metrics()
    for o in outcomes:
        m.kv_conversation_decision(o)
    for backend, p, r in records:
        m.kv_prediction(backend, p, r)
    _, text = reference(records, outcomes)
    assert ours(m) == samples(text)


def test_bucket_edges_count_as_prometheus_does() -> None:
    """``le`` is inclusive: an error equal to a bound falls in that bound's bucket."""
    m = metrics()
    for err in (*_ERROR_BUCKETS, 16385, -16385):
        m.kv_prediction("a", 20_000, 20_000 + err)
    _, text = reference([("a", 20_000, 20_000 + e) for e in (*_ERROR_BUCKETS, 16385, -16385)], [])
    assert ours(m) == samples(text)
    assert 'continuum_kv_prediction_error_tokens_bucket{backend="a",le="-16384.0"} 2.0' in (
        m.render().decode()
    )
