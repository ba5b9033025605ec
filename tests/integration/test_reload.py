"""Hot reload: SIGHUP and file edits change the running router without dropping requests;
invalid files and restart-only changes never take effect."""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any

import aiohttp

from bus.prefix_key import extract_prefix_key
from harness.procs import free_port
from harness.sim.fleet import SimFleet
from router.selection.ring import HashRing, key_position

from .conftest import (
    RouterProc,
    StartRouter,
    backend,
    chat_body,
    expected_prefix_config,
    http,
    wait_until,
)
from .test_semantic_cache import embed_server  # noqa: F401 - fixture
from .test_semantic_cache import pytestmark as needs_embedding_model


def prefix_config(sims: SimFleet, **prefix: Any) -> dict[str, Any]:
    return {
        "selection_strategy": "PrefixAwareHash",
        "prefix_routing": {"enabled": True, **prefix},
        "backends": [backend(s.name, s.url, models=["demo-model"]) for s in sims],
    }


def with_prefix(cfg: dict[str, Any], **prefix: Any) -> dict[str, Any]:
    new = copy.deepcopy(cfg)
    new["prefix_routing"].update(prefix)
    return new


def ring_owner(names: list[str], virtual_nodes: int, body: dict[str, Any]) -> str:
    """Where the ring puts ``body`` (idle backends): the ring is the same in every router
    instance by design (points at SHA256(name#i)), so a test can compute it too."""
    members = [SimpleNamespace(name=n, index=i, in_flight=0) for i, n in enumerate(names)]
    key = extract_prefix_key(body)
    assert key is not None
    owner = HashRing(members, virtual_nodes).owner(key_position(key), (1 << len(names)) - 1)
    assert owner is not None
    return str(owner.name)


async def assert_serves(router: RouterProc, n: int = 3) -> None:
    for i in range(n):
        r = await router.chat(chat_body(f"ping {i}", system=f"tenant {i}"))
        assert r.status == 200, r


async def test_virtual_nodes_reload_under_load_drops_nothing(
    start_router: StartRouter, sims: SimFleet
) -> None:
    cfg = prefix_config(sims, virtual_nodes=150)
    router = await start_router(cfg)
    done = 0
    failures: list[str] = []
    stop = asyncio.Event()

    async def client(worker: int) -> None:
        nonlocal done
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            i = 0
            while not stop.is_set():
                body = chat_body(f"w{worker} q{i}", system=f"tenant {i % 7}", max_tokens=4)
                try:
                    async with session.post(router.url + "/v1/chat/completions", json=body) as r:
                        payload = await r.read()
                        if r.status != 200:
                            failures.append(f"{r.status} {payload[:200]!r}")
                except (aiohttp.ClientError, TimeoutError) as exc:
                    failures.append(repr(exc))
                done += 1
                i += 1

    async def completed(n: int) -> bool:
        return done >= n

    workers = [asyncio.create_task(client(w)) for w in range(3)]
    try:
        await wait_until(lambda: completed(30), 10, what="traffic to flow")
        started = time.monotonic()
        for vnodes in (7, 400, 64):
            mark = done
            assert await router.reload(with_prefix(cfg, virtual_nodes=vnodes))

            # Keep the traffic going across each swap of the ring.
            def flowing(m: int = mark) -> Awaitable[bool]:
                return completed(m + 30)

            await wait_until(flowing, 10, what="traffic after reload")
        # Keep the load on for at least ~1.5 s in all (plain load, not synchronisation).
        await asyncio.sleep(max(0.0, 1.5 - (time.monotonic() - started)))
    finally:
        stop.set()
        await asyncio.gather(*workers)
    assert not failures, failures[:5]
    assert done >= 120
    stats = await router.stats()
    assert stats["config"]["virtual_nodes"] == 64
    assert stats["routing_decisions"]["total"] == done
    assert all(d["in_flight_requests"] == 0 for d in stats["backend_distribution"])
    assert "applies only after a restart" not in router.log()

    # Routing follows the rebuilt ring, not the one the router started with.
    names = [sim.name for sim in sims]
    bodies = [chat_body("which backend?", system=f"ring check {i}") for i in range(12)]
    moved = [b for b in bodies if ring_owner(names, 64, b) != ring_owner(names, 150, b)]
    assert moved, "pick prompts whose owner differs between the two rings"
    for body in bodies:
        r = await router.chat(body)
        assert r.status == 200, r
        assert r.headers["x-continuum-backend"] == ring_owner(names, 64, body)


