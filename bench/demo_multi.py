"""``make run-multi`` (``python -m bench.demo --routers 2``): router replicas on one Redis.

A fleet that outgrows one router runs replicas behind a load balancer; they share the
response cache and the KV index through one Redis. This starts the simulated engines, the
real listener, a ``redis-server`` of its own (``--redis-url`` uses a running one instead,
e.g. the local ``redis://127.0.0.1:6379/0``) and N real router processes (PrefixAwareHash
+ the KV index on ``backend: redis``, the response cache on Redis), each consuming every
event: in push mode the listener dials every router (``event_bus.urls``), in pull mode
each router pulls ``GET /events/{backend}``. The workload is spread over the routers the
way a round-robin load balancer does, request by request, so the turns of one
conversation land on different routers; then the deterministic requests are sent once
to the first router and once to the others. It prints per router the KV-aware routing
rate and the response cache hits, and the engines' prefix-cache hit rate.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import shutil
import signal
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench._fleet import (
    MODEL,
    ListenerProcess,
    PushMode,
    RouterProcess,
    demo_fleet,
    kv_consumers_connected,
    listener_config,
    listener_connected,
    router_config,
)
from harness.procs import Service, free_port

__all__ = ["run_multi"]

ROOT = Path(__file__).resolve().parents[1]
DEMO_CONFIG = ROOT / "deploy" / "demo.yaml"


@contextlib.asynccontextmanager
async def own_redis(workdir: Path) -> AsyncIterator[str]:
    """A private ``redis-server`` on a free loopback port, no persistence; its URL."""
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed: install it or pass --redis-url URL")
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
        "--dir", str(workdir),
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        for _ in range(200):
            with contextlib.suppress(OSError):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"PING\r\n")
                pong = await asyncio.wait_for(reader.read(16), 1)
                writer.close()
                if pong.startswith(b"+PONG"):
                    break
            await asyncio.sleep(0.05)
        else:
            raise SystemExit("redis-server did not answer PING")
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.terminate()
        await proc.wait()


async def clear_shared(redis_url: str) -> None:
    """Delete what an earlier run left in a Redis this demo did not start."""
    from redis.asyncio import Redis

    client = Redis.from_url(redis_url)
    try:
        for pattern in ("cr:kvidx:*", "cr:demo-multi:*"):
            keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
            if keys:
                await client.delete(*keys)
    finally:
        await client.aclose()


async def spread(
    urls: list[str], requests: list[list[dict]], concurrency: int, extra: dict[str, Any]
) -> list[collections.Counter[str]]:
    """Send request i to router ``i % len(urls)`` (a round-robin load balancer); per
    router, the X-Cache values it answered with."""
    counts = [collections.Counter[str]() for _ in urls]
    queue: asyncio.Queue[tuple[int, list[dict]]] = asyncio.Queue()
    for item in enumerate(requests):
        queue.put_nowait(item)

    async def worker(session: aiohttp.ClientSession) -> None:
        while not queue.empty():
            i, messages = queue.get_nowait()
            r = i % len(urls)
            body = {"model": MODEL, "messages": messages, "max_tokens": 16, **extra}
            async with session.post(urls[r] + "/v1/chat/completions", json=body) as resp:
                await resp.read()
                counts[r][resp.headers.get("x-cache", f"HTTP {resp.status}")] += 1

    async with aiohttp.ClientSession(headers={"authorization": "Bearer demo-tenant"}) as s:
        await asyncio.gather(*(worker(s) for _ in range(concurrency)))
    return counts


async def kv_decisions(router: Service) -> tuple[int, int]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(router.url + "/admin/kv-index/stats") as resp,
    ):
        d = (await resp.json())["routing_decisions"]
    return int(d["kv_aware"]), int(d["fallback"])


async def run_multi(
    args: argparse.Namespace, requests: list[list[dict]], deterministic: list[list[dict]]
) -> int:
    n = args.routers
    base = yaml.safe_load(DEMO_CONFIG.read_text())
    zmq_ports = [free_port() for _ in range(args.engines)]
    print(
        f"Continuum demo, {n} routers on one Redis: {args.engines} simulated engines, "
        f"{len(requests)} requests spread request by request over the routers\n"
    )
    async with (
        demo_fleet(args.engines, args.capacity_blocks, zmq_ports) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="continuum-multi-")))
        if args.redis_url:
            redis_url = args.redis_url
            await clear_shared(redis_url)
        else:
            redis_url = await stack.enter_async_context(own_redis(tmp))
        pushes: list[PushMode] = []
        if args.transport == "push":
            first = PushMode.make(tmp)
            pushes = [first, *(PushMode(free_port(), first.pki) for _ in range(n - 1))]
        lconfig = listener_config(fleet, zmq_ports, pushes[0] if pushes else None)
        if pushes:
            del lconfig["event_bus"]["url"]
            lconfig["event_bus"]["urls"] = [f"https://localhost:{p.bus_port}" for p in pushes]
        listener = await stack.enter_async_context(ListenerProcess(lconfig, tmp))
        await listener_connected(listener, fleet)
        routers: list[Service] = []
        for i in range(n):
            port = args.port + i if not args.once else 0
            cfg = router_config(
                base, fleet, "PrefixAwareHash", port, listener.url, pushes[i] if pushes else None
            )
            cfg["kv_cache_index"]["backend"] = "redis"
            cfg["response_cache"] = {
                "enabled": True,
                "backend": "redis",
                "capacity": 10_000,
                "ttl": "10m",
                "redis": {"url": redis_url, "key_prefix": "cr:demo-multi:"},
            }
            (tmp / f"router-{i + 1}").mkdir()
            router = await stack.enter_async_context(RouterProcess(cfg, tmp / f"router-{i + 1}"))
            await kv_consumers_connected(router, fleet.names)
            routers.append(router)
        mode = "push: the listener dials every router" if pushes else "pull: each router pulls"
        where = "its own redis-server" if not args.redis_url else redis_url
        print(f"  KV events {mode}; shared Redis: {where}\n")
        urls = [r.url for r in routers]
        t0 = time.perf_counter()
        await spread(urls, requests, args.concurrency, {"temperature": 0.7})
        elapsed = time.perf_counter() - t0
        routing = [await kv_decisions(r) for r in routers]
        # Deterministic requests: once through router 1, then once through the others.
        first_pass = await spread(urls[:1], deterministic, args.concurrency, {})
        await asyncio.sleep(0.3)  # write-backs are asynchronous
        second = await spread(urls[1:], deterministic, args.concurrency, {})
        stats = await fleet.stats()
        prompt = sum(s["prompt_tokens"] for s in stats)
        cached = sum(s["cached_tokens"] for s in stats)
        print(f"  {'router':<10} {'kv_aware':>9} {'fallback':>9} {'kv-aware rate':>14} "
              f"{'cache HIT':>10} {'cache MISS':>11}")  # fmt: skip
        print("  " + "-" * 67)
        for i, (kv, fb) in enumerate(routing):
            c = first_pass[0] if i == 0 else second[i - 1]
            rate = kv / (kv + fb) if kv + fb else 0.0
            print(
                f"  router-{i + 1:<3} {kv:>9} {fb:>9} {100 * rate:>13.1f}% "
                f"{c.get('HIT', 0):>10} {c.get('MISS', 0):>11}"
            )
        print(
            f"\n  workload: {len(requests)} requests in {elapsed:.1f}s, round-robin over the "
            f"routers; engines' prefix-cache token hit rate {100 * cached / max(prompt, 1):.1f}%."
            f"\n  kv_aware = requests the KV index scorer routed (the index every router reads"
            f" is the one Redis holds);\n  cache: {len(deterministic)} deterministic requests "
            "sent to router-1 first (MISS), then to the other routers (HIT from the shared "
            "Redis)."
        )
        if args.once:
            return 0
        print("\nThe routers keep serving (Ctrl-C stops):")
        for r in routers:
            print(f"  {r.url}   curl -s {r.url}/admin/kv-index/stats")
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    return 0
