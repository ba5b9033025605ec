"""KvOverlapScorer: the composite formula, hand-computed, on a real index and real backends.

    final = overlap_weight * (raw_overlap * tier_multiplier)
          + load_weight    * (1 - load_ratio)
          + health_weight  * health

Every expectation below is worked out by hand from the defaults (0.6 / 0.3 / 0.1,
min_overlap_threshold 0.3, gpu 1.0, storage 0.6) or the weights a test sets itself.
The index is a real ``InMemoryKvIndex``; the backends are ``router.pool.Backend`` objects
built from a parsed config, so ``in_flight`` and ``success_rate`` are the real gauges.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from router.config import RouterConfig, parse_config
from router.kvindex import InMemoryKvIndex, InstrumentedKvIndex, KvIndex, StorageTier
from router.kvindex.scorer import DEFAULT_SCORER_THRESHOLD, KvOverlapScorer
from router.pool import Backend, BackendPool
from router.selection import SelectionContext, Selector

KEY = bytes(range(32))
PREFIX = KEY.hex()
OTHER_KEY = bytes(range(1, 33))


class Clock:
    """A settable monotonic clock for the scorer's 100 ms prepare cache."""

    def __init__(self, t: float = 1000.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


class Decisions:
    """Collects on_decision callbacks as (decision, tier, score)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, float | None]] = []

    def __call__(self, decision: str, tier: str, score: float | None) -> None:
        self.calls.append((decision, tier, score))


def make(
    names: Sequence[str] = ("a", "b", "c"), **scoring: Any
) -> tuple[RouterConfig, BackendPool, tuple[Backend, ...]]:
    cfg, _ = parse_config(
        {
            "prefix_routing": {"enabled": True},
            "kv_cache_index": {"enabled": True, "scoring": scoring},
            "backends": [
                {"name": n, "url": f"http://h:{i + 1}", "type": "vllm", "models": ["m"]}
                for i, n in enumerate(names)
            ],
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    cands, _ = pool.candidates("m", "chat")
    assert [b.name for b in cands] == list(names)
    return cfg, pool, cands


def scorer_for(
    cfg: RouterConfig, index: KvIndex, clock: Clock | None = None
) -> tuple[KvOverlapScorer, Decisions]:
    decisions = Decisions()
    kw: dict[str, Any] = {"on_decision": decisions}
    if clock is not None:
        kw["clock"] = clock
    return KvOverlapScorer(index, cfg.kv_cache_index.scoring, **kw), decisions


async def scores(
    scorer: KvOverlapScorer, cands: Sequence[Backend], prefix: str = PREFIX
) -> dict[str, float]:
    p = await scorer.prepare(prefix, cands)
    return {b.name: scorer.score(p, b) for b in cands}


# -- the formula -------------------------------------------------------------------------


async def test_raw_overlap_is_normalised_by_the_largest_holder_and_load_by_the_busiest() -> None:
    cfg, _, (a, b, c) = make()
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "b", 500, StorageTier.GPU_HOT)
    a.in_flight, b.in_flight, c.in_flight = 2, 4, 0
    scorer, _ = scorer_for(cfg, index)

    got = await scores(scorer, (a, b, c))
    # a: 0.6 * 1000/1000 + 0.3 * (1 - 2/4) + 0.1 * 1.0 = 0.6 + 0.15 + 0.1
    assert got["a"] == pytest.approx(0.85)
    # b: 0.6 * 500/1000 + 0.3 * (1 - 4/4) + 0.1 * 1.0 = 0.3 + 0.0 + 0.1
    assert got["b"] == pytest.approx(0.4)
    # c holds nothing: 0, however idle it is.
    assert got["c"] == 0.0

    p = await scorer.prepare(PREFIX, (a, b, c))
    final, overlap, idle, health, tier = scorer.components(p, b)
    assert (overlap, idle, health, tier) == (pytest.approx(0.5), 0.0, 1.0, StorageTier.GPU_HOT)
    assert final == pytest.approx(0.4)


async def test_the_max_holder_is_taken_among_candidates_only() -> None:
    """An entry of a backend that is not a candidate (unhealthy, other model) does not
    shrink the candidates' raw overlap."""
    cfg, _, (a, b) = make(("a", "b"))
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 500, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "not-a-candidate", 1000, StorageTier.GPU_HOT)
    scorer, _ = scorer_for(cfg, index)
    got = await scores(scorer, (a, b))
    # a: 0.6 * 500/500 + 0.3 * (1 - 0) + 0.1 * 1.0 (all idle: load ratio 0)
    assert got == {"a": pytest.approx(1.0), "b": 0.0}


