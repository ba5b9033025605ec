"""Benchmark: the response cache and the KV index on Redis Sentinel and on Redis Cluster,
against bare redis-py.

The bench starts its own Sentinel deployment (``harness.redis_procs.SentinelSet``: a
primary, a replica, three sentinels, passwords on both) and its own Redis Cluster
(``harness.redis_procs.ClusterSet``: three primaries, three replicas, a password) and, in
the same run, times:

* cache ``get`` of a 1 KiB value through the router's stack (``build_cache_store`` with
  ``mode: sentinel``: ``FallbackCacheStore`` over ``RedisCacheStore`` over the
  Sentinel-managed pool) against a bare redis-py ``GET`` of the same key on a plain client
  connected to the same primary;
* KV index ``query_backends`` (3 backends on the prefix) and ``query_many`` of 64 keys
  through ``build_kv_index`` on the same Sentinel pool, against bare redis-py
  ``ZREVRANGEBYSCORE`` of the same key (a pipeline of 64 for the 64 keys) on the plain
  client;
* cache ``get`` of a 1 KiB value through the router's stack with ``mode: cluster``
  (``FallbackCacheStore`` over ``RedisCacheStore`` over the bounded ``RedisCluster``)
  against a bare redis-py ``RedisCluster`` ``GET`` of the same key on the same Cluster;
* KV index ``query_backends`` (3 backends on the prefix) and ``query_many`` of 64 keys
  through ``build_kv_index`` with ``mode: cluster``, where each backend's keys live in a
  slot of their own (``{cr:kvidx:<backend>}``) and a query fans out one script call per
  backend, concurrently, against a bare redis-py ``RedisCluster`` pipeline of
  ``ZREVRANGEBYSCORE`` over the same per-backend sets (3, and 3 x 64), which redis-py
  sends as one pipeline per node, concurrently.

Wall time per call (the round trip is the cost), interleaved every 50 calls so load from
elsewhere hits every case alike; medians over repeats and per-round ratios against the
baseline of that round. Target: each judged row at most 1.3x its baseline. Run:
``.venv/bin/python -m bench.redis_ha_bench [--loops N] [--repeats N] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster

from harness.redis_procs import ClusterSet, SentinelSet
from router.cache import build_cache_store
from router.config.models import KvCacheIndexConfig, RedisConfig
from router.kvindex import build_kv_index
from router.kvindex.base import StorageTier
from router.redis import RedisPools

from ._table import median, paired_ratio, print_results

TARGET_RATIO = 1.3
CHUNK = 50
KIB = 1024
MANY = 64


async def rows(s: SentinelSet, loops: int, repeats: int) -> list[dict[str, Any]]:
    cfg = RedisConfig.model_validate(s.config())
    pools = RedisPools()
    bare = Redis(host="127.0.0.1", port=s.master_port() or 0, password=s.password)
    try:
        cache = build_cache_store("redis", 10, 600, cfg, pools)
        index = build_kv_index(KvCacheIndexConfig(backend="redis"), cfg, pools=pools)
        await cache.set("bench", b"x" * KIB)
        keys = [f"{i:064x}" for i in range(MANY)]
        for b, n in (("vllm-1", 4096), ("vllm-2", 2048), ("vllm-3", 512)):
            await index.write_many([(k, b, n, StorageTier.GPU_HOT) for k in keys])
        ckey = cfg.key_prefix + "bench"
        ikey = "cr:kvidx:" + keys[0]
        ikeys = ["cr:kvidx:" + k for k in keys]

        async def bare_get() -> Any:
            return await bare.get(ckey)

        async def cache_get() -> Any:
            return await cache.get("bench")

        async def bare_zrange() -> Any:
            return await bare.zrevrangebyscore(ikey, "+inf", "-inf", withscores=True)

        async def query() -> Any:
            return await index.query_backends(keys[0])

        async def bare_many() -> Any:
            pipe = bare.pipeline(transaction=False)
            for k in ikeys:
                pipe.zrevrangebyscore(k, "+inf", "-inf", withscores=True)
            return await pipe.execute()

        async def query_many() -> Any:
            return await index.query_many(keys)

        # (label, fn, index of its baseline or None for a baseline)
        cases: list[tuple[str, Callable[[], Any], int | None]] = [
            ("baseline: redis-py GET 1 KiB, same primary", bare_get, None),
            ("cache get 1 KiB via Sentinel (router stack)", cache_get, 0),
            ("baseline: redis-py ZREVRANGEBYSCORE", bare_zrange, None),
            ("index query_backends via Sentinel, 3 backends", query, 2),
            (f"baseline: redis-py pipeline of {MANY} ZREVRANGEBYSCORE", bare_many, None),
            (f"index query_many {MANY} keys via Sentinel", query_many, 4),
        ]
        assert await cache_get() == b"x" * KIB and len(await query()) == 3
        out = await measure(cases, loops, repeats)
        await cache.close()
        await index.close()
        return out
    finally:
        await bare.aclose()
        await pools.aclose()


async def cluster_rows(c: ClusterSet, loops: int, repeats: int) -> list[dict[str, Any]]:
    cfg = RedisConfig.model_validate(c.config())
    pools = RedisPools()
    bare = RedisCluster(host="127.0.0.1", port=c.nodes[0].port, password=c.password)
    try:
        cache = build_cache_store("redis", 10, 600, cfg, pools)
        index = build_kv_index(KvCacheIndexConfig(backend="redis"), cfg, pools=pools)
        await cache.set("bench", b"x" * KIB)
        ckey = cfg.key_prefix + "bench"
        keys = [f"{i:064x}" for i in range(MANY)]
        names = ("vllm-1", "vllm-2", "vllm-3")
        for b, n in zip(names, (4096, 2048, 512), strict=True):
            await index.write_many([(k, b, n, StorageTier.GPU_HOT) for k in keys])
        one = [f"{{cr:kvidx:{b}}}{keys[0]}" for b in names]
        many = [f"{{cr:kvidx:{b}}}{k}" for b in names for k in keys]

        async def bare_get() -> Any:
            return await bare.get(ckey)

        async def cache_get() -> Any:
            return await cache.get("bench")

        def zranges(rkeys: list[str]) -> Callable[[], Any]:
            async def run() -> Any:
                pipe = bare.pipeline(transaction=False)
                for k in rkeys:
                    pipe.zrevrangebyscore(k, "+inf", "-inf", withscores=True)
                return await pipe.execute()

            return run

        async def query() -> Any:
            return await index.query_backends(keys[0])

        async def query_many() -> Any:
            return await index.query_many(keys)

        cases: list[tuple[str, Callable[[], Any], int | None]] = [
            ("baseline: redis-py RedisCluster GET 1 KiB, same cluster", bare_get, None),
            ("cache get 1 KiB via Cluster (router stack)", cache_get, 0),
            ("baseline: RedisCluster pipeline of 3 ZREVRANGEBYSCORE", zranges(one), None),
            ("index query_backends via Cluster, 3 backends", query, 2),
            (
                f"baseline: RedisCluster pipeline of 3x{MANY} ZREVRANGEBYSCORE",
                zranges(many),
                None,
            ),
            (f"index query_many {MANY} keys via Cluster, 3 backends", query_many, 4),
        ]
        assert await cache_get() == b"x" * KIB and await bare_get() == b"x" * KIB
        assert len(await query()) == 3 and all(len(g) == 3 for g in await query_many())
        assert all(len(r) == 1 for r in await zranges(many)())
        out = await measure(cases, loops, repeats)
        await cache.close()
        await index.close()
        return out
    finally:
        await bare.aclose()
        await pools.aclose()


async def measure(
    cases: list[tuple[str, Callable[[], Any], int | None]], loops: int, repeats: int
) -> list[dict[str, Any]]:
    """Time ``cases`` (label, call, index of its baseline or None), interleaved by chunks."""
    for _, fn, _ in cases:  # warm the pools
        for _ in range(200):
            await fn()
    timings: list[list[float]] = [[] for _ in cases]
    chunks = max(1, loops // CHUNK)
    for _ in range(repeats):
        spent = [0.0] * len(cases)
        for _ in range(chunks):
            for i, (_, fn, _) in enumerate(cases):
                t0 = time.perf_counter()
                for _ in range(CHUNK):
                    await fn()
                spent[i] += (time.perf_counter() - t0) / CHUNK
        for i in range(len(cases)):
            timings[i].append(spent[i] / chunks)
    out = []
    for (label, _, base), times in zip(cases, timings, strict=True):
        ratio = paired_ratio(times, timings[base]) if base is not None else 1.0
        out.append(
            {
                "case": label,
                "value": median(times) * 1e6,
                "unit": "us/call",
                "min": min(times) * 1e6,
                "max": max(times) * 1e6,
                "ratio": ratio,
                "target": f"<={TARGET_RATIO:g}x" if base is not None else None,
                "pass": (ratio <= TARGET_RATIO) if base is not None else None,
            }
        )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.redis_ha_bench", description=__doc__)
    p.add_argument("--loops", type=int, default=1000, help="calls per case per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", default=None, help="write the results here")
    args = p.parse_args(argv)
    exe = shutil.which("redis-server")
    if exe is None or shutil.which("redis-cli") is None:
        print("redis-server and redis-cli are needed (apt-get install redis-server redis-tools)")
        return 1
    s = SentinelSet(exe)
    try:
        s.wait_ready()
        results = asyncio.run(rows(s, args.loops, args.repeats))
    finally:
        s.close()
    c = ClusterSet(exe)
    try:
        c.wait_ready()
        results += asyncio.run(cluster_rows(c, args.loops, args.repeats))
    finally:
        c.close()
    print(
        f"Redis Sentinel (1 primary, 1 replica, 3 sentinels) and Redis Cluster (3 primaries, "
        f"3 replicas) vs bare redis-py on the same deployment: wall time, median of "
        f"{args.repeats} interleaved repeats x {args.loops} calls; target <= {TARGET_RATIO:g}x"
    )
    print_results(results, {"us/call": 1}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