async def test_file_edit_alone_is_picked_up(start_router: StartRouter, sims: SimFleet) -> None:
    cfg = prefix_config(sims, virtual_nodes=150, load_factor_epsilon=0.25)
    router = await start_router(cfg)
    new = with_prefix(cfg, virtual_nodes=33, load_factor_epsilon=0.5, max_prefix_length=256)
    router.write_config(new)  # no SIGHUP: the router polls the file every second
    await router.wait_prefix_config(new, within=3.5)
    assert "config reloaded (file changed)" in router.log()
    await assert_serves(router)


async def test_invalid_file_is_rejected_and_old_config_keeps_serving(
    start_router: StartRouter, sims: SimFleet
) -> None:
    cfg = prefix_config(sims, virtual_nodes=150, load_factor_epsilon=0.25)
    router = await start_router(cfg)
    bad = with_prefix(cfg, virtual_nodes=99, load_factor_epsilon=99)
    assert not await router.reload(bad), "an out-of-range epsilon must be rejected"
    log = router.log()
    assert "prefix_routing.load_factor_epsilon" in log, log
    assert "keeping the running config" in log
    stats = await router.stats()
    assert stats["config"] == expected_prefix_config(cfg), "nothing of the bad file applied"
    await assert_serves(router)

    # Unknown keys are errors too, named by their YAML path.
    typo = copy.deepcopy(cfg)
    typo["prefix_routing"]["virtual_node"] = 10
    assert not await router.reload(typo)
    assert "prefix_routing.virtual_node" in router.log()

    # Not even YAML.
    assert not await router.reload("prefix_routing: [unclosed\n")
    assert "invalid YAML" in router.log()
    assert (await router.stats())["config"] == expected_prefix_config(cfg)

    # A valid file afterwards is applied again.
    good = with_prefix(cfg, virtual_nodes=20)
    assert await router.reload(good)
    assert (await router.stats())["config"]["virtual_nodes"] == 20
    await assert_serves(router)


async def test_listen_change_is_restart_only(start_router: StartRouter, sims: SimFleet) -> None:
    cfg = prefix_config(sims)
    router = await start_router(cfg)
    assert await router.reload(with_prefix(cfg, virtual_nodes=41))
    assert "changed; it applies only after a restart" not in router.log()
    other_port = free_port()
    new = with_prefix(cfg, virtual_nodes=42)
    new["server"] = {**router.config["server"], "listen": f"127.0.0.1:{other_port}"}
    assert await router.reload(new)
    log = await router.wait_for_log("server.listen changed")
    assert "applies only after a restart" in log
    # The rest of the file applied; the listener did not move.
    assert (await router.stats())["config"]["virtual_nodes"] == 42
    await assert_serves(router)
    try:
        r = await http("GET", f"http://127.0.0.1:{other_port}/health", total_s=2)
    except aiohttp.ClientConnectionError:
        pass
    else:
        raise AssertionError(f"the router must not listen on the new port: {r}")


