"""Several router replicas on one Redis: one response cache and one KV index, shared.

A fleet that outgrows one router runs replicas behind a load balancer; they share the
response cache and the KV index through one Redis (``response_cache.redis``,
``kv_cache_index.backend: redis``). Real processes only: simulated engines (pull) or the
salted publisher (push), the real listener, a private ``redis-server``, and two or three
real router processes consuming the same listener, each on its own stream:

* pull, three routers: an answer cached at one router is a HIT at another; a prefix
  warmed through one router is routed KV-aware by the others; the shared index equals
  the listener's state entry by entry, read through every router.
* push, two routers: one listener with ``event_bus.urls`` keeps a session with each
  router, so both consume every event; killing one router leaves the other's stream
  untouched, and the restarted one catches up on its own session.
* conversation mode, two routers: both kinds of keys (prefix and prompt chain) in the
  shared indexes equal the listener's, entry by entry.
* draining: two listeners announce the same source; when the serving one drains, the
  router moves the stream to the other at once (``drain_handovers``).
"""

from __future__ import annotations

import asyncio
import functools
import signal
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as kpb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as kpb_grpc
from bus.sse import SseParser
from harness.procs import free_port
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json

from .conftest import RouterProc, StartRouter, metric_value, wait_until
from .push_stack import (
    TOKENS,
    ListenerProc,
    Pki,
    Publisher,
    State,
    backend_status,
    broker,
    listener_config,
    listener_state,
    make_pki,
    router_config,
    router_state,
    running,
    streaming_from,
)
from .test_tier4_e2e import (
    MODEL,
    NAMES,
    SALT_ENV,
    SECRET,
    Listener,
    backends,
    engines_and_listener,
    event_sources,
    prefix_of,
    sys_req,
)

pytest_plugins = ("tests.redis_fixture",)

pytestmark = [pytest.mark.slow, pytest.mark.redis]

B = "vllm-1"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory)


def shared_redis(url: str) -> dict[str, Any]:
    """The ``response_cache`` section every replica shares: Redis for the answers and,
    through the same pool, for the KV index."""
    return {"enabled": True, "backend": "redis", "redis": {"url": url}}


def pulling_config(
    fleet: SimFleet, listener: Listener, redis_url: str, **kv: Any
) -> dict[str, Any]:
    """A replica: pulls every engine's stream from ``listener``, index and cache on Redis."""
    return {
        "server": {"grpc_listen": "127.0.0.1:0"},
        "selection_strategy": "RoundRobin",
        "prefix_routing": {"enabled": True},
        "backends": backends(fleet, salt=True),
        "response_cache": shared_redis(redis_url),
        "kv_cache_index": {
            "enabled": True,
            "backend": "redis",
            "salt_secret_env": SALT_ENV,
            "event_sources": event_sources(listener),
            **kv,
        },
    }


async def redis_keys(url: str, prefix: str) -> list[bytes]:
    from redis.asyncio import Redis

    client = Redis.from_url(url)
    try:
        return [k async for k in client.scan_iter(match=prefix + "*", count=1000)]
    finally:
        await client.aclose()


async def wait_all_match(
    targets: Mapping[str, str], listener_url: str, backend: str, within: float = 30.0
) -> State:
    """Until the shared index, read through every router (name -> gRPC target), holds
    exactly the listener's state for ``backend``: no missing, no stale entry, the same
    token counts."""
    last: dict[str, Any] = {}

    async def same() -> bool:
        want = await listener_state(listener_url, backend)
        for name, target in targets.items():
            entries, got = await router_state(target, backend, list(want))
            last[name] = (len(want), entries, sum(1 for k in want if got.get(k) != want[k]))
            if entries != len(want) or got != want:
                return False
        return True

    await wait_until(same, within, interval=0.2, what=f"every router == listener ({last})")
    return await listener_state(listener_url, backend)


