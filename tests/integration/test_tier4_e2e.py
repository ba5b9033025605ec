"""Tier 4 end to end: engines -> KV listener -> router index -> KV-aware routing.

Real processes and sockets only: two simulated engines (``sim-1``, ``sim-2``) with
Qwen2's real tokenizer publish vLLM KV events on their own ZMQ ports (each with its own
replay port); the real ``continuum-kv-listener`` turns them into prefix-level events on
``GET /events/<backend>``; the real router consumes those streams into its KV index and
routes with the KvOverlapScorer in front of ``RoundRobin``.

A prefix is "warmed" on one engine by sending the request to that engine directly, so
only the index can tell the router where it is. Precise index state is read with the
router's own ``KvIndex.Query`` gRPC; admin JSON and metrics are checked as an operator
would. Every wait polls with a bound; nothing sleeps a fixed time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.prefix_key import extract_prefix_key
from bus.salt import SALT_PREFIX, SaltError, verify_salt
from harness.procs import Service, free_port
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_json

from .conftest import (
    RouterLauncher,
    RouterProc,
    StartRouter,
    http,
    metric_value,
    wait_until,
)

pytest.importorskip("tokenizers")

pytest_plugins = ("tests.redis_fixture",)

MODEL = "demo-model"
NAMES = ("sim-1", "sim-2")
SALT_ENV = "CONTINUUM_SALT_SECRET"
SECRET = "tier4-e2e-salt-secret-0123456789"
DECISIONS = "continuum_kv_index_routing_decisions_total"
KEY_PREFIX = "cr:kvidx:"
PREPARE_TTL_S = 0.1  # router/kvindex/scorer.py: a prefix's lookup is reused for 100 ms

# Long enough that the system turn's end lands in a full block (engines publish only
# full blocks), so the listener can attribute the chain to the system prompt's key.
LONG_QUESTION = "Please explain, step by step and with examples, " * 6


def long_system(tag: str) -> str:
    return f"You are assistant {tag}. " + " ".join(f"rule-{tag}-{i}" for i in range(60))


def sys_req(tag: str, question: str = LONG_QUESTION) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": long_system(tag)},
            {"role": "user", "content": question},
        ],
    }


def prefix_of(body: Mapping[str, Any]) -> str:
    key = extract_prefix_key(body)
    assert key is not None
    return key.hex()


# -- the listener process ----------------------------------------------------------------


class Listener(Service):
    """``python -m listener``; restartable on the same port (``listen`` is pinned after
    the first start)."""

    def __init__(self, config: dict[str, Any], path: Path) -> None:
        super().__init__("listener", ["listener"], config, path, env={SALT_ENV: SECRET})

    async def start(self) -> Listener:
        await super().start()
        self.config["listen"] = self.url.removeprefix("http://")
        return self

    async def stats(self) -> dict[str, Any]:
        r = await http("GET", self.url + "/stats", total_s=5)
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data


# -- the stack ---------------------------------------------------------------------------


@dataclass
class Stack:
    fleet: SimFleet
    listener: Listener
    router: RouterProc
    kvindex: pb_grpc.KvIndexStub

    def sim_url(self, name: str) -> str:
        return self.fleet.urls[NAMES.index(name)]


def backends(fleet: SimFleet, *, salt: bool) -> list[dict[str, Any]]:
    return [
        {
            "name": name,
            "url": url,
            "type": "vllm",
            "models": [MODEL],
            # sim-1 opts in to router-issued cache salts; sim-2 does not.
            **({"cache_salt": True} if salt and name == "sim-1" else {}),
        }
        for name, url in zip(NAMES, fleet.urls, strict=True)
    ]


def event_sources(listener: Listener) -> list[dict[str, Any]]:
    return [
        {
            "backend_name": name,
            "endpoint": f"{listener.url}/events/{name}",
            "reconnect_interval_ms": 100,
        }
        for name in NAMES
    ]


async def direct(url: str, body: Mapping[str, Any]) -> None:
    """A request straight to an engine, bypassing the router."""
    r = await http("POST", url + "/v1/chat/completions", json=body)
    assert r.status == 200, r


async def warm_up(fleet: SimFleet, listener: Listener, tag: str) -> None:
    """Until the listener has a frame from every engine (ZMQ's slow joiner: batches
    published before the SUB connected are lost to the live path)."""
    for i, name in enumerate(NAMES):
        n = 0

        async def got_frame(i: int = i, name: str = name) -> bool:
            nonlocal n
            n += 1
            await direct(fleet.urls[i], sys_req(f"{tag}-{name}-{n}"))
            return (await listener.stats())["sources"][name]["frames"] > 0

        await wait_until(got_frame, within=15, interval=0.05, what=f"a frame from {name}")


@contextlib.asynccontextmanager
async def engines_and_listener(
    tmp: Path, *, tag: str = "warm", conversation: bool = False
) -> AsyncIterator[tuple[SimFleet, Listener]]:
    """The engines (each with its own KV event and replay ports) and the listener
    subscribed to them, warmed up; ``conversation``: the listener announces prompt chain
    keys as well (with the engines' ``tokenizer.json``)."""
    ports = [(free_port(), free_port()) for _ in NAMES]
    overrides = {
        i: {"kv_events": f"tcp://*:{pub}", "kv_events_replay": f"tcp://*:{replay}"}
        for i, (pub, replay) in enumerate(ports)
    }
    async with SimFleet(
        n=len(NAMES),
        model=MODEL,
        names=list(NAMES),
        tokenizer="qwen2",
        kv_events_format="vllm-0.33",
        overrides=overrides,
    ) as fleet:
        lconfig: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "salt_secret_env": SALT_ENV,
            "sources": [
                {
                    "backend_name": name,
                    "engine": "vllm",
                    "zmq_endpoint": f"tcp://127.0.0.1:{pub}",
                    "zmq_mode": "connect",
                    "replay_endpoint": f"tcp://127.0.0.1:{replay}",
                    "allowed_publishers": ["127.0.0.1"],
                    "detokenize_endpoint": f"{url}/detokenize",
                    "model": MODEL,
                    "chat_template": "chatml",
                    **({"tokenizer": str(bundled_qwen2_json())} if conversation else {}),
                }
                for name, url, (pub, replay) in zip(NAMES, fleet.urls, ports, strict=True)
            ],
        }
        if conversation:
            lconfig["conversation"] = {"enabled": True}
        listener = await Listener(lconfig, tmp / "listener.yaml").start()
        try:
            await warm_up(fleet, listener, tag)
            yield fleet, listener
        finally:
            if listener.running:
                assert await listener.stop() == 0, listener.log()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def stack(
    module_router_launcher: RouterLauncher, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[Stack]:
    tmp = tmp_path_factory.mktemp("tier4")
    async with engines_and_listener(tmp) as (fleet, listener):
        router = await module_router_launcher.start(
            {
                "server": {"grpc_listen": "127.0.0.1:0"},
                "selection_strategy": "RoundRobin",
                "prefix_routing": {"enabled": True},
                "backends": backends(fleet, salt=True),
                "kv_cache_index": {
                    "enabled": True,
                    "salt_secret_env": SALT_ENV,
                    "event_sources": event_sources(listener),
                },
            },
            env={SALT_ENV: SECRET},
        )
        assert router.grpc_target is not None
        async with grpc.aio.insecure_channel(router.grpc_target) as channel:
            st = Stack(fleet, listener, router, pb_grpc.KvIndexStub(channel))

            async def connected() -> bool:
                return all(b["connection"]["connected"] for b in await kv_backends(router))

            await wait_until(connected, within=10, what="the router's event consumers")
            yield st


# -- observation helpers -----------------------------------------------------------------


async def kv_stats(router: RouterProc) -> dict[str, Any]:
    r = await http("GET", router.url + "/admin/kv-index/stats", headers=router.admin_headers)
    assert r.status == 200, r
    data: dict[str, Any] = r.json()
    return data


async def kv_backends(router: RouterProc) -> list[dict[str, Any]]:
    r = await http("GET", router.url + "/admin/kv-index/backends", headers=router.admin_headers)
    assert r.status == 200, r
    data: list[dict[str, Any]] = r.json()["backends"]
    return data


async def holders(stub: pb_grpc.KvIndexStub, prefix: str) -> dict[str, tuple[int, int]]:
    """{backend: (token_count, tier)} of the router's index entries for ``prefix``."""
    reply = await stub.Query(pb.QueryRequest(prefix_hash=prefix), timeout=5)
    return {e.backend: (e.token_count, e.tier) for e in reply.entries}


async def wait_held(
    stub: pb_grpc.KvIndexStub, prefix: str, backend: str, within: float = 15.0
) -> None:
    async def held() -> bool:
        return backend in await holders(stub, prefix)

    await wait_until(held, within=within, what=f"{prefix[:12]}... on {backend} in the index")


async def route(router: RouterProc, body: Mapping[str, Any]) -> str:
    """One request through the router; the backend it went to."""
    r = await router.chat(body)
    assert r.status == 200, r
    return r.headers["x-continuum-backend"]


async def decisions(router: RouterProc) -> tuple[dict[str, int], dict[tuple[str, str], float]]:
    """routing_decisions of the admin stats, and the decision counters of /metrics."""
    text = await router.metrics()
    series = {
        (d, t): metric_value(text, DECISIONS, decision=d, tier=t)
        for d in ("kv_aware", "fallback")
        for t in ("gpu_hot", "storage_warm", "none")
    }
    return (await kv_stats(router))["routing_decisions"], series


async def sim_last_request(url: str) -> dict[str, Any]:
    r = await http("GET", url + "/sim/last-request")
    assert r.status == 200, r
    data: dict[str, Any] = r.json()
    return data


async def quiesce(st: Stack, within: float = 15.0) -> None:
    """Until every engine batch reached the listener, the listener has no attribution
    work queued, and the router applied every record the listener published; the same
    positions on two polls in a row."""
    last: list[Any] = []
    seen: dict[str, Any] = {}

    async def settled() -> bool:
        sims = await st.fleet.stats()
        lst = await st.listener.stats()
        reply = await st.kvindex.Backends(pb.BackendsRequest(), timeout=5)
        router_ids = {b.name: b.last_event_id for b in reply.backends}
        pos: list[Any] = []
        done = True
        for name, sim in zip(NAMES, sims, strict=True):
            src = lst["sources"][name]
            hub_id = lst["hub"]["backends"][name]["last_event_id"]
            seen[name] = {
                "engine_next_seq": sim["kv_events"]["next_seq"],
                "listener": {k: src.get(k) for k in ("last_seq", "queued_roots", "gaps",
                                                      "restarts", "forged_frames", "resyncs")},
                "hub": hub_id,
                "router": router_ids.get(name),
            }  # fmt: skip
            if src["last_seq"] != sim["kv_events"]["next_seq"] - 1 or src["queued_roots"]:
                done = False
            if router_ids.get(name) != hub_id:
                done = False
            pos.append(hub_id)
        if not done:
            return False
        settled_now = pos == last
        last[:] = pos
        return settled_now

    try:
        await wait_until(settled, within=within, interval=0.1, what="engines, listener, router")
    except AssertionError as exc:  # say which position did not meet which
        raise AssertionError(f"{exc}; positions: {seen}") from None


# -- (a) a warmed prefix is routed to the engine that holds it ---------------------------


async def test_warmed_prefix_routes_to_its_engine(stack: Stack) -> None:
    router = stack.router
    req = sys_req("t4-kv-aware")
    prefix = prefix_of(req)
    await direct(stack.sim_url("sim-2"), req)
    await wait_held(stack.kvindex, prefix, "sim-2")
    assert "sim-1" not in await holders(stack.kvindex, prefix)

    stats = await kv_stats(router)
    assert stats["enabled"] is True and stats["index"]["entry_count"] >= 1, stats
    # The admin JSON has the documented shape.
    assert set(stats) >= {
        "config",
        "index",
        "event_sources",
        "routing_decisions",
        "query_latency_count",
        "overlap_score_count",
    }, stats
    assert stats["config"]["backend"] == "memory"
    assert stats["config"]["event_sources_count"] == 2
    assert set(stats["index"]) == {"prefix_count", "entry_count", "total_hits", "total_evictions"}
    assert {s["backend_name"] for s in stats["event_sources"]} == set(NAMES)
    for src in stats["event_sources"]:
        assert src["connected"] is True and src["events_received"] > 0, src
        assert src["last_event_at"] is not None and src["last_event_at"].endswith("Z"), src

    before, series_before = await decisions(router)
    picks = [await route(router, req) for _ in range(5)]
    assert picks == ["sim-2"] * 5

    after, series_after = await decisions(router)
    assert after["kv_aware"] == before["kv_aware"] + 5, (before, after)
    assert after["fallback"] == before["fallback"], (before, after)
    assert after["total"] == after["kv_aware"] + after["fallback"]
    assert series_after[("kv_aware", "gpu_hot")] == series_before[("kv_aware", "gpu_hot")] + 5
    metrics = await router.metrics()
    assert f'{DECISIONS}{{decision="kv_aware",tier="gpu_hot"}}' in metrics


# -- (b) an engine's cache reset empties its index entries ---------------------------------


async def test_reset_prefix_cache_drops_the_engines_entries(stack: Stack) -> None:
    router = stack.router
    req = sys_req("t4-reset")
    also_on_2 = sys_req("t4-reset-also")
    on_1 = sys_req("t4-reset-sim-1")
    await direct(stack.sim_url("sim-2"), req)
    await direct(stack.sim_url("sim-2"), also_on_2)
    await direct(stack.sim_url("sim-1"), on_1)
    for body, name in ((req, "sim-2"), (also_on_2, "sim-2"), (on_1, "sim-1")):
        await wait_held(stack.kvindex, prefix_of(body), name)

    r = await http("POST", stack.sim_url("sim-2") + "/reset_prefix_cache")
    assert r.status == 200, r

    async def sim_2_forgotten() -> bool:
        for body in (req, also_on_2):
            if "sim-2" in await holders(stack.kvindex, prefix_of(body)):
                return False
        return True

    await wait_until(sim_2_forgotten, within=15, what="sim-2's entries to be dropped")
    # Only sim-2's entries: sim-1 keeps its prefix.
    assert "sim-1" in await holders(stack.kvindex, prefix_of(on_1))

    before, series_before = await decisions(router)
    await route(router, req)  # nobody holds it now: the strategy decides
    after, series_after = await decisions(router)
    assert after["fallback"] == before["fallback"] + 1, (before, after)
    assert after["kv_aware"] == before["kv_aware"], (before, after)
    assert series_after[("fallback", "none")] == series_before[("fallback", "none")] + 1


# -- (d) router-issued cache salts ---------------------------------------------------------


async def test_cache_salts_bind_backend_and_prefix(stack: Stack) -> None:
    router = stack.router
    secret = SECRET.encode()
    seen: dict[tuple[str, bool], tuple[dict[str, Any], dict[str, Any]]] = {}
    routed_at: dict[str, float] = {}
    n = 0
    for target in NAMES:
        for caller in (True, False):
            # A fresh prefix is decided by RoundRobin: send until it lands on the target.
            for _ in range(4):
                n += 1
                body = sys_req(f"t4-salt-{n}")
                if caller:
                    body["cache_salt"] = "tenant-a"
                got = await route(router, body)
                routed_at[prefix_of(body)] = time.monotonic()
                if got == target:
                    seen[(target, caller)] = (body, await sim_last_request(stack.sim_url(got)))
                    break
            assert (target, caller) in seen, f"never routed to {target}"

    # sim-1 opted in: the salt binds (sim-1, the request's prefix key), caller's salt kept.
    body, forwarded = seen[("sim-1", True)]
    salt = forwarded["cache_salt"]
    assert salt.startswith(SALT_PREFIX), forwarded
    info = verify_salt(secret, "sim-1", salt)
    assert info is not None
    assert info.prefix_key.hex() == prefix_of(body)
    assert info.caller_salt == "tenant-a"
    assert forwarded["messages"] == body["messages"]
    with pytest.raises(SaltError):  # bound to the backend: useless on another one
        verify_salt(secret, "sim-2", salt)

    body, forwarded = seen[("sim-1", False)]
    info = verify_salt(secret, "sim-1", forwarded["cache_salt"])
    assert info is not None and info.prefix_key.hex() == prefix_of(body)
    assert info.caller_salt is None

    # sim-2 did not opt in: the caller's salt passes unchanged, and none is invented.
    _, forwarded = seen[("sim-2", True)]
    assert forwarded["cache_salt"] == "tenant-a"
    _, forwarded = seen[("sim-2", False)]
    assert "cache_salt" not in forwarded

    # The listener attributes the salted chain (salt echo), so the router's index learns
    # the prefix on sim-1 and routes the same request there by KV overlap.
    body, _ = seen[("sim-1", True)]
    await wait_held(stack.kvindex, prefix_of(body), "sim-1")
    # The scorer caches each prefix's index lookup for 100 ms (its prepare snapshot), a
    # miss included: the lookup made when this request was first routed must age out.
    await asyncio.sleep(max(0.0, routed_at[prefix_of(body)] + PREPARE_TTL_S - time.monotonic()))
    before, _ = await decisions(router)
    assert [await route(router, body) for _ in range(3)] == ["sim-1"] * 3
    after, _ = await decisions(router)
    assert after["kv_aware"] == before["kv_aware"] + 3
    assert (await stack.listener.stats())["sources"]["sim-1"]["salt_failures"] == 0


# -- (c) the listener dies and comes back --------------------------------------------------


async def test_listener_restart_reconnects_without_loss_or_duplicates(stack: Stack) -> None:
    router, listener = stack.router, stack.listener
    stable = {name: sys_req(f"t4-stable-{name}") for name in NAMES}
    for name, body in stable.items():
        await direct(stack.sim_url(name), body)
    for name, body in stable.items():
        await wait_held(stack.kvindex, prefix_of(body), name)
    await quiesce(stack)
    entries_before = (await kv_stats(router))["index"]["entry_count"]
    held_before = {name: await holders(stack.kvindex, prefix_of(b)) for name, b in stable.items()}
    reconnects_before = {
        b["backend_name"]: b["connection"]["reconnect_count"] for b in await kv_backends(router)
    }

    await listener.kill()

    async def disconnected() -> bool:
        return not any(b["connection"]["connected"] for b in await kv_backends(router))

    await wait_until(disconnected, within=10, what="the router to notice the dead listener")
    await listener.start()  # same port

    # The same workload goes on: more turns under the same system prompts (new blocks,
    # same prefixes). The first live batch makes the restarted listener replay what the
    # engines published before it started.
    n = 0
    for i, name in enumerate(NAMES):

        async def got_frame(i: int = i, name: str = name) -> bool:
            nonlocal n
            n += 1
            question = f"Turn {n}: " + LONG_QUESTION + f" and then turn {n} again. " * 4
            await direct(stack.fleet.urls[i], sys_req(f"t4-stable-{name}", question))
            return (await listener.stats())["sources"][name]["frames"] > 0

        await wait_until(got_frame, within=15, interval=0.05, what=f"a frame from {name}")

    async def reconnected() -> bool:
        return all(
            b["connection"]["connected"]
            and b["connection"]["reconnect_count"] > reconnects_before[b["backend_name"]]
            for b in await kv_backends(router)
        )

    await wait_until(reconnected, within=15, what="the router's consumers to reconnect")
    await quiesce(stack)

    for b in await kv_backends(router):
        assert b["connection"]["connected"] is True, b
        assert b["connection"]["reconnect_count"] >= 1, b
    for src in (await kv_stats(router))["event_sources"]:
        assert src["connected"] is True and src["reconnect_count"] >= 1, src
    # The restarted listener relearned the engines' blocks by replay, and the router's
    # consumers resumed with an ID of the dead epoch, so each got a resync block: the index
    # was rebuilt for both backends, not merely left as it was.
    after = await listener.stats()
    for name in NAMES:
        assert after["sources"][name]["replayed_batches"] > 0, after["sources"][name]
        assert after["hub"]["backends"][name]["resync_blocks"] >= 1, after["hub"]
    # No loss: each stable prefix is still held by its engine (with more tokens now)...
    for name, body in stable.items():
        now = await holders(stack.kvindex, prefix_of(body))
        assert set(now) == set(held_before[name]) == {name}, (name, now, held_before)
        assert now[name][0] >= held_before[name][name][0]
    # ...and no duplicates: the same workload, the same number of entries.
    assert (await kv_stats(router))["index"]["entry_count"] == entries_before
    # Routing still uses it.
    assert await route(router, stable["sim-2"]) == "sim-2"


# -- (e) one Redis index shared by two routers ----------------------------------------------


async def _delete_index_keys(url: str) -> None:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        keys = [k async for k in client.scan_iter(match=KEY_PREFIX + "*", count=1000)]
        if keys:
            await client.delete(*keys)
    finally:
        await client.aclose()


@pytest.mark.redis
async def test_redis_index_is_shared_by_two_routers(
    stack: Stack, start_router: StartRouter, redis_url: str
) -> None:
    await _delete_index_keys(redis_url)
    try:
        common = {
            "server": {"grpc_listen": "127.0.0.1:0"},
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "backends": backends(stack.fleet, salt=False),
            "response_cache": {"redis": {"url": redis_url}},
        }
        a = await start_router(
            {
                **common,
                "kv_cache_index": {
                    "enabled": True,
                    "backend": "redis",
                    "event_sources": event_sources(stack.listener),
                },
            }
        )
        b = await start_router({**common, "kv_cache_index": {"enabled": True, "backend": "redis"}})
        assert (await kv_stats(a))["config"]["event_sources_count"] == 2
        assert (await kv_stats(b))["config"]["event_sources_count"] == 0
        assert (await kv_stats(b))["config"]["backend"] == "redis"
        assert await kv_backends(b) == []

        req = sys_req("t4-redis-shared")
        prefix = prefix_of(req)
        await direct(stack.sim_url("sim-1"), req)
        assert b.grpc_target is not None
        async with grpc.aio.insecure_channel(b.grpc_target) as channel:
            # B consumes no events: only the shared Redis can tell it.
            await wait_held(pb_grpc.KvIndexStub(channel), prefix, "sim-1")

        from redis.asyncio import Redis

        client = Redis.from_url(redis_url)
        try:
            # The member names the backend's current generation (a resync swaps it).
            gen: bytes | None = await client.hget(KEY_PREFIX + "#gens", "sim-1")  # type: ignore[assignment]
            member = "sim-1" if gen is None else f"sim-1@{gen.decode()}"
            assert await client.zscore(KEY_PREFIX + prefix, member)
        finally:
            await client.aclose()

        b_before = (await kv_stats(b))["routing_decisions"]
        picks_b = [await route(b, req) for _ in range(3)]
        b_after = (await kv_stats(b))["routing_decisions"]
        a_before = (await kv_stats(a))["routing_decisions"]
        picks_a = [await route(a, req) for _ in range(3)]
        a_after = (await kv_stats(a))["routing_decisions"]

        assert picks_b == picks_a == ["sim-1"] * 3
        assert b_after["kv_aware"] == b_before["kv_aware"] + 3, (b_before, b_after)
        assert a_after["kv_aware"] == a_before["kv_aware"] + 3, (a_before, a_after)
        assert b_after["fallback"] == b_before["fallback"]
    finally:
        await _delete_index_keys(redis_url)


# -- hot reload: Tier 4 turned on, event sources added, restart-only fields kept -----------


async def test_reload_adds_an_event_source_and_turns_tier4_on(
    stack: Stack, start_router: StartRouter
) -> None:
    """An operator starts with prefix routing off and one event source, then reloads:
    the second source is consumed (its snapshot fills the index) without the first one
    reconnecting; prefix_routing.enabled on routes on the index at once; a scoring
    change is logged as restart-only and not applied."""
    config: dict[str, Any] = {
        "server": {"grpc_listen": "127.0.0.1:0"},
        "selection_strategy": "RoundRobin",
        "prefix_routing": {"enabled": False},
        "backends": backends(stack.fleet, salt=False),
        "kv_cache_index": {"enabled": True, "event_sources": event_sources(stack.listener)[:1]},
    }
    router = await start_router(config)
    async with grpc.aio.insecure_channel(router.grpc_address) as channel:
        stub = pb_grpc.KvIndexStub(channel)
        req = sys_req("t4-reload")
        prefix = prefix_of(req)
        await direct(stack.sim_url("sim-2"), req)

        async def connected(names: set[str]) -> bool:
            live = {
                b["backend_name"] for b in await kv_backends(router) if b["connection"]["connected"]
            }
            return live == names

        await wait_until(lambda: connected({"sim-1"}), within=10, what="sim-1's consumer")
        sim1_before = next(b for b in await kv_backends(router) if b["backend_name"] == "sim-1")
        # Prefix routing off: the strategy alone decides, the index is not asked (another
        # prompt: whatever the router sends, both engines then hold).
        picks = {await route(router, sys_req("t4-reload-rr")) for _ in range(4)}
        assert picks == set(NAMES), picks
        assert (await kv_stats(router))["routing_decisions"]["total"] == 0

        both = {**config, "kv_cache_index": {**config["kv_cache_index"]}}
        both["kv_cache_index"]["event_sources"] = event_sources(stack.listener)
        assert await router.reload(both)
        await wait_until(lambda: connected(set(NAMES)), within=10, what="sim-2's consumer")
        await wait_held(stub, prefix, "sim-2")
        sim1 = next(b for b in await kv_backends(router) if b["backend_name"] == "sim-1")
        assert sim1["connection"]["reconnect_count"] == sim1_before["connection"]["reconnect_count"]
        assert sim1["events"]["received"] >= sim1_before["events"]["received"]
        assert (await kv_stats(router))["config"]["event_sources_count"] == 2

        on = {**both, "prefix_routing": {"enabled": True}}
        assert await router.reload(on)
        before, series_before = await decisions(router)
        assert [await route(router, req) for _ in range(4)] == ["sim-2"] * 4
        after, series_after = await decisions(router)
        assert after["kv_aware"] == before["kv_aware"] + 4, (before, after)
        assert series_after[("kv_aware", "gpu_hot")] == series_before[("kv_aware", "gpu_hot")] + 4
        assert "applies only after a restart" not in router.log()

        scoring = {**on, "kv_cache_index": {**on["kv_cache_index"]}}
        scoring["kv_cache_index"]["scoring"] = {"overlap_weight": 0.5, "load_weight": 0.4}
        assert await router.reload(scoring)
        log = await router.wait_for_log("kv_cache_index.scoring.overlap_weight changed")
        assert "kv_cache_index.scoring.load_weight changed; it applies only after a restart" in log
        assert [await route(router, req) for _ in range(2)] == ["sim-2"] * 2