async def test_switch_to_prefix_aware_hash_without_prefixes_warns(
    start_router: StartRouter, sims: SimFleet
) -> None:
    cfg = prefix_config(sims)
    cfg["selection_strategy"] = "RoundRobin"
    cfg["prefix_routing"]["enabled"] = False
    router = await start_router(cfg)
    await assert_serves(router)
    assert (await router.stats())["routing_decisions"]["total"] == 0
    assert "selection_strategy" not in router.log()

    new = copy.deepcopy(cfg)
    new["selection_strategy"] = "PrefixAwareHash"
    assert await router.reload(new)
    log = await router.wait_for_log("config selection_strategy:")
    assert "PrefixAwareHash with prefix_routing.enabled: false" in log
    assert "WARNING" in next(ln for ln in log.splitlines() if "config selection_strategy" in ln)

    # The new strategy is live: without prefix keys it hashes the model name (fallback),
    # so every request lands on one backend.
    landed = set()
    for i in range(6):
        r = await router.chat(chat_body(f"q{i}", system=f"tenant {i}"))
        assert r.status == 200, r
        landed.add(r.headers["x-continuum-backend"])
    assert len(landed) == 1, landed
    decisions = (await router.stats())["routing_decisions"]
    assert decisions["fallback"] == 6 and decisions["total"] == 6


@needs_embedding_model
async def test_response_cache_fields_hot_reload_but_backend_is_restart_only(
    start_router: StartRouter,
    sims: SimFleet,
    embed_server: Any,  # noqa: F811 - the fixture imported above
) -> None:
    """ttl and every semantic field apply at once; response_cache.backend does not."""
    from .test_semantic_cache import PARAPHRASE, QUESTION, ask, semantic_config, tenant

    cfg = semantic_config(sims, embed_server.url, semantic={"threshold": 0.99})
    router = await start_router(cfg)
    who = tenant()
    for text in (QUESTION, PARAPHRASE):  # cosine 0.94 < 0.99: both miss and are stored
        assert (await router.chat(ask(text), headers=who)).headers["x-cache"] == "MISS"

    new = copy.deepcopy(cfg)
    new["response_cache"]["ttl"] = "10m"
    new["response_cache"]["semantic"]["threshold"] = 0.9
    new["response_cache"]["backend"] = "redis"
    new["response_cache"]["redis"] = {"url": "redis://127.0.0.1:6379"}
    assert await router.reload(new)
    log = await router.wait_for_log("response_cache.backend changed")
    assert "applies only after a restart" in log
    stats = await router.stats_of("/admin/response-cache/stats")
    assert (stats["backend_type"], stats["config"]["ttl"]) == ("memory", "10m")
    hit = await router.chat(ask("Tell me the capital city of France."), headers=who)  # 0.92
    assert (hit.headers["x-cache"], hit.headers.get("x-cache-mode")) == ("HIT", "semantic")

    off = copy.deepcopy(new)
    off["response_cache"]["semantic"]["enabled"] = False
    assert await router.reload(off)
    again = await router.chat(ask("Which city is France's capital?"), headers=who)  # 0.99
    assert again.headers["x-cache"] == "MISS"


async def test_response_cache_turned_on_by_reload_serves_hits(
    start_router: StartRouter, sims: SimFleet
) -> None:
    """Off at start, the cache is built by the reload that turns it on; off again, every
    request bypasses it."""
    cfg: dict[str, Any] = {"backends": [backend(sims[0].name, sims[0].url)]}
    router = await start_router(cfg)
    who = {"authorization": "Bearer tenant-reload"}
    ask: dict[str, Any] = {"model": "demo-model", "temperature": 0}
    ask["messages"] = [{"role": "user", "content": "cache?"}]
    assert (await router.chat(ask, headers=who)).headers["x-cache"] == "BYPASS"

    on = {**cfg, "response_cache": {"enabled": True, "ttl": "10m"}}
    assert await router.reload(on)
    assert (await router.chat(ask, headers=who)).headers["x-cache"] == "MISS"

    async def hit() -> bool:
        return (await router.chat(ask, headers=who)).headers["x-cache"] == "HIT"

    await wait_until(hit, 5, what="the stored answer to be served")
    stats = await router.stats_of("/admin/response-cache/stats")
    assert stats["config"]["ttl"] == "10m" and stats["requests"]["hit"] >= 1, stats
    metrics = await router.metrics()
    assert 'continuum_response_cache_requests_total{result="hit"}' in metrics
    assert "applies only after a restart" not in router.log()

    assert await router.reload(cfg)
    assert (await router.chat(ask, headers=who)).headers["x-cache"] == "BYPASS"