async def wait_consumed(rp: RouterProc, listener: ListenerProc, backend: str) -> None:
    """Until router ``rp``'s own consumer of ``backend`` applied the listener's last event."""

    async def caught_up() -> bool:
        head = (await listener.stats())["hub"]["backends"][backend]["last_event_id"]
        st = await backend_status(rp.grpc_address, backend)
        return st.connected and st.last_event_id == head

    await wait_until(caught_up, 30, interval=0.1, what=f"{rp.config_path.name} at the head")


# -- pull: three routers ------------------------------------------------------------------


async def test_three_pulling_routers_share_the_cache_and_the_index(
    start_router: StartRouter, redis_server: Any, tmp_path: Path
) -> None:
    async with engines_and_listener(tmp_path, tag="multi") as (fleet, listener):
        config = pulling_config(fleet, listener, redis_server.url)
        routers = [await start_router(config, env={SALT_ENV: SECRET}) for _ in range(3)]
        targets = {f"router-{i}": r.grpc_address for i, r in enumerate(routers)}
        a, b, c = routers

        # An answer cached at A is a HIT at B and at C, without a backend.
        body = {**sys_req("multi-cache"), "temperature": 0}
        first = await a.chat(body)
        assert first.status == 200 and first.headers["x-cache"] == "MISS", first

        async def stored() -> bool:
            return bool(await redis_keys(redis_server.url, "cr:resp:"))

        await wait_until(stored, 10, what="A's answer written to Redis")
        for other in (b, c):
            hit = await other.chat(body)
            assert hit.status == 200 and hit.headers["x-cache"] == "HIT", hit
            assert hit.json()["choices"] == first.json()["choices"]

        # A prefix warmed through A is routed KV-aware by B and C: only the shared
        # index can tell them (round robin alone would alternate).
        warm = sys_req("multi-route")
        r = await a.chat(warm)
        assert r.status == 200, r
        holder = r.headers["x-continuum-backend"]
        prefix = prefix_of(warm)

        async def indexed() -> bool:
            _, got = await router_state(b.grpc_address, holder, [prefix])
            return prefix in got

        await wait_until(indexed, 15, what="the warmed prefix in the shared index")
        for i, other in enumerate((b, c)):
            for n in range(3):
                r = await other.chat(sys_req("multi-route", question=f"and then {i}.{n}?"))
                assert r.status == 200 and r.headers["x-continuum-backend"] == holder, r
            text = await other.metrics()
            assert (
                metric_value(
                    text, "continuum_kv_index_routing_decisions_total", decision="kv_aware"
                )
                >= 3
            )

        # More traffic through all three, then: the shared index is the listener's
        # state, entry by entry, whichever router reads it.
        await asyncio.gather(
            *(
                rp.chat(sys_req(f"multi-load-{i % 4}", question=f"q{i}"))
                for i, rp in enumerate(routers * 4)
            )
        )
        for name in NAMES:
            state = await wait_all_match(targets, listener.url, name)
            assert state, name
        for rp in routers:
            text = await rp.metrics()
            for name in NAMES:
                assert metric_value(text, "continuum_kv_consumer_connected", backend=name) == 1.0


# -- conversation mode: both kinds of keys ------------------------------------------------


Keys = dict[tuple[str, str], int]
"""(kind, key) -> token count; kind ``prefix`` (a prefix hash) or ``chain`` (a chain key)."""


async def listener_keys(url: str, backend: str) -> Keys:
    """Both kinds of keys the listener holds for ``backend`` (its resync block)."""
    parser = SseParser()
    keys: Keys = {}
    async with aiohttp.ClientSession() as s, s.get(f"{url}/events/{backend}") as r:
        assert r.status == 200
        async for chunk in r.content.iter_any():
            for rec in parser.feed(chunk):
                ev = orjson.loads(rec.data)
                kind = rec.event or ev.get("event")
                if kind == "cache_created":
                    keys[("prefix", ev["prefix_hash"])] = ev.get("token_count") or 0
                elif kind == "chain_created":
                    keys[("chain", ev["chain_key"])] = ev.get("token_count") or 0
                if rec.id and ".s" not in rec.id:
                    return keys
    raise AssertionError("stream ended inside the resync block")


