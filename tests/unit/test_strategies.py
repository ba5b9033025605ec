"""Selection strategies on real Backend objects, and the selector's scorer seam."""

from __future__ import annotations

import collections
import hashlib
import random

from router.config import parse_config
from router.pool import BackendPool
from router.selection import SelectionContext, Selector
from router.selection.strategies import (
    LeastLatency,
    RandomChoice,
    RoundRobin,
    WeightedRoundRobin,
)


def make_pool(n: int = 3, strategy: str = "RoundRobin", **pr: object):
    cfg, _ = parse_config(
        {
            "selection_strategy": strategy,
            "prefix_routing": {"enabled": True, **pr},
            "backends": [
                {"name": f"b{i}", "url": f"http://h:{i + 1}", "models": ["m"], "weight": i + 1}
                for i in range(n)
            ],
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    return cfg, pool


def test_round_robin_cycles() -> None:
    _, pool = make_pool(3)
    cands, mask = pool.candidates("m", "chat")
    rr = RoundRobin()
    picks = [rr.select(cands, mask, SelectionContext("m")).name for _ in range(6)]
    assert collections.Counter(picks) == {"b0": 2, "b1": 2, "b2": 2}


def test_weighted_round_robin_is_proportional_and_smooth() -> None:
    _, pool = make_pool(3)  # weights 1, 2, 3
    cands, mask = pool.candidates("m", "chat")
    wrr = WeightedRoundRobin()
    picks = [wrr.select(cands, mask, SelectionContext("m")).name for _ in range(60)]
    assert collections.Counter(picks) == {"b0": 10, "b1": 20, "b2": 30}
    # smooth: the heaviest never runs more than twice in a row within a cycle of 6
    assert "b2b2b2" not in "".join(picks)


def test_least_latency_prefers_untried_then_fastest() -> None:
    _, pool = make_pool(3)
    cands, mask = pool.candidates("m", "chat")
    ll = LeastLatency()
    cands[0].record_latency(0.5)
    cands[1].record_latency(0.1)
    assert ll.select(cands, mask, SelectionContext("m")) is cands[2]  # no sample yet
    cands[2].record_latency(0.3)
    assert ll.select(cands, mask, SelectionContext("m")) is cands[1]


def test_random_uses_all() -> None:
    _, pool = make_pool(3)
    cands, mask = pool.candidates("m", "chat")
    r = RandomChoice(random.Random(3))
    assert {r.select(cands, mask, SelectionContext("m")).name for _ in range(100)} == {
        "b0",
        "b1",
        "b2",
    }


async def test_prefix_aware_hash_is_sticky_and_counts_decisions() -> None:
    cfg, pool = make_pool(4, "PrefixAwareHash")
    decisions: list[str] = []
    sel = Selector(pool, cfg, lambda d, b: decisions.append(d))
    cands, mask = pool.candidates("m", "chat")
    key = hashlib.sha256(b"some prefix").digest()
    first = await sel.select(cands, mask, SelectionContext("m", key))
    for _ in range(5):
        assert await sel.select(cands, mask, SelectionContext("m", key)) is first
    assert await sel.select(cands, mask, SelectionContext("m", None)) is not None
    assert decisions == ["prefix_hash"] * 6 + ["fallback"]
    assert sel.counts.total == 7 and sel.counts.unique.count() == 1


async def test_fallback_hashes_model_without_bound() -> None:
    cfg, pool = make_pool(4, "PrefixAwareHash")
    sel = Selector(pool, cfg)
    cands, mask = pool.candidates("m", "chat")
    owner = await sel.select(cands, mask, SelectionContext("m"))
    owner.in_flight = 1000
    assert await sel.select(cands, mask, SelectionContext("m")) is owner
    assert sel.counts.fallback == 2


async def test_scorer_runs_before_strategy_and_may_defer() -> None:
    cfg, pool = make_pool(3, "RoundRobin")
    sel = Selector(pool, cfg)
    cands, mask = pool.candidates("m", "chat")

    class Scorer:
        def __init__(self) -> None:
            self.pick = None
            self.calls = 0

        async def choose(self, prefix_key, candidates):
            self.calls += 1
            return self.pick

    scorer = Scorer()
    sel.scorer = scorer
    key = b"\x01" * 32
    scorer.pick = cands[2]
    assert all([await sel.select(cands, mask, SelectionContext("m", key)) is cands[2]] * 3)
    scorer.pick = None
    got = {(await sel.select(cands, mask, SelectionContext("m", key))).name for _ in range(3)}
    assert got == {"b0", "b1", "b2"}  # deferred to RoundRobin
    calls = scorer.calls
    await sel.select(cands, mask, SelectionContext("m", None))
    assert scorer.calls == calls  # no prefix key: scorer not consulted


async def test_virtual_nodes_reconfigure_rebuilds_ring() -> None:
    cfg, pool = make_pool(3, "PrefixAwareHash")
    sel = Selector(pool, cfg)
    assert len(sel.ring) == 3 * 150
    new_cfg, _ = parse_config(
        {**cfg.model_dump(), "prefix_routing": {"enabled": True, "virtual_nodes": 10}}
    )
    sel.configure(new_cfg)
    assert len(sel.ring) == 30
    assert sel.strategy.ring is sel.ring  # type: ignore[attr-defined]


def test_candidates_filter_health_model_internal_and_type() -> None:
    cfg, _ = parse_config(
        {
            "backends": [
                {"name": "a", "url": "http://h:1", "models": ["m"]},
                {"name": "b", "url": "http://h:2", "models": ["m"], "internal": True},
                {"name": "c", "url": "http://h:3", "models": ["m"], "enabled": False},
                {"name": "d", "url": "http://h:4", "models": ["other"]},
                {"name": "e", "url": "http://h:5", "models": ["m"], "type": "anthropic"},
                {"name": "f", "url": "http://h:6", "models": ["m"]},
            ]
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    assert [b.name for b in pool.candidates("m", "chat")[0]] == ["a", "f"]
    assert [b.name for b in pool.candidates("m", "anthropic")[0]] == ["e"]
    pool.get("f").healthy = False  # type: ignore[union-attr]
    pool._changed()
    assert [b.name for b in pool.candidates("m", "chat")[0]] == ["a"]
    assert pool.knows_model("m", "chat") and not pool.knows_model("zz", "chat")
