"""Micro-benchmark: the response cache stores (Tiers 2 and 3), memory and Redis.

Rows, each against a baseline measured in the same run:

* memory ``get`` hit and miss on a full store of the default capacity (1,000 keys of 64
  hex characters, 1 KiB values), and a hit on a store of ``--entries`` keys (100k: the
  dict and LRU list no longer fit in the CPU caches); ``set`` (replace; new key with an
  LRU eviction). Each call is an ``await`` inside a running coroutine, as in a request
  handler. Baselines: a bare ``dict.get`` on a dict of 1,000 keys, and an ``await`` of a
  coroutine that returns at once (the floor of any async store). Target: a ``get`` at
  most 1 us.
* Redis ``get`` of a 1 KiB value through ``RedisCacheStore`` (no hooks; with Prometheus
  hooks feeding ``continuum_cache_redis_latency_seconds``) and through the
  ``FallbackCacheStore`` that ``build_cache_store`` returns (hooks on), against a bare
  redis-py ``GET`` of the same key on the same client; the same for ``SET key value EX``
  and for a 64 KiB ``GET``. Wall time (the round trip is the cost), interleaved every 50
  calls. Target: at most 1.3x the bare call. Skipped if Redis is unreachable.

Memory rows use this thread's CPU time, Redis rows wall time (``_table.py`` explains the
interleaved-median method). Run:
``.venv/bin/python -m bench.cache_store_bench [--redis-url URL] [--entries N] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import sys
import time
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram

from router.cache import (
    ERROR_KINDS,
    OPERATIONS,
    InMemoryCacheStore,
    RedisCacheStore,
    build_cache_store,
)
from router.config.models import RedisConfig
from router.redis import RedisPools, glob_escape

from ._table import median, paired_ratio, print_results, time_interleaved

MEMORY_TARGET_US = 1.0
REDIS_TARGET_RATIO = 1.3
REDIS_CHUNK = 50
KIB = 1024
BATCH = 100
DEFAULT_CAPACITY = 1000  # response_cache.capacity's default


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends to completion, as ``await`` would."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("coroutine suspended")


def _key(rng: random.Random) -> str:
    return rng.randbytes(32).hex()


def _row(label: str, per: Sequence[float], base: Sequence[float], target: str, ok: bool | None):
    return {
        "case": label,
        "value": median(per) * 1e6,
        "unit": "us/call",
        "min": min(per) * 1e6,
        "max": max(per) * 1e6,
        "ratio": paired_ratio(per, base),
        "target": target,
        "pass": ok,
    }


def _awaiting(step: Callable[[str], Any], keys: list[str], is_async: bool) -> Callable[[], Any]:
    """One call runs a coroutine that does ``BATCH`` steps, awaiting each if ``is_async``:
    the cost of ``await store.get(k)`` inside a request handler, not of driving a fresh
    coroutine from outside (which adds a StopIteration per call)."""
    nxt = itertools.cycle(keys).__next__
    if is_async:

        async def run() -> None:
            for _ in range(BATCH):
                await step(nxt())

    else:

        async def run() -> None:
            for _ in range(BATCH):
                step(nxt())

    return lambda: drive(run())


def memory_rows(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    value = rng.randbytes(KIB)  # one object shared by every entry: the bench measures time
    cases: list[tuple[str, Callable[[], Any], bool]] = []
    stores = []
    for n in (DEFAULT_CAPACITY, args.entries):
        store = InMemoryCacheStore(n, 600)
        keys = [_key(rng) for _ in range(n)]
        for k in keys:
            store.put(k, value, 600)
        stores.append(store)
        hits = [keys[rng.randrange(n)] for _ in range(4096)]
        tag = f"{n // 1000}k"
        if n == DEFAULT_CAPACITY:
            plain = dict.fromkeys(keys, value)

            async def empty(key: str) -> None:
                return None

            misses = [_key(rng) for _ in range(4096)]
            fresh = [_key(rng) for _ in range(200_000)]

            def set_(key: str, store: InMemoryCacheStore = store) -> Any:
                return store.set(key, value, 600)

            cases += [
                (f"baseline: dict.get, {tag} keys", _awaiting(plain.get, hits, False), False),
                ("baseline: await an empty coroutine", _awaiting(empty, hits, True), False),
                (
                    f"memory get, hit, {tag} entries (default)",
                    _awaiting(store.get, hits, True),
                    True,
                ),
                (f"memory get, miss, {tag} entries", _awaiting(store.get, misses, True), True),
                (f"memory set, replace, {tag} entries", _awaiting(set_, hits, True), False),
                (f"memory set, new key + LRU evict, {tag}", _awaiting(set_, fresh, True), False),
            ]
        else:
            cases.append(
                (f"memory get, hit, {tag} entries", _awaiting(store.get, hits, True), True)
            )
    loops = max(1, args.loops // BATCH)
    timings = time_interleaved(
        [fn for _, fn, _ in cases], loops=loops, repeats=args.repeats, warmup=20
    )
    rows = []
    for (label, _, judged), per in zip(cases, timings, strict=True):
        per = [t / BATCH for t in per]
        base = [t / BATCH for t in timings[0]]
        ok = (median(per) * 1e6 <= MEMORY_TARGET_US) if judged else None
        rows.append(_row(label, per, base, f"<={MEMORY_TARGET_US:g}us" if judged else "", ok))
    assert stores[0].evictions > 0 and len(stores[0]) == DEFAULT_CAPACITY
    return rows


def prometheus_hooks() -> tuple[Callable[[str, float], None], Callable[[str], None]]:
    """Hooks as the router would wire them: label children cached, on a private registry."""
    reg = CollectorRegistry()
    hist = Histogram(
        "continuum_cache_redis_latency_seconds",
        "Redis response cache command latency.",
        ["operation"],
        registry=reg,
        buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
    )
    errs = Counter(
        "continuum_cache_redis_errors", "Redis response cache errors.", ["kind"], registry=reg
    )
    observe = {op: hist.labels(op).observe for op in OPERATIONS}
    count = {kind: errs.labels(kind).inc for kind in ERROR_KINDS}
    return (lambda op, s: observe[op](s)), (lambda kind: count[kind]())


async def redis_rows(url: str, loops: int, repeats: int) -> list[dict[str, Any]] | str:
    pools = RedisPools()
    cfg = RedisConfig(url=url, pool_size=4, key_prefix=f"bench:{uuid.uuid4().hex[:8]}:resp:")
    client = pools.get(cfg)
    try:
        await client.ping()
    except Exception as exc:
        await pools.aclose()
        return f"Redis at {url} unreachable ({type(exc).__name__}); Redis rows skipped"
    kp = cfg.key_prefix
    observe, count = prometheus_hooks()
    bare_store = RedisCacheStore(client, kp)
    hooked = RedisCacheStore(client, kp, observe_latency=observe, count_error=count)
    wrapped = build_cache_store(
        "redis", 1000, 600, cfg, pools, observe_latency=observe, count_error=count
    )
    rng = random.Random(3)
    small, big = rng.randbytes(KIB), rng.randbytes(64 * KIB)
    k_small, k_big, k_set = "ab" * 32, "cd" * 32, "ef" * 32
    try:
        await bare_store.set(k_small, small, 600)
        await bare_store.set(k_big, big, 600)
        assert client is wrapped.primary.redis  # type: ignore[attr-defined]
        get_small = (kp + k_small).encode()
        get_big = (kp + k_big).encode()
        set_key = (kp + k_set).encode()

        def bare_get(key: bytes) -> Callable[[], Any]:
            return lambda: client.get(key)

        def bare_set() -> Any:
            return client.set(set_key, small, ex=600)

        # (label, fn, baseline index or None for a baseline row)
        cases: list[tuple[str, Callable[[], Any], int | None]] = [
            ("baseline: redis-py GET 1 KiB", bare_get(get_small), None),
            ("RedisCacheStore.get 1 KiB, no hooks", lambda: bare_store.get(k_small), 0),
            ("RedisCacheStore.get 1 KiB, prometheus hooks", lambda: hooked.get(k_small), 0),
            ("build_cache_store (fallback) get 1 KiB", lambda: wrapped.get(k_small), 0),
            ("baseline: redis-py GET 64 KiB", bare_get(get_big), None),
            ("build_cache_store (fallback) get 64 KiB", lambda: wrapped.get(k_big), 4),
            ("baseline: redis-py SET 1 KiB EX", bare_set, None),
            ("RedisCacheStore.set 1 KiB, no hooks", lambda: bare_store.set(k_set, small, 600), 6),
            ("build_cache_store (fallback) set 1 KiB", lambda: wrapped.set(k_set, small, 600), 6),
        ]
        assert await wrapped.get(k_small) == small and await client.get(get_small) == small
        for _, fn, _ in cases:  # warm the pool and the caches
            for _ in range(200):
                await fn()
        timings: list[list[float]] = [[] for _ in cases]
        chunks = max(1, loops // REDIS_CHUNK)
        for _ in range(repeats):
            spent = [0.0] * len(cases)
            for _ in range(chunks):
                for i, (_, fn, _) in enumerate(cases):
                    t0 = time.perf_counter()
                    for _ in range(REDIS_CHUNK):
                        await fn()
                    spent[i] += time.perf_counter() - t0
            for i in range(len(cases)):
                timings[i].append(spent[i] / (chunks * REDIS_CHUNK))
        rows = []
        for (label, _, base), per in zip(cases, timings, strict=True):
            if base is None:
                rows.append(_row(label, per, per, "", None))
                continue
            ratio = paired_ratio(per, timings[base])
            rows.append(
                _row(
                    label,
                    per,
                    timings[base],
                    f"<={REDIS_TARGET_RATIO:g}x",
                    ratio <= REDIS_TARGET_RATIO,
                )
            )
        assert not wrapped.fallback_active  # type: ignore[attr-defined]
        return rows
    finally:
        keys = [k async for k in client.scan_iter(match=glob_escape(kp) + "*")]
        if keys:
            await client.unlink(*keys)
        await wrapped.close()
        await pools.aclose()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cache_store_bench", description=__doc__)
    p.add_argument("--entries", type=int, default=100_000, help="keys in the memory store")
    p.add_argument("--loops", type=int, default=50_000, help="memory calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--redis-loops", type=int, default=2000)
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)

    results = memory_rows(args, random.Random(args.seed))
    redis_note = "Redis rows skipped (--no-redis)"
    if not args.no_redis:
        got = asyncio.run(redis_rows(args.redis_url, args.redis_loops, args.repeats))
        if isinstance(got, str):
            redis_note = got
        else:
            results += got
            redis_note = (
                f"Redis {args.redis_url}: wall time, {args.redis_loops} calls x {args.repeats}, "
                f"interleaved every {REDIS_CHUNK}"
            )

    print(
        f"Response cache stores: memory rows on full stores (1 KiB values), each call an await "
        f"in a coroutine, thread CPU time, median of {args.repeats} interleaved repeats x "
        f"{args.loops} calls"
    )
    print(f"{redis_note}; ratio = paired, vs the baseline row above it\n")
    print_results(results, {}, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