async def router_keys(target: str, backend: str, want: Keys) -> tuple[int, int, Keys]:
    """(prefix entries, chain entries) ``backend`` holds in the index ``target`` reads,
    and the token counts of ``want``'s keys there."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = kpb_grpc.KvIndexStub(ch)
        reply = await stub.Backends(kpb.BackendsRequest())
        st = next((b for b in reply.backends if b.name == backend), None)
        got: Keys = {}
        for kind, key in want:
            q = (
                kpb.QueryRequest(prefix_hash=key)
                if kind == "prefix"
                else kpb.QueryRequest(chain_key=key)
            )
            for e in (await stub.Query(q)).entries:
                if e.backend == backend:
                    got[(kind, key)] = e.token_count
        return (st.entries, st.chain_entries, got) if st else (0, 0, got)


async def test_two_routers_share_both_kinds_of_keys_in_conversation_mode(
    start_router: StartRouter, redis_server: Any, tmp_path: Path
) -> None:
    async with engines_and_listener(tmp_path, tag="multi", conversation=True) as (fleet, listener):
        template = {
            "model": MODEL,
            "tokenizer_config": str(bundled_qwen2_config()),
            "tokenizer": str(bundled_qwen2_json()),
        }
        # Only the engines' events: a prediction is an entry no listener holds.
        conversation = {"enabled": True, "predict_ttl_seconds": 0, "templates": [template]}
        config = pulling_config(fleet, listener, redis_server.url, conversation=conversation)
        routers = [await start_router(config, env={SALT_ENV: SECRET}) for _ in range(2)]
        # Conversations whose turns alternate between the two routers.
        for conv in range(3):
            history: list[dict[str, str]] = []
            for turn in range(3):
                body = sys_req(f"multi-conv-{conv}", question=f"turn {turn}: " + "why? " * 60)
                body["messages"][1:1] = history
                r = await routers[turn % 2].chat({**body, "temperature": 0.7})
                assert r.status == 200, r
                answer = r.json()["choices"][0]["message"]["content"]
                history += [body["messages"][-1], {"role": "assistant", "content": answer}]
        last: dict[str, Any] = {}

        async def same(name: str) -> bool:
            want = await listener_keys(listener.url, name)
            prefixes = sum(1 for kind, _ in want if kind == "prefix")
            chains = len(want) - prefixes
            for rp in routers:
                entries, chain_entries, got = await router_keys(rp.grpc_address, name, want)
                last[name] = (prefixes, chains, entries, chain_entries, len(got))
                if (entries, chain_entries, got) != (prefixes, chains, want):
                    return False
            return chains > 0 and prefixes > 0

        for name in NAMES:
            await wait_until(
                functools.partial(same, name),
                30,
                interval=0.2,
                what=f"both routers == the listener's prefix and chain keys ({last})",
            )


# -- push: one listener, two routers ------------------------------------------------------


async def test_a_listener_pushes_to_two_routers_on_independent_sessions(
    start_router: StartRouter, pki: Pki, redis_server: Any, tmp_path: Path
) -> None:
    bus_ports = [free_port(), free_port()]
    zmq_port = free_port()
    routers: list[RouterProc] = []
    for port in bus_ports:
        config = router_config(pki, port, [B], [broker("kv-a", [B])])
        config["response_cache"] = shared_redis(redis_server.url)
        config["kv_cache_index"]["backend"] = "redis"
        routers.append(await start_router(config))
    a, b = routers
    pub = await Publisher(zmq_port, B).start()
    cfg = listener_config(pki, bus_ports[0], "kv-a", {B: zmq_port})
    del cfg["event_bus"]["url"]
    cfg["event_bus"]["urls"] = [f"https://localhost:{p}" for p in bus_ports]
    listener = await ListenerProc(cfg, tmp_path / "l.yaml", TOKENS["kv-a"]).start()
    async with running(listener, pub):
        await listener.warm_up(pub)
        await pub.burst(24, 8)
        targets = {"a": a.grpc_address, "b": b.grpc_address}
        await wait_all_match(targets, listener.url, B)
        epoch = (await listener.stats())["epoch"]
        for rp in routers:
            st = await backend_status(rp.grpc_address, B)
            assert st.connected and st.transport == "event_bus"
            assert st.last_event_id.startswith(epoch + "-")  # each consumes on its own
        b_before = await backend_status(b.grpc_address, B)

        # A dies; B's stream is another session and goes on.
        await a.kill()
        await pub.burst(8, 8)
        await wait_all_match({"b": b.grpc_address}, listener.url, B)
        # A comes back on its bus port: its session is dialled again, independently.
        await a.start()
        await pub.burst(8, 8)
        targets = {"a": a.grpc_address, "b": b.grpc_address}
        state = await wait_all_match(targets, listener.url, B)
        assert len(state) >= 5
        # The shared index matches through A whatever A does: A's own consumer must have
        # caught up too, on its new session, while B's stream was never broken.
        for rp in routers:
            await wait_consumed(rp, listener, B)
        b_after = await backend_status(b.grpc_address, B)
        assert b_after.reconnects == b_before.reconnects, (b_before, b_after)
        log = listener.log()
        for port in bus_ports:
            assert f"with https://localhost:{port}" in log


# -- draining: two listeners, one source --------------------------------------------------


def drain_slowly(config: dict[str, Any]) -> dict[str, Any]:
    """A long ``drain_deadline``: the router must not need the listener's own close."""
    config["event_bus"]["drain_deadline"] = "20s"
    return config


