"""Micro-benchmark: the KV index (Tier 4), memory and Redis backends.

Rows, each against a baseline measured in the same run:

* memory ``query_backends`` on an index of 100k prefixes (hit: 2 backends; miss), the
  coroutine driven to completion as an ``await`` would (it never suspends). Baseline: a
  bare ``dict.get`` on a dict of the same size. Target: at most 20 us per query.
* ``apply_event`` into the memory index (storage offloading on): a stream of created /
  offloaded / evicted events over 150k prefixes with ``max_entries`` 100k, so evictions
  happen too. Baseline: one bare dict store per event. Target: at least 100k events/s.
* Redis ``query_backends`` (one prefix, 3 backends) against a bare redis-py
  ``ZREVRANGEBYSCORE key +inf -inf WITHSCORES`` on the same key and client, wall time
  (the round trip is the cost), interleaved every 50 calls. Target: at most 1.3x.
  Skipped if Redis is unreachable. Also, per event: a consumer slice of 256 events applied
  one by one (a MULTI/EXEC each) and through ``apply_events`` (``write_many``: one script
  call), the same events.
* memory bytes per (prefix, backend) entry with tracemalloc, the 64-character keys
  included (the index keeps them). Baseline: a plain ``dict[str, int]`` of the same keys.
  Target: at most 400 B.

Then the chain (conversation) index's rows, listed in ``bench/kvindex_chain.py``: chain
events applied per second, the 64-chunk deepest-held query, bytes per (chain key,
backend), and Redis ``query_many`` against a bare pipeline of the same keys.

Memory rows use this thread's CPU time, Redis rows wall time (``_table.py`` explains the
interleaved-median method). Run:
``.venv/bin/python -m bench.kvindex_bench [--redis-url URL] [--prefixes N] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import itertools
import os
import random
import sys
import time
import tracemalloc
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from bus.events import KvEvent
from router.config.models import RedisConfig, StorageOffloadingConfig
from router.kvindex import (
    InMemoryKvIndex,
    InstrumentedKvIndex,
    RedisKvIndex,
    StorageTier,
    apply_event,
    apply_events,
)
from router.redis import build_redis

from ._table import median, paired_ratio, print_results, time_interleaved
from .kvindex_chain import chain_bytes_rows, chain_memory_rows, chain_redis_rows, route_rows

_T = TypeVar("_T")

QUERY_TARGET_US = 20.0
EVENTS_TARGET_PER_S = 100_000.0
REDIS_TARGET_RATIO = 1.3
BYTES_TARGET = 400.0
REDIS_CHUNK = 50
BATCH = 256
BACKENDS = [f"vllm-{i}" for i in range(8)]
OFFLOADING = StorageOffloadingConfig(enabled=True, treat_eviction_as_offload=True)


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends to completion, as ``await`` would."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("coroutine suspended")


def _prefix(rng: random.Random) -> str:
    return rng.randbytes(32).hex()


def build_memory(n: int, rng: random.Random) -> tuple[InMemoryKvIndex, list[str]]:
    idx = InMemoryKvIndex(max(n, 100), 600)
    prefixes = [_prefix(rng) for _ in range(n)]
    for i, p in enumerate(prefixes):
        idx.put(p, BACKENDS[i % 8], 512 + i % 2048, StorageTier.GPU_HOT)
        idx.put(p, BACKENDS[(i + 3) % 8], 256 + i % 1024, StorageTier.STORAGE_WARM)
    return idx, prefixes


def make_events(n_events: int, n_prefixes: int, rng: random.Random) -> list[KvEvent]:
    """created 60% (half of them growing a known prefix), offloaded 20%, evicted 20%."""
    prefixes = [_prefix(rng) for _ in range(n_prefixes)]
    out: list[KvEvent] = []
    for _ in range(n_events):
        p = prefixes[rng.randrange(n_prefixes)]
        b = BACKENDS[rng.randrange(8)]
        r = rng.random()
        if r < 0.6:
            out.append(KvEvent("cache_created", b, p, rng.randrange(16, 8192), "gpu"))
        elif r < 0.8:
            out.append(KvEvent("cache_offloaded", b, p, rng.randrange(16, 8192), "storage"))
        else:
            out.append(KvEvent("cache_evicted", b, p))
    return out


def bytes_per_entry(n_prefixes: int, per_prefix: int, rng: random.Random) -> tuple[float, float]:
    """(index bytes per entry, plain dict[str, int] bytes per key) under tracemalloc."""
    seeds = [rng.randbytes(32) for _ in range(n_prefixes)]
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = InMemoryKvIndex(n_prefixes, 600)
        for i, s in enumerate(seeds):
            p = s.hex()
            for j in range(per_prefix):
                idx.put(p, BACKENDS[(i + j) % 8], 1000 + i, StorageTier.GPU_HOT)
        index_bytes = tracemalloc.get_traced_memory()[0] - before
        del idx
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        plain = {s.hex(): 1000 + i for i, s in enumerate(seeds)}
        plain_bytes = tracemalloc.get_traced_memory()[0] - before
        del plain
    finally:
        tracemalloc.stop()
    return index_bytes / (n_prefixes * per_prefix), plain_bytes / n_prefixes


async def redis_rows(url: str, loops: int, repeats: int) -> list[dict[str, Any]] | str:
    client = build_redis(RedisConfig(url=url, pool_size=4))
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose(close_connection_pool=True)
        return f"Redis at {url} unreachable ({type(exc).__name__}); Redis rows skipped"
    kp = f"bench:{uuid.uuid4().hex[:8]}:kvidx:"
    idx = RedisKvIndex(client, 600, kp)
    try:
        p = "ab" * 32
        await idx.upsert(p, "vllm-1", 2048, StorageTier.GPU_HOT)
        await idx.upsert(p, "vllm-2", 1024, StorageTier.STORAGE_WARM)
        await idx.upsert(p, "vllm-3", 512, StorageTier.GPU_HOT)
        key = kp + p
        miss = "cd" * 32
        ev = KvEvent("cache_created", "vllm-4", p, 4096, "gpu")

        async def bare() -> Any:
            return await client.zrevrangebyscore(key, "+inf", "-inf", withscores=True)

        async def query() -> Any:
            return await idx.query_backends(p)

        async def query_miss() -> Any:
            return await idx.query_backends(miss)

        async def apply() -> Any:
            return await apply_event(idx, ev, OFFLOADING)

        # A consumer's chunk: created 80 %, evicted 20 % over 10k prefixes, the default
        # storage_offloading (off: an eviction is a remove); one by one, then as the
        # consumer hands a slice over (apply_events -> write_many: one script call).
        rng = random.Random(11)
        stream = [
            KvEvent("cache_created", b, p2, rng.randrange(16, 8192), "gpu")
            if rng.random() < 0.8
            else KvEvent("cache_evicted", b, p2)
            for p2, b in (
                (f"{rng.randrange(10_000):064x}", BACKENDS[rng.randrange(8)]) for _ in range(4096)
            )
        ]
        nxt_slice = itertools.cycle(
            [stream[i : i + BATCH] for i in range(0, len(stream), BATCH)]
        ).__next__
        off = StorageOffloadingConfig()

        async def apply_one_by_one() -> Any:
            for e in nxt_slice():
                await apply_event(idx, e, off)

        async def apply_batched() -> Any:
            return await apply_events(idx, nxt_slice(), off)

        cases: list[tuple[str, Callable[[], Any], bool, int]] = [
            ("baseline: redis-py ZREVRANGEBYSCORE", bare, False, 1),
            ("Redis query_backends, 3 backends", query, True, 1),
            ("Redis query_backends, miss", query_miss, True, 1),
            ("Redis apply_event (MULTI upsert)", apply, False, 1),
            (
                f"Redis apply_event one by one, per event (slices of {BATCH})",
                apply_one_by_one,
                False,
                BATCH,
            ),
            (f"Redis apply_events, per event (slices of {BATCH})", apply_batched, False, BATCH),
        ]
        assert len(await query()) == 3 and len(await bare()) == 3
        for _, fn, _, per in cases:  # warm the pool and the caches
            for _ in range(200 // per + 1):
                await fn()
        # Finer interleaving than the memory rows: a repeat is loops/CHUNK rounds of CHUNK
        # calls per case, so a burst of load from elsewhere hits every case alike.
        timings: list[list[float]] = [[] for _ in cases]
        chunks = max(1, loops // REDIS_CHUNK)
        for _ in range(repeats):
            spent = [0.0] * len(cases)
            for _ in range(chunks):
                for i, (_, fn, _, per) in enumerate(cases):
                    calls = max(1, REDIS_CHUNK // per)
                    t0 = time.perf_counter()
                    for _ in range(calls):
                        await fn()
                    spent[i] += (time.perf_counter() - t0) / (calls * per)
            for i in range(len(cases)):
                timings[i].append(spent[i] / chunks)
        base = timings[0]
        rows = []
        for (label, _, judged, _), times in zip(cases, timings, strict=True):
            ratio = paired_ratio(times, base)
            rows.append(
                {
                    "case": label,
                    "value": median(times) * 1e6,
                    "unit": "us/call" if "per event" not in label else "us/event",
                    "min": min(times) * 1e6,
                    "max": max(times) * 1e6,
                    "ratio": ratio,
                    "target": f"<={REDIS_TARGET_RATIO:g}x" if judged else "",
                    "pass": (ratio <= REDIS_TARGET_RATIO) if judged else None,
                }
            )
        return rows
    finally:
        keys = [k async for k in client.scan_iter(match=kp + "*")]
        if keys:
            await client.unlink(*keys)
        await idx.close()
        await client.aclose(close_connection_pool=True)


def memory_rows(args: argparse.Namespace, rng: random.Random) -> tuple[list[dict[str, Any]], Any]:
    """Query and event rows for the memory index (thread CPU time)."""
    # -- memory: query ------------------------------------------------------------------
    idx, prefixes = build_memory(args.prefixes, rng)
    plain = dict.fromkeys(prefixes, 0)  # same keys and size, for the baseline
    misses = [_prefix(rng) for _ in range(4096)]
    hits = [prefixes[rng.randrange(len(prefixes))] for _ in range(4096)]

    def cyc(seq: list[_T]) -> Callable[[], _T]:
        return itertools.cycle(seq).__next__

    def f_dict() -> Callable[[], Any]:
        nxt, get = cyc(hits), plain.get
        return lambda: get(nxt())

    def f_query(keys: list[str]) -> Callable[[], Any]:
        nxt, q = cyc(keys), idx.query_backends
        return lambda: drive(q(nxt()))

    def f_lookup() -> Callable[[], Any]:
        nxt, q = cyc(hits), idx.lookup
        return lambda: q(nxt())

    # -- memory: events -----------------------------------------------------------------
    ev_index = InMemoryKvIndex(100_000, 600)
    events = make_events(300_000, 150_000, rng)
    for ev in events:  # steady state: full, evicting
        drive(apply_event(ev_index, ev, OFFLOADING))
    store: dict[str | None, int | None] = {}

    def f_store() -> Callable[[], Any]:
        nxt = cyc(events)

        def run() -> None:
            ev = nxt()
            store[ev.prefix_hash] = ev.token_count

        return run

    def f_apply() -> Callable[[], Any]:
        nxt = cyc(events)
        return lambda: drive(apply_event(ev_index, nxt(), OFFLOADING))

    # -- scorer: prepare() + score() for one request, 4 candidates ---------------------
    from router.config import ScoringConfig, parse_config
    from router.kvindex.scorer import KvOverlapScorer
    from router.pool import BackendPool

    # The candidates are the index's own backend names, so entries are found and scored.
    cfg, _ = parse_config(
        {
            "backends": [
                {"name": name, "url": f"http://h:{i + 1}", "models": ["m"]}
                for i, name in enumerate(BACKENDS)
            ]
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    cands, _ = pool.candidates("m", "chat")
    scorer = KvOverlapScorer(idx, ScoringConfig())
    keys = [prefixes[rng.randrange(len(prefixes))] for _ in range(4096)]

    def f_prepare_score() -> Callable[[], Any]:
        # A fresh prefix each call, so prepare() really queries (no 100 ms cache hit).
        nxt = cyc(keys)

        def run() -> None:
            key = nxt()
            scorer._prepared.pop(key, None)
            p = drive(scorer.prepare(key, cands))
            for b in cands:
                scorer.score_with_tier(p, b)

        return run

    prep = drive(scorer.prepare(prefixes[-1], cands))  # the newest: never evicted
    held = next(b for b in cands if b.name in prep.entries)

    def f_score() -> Callable[[], Any]:
        return lambda: scorer.score_with_tier(prep, held)

    # -- the index as the router builds it: the instrumented wrapper over memory ----------
    wrapped = InstrumentedKvIndex(idx)
    ev_wrapped = InstrumentedKvIndex(ev_index)

    def f_wrapped_query() -> Callable[[], Any]:
        nxt, q = cyc(hits), wrapped.query_backends
        return lambda: drive(q(nxt()))

    def f_wrapped_apply() -> Callable[[], Any]:
        nxt = cyc(events)
        return lambda: drive(apply_event(ev_wrapped, nxt(), OFFLOADING))

    cases: list[tuple[str, Callable[[], Any], str]] = [
        ("baseline: dict.get, 100k keys", f_dict(), ""),
        ("memory query_backends, hit (2 backends)", f_query(hits), "query"),
        ("memory query_backends, miss", f_query(misses), "query"),
        ("memory lookup (sync), hit", f_lookup(), ""),
        ("baseline: dict store per event", f_store(), ""),
        ("memory apply_event (offloading on)", f_apply(), "events"),
        ("scorer prepare()+score() x8 candidates", f_prepare_score(), "prepare"),
        ("scorer score_with_tier(), one backend", f_score(), "score"),
        ("instrumented(memory) query_backends, hit", f_wrapped_query(), "query"),
        ("instrumented(memory) apply_event", f_wrapped_apply(), "events"),
    ]
    timings = time_interleaved([fn for _, fn, _ in cases], loops=args.loops, repeats=args.repeats)
    results: list[dict[str, Any]] = []
    for (label, _, kind), per in zip(cases, timings, strict=True):
        base = timings[4] if kind == "events" or "per event" in label else timings[0]
        med = median(per) * 1e6
        row: dict[str, Any] = {
            "case": label,
            "value": med,
            "unit": "us/call",
            "min": min(per) * 1e6,
            "max": max(per) * 1e6,
            "ratio": paired_ratio(per, base),
            "target": "",
            "pass": None,
        }
        if kind in ("query", "prepare"):
            row["target"] = f"<={QUERY_TARGET_US:g}us"
            row["pass"] = med <= QUERY_TARGET_US
        if kind == "score":
            row["target"] = "<=2us"
            row["pass"] = med <= 2.0
        results.append(row)
        if kind == "events":
            rate = 1e6 / med if med > 0 else float("nan")
            results.append(
                {
                    "case": "  = events applied per second",
                    "value": rate,
                    "unit": "events/s",
                    "min": 1 / max(per),
                    "max": 1 / min(per),
                    "ratio": float("nan"),
                    "target": f">={EVENTS_TARGET_PER_S / 1000:g}k/s",
                    "pass": rate >= EVENTS_TARGET_PER_S,
                }
            )
    stats = ev_index.snapshot_stats()
    return results, stats


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.kvindex_bench", description=__doc__)
    p.add_argument("--prefixes", type=int, default=100_000, help="prefixes in the index")
    p.add_argument("--loops", type=int, default=50_000, help="memory calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--redis-loops", type=int, default=2000)
    p.add_argument("--no-redis", action="store_true")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--no-chains", action="store_true", help="skip the chain index's rows")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)

    results, stats = memory_rows(args, rng)
    gc.collect()
    if not args.no_chains:
        results += chain_memory_rows(args, random.Random(args.seed))
        results += route_rows(args, random.Random(args.seed))
        gc.collect()

    # -- Redis --------------------------------------------------------------------------
    redis_note = "Redis rows skipped (--no-redis)"
    if not args.no_redis:
        got = asyncio.run(redis_rows(args.redis_url, args.redis_loops, args.repeats))
        if isinstance(got, str):
            redis_note = got
        else:
            results += got
            redis_note = (
                f"Redis {args.redis_url}: wall time, {args.redis_loops} calls x {args.repeats}"
            )
            if not args.no_chains:
                chain = asyncio.run(
                    chain_redis_rows(args.redis_url, args.redis_loops // 10, args.repeats)
                )
                if isinstance(chain, str):
                    redis_note += f"; {chain}"
                else:
                    results += chain

    # -- memory footprint ---------------------------------------------------------------
    for per_prefix in (1, 4):
        n = args.prefixes // per_prefix
        b, plain_b = bytes_per_entry(n, per_prefix, random.Random(args.seed))
        results.append(
            {
                "case": f"memory bytes/entry, {n} prefixes x {per_prefix} backend(s)",
                "value": b,
                "unit": "B/entry",
                "min": float("nan"),
                "max": float("nan"),
                "ratio": b / plain_b,
                "target": f"<={BYTES_TARGET:g}B",
                "pass": b <= BYTES_TARGET,
            }
        )

    if not args.no_chains:
        results += chain_bytes_rows(args.prefixes, args.seed)

    print(
        f"KV index: {args.prefixes} prefixes x 2 backends for queries; events over 150k "
        f"prefixes into max_entries=100k (after warm-up: {stats.prefix_count} prefixes, "
        f"{stats.entry_count} entries, {stats.total_evictions} evicted); memory rows: thread "
        f"CPU time, median of {args.repeats} interleaved repeats x {args.loops} calls"
    )
    print(f"{redis_note}; ratio = vs the baseline row above it (bytes: vs dict[str, int])\n")
    digits = {"us/call": 3, "events/s": 0, "B/entry": 1}
    print_results(results, digits, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
