"""Router memory benchmark: the router process's RSS idle and under load, for sizing its
container (deploy/k8s/base/router.yaml's memory request and limit).

Real processes: two ``harness.sim --trivial`` engines and the router (``python -m router
serve``) on the deploy/k8s overlays' feature set (PrefixAwareHash, prefix routing, the
response cache, the KV index) with the cache and index in memory, the way a router runs
while its Redis is away (``fallback_to_memory``; the overlays' fallback keeps
``fallback_capacity`` 1000 entries, like ``capacity`` here). Per round, a fresh router:

* ``RSS empty``: VmRSS (``/proc/<pid>/status``) after READY and a warm-up of 20 requests:
  the baseline of the same process;
* ``RSS @load``: after ``--requests`` distinct cacheable chat completions (temperature 0,
  64 tenants with 1 KB system prompts, ``--concurrency`` at a time), so the response cache
  is full (capacity 1000, LRU) and the ring and the HTTP stack have seen the load;
* ``RSS @2x``: after as many again (the cache is full already: growth here is a leak or
  fragmentation, not data).

The table shows medians over ``--repeats`` rounds and the ratio to the same run's empty
RSS. Run: ``.venv/bin/python -m bench.router_memory_bench [--requests 3000] [--repeats 3]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
from pathlib import Path

import aiohttp

from harness.procs import launch, python_module
from harness.sim.fleet import SimFleet

from ._kvstack import rss_bytes
from ._table import fmt_float, median, render_table

MODEL = "bench-model"
CAPACITY = 1000
TENANTS = 64


def router_yaml(urls: list[str]) -> str:
    lines = [
        'server: {listen: "127.0.0.1:0"}',
        "selection_strategy: PrefixAwareHash",
        "prefix_routing: {enabled: true}",
        f'response_cache: {{enabled: true, backend: memory, capacity: {CAPACITY}, ttl: "30m"}}',
        "kv_cache_index: {enabled: true, backend: memory}",
        "backends:",
    ]
    for i, url in enumerate(urls):
        lines.append(f'  - {{name: b{i + 1}, url: "{url}", type: vllm, models: [{MODEL}]}}')
    return "\n".join(lines) + "\n"


def body(i: int) -> bytes:
    tenant = i % TENANTS
    system = f"tenant {tenant}: " + "You are a careful assistant. " * 36  # ~1 KB
    return json.dumps(
        {
            "model": MODEL,
            "temperature": 0,
            "max_tokens": 16,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"question number {i}"},
            ],
        }
    ).encode()


async def drive(url: str, start: int, count: int, concurrency: int) -> int:
    """``count`` distinct requests from index ``start``; returns how many answered 200."""
    ok = 0
    queue = iter(range(start, start + count))
    async with aiohttp.ClientSession() as session:

        async def worker() -> None:
            nonlocal ok
            for i in queue:
                async with session.post(
                    f"{url}/v1/chat/completions",
                    data=body(i),
                    headers={"content-type": "application/json"},
                ) as r:
                    await r.read()
                    ok += r.status == 200

        await asyncio.gather(*(worker() for _ in range(concurrency)))
    return ok


def settled_rss(pid: int) -> int:
    """VmRSS after a second's rest (max of 3 reads)."""
    time.sleep(1.0)
    return max(rss_bytes(pid) for _ in range(3))


async def one_round(urls: list[str], workdir: Path, requests: int, concurrency: int) -> dict:
    cfg = workdir / "router.yaml"
    cfg.write_text(router_yaml(urls))
    child = await launch(
        "router",
        python_module("router", "serve", "--config", str(cfg)),
        ready_timeout=30,
        log=workdir / "router.log",
    )
    try:
        url = child.ready.url()
        warm = await drive(url, 10**7, 20, 4)
        empty = settled_rss(child.pid)
        first = await drive(url, 0, requests, concurrency)
        loaded = settled_rss(child.pid)
        second = await drive(url, requests, requests, concurrency)
        twice = settled_rss(child.pid)
    finally:
        await child.stop()
    return {
        "empty": empty,
        "loaded": loaded,
        "twice": twice,
        "answered": warm + first + second,
        "sent": 20 + 2 * requests,
    }


async def main_async(args: argparse.Namespace) -> None:
    rounds = []
    async with SimFleet(n=2, model=MODEL, trivial=True) as fleet:
        for r in range(args.repeats):
            with tempfile.TemporaryDirectory(prefix=f"router-mem-{r}-") as tmp:
                rounds.append(
                    await one_round(fleet.urls, Path(tmp), args.requests, args.concurrency)
                )
    mib = 2**20
    e = median(x["empty"] for x in rounds) / mib
    lo = median(x["loaded"] for x in rounds) / mib
    tw = median(x["twice"] for x in rounds) / mib
    print(
        f"router VmRSS: 2 trivial sim engines, PrefixAwareHash + prefix routing + memory "
        f"response cache (capacity {CAPACITY}) + memory KV index; {args.requests} distinct "
        f"cacheable requests per step, concurrency {args.concurrency}; medians of "
        f"{args.repeats} fresh processes; baseline = the same process before the load\n"
    )
    rows = [
        ["empty (after 20 warm-up requests)", fmt_float(e, 1), "1.00x"],
        [f"@load ({args.requests} requests)", fmt_float(lo, 1), fmt_float(lo / e, 2) + "x"],
        [f"@2x ({2 * args.requests} requests)", fmt_float(tw, 1), fmt_float(tw / e, 2) + "x"],
    ]
    print(render_table(["step", "RSS MiB", "vs empty"], rows))
    answered = sum(x["answered"] for x in rounds)
    sent = sum(x["sent"] for x in rounds)
    print(f"\nanswered 200: {answered}/{sent}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", type=int, default=3000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