async def test_draining_listener_hands_its_stream_over_at_once(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    bus_port, zmq_port = free_port(), free_port()
    brokers = [broker("kv-a", [B]), broker("kv-b", [B])]
    router = await start_router(router_config(pki, bus_port, [B], brokers))
    pub = await Publisher(zmq_port, B).start()
    procs = {
        cid: ListenerProc(
            drain_slowly(listener_config(pki, bus_port, cid, {B: zmq_port})),
            tmp_path / f"{cid}.yaml",
            TOKENS[cid],
        )
        for cid in ("kv-a", "kv-b")
    }
    for p in procs.values():
        await p.start()
    async with running(*procs.values(), pub):
        for p in procs.values():
            await p.warm_up(pub)
        await pub.burst(16, 8)
        serving_now = functools.partial(
            streaming_from, router.grpc_address, B, list(procs.values())
        )
        serving = await wait_until(serving_now, 20, what="a stream from one listener")
        other = next(p for p in procs.values() if p is not serving)
        before = (await router.stats_of("/admin/kv-index/stats"))["event_bus"]
        serving.proc.send_signal(signal.SIGTERM)

        async def moved() -> bool:
            return (await serving_now()) is other

        await wait_until(moved, 20, what="the stream moved to the other listener")
        stats = (await router.stats_of("/admin/kv-index/stats"))["event_bus"]
        assert stats["drain_handovers"] == before["drain_handovers"] + 1, stats
        assert stats["stream_closes"].get("draining", 0) >= 1
        assert "is draining; moving to session" in router.log()
        assert await serving.proc.wait() == 0
        await pub.burst(8, 8)
        want = await listener_state(other.url, B)
        entries, got = await router_state(router.grpc_address, B, list(want))

        async def caught_up() -> bool:
            nonlocal want, entries, got
            want = await listener_state(other.url, B)
            entries, got = await router_state(router.grpc_address, B, list(want))
            return entries == len(want) and got == want

        await wait_until(caught_up, 20, what="the router == the remaining listener")
