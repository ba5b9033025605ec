"""Tier 4 with conversation routing: the chain index beside the prefix index, its events,
decisions and accounting as admin and Prometheus report them.

``KvRuntime`` is built from a parsed config (memory indexes, no event source started);
events are applied the way its consumers apply them (``apply_events`` over both indexes).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson
import pytest

from bus.events import KvEvent
from router.admin import AdminApi
from router.admin_auth import AdminToken
from router.config import RouterConfig, parse_config
from router.http.types import Request
from router.kv_runtime import KvRuntime
from router.kvindex import (
    CHAIN_KEY_PREFIX,
    FallbackKvIndex,
    InMemoryKvIndex,
    apply_events,
)
from router.metrics import RouterMetrics
from router.pool import BackendPool
from router.redis import RedisPools
from router.selection import RoutingCounts
from tests.unit.kvindex_support import GPU, C, P, state


@dataclass
class Chain:
    keys: list[bytes]
    prompt_bytes: int
    conversation: bytes | None = None


def config(
    conversation: dict[str, Any] | None = None, extra: dict[str, Any] | None = None, **kv: Any
) -> RouterConfig:
    cfg, _ = parse_config(
        {
            **(extra or {}),
            "prefix_routing": {"enabled": True},
            "backends": [
                {"name": n, "url": f"http://h:{i + 1}", "type": "vllm", "models": ["m"]}
                for i, n in enumerate(("a", "b"))
            ],
            "kv_cache_index": {
                "enabled": True,
                "max_entries": 500,
                "entry_ttl_seconds": 60,
                "conversation": {"enabled": True, "max_entries": 2000, **(conversation or {})},
                **kv,
            },
        }
    )
    return cfg


def chain_event(kind: str, backend: str, i: int, tokens: int | None = None) -> KvEvent:
    return KvEvent(kind, backend, None, tokens, "gpu" if tokens else None, chain_key=C(i).hex())  # type: ignore[arg-type]


async def test_the_chain_index_is_built_beside_the_prefix_index() -> None:
    kv = KvRuntime(config())
    try:
        assert kv.chain_index is not None and kv.conversation is not None
        inner = kv.chain_index.inner
        assert isinstance(inner, InMemoryKvIndex)
        assert (inner.max_entries, inner.ttl_seconds) == (2000, 60.0)
        assert kv.conversation.index is kv.chain_index
        assert kv.conversation.load is kv.prefill_load
        off = KvRuntime(config({"enabled": False}))
        assert off.chain_index is None and off.conversation is None
        assert off.accuracy is not None and off.prefill_load is not None
    finally:
        await kv.stop()


async def test_redis_chain_index_has_its_own_namespace() -> None:
    pools = RedisPools()
    try:
        cfg = config(
            backend="redis",
            extra={"response_cache": {"redis": {"url": "redis://127.0.0.1:1"}}},
        )
        kv = KvRuntime(cfg, pools=pools)
        assert kv.chain_index is not None
        fb = kv.chain_index.inner
        assert isinstance(fb, FallbackKvIndex)
        assert fb.primary.key_prefix == CHAIN_KEY_PREFIX == "cr:kvchain:"
        assert fb.fallback.max_entries == 2000
        prefix = kv.index.inner
        assert isinstance(prefix, FallbackKvIndex) and prefix.primary.key_prefix == "cr:kvidx:"
        assert fb.primary.redis is prefix.primary.redis  # one shared pool
    finally:
        await pools.aclose()


async def test_events_decisions_and_accounting_reach_admin_and_metrics() -> None:
    cfg = config()
    pool = BackendPool(cfg.backends, cfg.health_check)
    metrics = RouterMetrics(lambda: pool)
    kv = KvRuntime(
        cfg,
        metrics.kv_decision,
        on_conversation_decision=metrics.kv_conversation_decision,
        on_prediction=metrics.kv_prediction,
    )
    metrics.attach_kv(kv.metrics_snapshot)
    admin = AdminApi(
        config=lambda: cfg, token=AdminToken(None), pool=pool, counts=RoutingCounts(), kv=kv
    )
    try:
        assert kv.chain_index is not None and kv.conversation is not None
        events = [
            KvEvent("cache_created", "a", P(1), 100, "gpu"),
            *(chain_event("chain_created", "a", i, 256 * (i + 1)) for i in range(4)),
            chain_event("chain_created", "b", 0, 256),
            chain_event("chain_evicted", "a", 3),
        ]
        labels = await apply_events(
            kv.index, events, cfg.kv_cache_index.storage_offloading, kv.chain_index
        )
        assert labels == ["created"] * 6 + ["evicted"]
        assert state(await kv.index.peek(P(1))) == {"a": (100, GPU)}
        cands, _ = pool.candidates("m", "chat")
        req = Chain([C(i) for i in range(6)], 6 * 1024)
        view = await kv.conversation.assess(req, cands)
        a = pool.get("a")
        assert a is not None and kv.conversation.decide(view, cands) is a
        await kv.conversation.routed(view, a)
        kv.accuracy.record("a", kv.conversation.predicted_cached_tokens(view, a), 800)
        ticket = kv.prefill_load.started("a", kv.conversation.prefill_tokens(view, a))
        assert ticket.tokens == 1536 - 768
        await kv.sweep()  # refreshes both indexes' last_stats for the scrape

        r = await admin.kv_stats(Request("GET", "/admin/kv-index/stats", "", {}, b""))
        doc = orjson.loads(r.body)
        assert doc["routing_decisions"] == {"kv_aware": 1, "fallback": 0, "total": 1}
        assert doc["prediction_accuracy"] == {
            "a": {
                "requests": 1,
                "predicted_cached_tokens": 768,
                "reported_cached_tokens": 800,
                "mean_abs_error_tokens": "32.0",
                "accuracy": "0.9600",
            }
        }
        conv = doc["conversation"]
        assert conv["config"]["chunk_bytes"] == 1024 and conv["config"]["max_entries"] == 2000
        assert conv["config"]["scoring"]["active_request_weight"] == 32
        assert conv["index"]["key_count"] == 6  # 0..2 real (a), 0 (b), 3..5 predicted (a)
        assert conv["index"]["entry_count"] == 7 and conv["index"]["queries"] == 1
        assert conv["routing_decisions"] == {
            "chosen": 1,
            "tie": 0,
            "none_held": 0,
            "total": 1,
            "capped": 0,
        }
        assert conv["predictions"] == {"keys_written": 3, "write_errors": 0}
        assert conv["prompts"] == {"tracked": 0, "one_shot": 0, "small_turns": 0}
        assert conv["cached_tokens"] == {
            "requests": 1,
            "predicted_tokens": 768,
            "reported_tokens": 800,
            "accuracy": "0.9600",
        }
        assert conv["in_flight_prefill_tokens"] == {"a": 768}
        assert doc["index"]["entry_count"] == 1  # the prefix index, untouched by chains

        text = metrics.render().decode()
        for line in (
            'continuum_kv_index_routing_decisions_total{decision="kv_aware",tier="gpu_hot"} 1.0',
            'continuum_kv_conversation_decisions_total{outcome="chosen"} 1.0',
            'continuum_kv_predicted_cached_tokens_total{backend="a"} 768.0',
            'continuum_kv_reported_cached_tokens_total{backend="a"} 800.0',
            'continuum_kv_prediction_error_tokens_bucket{backend="a",le="64.0"} 1.0',
            'continuum_kv_prediction_error_tokens_bucket{backend="a",le="16.0"} 0.0',
            "continuum_kv_chain_index_keys 6.0",
            "continuum_kv_chain_index_entries 7.0",
            'continuum_kv_in_flight_prefill_tokens{backend="a"} 768.0',
            "continuum_kv_conversation_capped_total 0.0",
        ):
            assert line in text, line
        kv.prefill_load.finished(ticket)
        kv.conversation.decide(await kv.conversation.assess(Chain([C(99)], 2048), cands), cands)
        text = metrics.render().decode()
        assert 'continuum_kv_conversation_decisions_total{outcome="none_held"} 1.0' in text
        assert (
            'continuum_kv_index_routing_decisions_total{decision="fallback",tier="none"} 1.0'
            in text
        )
    finally:
        await kv.stop()


async def test_conversation_off_leaves_the_admin_document_as_it_was() -> None:
    cfg = config({"enabled": False})
    pool = BackendPool(cfg.backends, cfg.health_check)
    kv = KvRuntime(cfg)
    admin = AdminApi(
        config=lambda: cfg, token=AdminToken(None), pool=pool, counts=RoutingCounts(), kv=kv
    )
    try:
        doc = orjson.loads((await admin.kv_stats(Request("GET", "/", "", {}, b""))).body)
        assert "conversation" not in doc and doc["prediction_accuracy"] == {}
        assert "chain_index" not in kv.metrics_snapshot()
    finally:
        await kv.stop()


@pytest.mark.parametrize("outcome", ["chosen", "tie", "none_held", "bogus"])
def test_conversation_decision_metric_labels_are_an_allow_list(outcome: str) -> None:
    cfg = config()
    pool = BackendPool(cfg.backends, cfg.health_check)
    metrics = RouterMetrics(lambda: pool)
    metrics.kv_conversation_decision(outcome)
    text = metrics.render().decode()
    assert ('outcome="bogus"' in text) is False
    if outcome != "bogus":
        assert f'continuum_kv_conversation_decisions_total{{outcome="{outcome}"}} 1.0' in text
