"""The chain (conversation) index rows of ``bench/kvindex_bench.py``.

Each row against a baseline measured in the same run (medians of interleaved repeats):

* **apply chain key events** (memory): a consumer's slices of 256 ``chain_created`` 70% /
  ``chain_evicted`` 20% / ``chain_offloaded`` 10% over 150k keys into ``max_entries``
  100k (evicting), through ``apply_events`` into the instrumented memory chain index, as
  the router applies them. Baseline: one dict store per event. Target: >= 200k events/s.
* **a 64-chunk deepest-held query** (memory): ``query_many`` of a 64-key chain and the
  scan (``router.kvindex.chains.deepest_held``) for 8 candidates, 3 of which hold
  prefix-closed depths, on an index of 128k keys. Target: <= 20 us. Measured beside it:
  the alternative, a binary search per backend with memoised per-key lookups, and the
  whole ``ConversationScorer.assess`` + ``decide``, and ``predictions`` (predict on route:
  the writes it would make). Baseline: 64 ``dict.get`` on a dict of the same size.
* **bytes per (key, backend)** (memory, tracemalloc): 16-byte chain keys written in
  slices of 256 (as events arrive), one and four backends per key, keys included.
  Baseline: a plain ``dict[bytes, int]`` of the same keys. Target: <= 200 B.
* **conversation routing, per request** (memory): everything of a chat request's
  conversation-depth routing but rendering its chain, as ``Selector.select`` and the
  forwarder's ``RoutingFeedback`` (``KvRuntime.sent``, ``answered``, ``delivered``) run it,
  for chains of 8, 33 and 130 keys (chats of about 2k, 8k and 32k tokens,
  ``conversation_cost_bench``'s sizes), 64 conversations over 3 backends, in the steady
  state of those requests repeated (each chain held by the backend routed to), with the
  router's metrics callbacks.
  Baseline: the prefix-key path's selection of the same requests (the overlap scorer's
  lookup, then PrefixAwareHash).
* **Redis**: ``query_many`` of a 64-key chain (3 backends, 114 entries) against a bare
  redis-py pipeline of ``ZRANGE key 0 -1 WITHSCORES`` of the same 64 keys, wall time.
  Target: <= 1.3x. Beside it: the 128-command pipeline (``ZREVRANGEBYSCORE`` +
  ``HGETALL`` per key) that the one-string script replaced, and the script's time inside
  Redis per call (``INFO commandstats``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import random
import time
import tracemalloc
import uuid
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

from bus.events import KvEvent
from router.config import parse_config
from router.config.models import ConversationConfig, RedisConfig, StorageOffloadingConfig
from router.kv_runtime import KvRuntime
from router.kvindex import (
    IndexEntry,
    InMemoryKvIndex,
    InstrumentedKvIndex,
    KvIndex,
    RedisKvIndex,
    StorageTier,
    apply_events,
)
from router.kvindex.chains import deepest_held
from router.kvindex.cost import ConversationScorer
from router.kvindex.prefill import PrefillLoad
from router.metrics import RouterMetrics
from router.pool import BackendPool
from router.redis import build_redis
from router.selection import SelectionContext, Selector

from ._table import median, paired_ratio, time_interleaved

__all__ = ["chain_bytes_rows", "chain_memory_rows", "chain_redis_rows", "route_rows"]

EVENTS_TARGET_PER_S = 200_000.0
QUERY_TARGET_US = 20.0
BYTES_TARGET = 200.0
REDIS_TARGET_RATIO = 1.3
CHAIN = 64
SLICE = 256
REDIS_CHUNK = 20
BACKENDS = [f"vllm-{i}" for i in range(8)]
OFFLOADING = StorageOffloadingConfig(enabled=True)


def drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run a coroutine that never suspends to completion, as ``await`` would."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise RuntimeError("coroutine suspended")


class _Chain:
    __slots__ = ("conversation", "keys", "prompt_bytes")

    def __init__(self, keys: list[bytes], prompt_bytes: int) -> None:
        self.keys = keys
        self.prompt_bytes = prompt_bytes
        self.conversation: bytes | None = None


def _row(label: str, per: list[float], base: list[float], scale: float = 1e6) -> dict[str, Any]:
    return {
        "case": label,
        "value": median(per) * scale,
        "unit": "us/call",
        "min": min(per) * scale,
        "max": max(per) * scale,
        "ratio": paired_ratio(per, base),
        "target": "",
        "pass": None,
    }


def _events(n_events: int, n_keys: int, rng: random.Random) -> list[KvEvent]:
    keys = [rng.randbytes(16).hex() for _ in range(n_keys)]
    out: list[KvEvent] = []
    for _ in range(n_events):
        k = keys[rng.randrange(n_keys)]
        b = BACKENDS[rng.randrange(8)]
        r = rng.random()
        if r < 0.7:
            out.append(
                KvEvent("chain_created", b, None, rng.randrange(16, 8192), "gpu", chain_key=k)
            )
        elif r < 0.9:
            out.append(KvEvent("chain_evicted", b, chain_key=k))
        else:
            out.append(
                KvEvent("chain_offloaded", b, None, rng.randrange(16, 8192), "storage", chain_key=k)
            )
    return out


def _binary_search(index: KvIndex, keys: Sequence[bytes], names: Sequence[str]) -> dict[str, int]:
    """The measured alternative: per backend, a binary search for its deepest key (valid
    under prefix closure), each key's lookup memoised across backends."""
    memo: dict[int, Sequence[IndexEntry]] = {}

    def row(i: int) -> Sequence[IndexEntry]:
        r = memo.get(i)
        if r is None:
            r = memo[i] = drive(index.query_backends(keys[i]))
        return r

    out: dict[str, int] = {}
    for name in names:
        lo, hi = 0, len(keys)
        while lo < hi:
            mid = (lo + hi) // 2
            if any(e.backend == name for e in row(mid)):
                lo = mid + 1
            else:
                hi = mid
        if lo:
            out[name] = lo
    return out


