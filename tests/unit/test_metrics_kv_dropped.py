"""``continuum_kv_event_dropped_total``: what a dashboard's
``sum by (backend) (rate(continuum_kv_event_dropped_total[5m]))`` adds up per backend.

The series come from the consumers' counters (``router.ingest.ConsumerStats``): invalid
and oversized records, streams the listener closed for ``buffer_overflow`` and resyncs
that replaced held state, each its own ``reason``, every backend its own series.
"""

from __future__ import annotations

from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from router.config import parse_config
from router.ingest import ConsumerStats
from router.metrics import RouterMetrics
from router.pool import BackendPool

NAME = "continuum_kv_event_dropped"


def metrics(consumers: dict[str, dict[str, Any]]) -> RouterMetrics:
    cfg, _ = parse_config({"backends": [{"name": "a", "url": "http://127.0.0.1:9"}]})
    pool = BackendPool(cfg.backends, cfg.health_check)
    m = RouterMetrics(lambda: pool)
    m.attach_kv(lambda: {"consumers": consumers, "index": {}, "prefill_tokens": {}})
    return m


def counters(**kw: int) -> dict[str, Any]:
    st = ConsumerStats("x")
    for name, value in kw.items():
        setattr(st, name, value)
    return st.as_dict()


def samples(m: RouterMetrics) -> dict[tuple[str, str], float]:
    out: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        if fam.name == NAME:
            for s in fam.samples:
                if s.name == NAME + "_total":
                    out[(s.labels["backend"], s.labels["reason"])] = s.value
    return out


def test_every_kind_of_drop_is_a_reason_of_its_backend() -> None:
    m = metrics(
        {
            "sim-1": counters(dropped=5, overflows=2, stream_overflows=3, resync_losses=1),
            "sim-2": counters(stream_overflows=7),
        }
    )
    got = samples(m)
    assert got == {
        ("sim-1", "invalid"): 3.0,
        ("sim-1", "oversized"): 2.0,
        ("sim-1", "stream_overflow"): 3.0,
        ("sim-1", "resync"): 1.0,
        ("sim-2", "invalid"): 0.0,
        ("sim-2", "oversized"): 0.0,
        ("sim-2", "stream_overflow"): 7.0,
        ("sim-2", "resync"): 0.0,
    }
    by_backend: dict[str, float] = {}
    for (backend, _reason), v in got.items():
        by_backend[backend] = by_backend.get(backend, 0.0) + v
    assert by_backend == {"sim-1": 9.0, "sim-2": 7.0}  # sum by (backend)


def test_a_backend_without_drops_still_has_its_series() -> None:
    # rate() over a series that appears only at the first drop misses that drop.
    got = samples(metrics({"sim-1": counters()}))
    assert set(got) == {("sim-1", r) for r in ("invalid", "oversized", "stream_overflow", "resync")}
    assert set(got.values()) == {0.0}