async def test_tier_multipliers_weigh_the_overlap() -> None:
    cfg, _, (a, b) = make(("a", "b"))
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.STORAGE_WARM)
    await index.upsert(PREFIX, "b", 1000, StorageTier.GPU_HOT)
    scorer, decisions = scorer_for(cfg, index)
    got = await scores(scorer, (a, b))
    # a: 0.6 * (1.0 * 0.6) + 0.3 * 1 + 0.1 * 1 = 0.36 + 0.4
    assert got["a"] == pytest.approx(0.76)
    # b: 0.6 * (1.0 * 1.0) + 0.3 + 0.1
    assert got["b"] == pytest.approx(1.0)
    assert await scorer.choose(KEY, (a, b)) is b
    assert decisions.calls == [("kv_aware", "gpu_hot", pytest.approx(1.0))]

    # Custom multipliers: gpu 0.8, storage 0.5 (and a smaller holder on the GPU).
    cfg2, _, (a2, b2) = make(("a", "b"), gpu_tier_weight=0.8, storage_tier_weight=0.5)
    index2 = InMemoryKvIndex()
    await index2.upsert(PREFIX, "a", 800, StorageTier.STORAGE_WARM)
    await index2.upsert(PREFIX, "b", 400, StorageTier.GPU_HOT)
    scorer2, decisions2 = scorer_for(cfg2, index2)
    got2 = await scores(scorer2, (a2, b2))
    # a: overlap 800/800 * 0.5 = 0.5 -> 0.6 * 0.5 + 0.3 + 0.1 = 0.7
    assert got2["a"] == pytest.approx(0.7)
    # b: overlap 400/800 * 0.8 = 0.4 -> 0.6 * 0.4 + 0.3 + 0.1 = 0.64
    assert got2["b"] == pytest.approx(0.64)
    assert await scorer2.choose(KEY, (a2, b2)) is a2
    assert decisions2.calls == [("kv_aware", "storage_warm", pytest.approx(0.7))]


async def test_min_overlap_threshold_excludes_small_holders() -> None:
    cfg, _, (a, b) = make(("a", "b"))
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "b", 200, StorageTier.GPU_HOT)
    a.in_flight = 9  # a is the busiest; b idle would win on load alone
    scorer, _ = scorer_for(cfg, index)
    p = await scorer.prepare(PREFIX, (a, b))
    final, overlap, idle, _, tier = scorer.components(p, b)
    # b: 200/1000 = 0.2 < 0.3 -> excluded (score 0), although it is idle.
    assert final == 0.0 and overlap == pytest.approx(0.2) and idle == 1.0
    assert scorer.score_with_tier(p, b) == (0.0, None)
    assert tier is StorageTier.GPU_HOT
    # a: 0.6 * 1.0 + 0.3 * (1 - 9/9) + 0.1 = 0.7
    assert scorer.score(p, a) == pytest.approx(0.7)
    assert await scorer.choose(KEY, (a, b)) is a

    # Exactly at the threshold passes (the rule is "under the threshold").
    cfg2, _, (a2, b2) = make(("a", "b"), min_overlap_threshold=0.5)
    index2 = InMemoryKvIndex()
    await index2.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index2.upsert(PREFIX, "b", 500, StorageTier.GPU_HOT)
    scorer2, _ = scorer_for(cfg2, index2)
    got2 = await scores(scorer2, (a2, b2))
    # b: 0.6 * 0.5 + 0.3 + 0.1 = 0.7
    assert got2["b"] == pytest.approx(0.7)