def chain_memory_rows(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    """Query and event rows (thread CPU time)."""
    results: list[dict[str, Any]] = []
    loops = max(100, args.loops // 10)

    # -- the query ----------------------------------------------------------------------
    inner = InMemoryKvIndex(1_000_000, 600)
    index = InstrumentedKvIndex(inner)
    chains: list[list[bytes]] = []
    for _ in range(2000):
        keys = [rng.randbytes(16) for _ in range(CHAIN)]
        chains.append(keys)
        changes = []
        for b in rng.sample(BACKENDS, 3):
            depth = rng.randint(1, CHAIN)
            changes += [(keys[i], b, 256 * (i + 1), StorageTier.GPU_HOT) for i in range(depth)]
        inner.write(changes)
    plain = dict.fromkeys((k for c in chains for k in c), 0)
    cfg, _ = parse_config(
        {
            "backends": [
                {"name": n, "url": f"http://h:{i + 1}", "models": ["m"]}
                for i, n in enumerate(BACKENDS)
            ]
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    cands, _ = pool.candidates("m", "chat")
    names = [b.name for b in cands]
    scorer = ConversationScorer(
        index, ConversationConfig(enabled=True), PrefillLoad(), entry_ttl_seconds=600
    )
    nxt = itertools.cycle(chains).__next__
    chain_objs = itertools.cycle([_Chain(c, CHAIN * 1024 + 300) for c in chains]).__next__
    fresh = [rng.randbytes(16) for _ in range(CHAIN)]
    fresh_view = drive(scorer.assess(_Chain(fresh, CHAIN * 1024), cands))

    def f_dict() -> None:
        get = plain.get
        for k in nxt():
            get(k)

    def f_scan() -> None:
        deepest_held(drive(index.query_many(nxt())), names)

    def f_search() -> None:
        _binary_search(index, nxt(), names)

    def f_assess_decide() -> None:
        view = drive(scorer.assess(chain_objs(), cands))
        scorer.decide(view, cands)

    def f_predict_held() -> None:
        view = drive(scorer.assess(chain_objs(), cands))
        b = next(iter(view.held))
        scorer.predictions(view, pool.get(b))  # type: ignore[arg-type]

    def f_predict_new() -> None:
        scorer.predictions(fresh_view, cands[0])

    cases = [
        ("baseline: 64 x dict.get, 128k keys", f_dict, ""),
        ("chain deepest held, 64 keys: query_many + scan", f_scan, "query"),
        ("chain deepest held, 64 keys: binary search, memoised", f_search, ""),
        ("conversation scorer assess()+decide(), 64 keys x8", f_assess_decide, ""),
        ("  + predictions() for a holder (assess included)", f_predict_held, ""),
        ("conversation predictions(), 64 new keys", f_predict_new, ""),
    ]
    timings = time_interleaved([fn for _, fn, _ in cases], loops=loops, repeats=args.repeats)
    for (label, _, kind), per in zip(cases, timings, strict=True):
        row = _row(label, per, timings[0])
        if kind == "query":
            row["target"] = f"<={QUERY_TARGET_US:g}us"
            row["pass"] = row["value"] <= QUERY_TARGET_US
        results.append(row)
    # The two algorithms agree on these (prefix-closed) chains.
    for c in chains[:200]:
        held, _ = deepest_held(drive(index.query_many(c)), names)
        assert {n: h.depth for n, h in held.items()} == _binary_search(index, c, names)

    # -- applying chain events ----------------------------------------------------------
    chain_index = InstrumentedKvIndex(InMemoryKvIndex(100_000, 600))
    prefix_index = InstrumentedKvIndex(InMemoryKvIndex(1000, 600))
    events = _events(300_000, 150_000, rng)
    slices = [events[i : i + SLICE] for i in range(0, len(events), SLICE)]
    for s in slices:  # steady state: full, evicting
        drive(apply_events(prefix_index, s, OFFLOADING, chain_index))
    store: dict[str | None, int | None] = {}
    nxt_slice = itertools.cycle(slices).__next__

    def f_store() -> None:
        for ev in nxt_slice():
            store[ev.chain_key] = ev.token_count

    def f_apply() -> None:
        drive(apply_events(prefix_index, nxt_slice(), OFFLOADING, chain_index))

    ev_loops = max(20, loops // 20)
    base, apply = time_interleaved([f_store, f_apply], loops=ev_loops, repeats=args.repeats)
    per_event = [t / SLICE for t in apply]
    results.append(
        _row(
            "baseline: dict store per chain event",
            [t / SLICE for t in base],
            [t / SLICE for t in base],
        )
    )
    results.append(
        _row(
            f"memory apply_events, chain events (slices of {SLICE})",
            per_event,
            [t / SLICE for t in base],
        )
    )
    rate = 1 / median(per_event)
    results.append(
        {
            "case": "  = chain key events applied per second",
            "value": rate,
            "unit": "events/s",
            "min": 1 / max(per_event),
            "max": 1 / min(per_event),
            "ratio": float("nan"),
            "target": f">={EVENTS_TARGET_PER_S / 1000:g}k/s",
            "pass": rate >= EVENTS_TARGET_PER_S,
        }
    )
    return results


ROUTE_CHAINS = (8, 33, 130)


def _prefix_decisions(metrics: RouterMetrics) -> Callable[[str, Any], None]:
    return lambda decision, _backend: metrics.prefix_decision(decision)


ROUTE_BACKENDS = 3


def route_rows(args: argparse.Namespace, rng: random.Random) -> list[dict[str, Any]]:
    """Conversation routing per request against the prefix-key path's selection."""
    cfg, _ = parse_config(
        {
            "selection_strategy": "PrefixAwareHash",
            "prefix_routing": {"enabled": True, "load_factor_epsilon": 0.25},
            "kv_cache_index": {"enabled": True, "conversation": {"enabled": True}},
            "backends": [
                {"name": f"b{i + 1}", "url": f"http://h:{i + 1}", "models": ["m"]}
                for i in range(ROUTE_BACKENDS)
            ],
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    cands, mask = pool.candidates("m", "chat")
    loops = max(100, args.loops // 20)
    results: list[dict[str, Any]] = []
    usage = {"prompt_tokens": 8000, "prompt_tokens_details": {"cached_tokens": 7900}}
    for n_keys in ROUTE_CHAINS:
        metrics = RouterMetrics(lambda: pool)  # the router's callbacks, as app.py wires them
        kv = KvRuntime(
            cfg,
            metrics.kv_decision,
            on_conversation_decision=metrics.kv_conversation_decision,
            on_prediction=metrics.kv_prediction,
        )
        selector = Selector(pool, cfg, _prefix_decisions(metrics))
        selector.scorer = kv.scorer
        selector.conversation = kv.conversation
        chains = [_Chain([rng.randbytes(16) for _ in range(n_keys)], n_keys * 1024 - 200)]
        for _ in range(63):
            chains.append(_Chain([rng.randbytes(16) for _ in range(n_keys)], n_keys * 1024 - 200))
        prefixes = [rng.randbytes(32) for _ in chains]
        nxt_chain = itertools.cycle(chains).__next__
        nxt_prefix = itertools.cycle(prefixes).__next__

        def f_prefix(
            nxt_prefix: Callable[[], bytes] = nxt_prefix, sel: Selector = selector
        ) -> None:
            drive(sel.select(cands, mask, SelectionContext("m", nxt_prefix())))

        def f_route(
            nxt_chain: Callable[[], _Chain] = nxt_chain,
            sel: Selector = selector,
            kv: KvRuntime = kv,
        ) -> None:
            ctx = SelectionContext("m", None, None, nxt_chain())
            backend = drive(sel.select(cands, mask, ctx))
            kv.answered(kv.sent(backend, ctx))
            kv.delivered(backend, ctx, usage)

        base, route = time_interleaved([f_prefix, f_route], loops=loops, repeats=args.repeats)
        if n_keys == ROUTE_CHAINS[0]:
            results.append(
                _row("baseline: prefix-key selection (overlap scorer + ring)", base, base)
            )
        results.append(
            _row(f"conversation routing per request, {n_keys} keys x{ROUTE_BACKENDS}", route, base)
        )
    return results


def chain_bytes_rows(n: int, seed: int) -> list[dict[str, Any]]:
    """Bytes per (chain key, backend) under tracemalloc, keys written in slices of 256."""
    results = []
    for per_key in (1, 4):
        rng = random.Random(seed)
        hexes = [rng.randbytes(16).hex() for _ in range(n // per_key)]
        gc.collect()
        tracemalloc.start()
        try:
            before = tracemalloc.get_traced_memory()[0]
            idx = InMemoryKvIndex(n, 600)
            batch: list[Any] = []
            for i, h in enumerate(hexes):
                k = bytes.fromhex(h)  # as apply does with an event's chain_key
                batch += [
                    (k, BACKENDS[(i + j) % 8], 1000 + i, StorageTier.GPU_HOT)
                    for j in range(per_key)
                ]
                if len(batch) >= SLICE:
                    idx.write(batch)
                    batch = []
            idx.write(batch)
            del batch
            index_bytes = tracemalloc.get_traced_memory()[0] - before
            del idx
            gc.collect()
            before = tracemalloc.get_traced_memory()[0]
            plain = {bytes.fromhex(h): 1000 + i for i, h in enumerate(hexes)}
            plain_bytes = tracemalloc.get_traced_memory()[0] - before
            del plain
        finally:
            tracemalloc.stop()
        b = index_bytes / (len(hexes) * per_key)
        results.append(
            {
                "case": f"memory bytes/entry, {len(hexes)} chain keys x {per_key} backend(s)",
                "value": b,
                "unit": "B/entry",
                "min": float("nan"),
                "max": float("nan"),
                "ratio": b / (plain_bytes / len(hexes)),
                "target": f"<={BYTES_TARGET:g}B",
                "pass": b <= BYTES_TARGET,
            }
        )
    return results


async def _script_usec(client: Any) -> tuple[int, int]:
    """(calls, usec) of EVALSHA in ``INFO commandstats`` (Redis' own time)."""
    info = await client.info("commandstats")
    st = info.get("cmdstat_evalsha") or {}
    return int(st.get("calls", 0)), int(st.get("usec", 0))


async def chain_redis_rows(url: str, loops: int, repeats: int) -> list[dict[str, Any]] | str:
    client = build_redis(RedisConfig(url=url, pool_size=4))
    try:
        await client.ping()
    except Exception as exc:
        await client.aclose(close_connection_pool=True)
        return f"Redis at {url} unreachable ({type(exc).__name__}); chain Redis rows skipped"
    kp = f"bench:{uuid.uuid4().hex[:8]}:kvchain:"
    idx = RedisKvIndex(client, 600, kp)
    try:
        rng = random.Random(5)
        keys = [rng.randbytes(16) for _ in range(CHAIN)]
        for b, depth in (("vllm-1", 64), ("vllm-2", 40), ("vllm-3", 10)):
            await idx.write_many(
                [(keys[i], b, 256 * (i + 1), StorageTier.GPU_HOT) for i in range(depth)]
            )
        rkeys = [(kp + k.hex()).encode() for k in keys]

        async def bare() -> Any:
            pipe = client.pipeline(transaction=False)
            for k in rkeys:
                pipe.zrange(k, 0, -1, withscores=True)
            return await pipe.execute()

        async def query_many() -> Any:
            return await idx.query_many(keys)

        async def pipelined_128() -> Any:
            cmds: list[tuple[Any, ...]] = []
            for k in rkeys:
                cmds.append((b"ZREVRANGEBYSCORE", k, b"+inf", b"-inf", b"WITHSCORES"))
                cmds.append((b"HGETALL", k + b":t"))
            cmds.append((b"HGETALL", (kp + "#gens").encode()))
            replies = await idx._roundtrip(cmds)
            gens = replies[-1]
            return [idx._decode(replies[2 * i], replies[2 * i + 1], gens) for i in range(CHAIN)]

        async def deepest() -> Any:
            return deepest_held(await idx.query_many(keys), BACKENDS)

        cases: list[tuple[str, Callable[[], Any], bool]] = [
            ("baseline: redis-py pipeline, 64 x ZRANGE WITHSCORES", bare, False),
            ("Redis chain query_many, 64 keys (one script)", query_many, True),
            ("Redis 128-command pipeline (ZREVRANGEBYSCORE+HGETALL)", pipelined_128, False),
            ("Redis chain deepest held, 64 keys", deepest, False),
        ]
        got = await query_many()
        assert sum(map(len, got)) == 114 and len(await bare()) == CHAIN
        assert [[(e.backend, e.token_count) for e in r] for r in await pipelined_128()] == [
            [(e.backend, e.token_count) for e in r] for r in got
        ]
        for _, fn, _ in cases:
            for _ in range(50):
                await fn()
        calls0, usec0 = await _script_usec(client)
        timings: list[list[float]] = [[] for _ in cases]
        chunks = max(1, loops // REDIS_CHUNK)
        for _ in range(repeats):
            spent = [0.0] * len(cases)
            for _ in range(chunks):
                for i, (_, fn, _) in enumerate(cases):
                    t0 = time.perf_counter()
                    for _ in range(REDIS_CHUNK):
                        await fn()
                    spent[i] += (time.perf_counter() - t0) / REDIS_CHUNK
            for i in range(len(cases)):
                timings[i].append(spent[i] / chunks)
        calls1, usec1 = await _script_usec(client)
        rows = []
        for (label, _, judged), per in zip(cases, timings, strict=True):
            row = _row(label, per, timings[0])
            if judged:
                row["target"] = f"<={REDIS_TARGET_RATIO:g}x"
                row["pass"] = row["ratio"] <= REDIS_TARGET_RATIO
            rows.append(row)
        if calls1 > calls0:  # the scripts of query_many and deepest (shared Redis: approximate)
            per_call = (usec1 - usec0) / (calls1 - calls0)
            rows.append(
                {
                    "case": "  Redis' own time per query_many script call",
                    "value": per_call,
                    "unit": "us/call",
                    "min": float("nan"),
                    "max": float("nan"),
                    "ratio": float("nan"),
                    "target": "",
                    "pass": None,
                }
            )
        return rows
    finally:
        found = [k async for k in client.scan_iter(match=kp + "*")]
        if found:
            await client.unlink(*found)
        await idx.close()
        await client.aclose(close_connection_pool=True)
