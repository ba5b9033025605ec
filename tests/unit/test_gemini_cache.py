"""Gemini context cache: config, the entry map, eligibility, and the lifecycle manager.

The manager runs against the Gemini API simulator over real loopback HTTP, with its
clocks injected, so ttl-driven behaviour (extend on hit, expiry) needs no waiting.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.prefix_key import compute_prefix_key
from harness.gemini_sim import GeminiSim
from router.config import BackendConfig, ConfigError, GeminiContextCacheConfig, parse_config
from router.gemini.api import is_stale_reference, parse_cached_content, parse_timestamp
from router.gemini.entries import ContextCacheMap
from router.gemini.manager import GeminiContextCache, eligible_prefix
from router.pool import Backend
from router.upstream import UpstreamClient

MODEL = "gemini-2.5-flash"


# -- config ------------------------------------------------------------------------------


def test_config_defaults() -> None:
    cfg, _ = parse_config({})
    g = cfg.gemini_context_cache
    assert g.model_dump() == {
        "enabled": False,
        "min_prefix_bytes": 16384,
        "ttl": "10m",
        "extend_on_hit": False,
        "max_entries": 1000,
        "create_timeout_ms": 5000,
        "negative_ttl_seconds": 600,
        "prefer_native_api": False,
    }
    assert g.ttl_seconds == 600


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("min_prefix_bytes", 1023, "greater than or equal to 1024"),
        ("ttl", "59s", "at least 60s"),
        ("ttl", "ten minutes", "expected a duration"),
        ("max_entries", 9, "greater than or equal to 10"),
        ("max_entries", 1_000_001, "less than or equal to 1000000"),
        ("create_timeout_ms", 499, "greater than or equal to 500"),
        ("create_timeout_ms", 60_001, "less than or equal to 60000"),
        ("negative_ttl_seconds", 0, "greater than or equal to 1"),
        ("extend_on_hit", "sometimes", "boolean"),
        ("unknown_field", 1, "unknown field"),
    ],
)
def test_config_errors_name_the_path(field: str, value: Any, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_config({"gemini_context_cache": {field: value}})
    text = str(err.value)
    assert f"gemini_context_cache.{field}" in text and message in text


def test_config_edges_accepted() -> None:
    cfg, _ = parse_config(
        {
            "gemini_context_cache": {
                "min_prefix_bytes": 1024,
                "ttl": "60s",
                "max_entries": 10,
                "create_timeout_ms": 500,
                "negative_ttl_seconds": 1,
            }
        }
    )
    assert cfg.gemini_context_cache.ttl_seconds == 60


# -- the map -----------------------------------------------------------------------------


def key(i: int) -> tuple[str, bytes]:
    return ("b", bytes([i]) * 32)


def test_map_lru_evicts_least_recent_and_returns_live() -> None:
    m = ContextCacheMap(3)
    for i in range(3):
        assert m.put_live(key(i), f"cachedContents/{i}", 100.0, 60.0, 10, 0.0) == []
    assert m.lookup(key(0), 1.0)[0] == "hit"  # 0 is now the most recent
    evicted = m.put_live(key(3), "cachedContents/3", 100.0, 60.0, 10, 1.0)
    assert [e.name for e in evicted] == ["cachedContents/1"]
    assert len(m) == 3 and m.lookup(key(1), 1.0)[0] == "miss"


def test_map_expired_negatives_go_first() -> None:
    m = ContextCacheMap(3)
    m.put_live(key(0), "cachedContents/0", 100.0, 60.0, 10, 0.0)
    m.put_negative(key(1), 5.0, 0.0)  # expires at 5
    m.put_live(key(2), "cachedContents/2", 100.0, 60.0, 10, 0.0)
    assert m.negatives == 1
    # At t=6 the rejection is over: it makes room, the older live entry stays.
    assert m.put_live(key(3), "cachedContents/3", 100.0, 60.0, 10, 6.0) == []
    assert m.negatives == 0 and m.live_count == 3
    assert m.lookup(key(0), 6.0)[0] == "hit"


def test_map_negative_and_expiry() -> None:
    m = ContextCacheMap(10)
    m.put_negative(key(1), 10.0, 0.0)
    assert m.lookup(key(1), 9.0)[0] == "negative"
    assert m.lookup(key(1), 10.0)[0] == "miss" and m.negatives == 0
    m.put_live(key(2), "cachedContents/2", 50.0, 60.0, 10, 0.0)
    assert m.lookup(key(2), 47.0)[0] == "hit"
    assert m.lookup(key(2), 48.5)[0] == "miss"  # within the safety margin of expiry
    assert len(m) == 0


def test_map_drop_only_named() -> None:
    m = ContextCacheMap(10)
    m.put_live(key(1), "cachedContents/new", 50.0, 60.0, 10, 0.0)
    assert m.drop(key(1), "cachedContents/old") is None
    assert m.drop(key(1), "cachedContents/new") is not None
    assert m.clear() == []


@given(
    st.lists(
        st.tuples(st.integers(0, 30), st.booleans(), st.floats(0, 100, allow_nan=False)),
        max_size=200,
    )
)
def test_map_bound_and_gauge_hold(ops: list[tuple[int, bool, float]]) -> None:
    m = ContextCacheMap(10)
    now = 0.0
    for i, live, t in ops:
        now += 1
        if live:
            m.put_live(key(i), f"cachedContents/{i}-{now}", now + t, 60.0, 1, now)
        else:
            m.put_negative(key(i), now + t, now)
        m.lookup(key((i * 7) % 31), now)
        assert len(m) <= 10
        assert m.negatives == sum(1 for e in m.entries() if not e.live)


# -- eligibility and digest --------------------------------------------------------------


def body(system: Any, *rest: dict[str, Any], **extra: Any) -> dict[str, Any]:
    msgs = [{"role": "system", "content": system}, *rest] if system is not None else list(rest)
    if not rest:
        msgs.append({"role": "user", "content": "hi"})
    return {"model": MODEL, "messages": msgs, **extra}


def test_digest_is_the_prefix_key_over_the_whole_system_prompt() -> None:
    system = "é" * 3000  # 6000 bytes: no truncation at 1024 as Tier 1 would
    got = eligible_prefix(body(system), "models/" + MODEL, 4096)
    assert got is not None
    assert got.digest == compute_prefix_key(MODEL, "S", system, None)
    assert got.digest != compute_prefix_key(MODEL, "S", system, 1024)
    assert got.system == system and got.model == MODEL
    parts = [{"type": "text", "text": "a" * 3000}, {"type": "text", "text": "b" * 3000}]
    assert eligible_prefix(body(parts), MODEL, 4096) is not None


@pytest.mark.parametrize(
    "req",
    [
        body("x" * 4095),  # under min_prefix_bytes
        body(None, {"role": "user", "content": "x" * 9000}),  # no system prompt
        body("x" * 5000, {"role": "user", "content": "q"}, {"role": "system", "content": "2"}),
        body("x" * 5000, tools=[{"type": "function", "function": {"name": "f"}}]),
        body([{"type": "text", "text": "x" * 5000}, {"type": "image_url", "image_url": "u"}]),
        {"model": MODEL, "messages": [{"role": "system", "content": "x" * 5000}]},
        {"model": MODEL, "messages": "not a list"},
        body("x" * 5000, extra_body={"google": {"cached_content": "cachedContents/own"}}),
        {**body("x" * 5000), "system": "a top-level system is not OpenAI's"},
    ],
)
def test_ineligible(req: dict[str, Any]) -> None:
    assert eligible_prefix(req, MODEL, 4096) is None


# -- wire parsing ------------------------------------------------------------------------


def test_parse_cached_content() -> None:
    got = parse_cached_content(
        b'{"name": "cachedContents/abc123", "model": "models/m", '
        b'"expireTime": "2026-01-01T00:10:00.500Z", "usageMetadata": {"totalTokenCount": 2048}}'
    )
    assert got.name == "cachedContents/abc123" and got.token_count == 2048
    assert got.expire_time == parse_timestamp("2026-01-01T00:10:00Z") + 0.5


@pytest.mark.parametrize(
    "data",
    [b"", b"[]", b"{}", b'{"name": "files/x"}', b'{"name": "cachedContents/../x"}', b"\xff"],
)
def test_parse_cached_content_rejects(data: bytes) -> None:
    with pytest.raises(ValueError):
        parse_cached_content(data)


def test_parse_timestamp_forms() -> None:
    assert parse_timestamp("1970-01-01T00:00:01Z") == 1.0
    assert parse_timestamp("1970-01-01T01:00:01+01:00") == 1.0
    assert abs(parse_timestamp("1970-01-01T00:00:00.123456789Z") - 0.123456789) < 1e-9
    for bad in ("", "yesterday", "1970-01-01 00:00:00Z", "1970-01-01T00:00:00"):
        with pytest.raises(ValueError):
            parse_timestamp(bad)


@given(st.text(max_size=40))
def test_parse_timestamp_never_crashes_otherwise(text: str) -> None:
    try:
        parse_timestamp(text)
    except ValueError:
        pass


def test_stale_reference_classification() -> None:
    assert is_stale_reference(404, b"")
    msg = b'{"error": {"code": 403, "message": "CachedContent not found (or permission denied)"}}'
    assert is_stale_reference(403, msg)
    assert not is_stale_reference(403, b'{"error": {"message": "API key not valid"}}')
    assert not is_stale_reference(400, b"{}")


# -- the manager against the simulator ---------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.mono = 1000.0
        self.offset = 0.0

    def monotonic(self) -> float:
        return self.mono + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds


@pytest.fixture
async def sim() -> AsyncIterator[GeminiSim]:
    async with GeminiSim(min_cache_tokens=1024, api_key="k") as s:
        yield s


@pytest.fixture
async def client() -> AsyncIterator[UpstreamClient]:
    c = UpstreamClient(2.0, 5.0)
    await c.start()
    yield c
    await c.close()


def make(
    sim: GeminiSim, client: UpstreamClient, clock: Clock, **cfg: Any
) -> tuple[GeminiContextCache, Backend]:
    import os

    os.environ["GEMINI_UNIT_KEY"] = "k"
    b = Backend(
        BackendConfig(
            name="g", url=sim.url, type="gemini", models=[MODEL], api_key_env="GEMINI_UNIT_KEY"
        ),
        0,
    )
    config = GeminiContextCacheConfig(enabled=True, min_prefix_bytes=4096, **cfg)
    import time

    real_wall = time.time

    def wall() -> float:
        return real_wall() + clock.offset

    return GeminiContextCache(config, client, clock=clock.monotonic, wall=wall), b


async def settle(cache: GeminiContextCache) -> None:
    while cache._tasks:
        await asyncio.gather(*list(cache._tasks), return_exceptions=True)


def prefix(tag: str) -> Any:
    got = eligible_prefix(body(f"{tag} " + "x" * 5000), MODEL, 4096)
    assert got is not None
    return got


async def test_extend_on_hit(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock, extend_on_hit=True, ttl="100s")
    p = prefix("extend")
    assert cache.plan(b, p) is None
    await settle(cache)
    entry = cache.plan(b, p)
    assert entry is not None and entry.name in sim.resources
    await settle(cache)
    assert not [r for r in sim.log if r["method"] == "PATCH"]  # 100% of the ttl left
    clock.advance(79)  # 21% left: still no extension
    assert cache.plan(b, p) is not None
    await settle(cache)
    assert not [r for r in sim.log if r["method"] == "PATCH"]
    clock.advance(2)  # 19% left
    sim.time_offset = clock.offset  # the simulator's clock moves alike
    assert cache.plan(b, p) is not None
    assert cache.plan(b, p) is not None  # one PATCH in flight at a time
    await settle(cache)
    patches = [r for r in sim.log if r["method"] == "PATCH"]
    assert len(patches) == 1
    assert patches[0]["path"] == f"/v1beta/{entry.name}?updateMask=ttl"
    assert patches[0]["body"] == {"ttl": "100s"}
    assert entry.expires_at - clock.monotonic() > 95
    assert cache.totals.extends == 1
    await cache.close()


async def test_extend_off_by_default(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock, ttl="100s")
    p = prefix("no-extend")
    cache.plan(b, p)
    await settle(cache)
    clock.advance(90)
    assert cache.plan(b, p) is not None
    await settle(cache)
    assert not [r for r in sim.log if r["method"] == "PATCH"]
    clock.advance(9)  # past expiry (minus the margin): a miss, created again
    assert cache.plan(b, p) is None
    await settle(cache)
    assert cache.totals.creates == 2
    await cache.close()


async def test_negative_cache_expires(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock, negative_ttl_seconds=30)
    sim.min_cache_tokens = 100_000
    p = prefix("neg")
    cache.plan(b, p)
    await settle(cache)
    assert cache.map.negatives == 1 and cache.totals.create_failures == 1
    assert cache.plan(b, p) is None and cache.totals.negative == 1
    assert not cache._tasks  # no create while rejected
    clock.advance(31)
    sim.min_cache_tokens = 1024
    assert cache.plan(b, p) is None  # a miss again: one more create
    await settle(cache)
    assert cache.plan(b, p) is not None
    await cache.close()


async def test_create_timeout_is_transient(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock, create_timeout_ms=500, negative_ttl_seconds=600)
    sim._hold = asyncio.Event()  # the create never answers
    try:
        cache.plan(b, prefix("slow"))
        assert cache.in_flight == 1
        await settle(cache)
    finally:
        sim._hold.set()
    assert cache.in_flight == 0 and cache.totals.create_failures == 1
    (entry,) = cache.map.entries()
    assert not entry.live and entry.expires_at - clock.monotonic() <= 60  # retried soon
    await cache.close()


async def test_eviction_and_clear_delete_remotely(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock, max_entries=10)
    prefixes = [prefix(f"p{i}") for i in range(11)]
    for p in prefixes[:10]:
        cache.plan(b, p)
        await settle(cache)
    assert len(sim.resources) == 10
    first = cache.plan(b, prefixes[0])  # recently used: survives
    assert first is not None
    cache.plan(b, prefixes[1])
    second_name = cache.map.entries()[1].name
    cache.plan(b, prefixes[10])
    await settle(cache)
    assert cache.totals.evictions == 1
    deletes = [r["path"] for r in sim.log if r["method"] == "DELETE"]
    assert len(deletes) == 1 and first.name not in deletes[0]
    assert len(sim.resources) == 10 and second_name in sim.resources
    assert await cache.clear() == 10
    assert sim.resources == {}
    assert cache.stats()["entries"] == 0
    await cache.close()


async def test_clear_during_create_does_not_refill(sim: GeminiSim, client: UpstreamClient) -> None:
    clock = Clock()
    cache, b = make(sim, client, clock)
    sim._hold = asyncio.Event()
    cache.plan(b, prefix("racing"))
    assert sim.create_arrived is not None
    await sim.create_arrived.wait()
    assert await cache.clear() == 0
    sim._hold.set()
    sim._hold = None
    await settle(cache)
    assert len(cache.map) == 0 and sim.resources == {}  # created, then deleted at once
    await cache.close()


async def test_stats_shape(sim: GeminiSim, client: UpstreamClient) -> None:
    cache, b = make(sim, client, Clock())
    cache.plan(b, prefix("stats"))
    stats = cache.stats()
    assert stats["in_flight"] == 1
    await settle(cache)
    stats = cache.stats()
    assert set(stats) == {
        "enabled",
        "config",
        "entries",
        "negative_entries",
        "in_flight",
        "backends",
        "counters",
    }
    assert stats["entries"] == 1 and stats["backends"]["g"]["entries"] == 1
    assert set(stats["counters"]) >= {
        "hit",
        "miss",
        "ineligible",
        "negative",
        "creates",
        "create_failures",
        "evictions",
        "cached_tokens",
    }
    await cache.close()