async def test_storage_copies_under_the_threshold_are_excluded() -> None:
    """storage_tier_weight below min_overlap_threshold: a warm-only copy never counts."""
    cfg, _, (a, b) = make(("a", "b"), storage_tier_weight=0.2)
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.STORAGE_WARM)
    scorer, decisions = scorer_for(cfg, index)
    assert await scores(scorer, (a, b)) == {"a": 0.0, "b": 0.0}
    assert await scorer.choose(KEY, (a, b)) is None
    assert decisions.calls == [("fallback", "none", None)]


async def test_an_idle_uncached_backend_never_wins() -> None:
    """Load + health alone (0.3 + 0.1 = 0.4 > 0.3) would beat the pool threshold: an
    uncached backend must score 0, so the busy holder wins."""
    cfg, _, (a, b, c) = make()
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 64, StorageTier.GPU_HOT)
    a.in_flight = 50
    scorer, decisions = scorer_for(cfg, index)
    got = await scores(scorer, (a, b, c))
    # a: 0.6 * 1.0 + 0.3 * (1 - 50/50) + 0.1 * 1.0 = 0.7; b, c: 0 (not 0.4).
    assert got == {"a": pytest.approx(0.7), "b": 0.0, "c": 0.0}
    assert await scorer.choose(KEY, (a, b, c)) is a
    # With no entry at all nobody is chosen: the strategy decides.
    assert await scorer.choose(OTHER_KEY, (a, b, c)) is None
    assert decisions.calls == [
        ("kv_aware", "gpu_hot", pytest.approx(0.7)),
        ("fallback", "none", None),
    ]


async def test_the_pool_threshold_is_strictly_greater_than_0_3() -> None:
    # overlap 0.3 / load 0.7 / health 0.0: the only holder, also the only busy one,
    # scores exactly 0.3 * 1.0 + 0.7 * (1 - 1/1) + 0.0 * 1.0 = 0.3.
    cfg, _, (a, b) = make(("a", "b"), overlap_weight=0.3, load_weight=0.7, health_weight=0.0)
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 100, StorageTier.GPU_HOT)
    a.in_flight = 1
    clock = Clock()
    scorer, decisions = scorer_for(cfg, index, clock)
    assert scorer.threshold == DEFAULT_SCORER_THRESHOLD == 0.3
    p = await scorer.prepare(PREFIX, (a, b))
    assert scorer.score(p, a) == 0.3
    assert await scorer.choose(KEY, (a, b)) is None
    assert decisions.calls == [("fallback", "none", None)]

    # Just above: b now carries 2 in flight, so a's load ratio is 1/2:
    # 0.3 + 0.7 * 0.5 = 0.65 > 0.3 -> chosen (after the prepare cache expired).
    b.in_flight = 2
    clock.t += 0.1
    assert await scorer.choose(KEY, (a, b)) is a
    assert decisions.calls[-1] == ("kv_aware", "gpu_hot", pytest.approx(0.65))


async def test_health_is_the_backends_success_rate() -> None:
    cfg, _, (a, b) = make(("a", "b"))
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "b", 1000, StorageTier.GPU_HOT)
    for i in range(100):
        a.record_outcome(i % 2 == 0)  # 50 of the last 100 failed
    assert a.success_rate == 0.5 and b.success_rate == 1.0
    scorer, decisions = scorer_for(cfg, index)
    p = await scorer.prepare(PREFIX, (a, b))
    assert scorer.components(p, a)[3] == 0.5
    got = {x.name: scorer.score(p, x) for x in (a, b)}
    # a: 0.6 + 0.3 + 0.1 * 0.5 = 0.95; b: 0.6 + 0.3 + 0.1 * 1.0 = 1.0
    assert got == {"a": pytest.approx(0.95), "b": pytest.approx(1.0)}
    assert await scorer.choose(KEY, (a, b)) is b
    assert decisions.calls == [("kv_aware", "gpu_hot", pytest.approx(1.0))]


