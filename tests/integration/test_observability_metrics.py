"""The dashboard and the alert rules name only series that a running router and listener export.

Real processes: two simulated engines (Qwen2 tokenizer and chat template, vLLM KV events
over ZeroMQ), the real ``continuum-kv-listener`` in conversation mode on both, and the real
router with every tier that has metrics: PrefixAwareHash, the response cache on a real
``redis-server``, the KV index pulled from the listener over SSE with anti-entropy checks,
and conversation-depth routing. Requests go through the router (one of them slow, so the
in-flight gauges have a sample while it runs); both ``/metrics`` are scraped several
times, as Prometheus would, and the union of what they showed is the inventory.

What a user relies on: every PromQL expression of ``deploy/grafana/continuum.json`` and
``deploy/prometheus/alerts.yaml`` (read by ``tests/promql.py``)

* names a series that exists (histograms by their ``_bucket``/``_count`` series,
  counters by ``_total``);
* matches only on labels that series has, and an ``=`` or ``=~`` matcher on a value the
  series really takes (``decision="kv_aware"``, ``le=~"-1024(.0)?"``);
* groups (``by``, ``on``) only by labels the expression's series have, or by the target
  labels Prometheus adds (``job``, ``instance``).

So a renamed metric or label fails here instead of leaving an empty panel or an alert that
can never fire.
"""

from __future__ import annotations

import asyncio
import re
from collections import defaultdict
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from prometheus_client.parser import text_string_to_metric_families

from harness.procs import Service, free_port
from tests import promql
from tests.redis_fixture import redis_url  # noqa: F401 - fixture

from .conftest import RouterLauncher, RouterProc, http, wait_until
from .qwen_stack import qwen2_templates, qwen_fleet

pytest.importorskip("tokenizers")

MODEL = "qwen-sim"
NAMES = ("sim-1", "sim-2")
SYSTEM = "You are the operations assistant. Answer briefly and precisely. " * 30
TARGET_LABELS = frozenset(("job", "instance"))
"""Added by Prometheus to every scraped series, never in ``/metrics`` itself."""

Inventory = dict[str, dict[str, set[str]]]
"""Sample name -> label name -> the values seen."""


def chat(question: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        "max_tokens": 8,
        "temperature": 0,
    }


def add_scrape(inventory: Inventory, text: str) -> None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = inventory.setdefault(sample.name, defaultdict(set))
            for name, value in sample.labels.items():
                labels[name].add(value)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def inventory(
    module_router_launcher: RouterLauncher,
    tmp_path_factory: pytest.TempPathFactory,
    redis_url: str,  # noqa: F811
) -> AsyncIterator[Inventory]:
    tmp = tmp_path_factory.mktemp("observability")
    engines, listener_config = qwen_fleet(NAMES, MODEL)
    async with engines as fleet:
        listener = Service(
            "listener",
            ["listener"],
            listener_config,
            tmp / "listener.yaml",
        )
        await listener.start()
        try:
            router = await module_router_launcher.start(
                {
                    "selection_strategy": "PrefixAwareHash",
                    "prefix_routing": {"enabled": True},
                    "backends": [
                        {"name": name, "url": url, "type": "vllm", "models": [MODEL]}
                        for name, url in zip(NAMES, fleet.urls, strict=True)
                    ],
                    "response_cache": {
                        "enabled": True,
                        "backend": "redis",
                        "redis": {"url": redis_url, "key_prefix": f"obs:{free_port()}:"},
                    },
                    "kv_cache_index": {
                        "enabled": True,
                        "event_sources": [
                            {
                                "backend_name": name,
                                "endpoint": f"{listener.url}/events/{name}",
                                "reconnect_interval_ms": 100,
                            }
                            for name in NAMES
                        ],
                        "anti_entropy": {"interval_seconds": 0.5},
                        "conversation": {
                            "enabled": True,
                            "templates": qwen2_templates(MODEL),
                        },
                    },
                }
            )
            yield await _traffic_and_scrapes(router, listener)
        finally:
            if listener.running:
                assert await listener.stop() == 0, listener.log()


async def _traffic_and_scrapes(router: RouterProc, listener: Service) -> Inventory:
    inventory: Inventory = {}

    async def scrape() -> None:
        add_scrape(inventory, await router.metrics())
        r = await http("GET", listener.url + "/metrics", total_s=10)
        assert r.status == 200, r
        add_scrape(inventory, r.body.decode())

    for i in range(3):  # misses, then a response cache hit for the repeated question
        r = await router.chat(chat(f"Question {i % 2}: how do I rotate the bus token?"))
        assert r.status == 200, r.body
    # One slow request: the in-flight series (prefill tokens) exist while it runs.
    slow = asyncio.create_task(
        router.chat(chat("A slow one."), headers={"x-sim-delay-ms": "3000"}, total_s=30)
    )

    async def prefilling() -> bool:
        return "continuum_kv_in_flight_prefill_tokens{" in await router.metrics()

    await wait_until(prefilling, within=10, what="a request in flight with prefill tokens")
    await scrape()
    assert (await slow).status == 200

    async def complete() -> bool:
        await scrape()
        return all(
            name in inventory
            for name in (
                "continuum_kv_prediction_error_tokens_bucket",
                "continuum_kv_index_divergence",
                "continuum_request_duration_seconds_bucket",
            )
        )

    await wait_until(complete, within=30, interval=0.5, what="predictions, an anti-entropy check")
    return inventory


def _problems(where: str, expr: str, inventory: Inventory) -> list[str]:
    refs = promql.references(expr)
    problems: list[str] = []
    seen_labels: set[str] = set(TARGET_LABELS)
    for sel in refs.selectors:
        if sel.metric not in inventory:
            problems.append(f"{where}: no series {sel.metric!r} in /metrics")
            continue
        labels = inventory[sel.metric]
        seen_labels |= set(labels)
        for label, op, value in sorted(sel.matchers):
            if label in TARGET_LABELS:
                continue
            if label not in labels:
                problems.append(f"{where}: {sel.metric} has no label {label!r}")
            elif op == "=" and value not in labels[label]:
                problems.append(f"{where}: {sel.metric}{{{label}}} never is {value!r}")
            elif op == "=~" and not any(re.fullmatch(value, v) for v in labels[label]):
                problems.append(f"{where}: {sel.metric}{{{label}=~{value!r}}} matches nothing")
    for label in sorted(refs.grouping - seen_labels):
        problems.append(f"{where}: grouping by {label!r}, which none of its series has")
    return problems


def test_every_query_names_exported_series_and_labels(inventory: Inventory) -> None:
    exprs = promql.all_expressions()
    assert len(exprs) > 40
    problems = [p for where, expr in exprs for p in _problems(where, expr, inventory)]
    assert problems == []


def test_the_check_catches_a_renamed_metric_and_label(inventory: Inventory) -> None:
    """The inventory is the real one and the check is not vacuous."""
    assert _problems("x", "sum(rate(continuum_kv_event_dropped_total[5m]))", inventory) == []
    assert _problems("x", "continuum_kv_events_dropped_total", inventory)
    assert _problems("x", 'continuum_kv_event_dropped_total{reasons="resync"}', inventory)
    assert _problems("x", 'continuum_kv_event_dropped_total{reason="resynced"}', inventory)
    assert _problems("x", "sum by (tier) (continuum_kv_event_dropped_total)", inventory)
    assert "continuum_kv_listener_events_published_total" in inventory  # the listener's


def test_the_dashboard_backend_variable_lists_the_backends(inventory: Inventory) -> None:
    assert inventory["continuum_backend_healthy"]["backend"] == set(NAMES)