# -- the prepare snapshot and its 100 ms cache -------------------------------------------


async def test_load_ratio_reads_the_in_flight_snapshot_taken_by_prepare() -> None:
    cfg, _, (a, b) = make(("a", "b"))
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "b", 1000, StorageTier.GPU_HOT)
    a.in_flight, b.in_flight = 1, 4
    scorer, _ = scorer_for(cfg, index)
    p = await scorer.prepare(PREFIX, (a, b))
    assert p.in_flight == {"a": 1, "b": 4}
    # The live gauge moves after the snapshot: the scores do not.
    a.in_flight, b.in_flight = 8, 0
    # a: 0.6 + 0.3 * (1 - 1/4) + 0.1 = 0.925; b: 0.6 + 0.3 * (1 - 4/4) + 0.1 = 0.7
    assert scorer.score(p, a) == pytest.approx(0.925)
    assert scorer.score(p, b) == pytest.approx(0.7)


async def test_prepare_is_cached_for_100_ms_then_queries_again() -> None:
    cfg, _, (a, b) = make(("a", "b"))
    index = InstrumentedKvIndex(InMemoryKvIndex())
    await index.upsert(PREFIX, "a", 1000, StorageTier.GPU_HOT)
    await index.upsert(PREFIX, "b", 1000, StorageTier.GPU_HOT)
    a.in_flight, b.in_flight = 0, 3
    clock = Clock(1000.0)
    t0 = clock.t
    scorer, decisions = scorer_for(cfg, index, clock)

    def index_queries() -> int:
        return index.queries

    assert await scorer.choose(KEY, (a, b)) is a  # a idle, b busy
    assert index_queries() == 1

    # Within 100 ms: neither the index nor the in-flight gauge is read again.
    a.in_flight, b.in_flight = 5, 0
    await index.upsert(PREFIX, "b", 4000, StorageTier.GPU_HOT)
    clock.t = t0 + 0.099
    assert await scorer.choose(KEY, (a, b)) is a
    assert index_queries() == 1

    # 100 ms after the snapshot it is stale: a fresh query sees b's bigger entry and load.
    clock.t = t0 + 0.1
    assert await scorer.choose(KEY, (a, b)) is b
    assert index_queries() == 2
    # b: 0.6 * 1.0 + 0.3 * (1 - 0/5) + 0.1 = 1.0; a: 1000/4000 = 0.25 < 0.3, excluded.
    p = await scorer.prepare(PREFIX, (a, b))
    assert scorer.score(p, a) == 0.0
    assert [d[0] for d in decisions.calls] == ["kv_aware"] * 3
    assert decisions.calls[-1] == ("kv_aware", "gpu_hot", pytest.approx(1.0))

    # The cache is per prefix: another prefix queries at once.
    await scorer.choose(OTHER_KEY, (a, b))
    assert decisions.calls[-1] == ("fallback", "none", None)


# -- decisions through the selector ------------------------------------------------------


async def test_selector_takes_the_scorer_pick_else_the_strategy() -> None:
    cfg, pool, cands = make(("a", "b", "c"))
    _, mask = pool.candidates("m", "chat")
    index = InMemoryKvIndex()
    await index.upsert(PREFIX, "c", 512, StorageTier.GPU_HOT)
    clock = Clock()
    scorer, decisions = scorer_for(cfg, index, clock)
    sel = Selector(pool, cfg)
    sel.scorer = scorer
    picks = [(await sel.select(cands, mask, SelectionContext("m", KEY))).name for _ in range(4)]
    assert picks == ["c"] * 4
    # No entry for this prefix: RoundRobin spreads it over every candidate.
    others = {(await sel.select(cands, mask, SelectionContext("m", OTHER_KEY))).name for _ in "abc"}
    assert others == {"a", "b", "c"}
    assert [d[0] for d in decisions.calls] == ["kv_aware"] * 4 + ["fallback"] * 3
    assert {d[1] for d in decisions.calls[:4]} == {"gpu_hot"}
