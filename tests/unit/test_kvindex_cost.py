"""Conversation-depth routing over the chain index: deepest held, the cost model, predict
on route, the prefill ledger and predicted-against-delivered accounting.

The index is a real ``InMemoryKvIndex`` (behind the instrumented wrapper, as the router
builds it) on a settable clock; the backends are ``router.pool.Backend`` objects from a
parsed config, so ``in_flight`` is the real gauge. Costs are worked out by hand from the
defaults (gpu_credit 1.0, storage_credit 0.5, prefill_load_weight 1.0,
active_request_weight 256, bytes_per_token 4.0, chunk_bytes 1024).
"""

from __future__ import annotations

import collections
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from router.config import parse_config
from router.config.models import ConversationConfig, ConversationScoringConfig
from router.kvindex import (
    EMPTY,
    Change,
    IndexEntry,
    InMemoryKvIndex,
    InstrumentedKvIndex,
    StorageTier,
)
from router.kvindex.accuracy import PredictionAccuracy
from router.kvindex.chains import deepest_held
from router.kvindex.cost import ChainView, ConversationScorer
from router.kvindex.load_average import LoadAverage, RecentCount
from router.kvindex.prefill import PrefillLoad
from router.kvindex.resident import LiveConversations
from router.pool import Backend, BackendPool
from tests.unit.kvindex_support import GPU, WARM, C, FakeClock, state

CHUNK = 1024


@dataclass
class Chain:
    """A request chain as ``router.conversation`` computes it: keys and the prompt's size."""

    keys: list[bytes]
    prompt_bytes: int
    conversation: bytes | None = None


def chain(n: int, tail: int = 0, first: int = 0) -> Chain:
    """``n`` keys C(first)..C(first + n - 1) of a prompt of n full chunks plus ``tail``."""
    return Chain([C(first + i) for i in range(n)], n * CHUNK + tail)


def backends(*names: str) -> tuple[Backend, ...]:
    cfg, _ = parse_config(
        {
            "backends": [
                {"name": n, "url": f"http://h:{i + 1}", "type": "vllm", "models": ["m"]}
                for i, n in enumerate(names)
            ]
        }
    )
    pool = BackendPool(cfg.backends, cfg.health_check)
    cands, _ = pool.candidates("m", "chat")
    return cands


@dataclass
class Rig:
    clock: FakeClock
    inner: InMemoryKvIndex
    index: InstrumentedKvIndex
    load: PrefillLoad
    scorer: ConversationScorer
    cands: tuple[Backend, ...]
    decisions: list[tuple[str, str]] = field(default_factory=list)

    def by(self, name: str) -> Backend:
        return next(b for b in self.cands if b.name == name)

    def hold(
        self, backend: str, depth: int, tier: StorageTier = GPU, per_key: int = 256, first: int = 0
    ) -> None:
        """``backend`` holds keys first..first+depth-1, ``per_key`` tokens a chunk (events)."""
        self.inner.write([(C(first + i), backend, per_key * (i + 1), tier) for i in range(depth)])


FORMULA = ConversationScoringConfig(
    prefill_load_weight=1.0, active_request_weight=256.0, load_factor_epsilon=None
)
"""The weights the hand-worked costs below use (not the defaults): whole tokens, no cap."""


def rig(names: Sequence[str] = ("a", "b", "c"), entry_ttl: float = 600, **conv: Any) -> Rig:
    clock = FakeClock(1000.0)
    inner = InMemoryKvIndex(10_000, entry_ttl, clock=clock)
    index = InstrumentedKvIndex(inner)
    load = PrefillLoad()
    conv.setdefault("scoring", FORMULA)
    config = ConversationConfig(enabled=True, chunk_bytes=CHUNK, **conv)
    decisions: list[tuple[str, str]] = []
    scorer = ConversationScorer(
        index,
        config,
        load,
        entry_ttl_seconds=entry_ttl,
        on_decision=lambda outcome, tier: decisions.append((outcome, tier)),
        clock=clock,
    )
    return Rig(clock, inner, index, load, scorer, backends(*names), decisions)


# ---- deepest held ------------------------------------------------------------------------


def E(backend: str, tokens: int, tier: StorageTier = GPU) -> IndexEntry:
    return IndexEntry(backend, tokens, tier, 1e12)


def test_deepest_held_is_each_candidates_deepest_key() -> None:
    rows: list[Sequence[IndexEntry]] = [
        (E("a", 100), E("b", 100)),
        (E("a", 200), E("b", 200, WARM)),
        (E("a", 300),),
        EMPTY,
        (E("z", 500),),  # not a candidate, but the deepest key anyone holds
    ]
    held, deepest = deepest_held(rows, ["a", "b", "c"])
    assert {n: (h.depth, h.token_count, h.tier) for n, h in held.items()} == {
        "a": (3, 300, GPU),
        "b": (2, 200, WARM),
    }
    assert deepest is not None and (deepest.depth, deepest.token_count) == (5, 500)
    assert deepest_held([EMPTY] * 4, ["a"]) == ({}, None)
    assert deepest_held([], ["a"]) == ({}, None)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from("abcdef"), st.sets(st.integers(0, 39), max_size=40), max_size=6
    ),
    st.sets(st.sampled_from("abcdefg")),
)
def test_deepest_held_is_the_deepest_key_present(
    holdings: dict[str, set[int]], names: set[str]
) -> None:
    """Against brute force, whatever the holdings (prefix-closed or not); and for
    prefix-closed holdings it equals a binary search over i (valid only because of
    closure), which is what ``bus.events`` promises the listener announces."""
    n = 40
    rows: list[Sequence[IndexEntry]] = [
        tuple(E(b, 10 * (i + 1)) for b in sorted(holdings, reverse=True) if i in holdings[b])
        or EMPTY
        for i in range(n)
    ]
    held, deepest = deepest_held(rows, names)
    want = {b: max(ix) + 1 for b, ix in holdings.items() if b in names and ix}
    assert {b: h.depth for b, h in held.items()} == want
    assert all(h.token_count == 10 * h.depth for h in held.values())
    anyone = [max(ix) + 1 for ix in holdings.values() if ix]
    assert (deepest.depth if deepest else 0) == max(anyone, default=0)

    closed = {b: set(range(max(ix) + 1)) for b, ix in holdings.items() if ix}
    rows = [
        tuple(E(b, 10 * (i + 1)) for b in sorted(closed, reverse=True) if i in closed[b]) or EMPTY
        for i in range(n)
    ]

    def search(b: str) -> int:
        lo, hi = 0, n  # keys [0, lo) held, [hi, n) not
        while lo < hi:
            mid = (lo + hi) // 2
            if any(e.backend == b for e in rows[mid]):
                lo = mid + 1
            else:
                hi = mid
        return lo

    held, _ = deepest_held(rows, names)
    assert {b: h.depth for b, h in held.items()} == {b: search(b) for b in names if search(b) > 0}


def _predictions_by_rows(scorer: ConversationScorer, view: Any, backend: Backend) -> list[Change]:
    """What predict on route writes, read row by row (the definition)."""
    name = backend.name
    renew_before = scorer.index.now() + scorer.predict_ttl / 2
    per_chunk = scorer.chunk_bytes * view.tokens_per_byte
    out: list[Change] = []
    for i, (key, row) in enumerate(zip(view.keys, view.rows, strict=True)):
        mine = [e for e in row if e.backend == name]
        if not mine:
            out.append((key, name, round((i + 1) * per_chunk), GPU))
        elif mine[0].expires_at < renew_before:
            out.append((key, name, mine[0].token_count, mine[0].tier))
    return out


@settings(max_examples=200, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from("abc"),
        st.tuples(st.integers(0, 12), st.booleans(), st.sampled_from([None, 2.0, 6.0])),
        max_size=3,
    ),
    st.integers(0, 8),
)
async def test_predictions_are_the_keys_unheld_or_about_to_expire(
    holdings: dict[str, tuple[int, bool, float | None]], advance: int
) -> None:
    """Whatever the holdings (prefix-closed or with a gap, events or predictions, fresh or
    half expired), the writes are exactly the keys the backend does not hold and those it
    holds with less than half the prediction TTL left."""
    r = rig(predict_ttl_seconds=10)
    for b, (depth, gap, ttl) in holdings.items():
        keys = [i for i in range(depth) if not (gap and i == depth // 2 and depth > 2)]
        r.inner.write([(C(i), b, 256 * (i + 1), GPU) for i in keys], ttl)
    r.clock.advance(advance)
    view = await r.scorer.assess(chain(12), r.cands)
    for backend in r.cands:
        want = _predictions_by_rows(r.scorer, view, backend)
        assert r.scorer.predictions(view, backend) == want


# ---- the cost model --------------------------------------------------------------------


async def test_cost_is_prompt_minus_credited_held_tokens_plus_load() -> None:
    r = rig()
    r.hold("a", 6)  # keys 0..5, 1536 tokens at the deepest: 0.25 tokens per byte
    r.hold("b", 3, WARM)  # 768 tokens, storage only
    view = await r.scorer.assess(chain(8, tail=500), r.cands)
    assert view.tokens_per_byte == pytest.approx(0.25)
    assert view.prompt_tokens == round((8 * CHUNK + 500) * 0.25) == 2173
    a, b, c = (r.scorer.components(view, x) for x in r.cands)
    assert (a.held_tokens, a.depth, a.tier, a.credited_tokens, a.cost) == (
        1536,
        6,
        GPU,
        1536.0,
        2173 - 1536,
    )
    assert (b.held_tokens, b.depth, b.tier, b.cost) == (768, 3, WARM, 2173 - 0.5 * 768)
    assert (c.held_tokens, c.depth, c.tier, c.cost) == (0, 0, None, 2173)
    assert r.scorer.decide(view, r.cands) is r.by("a")
    assert r.decisions == [("chosen", "gpu_hot")]

    # Load: two requests in flight on a (+512) still leave it cheapest; 1000 prefill
    # tokens in flight on it too (+1000: 2149) make b (1789) the cheapest.
    r.by("a").in_flight = 2
    assert r.scorer.cost(view, r.by("a")) == 637 + 512
    assert r.scorer.decide(view, r.cands) is r.by("a")
    ticket = r.load.started("a", 1000)
    comp = r.scorer.components(view, r.by("a"))
    assert (comp.in_flight_prefill_tokens, comp.in_flight_requests, comp.cost) == (1000, 2, 2149)
    assert r.scorer.decide(view, r.cands) is r.by("b")
    assert r.decisions[-1] == ("chosen", "storage_warm")
    r.load.finished(ticket)
    assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_the_weights_come_from_the_config() -> None:
    r = rig(
        scoring={
            "gpu_credit": 0.5,
            "storage_credit": 0.0,
            "prefill_load_weight": 2.0,
            "active_request_weight": 10.0,
            "bytes_per_token": 2.0,
        }
    )
    r.hold("b", 2, WARM)  # storage credit 0: worth nothing
    r.by("a").in_flight = 1
    r.load.started("a", 5)
    view = await r.scorer.assess(chain(4), r.cands)  # 4096 bytes * 512/2048 = 1024 tokens
    assert view.prompt_tokens == 1024
    assert r.scorer.cost(view, r.by("a")) == 1024 + 2 * 5 + 10 * 1
    assert r.scorer.cost(view, r.by("b")) == 1024
    r.hold("c", 4)  # 1024 tokens on the GPU: credit 0.5
    view = await r.scorer.assess(chain(4), r.cands)
    assert r.scorer.cost(view, r.by("c")) == 1024 - 512


async def test_nobody_holding_anything_goes_to_the_strategy_and_a_tie_to_one_holder() -> None:
    r = rig(scoring=FORMULA.model_copy(update={"new_prompts": "strategy"}))
    r.hold("z", 8)  # a backend that is not a candidate
    view = await r.scorer.assess(chain(8), r.cands)
    assert view.held == {} and view.prompt_tokens == 8 * 256  # z's ratio still informs
    assert r.scorer.decide(view, r.cands) is None
    r.hold("a", 3)
    r.hold("b", 3)  # a and b hold the same, all idle: a tie
    view = await r.scorer.assess(chain(8), r.cands)
    tied = r.scorer.decide(view, r.cands)
    assert tied is not None and tied.name in ("a", "b")
    # The same prompt always prefers the same holder (no alternation between them).
    assert all(r.scorer.decide(view, r.cands) is tied for _ in range(5))
    other = r.by("b") if tied is r.by("a") else r.by("a")
    tied.in_flight = 1  # +256: a whole chunk's tokens of load, no longer a tie
    assert r.scorer.decide(view, r.cands) is other
    assert r.decisions[:2] == [("none_held", "none"), ("tie", "gpu_hot")]
    assert r.decisions[-1] == ("chosen", "gpu_hot")
    assert r.scorer.decisions == {"chosen": 1, "tie": 6, "none_held": 1}
    assert r.scorer.decide(view, ()) is None


async def test_costs_within_a_chunk_tie_and_prompts_spread_over_the_holders() -> None:
    """A difference smaller than one chunk's tokens says nothing the index can know; the
    preferred holder differs from prompt to prompt, so shared prompts spread."""
    r = rig(("a", "b"))
    preferred = set()
    for p in range(16):
        r.hold("a", 2, first=100 * p)
        r.hold("b", 2, first=100 * p)
        view = await r.scorer.assess(chain(4, first=100 * p), r.cands)
        chosen = r.scorer.decide(view, r.cands)
        assert chosen is not None
        preferred.add(chosen.name)
    assert preferred == {"a", "b"}
    # One more chunk held is a whole chunk's tokens: no longer a tie.
    r.hold("a", 3, first=0)
    view = await r.scorer.assess(chain(4), r.cands)
    assert r.scorer.decide(view, r.cands) is r.by("a")
    assert r.decisions[-1] == ("chosen", "gpu_hot")


async def test_load_jitter_does_not_copy_a_prompt_to_a_second_engine() -> None:
    """An idle backend holding nothing is within a chunk of the busier holder's cost: the
    holder keeps the prompt (the one holding the most wins a tie), whatever the prompt's
    own preference. Breaking that tie by preference would put the prompt on the other
    engine too, and from then on it would follow the load there and back."""
    r = rig(("a", "b"))
    r.by("a").in_flight = 1
    r.load.started("a", 200)  # cost(a) = 1024 - 512 + 256 + 200 = 968, cost(b) = 1024
    for p in range(16):
        r.hold("a", 2, first=100 * p)  # 512 tokens held of 1024
        view = await r.scorer.assess(chain(4, first=100 * p), r.cands)
        assert r.scorer.cost(view, r.by("b")) - r.scorer.cost(view, r.by("a")) == 56
        assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_an_empty_holder_can_win_on_load() -> None:
    """Held tokens are a credit, not a gate: a holder loaded past its credit loses to an
    idle backend that holds nothing."""
    r = rig(("a", "b"))
    r.hold("a", 2)  # 512 tokens held of 1024
    r.by("a").in_flight = 3  # +768
    view = await r.scorer.assess(chain(4), r.cands)
    assert r.scorer.cost(view, r.by("a")) == 1024 - 512 + 768
    assert r.scorer.decide(view, r.cands) is r.by("b")
    assert r.decisions == [("chosen", "none")]


async def test_prompt_tokens_without_any_holder_use_bytes_per_token() -> None:
    r = rig()
    view = await r.scorer.assess(Chain([], 4000), r.cands)  # shorter than one chunk
    assert (view.prompt_tokens, view.held, view.rows) == (1000, {}, [])
    assert r.scorer.decide(view, r.cands) is None


async def test_choose_is_one_routing_lookup_and_a_peek_is_none() -> None:
    r = rig()
    r.hold("a", 2)
    assert await r.scorer.choose(chain(6), r.cands) is r.by("a")
    assert (r.index.queries, r.index.hits) == (1, 1)
    view = await r.scorer.assess(chain(6), r.cands, peek=True)
    assert view.held["a"].depth == 2
    assert (r.index.queries, r.index.hits) == (1, 1)
    await r.scorer.assess(chain(3, first=100), r.cands)
    assert (r.index.queries, r.index.hits) == (2, 1)


async def test_what_the_forwarder_records() -> None:
    r = rig()
    r.hold("a", 4, per_key=300)  # 1200 tokens held; ratio 1200 / 4096 tokens per byte
    r.hold("b", 2, WARM, per_key=300)
    view = await r.scorer.assess(chain(8), r.cands)
    assert view.prompt_tokens == 2400
    assert r.scorer.predicted_cached_tokens(view, r.by("a")) == 1200
    assert r.scorer.predicted_cached_tokens(view, r.by("b")) == 600  # whatever the tier
    assert r.scorer.predicted_cached_tokens(view, r.by("c")) == 0
    assert r.scorer.prefill_tokens(view, r.by("a")) == 1200
    assert r.scorer.prefill_tokens(view, r.by("b")) == 2400 - 300
    assert r.scorer.prefill_tokens(view, r.by("c")) == 2400


# ---- predict on route --------------------------------------------------------------------


async def test_routed_writes_the_chain_as_held_for_the_prediction_ttl() -> None:
    r = rig(predict_ttl_seconds=10)
    r.hold("a", 2, per_key=300)  # real entries, 600 s
    view = await r.scorer.assess(chain(5), r.cands)
    assert await r.scorer.routed(view, r.by("a")) == 3  # keys 2..4: a holds 0 and 1
    rows = await r.index.peek_many(chain(5).keys)
    assert [state(row)["a"] for row in rows] == [(300 * (i + 1), GPU) for i in range(5)]
    assert [round(row[0].expires_at - r.clock.now) for row in rows] == [600, 600, 10, 10, 10]

    # The next request of the conversation sees a holding all five keys.
    view = await r.scorer.assess(chain(6), r.cands)
    assert view.held["a"].depth == 5
    assert r.scorer.decide(view, r.cands) is r.by("a")
    # Predictions vanish after their TTL; events are untouched.
    r.clock.advance(11)
    view = await r.scorer.assess(chain(6), r.cands)
    assert view.held["a"].depth == 2


async def test_an_event_replaces_a_prediction_and_a_prediction_never_cuts_an_event() -> None:
    r = rig(predict_ttl_seconds=10)
    view = await r.scorer.assess(chain(3), r.cands)
    await r.scorer.routed(view, r.by("b"))
    r.inner.write([(C(1), "b", 999, WARM)])  # the engine's event for key 1
    (e,) = r.inner.lookup(C(1))
    assert (e.token_count, e.tier, e.expires_at) == (999, WARM, r.clock.now + 600)
    view = await r.scorer.assess(chain(3), r.cands)
    # Even with a stale view (key 1 unheld in it), the prediction leaves the event alone.
    stale = view.rows
    view.rows = [EMPTY, EMPTY, EMPTY]
    await r.scorer.routed(view, r.by("b"))
    view.rows = stale
    (e,) = r.inner.lookup(C(1))
    assert (e.token_count, e.tier, e.expires_at) == (999, WARM, r.clock.now + 600)


async def test_routed_renews_only_what_is_about_to_expire() -> None:
    r = rig(predict_ttl_seconds=10)
    view = await r.scorer.assess(chain(4), r.cands)
    assert await r.scorer.routed(view, r.by("a")) == 4
    r.clock.advance(4)  # 6 s left: more than half the TTL
    view = await r.scorer.assess(chain(4), r.cands)
    assert await r.scorer.routed(view, r.by("a")) == 0
    r.clock.advance(2)  # 4 s left: renewed, count and tier kept
    view = await r.scorer.assess(chain(6), r.cands)
    assert await r.scorer.routed(view, r.by("a")) == 6
    rows = r.inner.lookup_many(chain(6).keys)
    assert all(row[0].expires_at == r.clock.now + 10 for row in rows)
    assert r.scorer.predicted_keys == 10


async def test_predictions_are_off_at_ttl_0_and_never_outlive_the_index_ttl() -> None:
    r = rig(predict_ttl_seconds=0)
    view = await r.scorer.assess(chain(3), r.cands)
    assert await r.scorer.routed(view, r.by("a")) == 0
    assert r.inner.lookup(C(0)) is EMPTY
    r = rig(entry_ttl=5, predict_ttl_seconds=60)
    assert r.scorer.predict_ttl == 5
    view = await r.scorer.assess(chain(1), r.cands)
    await r.scorer.routed(view, r.by("a"))
    assert r.inner.lookup(C(0))[0].expires_at == r.clock.now + 5


async def test_a_failed_prediction_never_fails_the_request(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class Down(InMemoryKvIndex):
        async def write_many(self, changes: Sequence[Change], ttl: float | None = None) -> None:
            raise ConnectionError("down")

    r = rig()
    scorer = ConversationScorer(Down(), r.scorer.config, r.load, entry_ttl_seconds=600)
    view = await scorer.assess(chain(2), r.cands)
    assert await scorer.routed(view, r.by("a")) == 0
    assert await scorer.routed(view, r.by("a")) == 0
    assert scorer.prediction_errors == 2
    assert len([m for m in caplog.messages if "prediction write failed" in m]) == 1


async def test_without_events_predictions_keep_each_prompt_on_one_backend() -> None:
    """The approximate mode (no listener): 8 system prompts over 2 backends, requests in
    random order; the first of each prompt goes where the strategy (round robin) sends it
    and every later one follows it there, 50/50."""
    r = rig(("a", "b"), predict_ttl_seconds=10)
    rng = random.Random(3)
    turn = 0
    placed: dict[int, set[str]] = {}
    for _ in range(400):
        p = rng.randrange(8)
        # a shared 3-chunk system prompt, then 2 chunks of this session's own
        keys = [C(1000 * p + i) for i in range(3)] + [
            C(rng.randrange(10**9) + 10**6) for _ in range(2)
        ]
        req = Chain(keys, 5 * CHUNK + 100)
        view = await r.scorer.assess(req, r.cands)
        chosen = r.scorer.decide(view, r.cands)
        if chosen is None:
            chosen = r.cands[turn % 2]
            turn += 1
        await r.scorer.routed(view, chosen)
        placed.setdefault(p, set()).add(chosen.name)
        r.clock.advance(0.05)
    assert all(len(names) == 1 for names in placed.values()), placed
    spread = [sum(1 for names in placed.values() if n in names) for n in ("a", "b")]
    assert spread == [4, 4]


# ---- the prefill ledger -----------------------------------------------------------------


def test_prefill_load_counts_until_finished_once() -> None:
    load = PrefillLoad()
    t1 = load.started("a", 100)
    t2 = load.started("a", 50)
    t3 = load.started("b", 7)
    assert (load.tokens("a"), load.tokens("b"), load.tokens("c")) == (150, 7, 0)
    load.finished(t1)
    load.finished(t1)  # idempotent: first byte, then the forwarder's finally
    assert load.tokens("a") == 50
    load.finished(t2)
    load.finished(t3)
    assert load.snapshot() == {}
    assert load.started("a", -5).tokens == 0 and load.tokens("a") == 0


# ---- predicted against delivered --------------------------------------------------------


def test_accuracy_sums_per_backend_and_reports_to_metrics() -> None:
    seen: list[tuple[str, int, int]] = []
    acc = PredictionAccuracy(on_record=lambda b, p, r: seen.append((b, p, r)))
    acc.record("a", 1000, 1000)
    acc.record("a", 1000, 1200)  # the engine reused more (whole blocks)
    acc.record("a", 500, 0)  # predicted tokens that were not there
    acc.record("b", 0, 0)
    acc.record("b", -3, -1)  # negatives count as 0
    a = acc.get("a")
    assert a is not None
    assert (a.requests, a.predicted_tokens, a.reported_tokens, a.abs_error_tokens) == (
        3,
        2500,
        2200,
        700,
    )
    assert a.accuracy == pytest.approx(1 - 700 / (1000 + 1200 + 500))
    assert acc.document() == {
        "a": {
            "requests": 3,
            "predicted_cached_tokens": 2500,
            "reported_cached_tokens": 2200,
            "mean_abs_error_tokens": "233.3",
            "accuracy": "0.7407",
        },
        "b": {
            "requests": 2,
            "predicted_cached_tokens": 0,
            "reported_cached_tokens": 0,
            "mean_abs_error_tokens": "0.0",
            "accuracy": "1.0000",
        },
    }
    assert seen[1] == ("a", 1000, 1200) and seen[-1] == ("b", 0, 0)
    total = acc.total()
    assert (total.requests, total.predicted_tokens, total.reported_tokens) == (5, 2500, 2200)
    assert total.accuracy == a.accuracy  # b's records were exact and empty


# ---- the defaults and the bounded-load cap ---------------------------------------------


def test_the_documented_defaults() -> None:
    sc = ConversationScoringConfig()
    assert (
        sc.prefill_load_weight,
        sc.active_request_weight,
        sc.load_factor_epsilon,
        sc.load_window_seconds,
    ) == (0.1, 32.0, 0.25, 2.0)
    assert (sc.gpu_credit, sc.storage_credit, sc.bytes_per_token) == (1.0, 0.5, 4.0)
    assert (sc.sticky_tokens, sc.sticky_load_factor_epsilon) == (0, 0.5)


async def test_a_conversation_held_deep_stays_past_the_cap_up_to_the_wider_bound() -> None:
    """a holds 2,048 tokens of the conversation, b 256 (the shared prompt): a's own history
    is 1,792 >= sticky_tokens (1,024), so a is measured against epsilon 0.5, not 0.25
    (counts now here). A conversation whose backend holds less of its own than that is
    moved by the usual cap, and so is this one with the exemption off (the default)."""
    instant = ConversationScoringConfig(load_window_seconds=0, sticky_tokens=1024)
    r = rig(("a", "b", "c"), scoring=instant)
    r.hold("a", 8)
    r.hold("b", 1)
    view = await r.scorer.assess(chain(8), r.cands)
    r.by("b").in_flight = r.by("c").in_flight = 3
    r.by("a").in_flight = 5  # cap ceil(1.25 * 12 / 3) = 5: over it; wide ceil(1.5 * 12 / 3) = 6
    assert r.scorer.decide(view, r.cands) is r.by("a")
    r.by("a").in_flight = 6  # cap 6, wide ceil(6.5) = 7
    assert r.scorer.decide(view, r.cands) is r.by("a")
    r.by("a").in_flight = 7  # wide ceil(1.5 * 14 / 3) = 7: over that too
    assert r.scorer.decide(view, r.cands) is r.by("b")

    shallow = rig(("a", "b", "c"), scoring=instant)
    shallow.hold("a", 4)  # 1,024 tokens against b's 256: 768 of its own
    shallow.hold("b", 1)
    view = await shallow.scorer.assess(chain(4), shallow.cands)
    shallow.by("b").in_flight = shallow.by("c").in_flight = 3
    shallow.by("a").in_flight = 5
    assert shallow.scorer.decide(view, shallow.cands) is shallow.by("b")

    off = rig(
        ("a", "b", "c"), scoring=ConversationScoringConfig(load_window_seconds=0, sticky_tokens=0)
    )
    off.hold("a", 8)
    off.hold("b", 1)
    view = await off.scorer.assess(chain(8), off.cands)
    off.by("b").in_flight = off.by("c").in_flight = 3
    off.by("a").in_flight = 5
    assert off.scorer.decide(view, off.cands) is off.by("b")


async def test_a_holder_at_the_load_cap_is_passed_over() -> None:
    """With the defaults a conversation stays where it is held until that engine reaches
    PrefixAwareHash's cap; then the cheapest backend under the cap takes it (instantaneous
    counts here: the averaged cap is below)."""
    r = rig(("a", "b", "c"), scoring=ConversationScoringConfig(load_window_seconds=0))
    r.hold("a", 4)  # the whole conversation
    r.hold("b", 1)  # the shared system prompt
    view = await r.scorer.assess(chain(4), r.cands)
    r.by("a").in_flight = 3  # cap = ceil(1.25 * (3 + 0 + 0 + 1) / 3) = 2: a is at it
    assert r.scorer.decide(view, r.cands) is r.by("b")
    r.by("a").in_flight = 1  # cap = ceil(1.25 * 2 / 3) = 1: a is still at it
    assert r.scorer.decide(view, r.cands) is r.by("b")
    assert r.scorer.capped == 2  # both times the deepest holder was passed over
    assert r.scorer.pick(view, r.cands)[0] is r.by("b") and r.scorer.capped == 2  # read-only
    r.by("b").in_flight = r.by("c").in_flight = 1  # cap 2: nobody at it, a holds most
    assert r.scorer.decide(view, r.cands) is r.by("a")
    r.by("a").in_flight, r.by("b").in_flight = 1, 3  # b, a shallower holder, is at the cap
    assert r.scorer.decide(view, r.cands) is r.by("a")
    assert r.scorer.capped == 2  # the deepest holder took it: nothing overridden
    r.hold("c", 4)  # a second copy of the whole conversation
    view = await r.scorer.assess(chain(4), r.cands)
    r.by("a").in_flight, r.by("b").in_flight, r.by("c").in_flight = 4, 0, 0
    assert r.scorer.decide(view, r.cands) is r.by("c")
    assert r.scorer.capped == 2  # c held as much as a: the cap cost nothing cached


async def test_equal_load_leaves_the_choice_to_what_is_held() -> None:
    """Even with no slack (epsilon 0) the cap never excludes everyone: with equal load
    both are below it and the holder wins."""
    instant = ConversationScoringConfig(load_factor_epsilon=0.0, load_window_seconds=0)
    r = rig(("a", "b"), scoring=instant)
    r.hold("a", 4)
    view = await r.scorer.assess(chain(4), r.cands)
    for n in (0, 1, 2, 7):
        r.by("a").in_flight = r.by("b").in_flight = n  # cap = ceil((2n + 1) / 2) = n + 1
        assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_no_bound_lets_the_cost_pile_on_the_holder() -> None:
    r = rig(("a", "b"), scoring=ConversationScoringConfig(load_factor_epsilon=None))
    r.hold("a", 4)
    r.by("a").in_flight = 5  # 5 x 32 = 160 tokens of load against 1024 held
    view = await r.scorer.assess(chain(4), r.cands)
    assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_a_burst_at_the_holder_does_not_send_its_conversation_away() -> None:
    """A backend is at the cap only when it is over it now and on average over
    ``load_window_seconds``: sessions of one prompt arriving together leave their
    conversation where it is held."""
    r = rig(("a", "b", "c"), scoring=ConversationScoringConfig())
    r.hold("a", 4)
    r.hold("b", 1)
    view = await r.scorer.assess(chain(4), r.cands)
    for _ in range(10):  # 10 s of all idle: the averages cover whole windows
        assert r.scorer.decide(view, r.cands) is r.by("a")
        r.clock.advance(1.0)
    for burst in range(1, 6):  # five arrivals within 50 ms
        r.clock.advance(0.01)
        r.by("a").in_flight = burst  # the instantaneous cap would pass a over from 2 on
        assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_a_lasting_imbalance_moves_work_off_the_holder() -> None:
    """Held at 3 in flight for several windows, the holder's average reaches the cap
    (ceil(1.25 * 4 / 3) = 2) and the cheapest backend under it takes the request; once the
    holder drains, its average falls and it takes its conversation back."""
    r = rig(("a", "b", "c"), scoring=ConversationScoringConfig())
    r.hold("a", 4)
    r.hold("b", 1)
    view = await r.scorer.assess(chain(4), r.cands)
    for _ in range(10):
        assert r.scorer.decide(view, r.cands) is r.by("a")
        r.clock.advance(1.0)
    r.by("a").in_flight = 3
    chosen = []
    for _ in range(40):  # 4 s of a steady 3 in flight, sampled every 100 ms
        r.clock.advance(0.1)
        chosen.append(r.scorer.decide(view, r.cands))
    assert chosen[0] is r.by("a") and chosen[-1] is r.by("b")
    averages = r.scorer.load_average.snapshot()
    assert averages["a"] > 2.0 and averages["b"] == averages["c"] == 0.0
    r.by("a").in_flight = 0  # below the cap now: a takes its conversation back at once
    r.clock.advance(0.1)
    assert r.scorer.decide(view, r.cands) is r.by("a")


async def test_a_router_starting_into_a_burst_caps_it_on_the_counts_now() -> None:
    """Until a window has passed since a backend's first sample its average covers only
    part of one; the count now stands in for the rest, so the sessions of a burst that
    meets a fresh router spread as under an instantaneous cap."""
    r = rig(("a", "b", "c"), scoring=ConversationScoringConfig())
    r.hold("a", 4)
    r.hold("b", 1)
    view = await r.scorer.assess(chain(4), r.cands)
    assert r.scorer.decide(view, r.cands) is r.by("a")
    r.by("a").in_flight = 3  # cap = ceil(1.25 * 4 / 3) = 2: a is over it
    r.clock.advance(0.01)
    assert r.scorer.decide(view, r.cands) is r.by("b")


def test_load_average_follows_the_exponential_window() -> None:
    """After warming up at 0, one window after a step from 0 to 10 the average is
    10 * (1 - 1/e); before a whole window has passed since the first sample, the count
    now fills the rest of it. A count weighs from the sample that saw it on."""
    clock = FakeClock(0.0)
    avg = LoadAverage(2.0, clock)
    b = backends("x")[0]
    b.in_flight = 4
    assert avg.sample([b]) == [4.0]  # first sample: the count itself
    b.in_flight = 0
    clock.advance(2.0)  # the 4 held until now; a window since the first sample
    w = 1 - math.exp(-1)
    assert avg.sample([b])[0] == pytest.approx(w * 4 + (1 - w) * 0)
    clock.advance(100.0)
    assert avg.sample([b])[0] == pytest.approx(0.0, abs=1e-9)  # warmed up, idle
    b.in_flight = 10
    assert avg.sample([b])[0] == pytest.approx(0.0, abs=1e-9)  # no time: no weight yet
    clock.advance(2.0)
    assert avg.sample([b])[0] == pytest.approx(10 * w)
    assert LoadAverage(0.0, clock).sample([b]) == [10.0]  # window 0: the count itself


def test_recent_placements_decay_over_the_window() -> None:
    clock = FakeClock(0.0)
    placed = RecentCount(2.0, clock)
    assert placed.value("a") == 0.0
    placed.add("a")
    placed.add("a")
    assert placed.value("a") == 2.0
    clock.advance(2.0)
    assert placed.value("a") == pytest.approx(2 * math.exp(-1))


async def test_new_prompts_go_to_the_least_loaded_and_a_burst_of_them_splits_evenly() -> None:
    """``new_prompts: least_loaded``: a prompt nobody holds goes to the backend with the
    fewest prompts placed lately, then the fewest requests in flight; each one's later
    requests follow it (its keys are predicted there)."""
    r = rig(("a", "b"))
    r.by("a").in_flight = 3
    view = await r.scorer.assess(chain(4, first=0), r.cands)
    first = r.scorer.decide(view, r.cands)
    assert first is r.by("b") and r.decisions[-1] == ("none_held", "none")
    await r.scorer.routed(view, first)
    homes = collections.Counter[str]()
    homes[first.name] += 1
    for p in range(1, 8):  # seven more new prompts, no load showing yet
        view = await r.scorer.assess(chain(4, first=100 * p), r.cands)
        chosen = r.scorer.decide(view, r.cands)
        assert chosen is not None
        await r.scorer.routed(view, chosen)
        homes[chosen.name] += 1
    assert homes == {"a": 4, "b": 4}
    view = await r.scorer.assess(chain(4, first=0), r.cands)
    assert view.held["b"].depth == 4 and r.scorer.decide(view, r.cands) is r.by("b")


async def test_a_request_sent_past_its_loaded_home_does_not_move_the_prompt() -> None:
    """Once a second engine holds a prompt (it took a request past the cap), the two tie
    and the prompt's home keeps it, whatever the rendezvous hash would say."""
    for p in range(8):
        r = rig(("a", "b"))
        view = await r.scorer.assess(chain(4, first=100 * p), r.cands)
        home = r.scorer.decide(view, r.cands)
        assert home is not None
        await r.scorer.routed(view, home)
        other = r.by("b") if home is r.by("a") else r.by("a")
        await r.scorer.routed(view, other)  # the overflow: predicted on the other too
        view = await r.scorer.assess(chain(4, first=100 * p), r.cands)
        assert set(view.held) == {"a", "b"}
        assert r.scorer.decide(view, r.cands) is home
        assert r.decisions[-1] == ("tie", "gpu_hot")


async def test_a_prompt_whose_home_lost_it_gets_the_engine_it_went_to_as_home() -> None:
    r = rig(("a", "b"))
    for home_first in ("a", "b"):
        r = rig(("a", "b"))
        r.hold(home_first, 4)
        view = await r.scorer.assess(chain(4), r.cands)
        await r.scorer.routed(view, r.by(home_first))  # its home
        other = "b" if home_first == "a" else "a"
        await r.index.remove_backend(home_first)  # the home's engine evicted it
        r.hold(other, 4)
        view = await r.scorer.assess(chain(4), r.cands)
        assert r.scorer.decide(view, r.cands) is r.by(other)
        await r.scorer.routed(view, r.by(other))
        r.hold(home_first, 4)  # both hold it again: the new home keeps it
        view = await r.scorer.assess(chain(4), r.cands)
        assert r.scorer.decide(view, r.cands) is r.by(other)


# ---- resident conversations ---------------------------------------------------------------


def session(s: int, turn: int) -> Chain:
    """Session ``s``'s request at ``turn`` (0-based): a 2-chunk system prompt every
    session shares (C(0), C(1)), then its own history (6 chunks), one chunk more per
    turn."""
    own = [C(1000 * (s + 1) + i) for i in range(6 + turn)]
    return Chain([C(0), C(1), *own], (8 + turn) * CHUNK, b"conversation-%d" % s)


def test_live_conversations_follow_a_conversation_from_turn_to_turn() -> None:
    clock = FakeClock(0.0)
    live = LiveConversations(60.0, clock, max_conversations=3)
    prompt = C(0)
    assert live.owner(b"s0") is None
    assert live.continuing(prompt) == 0.5  # nothing known of the prompt yet
    live.placed(b"s0", prompt, "a", 1000, size=4000)  # first requests count half
    live.placed(b"s1", prompt, "b", 700, size=2800)
    assert live.owner(b"s0") == ("a", 500)
    assert (live.tokens("a"), live.tokens("b")) == (500, round(700 / 3))  # 1 of 1 open
    live.placed(b"s0", prompt, "b", 1300, size=5200)  # its second request, on b: counts in full
    assert (live.tokens("a"), live.tokens("b"), len(live)) == (0, 233 + 1300, 2)
    assert live.continuing(prompt) == (1 + 1) / (2 + 2)
    clock.advance(30)
    live.placed(b"s2", C(9), "a", 500, size=2000)
    clock.advance(31)  # the first two were routed 61 s ago
    live.expire()
    assert (live.tokens("a"), live.tokens("b"), len(live)) == (250, 0, 1)
    for s in range(3, 7):  # bounded: the oldest goes first
        live.placed(b"s%d" % s, C(9), "b", 100, size=400)
    assert len(live) == 3 and live.tokens("a") == 0


def test_a_prompt_whose_conversations_never_go_on_stops_counting_its_requests() -> None:
    """Single requests of a shared prompt are not conversations an engine must keep:
    the share of the prompt's conversations that went on falls, and so does what each
    new one counts (without it the term balanced all recent traffic and split shared
    prompts: ``bench/affinity_bench.py``)."""
    live = LiveConversations(300.0, FakeClock(0.0))
    for i in range(200):
        live.placed(b"q%d" % i, C(0), "a", 1000, size=4000)
    assert live.continuing(C(0)) < 0.02
    owner = live.owner(b"q199")
    assert owner is not None and owner[1] < 20  # of its 1000 tokens
    for i in range(50):  # a chat prompt: every conversation sends a second turn
        live.placed(b"c%d" % i, C(5), "b", 1000, size=4000)
        live.placed(b"c%d" % i, C(5), "b", 1200, size=4800)
    assert live.continuing(C(5)) > 0.95


async def test_a_shared_prompts_new_sessions_spread_by_what_each_engine_keeps() -> None:
    """Every new session of a shared prompt ties on what is held, and goes to the
    prompt's home; with ``resident_weight`` they go where fewer live conversations'
    tokens are kept (copying the 2-chunk prompt once), and each later turn stays with
    its own history."""
    placements = {}
    for weight in (0.0, 0.25):
        scoring = FORMULA.model_copy(update={"resident_weight": weight})
        r = rig(("a", "b"), scoring=scoring)
        r.hold("a", 2)  # the shared prompt, on its home
        homes = collections.Counter[str]()
        where = {}
        for s in range(8):
            view = await r.scorer.assess(session(s, 0), r.cands)
            chosen = r.scorer.decide(view, r.cands)
            assert chosen is not None
            await r.scorer.routed(view, chosen)
            homes[chosen.name] += 1
            where[s] = chosen.name
        placements[weight] = homes
        # The next turns, held where they went (predictions), arriving interleaved
        # across the engines as sessions' turns do (not all of one engine's first).
        rank = collections.Counter[str]()
        order = []
        for s in range(8):
            rank[where[s]] += 1
            order.append((rank[where[s]], s))
        for _, s in sorted(order):
            view = await r.scorer.assess(session(s, 1), r.cands)
            assert view.held[where[s]].depth == 8
            chosen = r.scorer.decide(view, r.cands)
            assert chosen is not None and chosen.name == where[s], (weight, s)
            await r.scorer.routed(view, chosen)
        if weight:
            assert len(r.scorer.live) == 8  # each conversation once, by its identity
            total = r.scorer.live.tokens("a") + r.scorer.live.tokens("b")
            assert total == 8 * 9 * 256  # second requests count in full
    assert placements[0.0] == {"a": 8}
    # (first requests count by the share of the prompt's conversations that went on,
    # which falls while none has sent its second turn: 2 of the 8 move in this burst)
    assert placements[0.25]["a"] + placements[0.25]["b"] == 8 and placements[0.25]["b"] >= 2


async def test_the_resident_term_is_in_the_cost_and_its_parts() -> None:
    scoring = FORMULA.model_copy(update={"resident_weight": 0.5})
    r = rig(("a", "b"), scoring=scoring)
    r.hold("a", 2)
    view = await r.scorer.assess(session(0, 0), r.cands)
    await r.scorer.routed(view, r.by("a"))
    view = await r.scorer.assess(session(1, 0), r.cands)
    a, b = (r.scorer.components(view, x) for x in r.cands)
    assert (a.resident_tokens, b.resident_tokens) == (1024, 0)  # a first request: half
    assert a.cost == 2048 - 512 + 0.5 * 1024 and b.cost == 2048
    own = await r.scorer.assess(session(0, 1), r.cands)  # its own tokens do not count
    assert r.scorer.components(own, r.by("a")).resident_tokens == 0


# ---- one-shot prompts ---------------------------------------------------------------------


def question(q: int, first: int = 0, turn: int = 0) -> Chain:
    """A request of the prompt C(first).. (4 chunks): a conversation of its own, whose
    ``turn`` adds a chunk each (a quarter of the prompt: not small turns)."""
    own = [C(10_000 * (q + 1) + first + i) for i in range(turn)]
    return Chain(
        [*(C(first + i) for i in range(4)), *own],
        (4 + turn) * CHUNK,
        b"question-%d-%d" % (first, q),
    )


async def _others(r: Rig, n: int) -> None:
    """``n`` single requests of prompts of their own, spread over the rig's backends: the
    rest of the traffic, so that the prompt under test is one of many (a prompt with more
    than one backend's share of the requests is never kept home)."""
    for i in range(n):
        await _ask(r, question(0, first=100_000 + 10 * i), r.cands[i % len(r.cands)].name)


async def _past_the_usual_cap(r: Rig, c: Chain) -> Backend | None:
    """The choice for ``c`` with its home ``a`` over the usual cap and under the wider one:
    ``b`` at 4 in flight, ``a`` at 9 (cap ceil(1.25 * 14 / 2) = 9, wide ceil(10.5) = 11)."""
    return _decide_past_the_usual_cap(r, await r.scorer.assess(c, r.cands))


def _decide_past_the_usual_cap(r: Rig, view: ChainView) -> Backend | None:
    """:func:`_past_the_usual_cap` for a view already assessed."""
    r.by("b").in_flight = 4
    r.by("a").in_flight = 9
    return r.scorer.decide(view, r.cands)


async def _ask(r: Rig, c: Chain, to: str | None = None) -> Backend:
    view = await r.scorer.assess(c, r.cands)
    chosen = r.by(to) if to is not None else r.scorer.decide(view, r.cands)
    assert chosen is not None
    await r.scorer.routed(view, chosen)
    return chosen


async def test_a_one_shot_prompts_home_keeps_it_when_another_engine_holds_it_too() -> None:
    """A prompt whose conversations never go on (single requests: templated tasks) is worth
    only its shared prefix, and a copy on a second engine (one request sent past the cap)
    should not be fed by load jitter: its home keeps it unless the home costs more by the
    tokens it holds. A prompt whose conversations go on is left to the cost, so its new
    sessions spread (``bench/affinity_bench.py``: 93 -> 96-98.5 % of each prompt on one
    backend; ``fleet_bench`` unchanged)."""
    scoring = FORMULA.model_copy(update={"resident_weight": 0.1})
    for one_shot in (True, False):
        r = rig(("a", "b"), scoring=scoring)
        r.hold("a", 4)
        await _others(r, 40)
        for q in range(12):  # the prompt's home is a; every question its own conversation
            await _ask(r, question(q), "a")
            if not one_shot:  # ... or each goes on to a second turn
                await _ask(r, question(q, turn=1), "a")
        await _ask(r, question(99), "b")  # the overflow: b holds it too now
        view = await r.scorer.assess(question(100), r.cands)
        assert set(view.held) == {"a", "b"}
        r.by("a").in_flight = 2  # 512 tokens dearer: more than a chunk, less than held
        chosen = r.scorer.decide(view, r.cands)
        assert chosen is r.by("a" if one_shot else "b"), one_shot
        r.by("a").in_flight = 5  # 1,280 dearer: more than the 1,024 held tokens
        assert r.scorer.decide(view, r.cands) is r.by("b")


async def test_too_few_conversations_say_nothing_of_a_prompt() -> None:
    """A burst of new sessions starts many conversations before any can go on: a prompt
    is judged one-shot only after 8 of them (else the burst stays on the home)."""
    r = rig(("a", "b"), scoring=FORMULA.model_copy(update={"resident_weight": 0.1}))
    r.hold("a", 4)
    for q in range(5):
        await _ask(r, question(q), "a")
    await _ask(r, question(99), "b")
    view = await r.scorer.assess(question(100), r.cands)
    r.by("a").in_flight = 2
    assert r.scorer.decide(view, r.cands) is r.by("b")
    assert not r.scorer.live.one_shot(C(0), 0.25, 8) and r.scorer.live.one_shot(C(0), 0.25, 6)


async def test_a_one_shot_prompts_home_is_held_to_the_wider_load_bound() -> None:
    """Its home is measured against ``sticky_load_factor_epsilon`` (0.5) instead of 0.25:
    a request sent past it prefills the whole prompt elsewhere for nothing to reuse
    later. A prompt whose conversations go on gets the usual cap (counts now here).
    Another engine holds the prompt too here, so the copy bound is out of play."""
    instant = ConversationScoringConfig(load_window_seconds=0)
    for one_shot in (True, False):
        r = rig(("a", "b"), scoring=instant)
        r.hold("a", 4)
        await _others(r, 40)
        for q in range(12):
            await _ask(r, question(q), "a")
            if not one_shot:
                await _ask(r, question(q, turn=1), "a")
        r.hold("b", 2)  # b holds half of it (an earlier overflow)
        view = await r.scorer.assess(question(100), r.cands)
        chosen = _decide_past_the_usual_cap(r, view)
        assert chosen is r.by("a" if one_shot else "b"), one_shot
        r.by("a").in_flight = 15  # wide ceil(1.5 * 20 / 2) = 15: over that too
        assert r.scorer.decide(view, r.cands) is r.by("b")


async def test_a_home_is_not_copied_for_load_until_the_copy_bound() -> None:
    """When every candidate under the caps holds none of a one-shot prompt, sending a
    request past its home copies the whole prompt into a cache other prompts fill, and
    in a full fleet evicts as much of them (``make run``'s demo: a cascade of copies). So
    the home keeps it up to ``copy_load_factor_epsilon`` (2: 3x the mean), past the
    sticky bound; with the bound at the sticky one's, the request is copied."""
    instant = ConversationScoringConfig(load_window_seconds=0)
    for copy_eps in (2.0, 0.5):
        r = rig(
            ("a", "b", "c", "d"),
            scoring=instant.model_copy(update={"copy_load_factor_epsilon": copy_eps}),
        )
        r.hold("a", 4)
        await _others(r, 80)
        for q in range(12):
            await _ask(r, question(q), "a")
        view = await r.scorer.assess(question(100), r.cands)
        assert set(view.held) == {"a"}
        for name in "bcd":
            r.by(name).in_flight = 1
        r.by("a").in_flight = 8  # total 12: cap 4, sticky ceil(4.5) = 5, copy ceil(9) = 9
        chosen = r.scorer.decide(view, r.cands)
        assert chosen is not None and (chosen.name == "a") is (copy_eps == 2.0), copy_eps
        assert r.scorer.capped == (copy_eps != 2.0)
        r.by("a").in_flight = 12  # total 16: copy bound ceil(3 * 16 / 4) = 12, reached
        chosen = r.scorer.decide(view, r.cands)
        assert chosen is not None and chosen.name != "a"


async def test_a_prompt_not_judged_yet_is_not_copied_for_load_either() -> None:
    """Before 3 requests after a conversation's first (or 8 conversations) nothing says
    whether spreading a prompt buys room, and the first requests are where a burst of
    new sessions meets a loaded home: its home keeps it up to the copy bound (not the
    sticky one). Once its conversations are seen to grow, the usual cap applies."""
    instant = ConversationScoringConfig(load_window_seconds=0)
    r = rig(("a", "b"), scoring=instant)
    r.hold("a", 4)
    await _others(r, 40)
    for q in range(2):
        await _ask(r, question(q), "a")
    assert await _past_the_usual_cap(r, question(100)) is r.by("a")
    for q in range(2, 6):  # conversations that go on with long turns: judged, not small
        await _ask(r, question(q), "a")
        await _ask(r, question(q, turn=1), "a")
    assert await _past_the_usual_cap(r, question(101)) is r.by("b")


# ---- prompts whose turns are small ------------------------------------------------------


def test_live_conversations_measure_what_a_prompts_turns_add() -> None:
    """Per prompt, the bytes each request after a conversation's first added to it, against
    the conversations' first requests: a long system prompt with short exchanges adds a
    few percent a turn, a chat whose answers and questions are long or an agent's tool
    results add a tenth or more."""
    live = LiveConversations(300.0, FakeClock(0.0))
    for c in range(2):
        live.placed(b"small-%d" % c, C(0), "a", 1000, size=4000)
        live.placed(b"large-%d" % c, C(5), "b", 1000, size=4000)
    for turn in range(1, 3):
        for c in range(2):
            live.placed(b"small-%d" % c, C(0), "a", 1000, size=4000 + 200 * turn)  # 5 %
            live.placed(b"large-%d" % c, C(5), "b", 1000, size=4000 + 400 * turn)  # 10 %
    assert live.small_turns(C(0), 1 / 16, 4) and not live.small_turns(C(0), 1 / 16, 5)
    assert not live.small_turns(C(5), 1 / 16, 4) and live.small_turns(C(5), 1 / 8, 4)
    assert not live.small_turns(C(9), 1 / 16, 0)  # a prompt not seen
    for q in range(40):  # single requests only: one-shot, not small turns (no evidence)
        live.placed(b"q%d" % q, C(7), "a", 1000, size=4000)
    assert live.one_shot(C(7), 0.25, 8) and not live.small_turns(C(7), 1 / 16, 1)
    for t in range(300):  # counts halve as they accumulate; the ratio stays
        live.placed(b"long", C(0), "a", 1000, size=4400 + 200 * t)
    assert live.small_turns(C(0), 1 / 16, 4)
    live.placed(b"long", C(0), "a", 1000, size=0)  # a shorter prompt adds nothing
    assert live.small_turns(C(0), 1 / 16, 4)


def small_turn(q: int, turn: int, first: int = 0) -> Chain:
    """Turn ``turn`` of conversation ``q`` under the prompt C(first).. (4 chunks): each
    turn adds 64 bytes, inside the last partial chunk (1.6 % of the prompt)."""
    keys = [C(first + i) for i in range(4)]
    return Chain(keys, 4 * CHUNK + 64 * turn, b"chat-%d-%d" % (first, q))


async def test_a_prompt_whose_turns_are_small_stays_home_as_a_one_shot_prompt() -> None:
    """Conversations that go on but add only a few percent of their prompt a turn (a long
    system prompt and short exchanges: ``make run``'s tenants) are worth only the shared
    prompt: spreading them buys no room and each one sent past the home copies the whole
    prompt into another engine's cache. Their home is held to the wider bound and keeps
    them against a copy elsewhere, as a one-shot prompt's home does; conversations whose
    turns add a chunk (a quarter of the prompt) each spread as before."""
    instant = ConversationScoringConfig(load_window_seconds=0)
    for small in (True, False):
        r = rig(("a", "b"), scoring=instant)
        r.hold("a", 4)
        await _others(r, 20)
        for q in range(3):
            for turn in range(2):
                await _ask(r, small_turn(q, turn) if small else question(q, turn=turn), "a")
        assert r.scorer.live.small_turns(C(0), 1 / 16, 3) is small
        r.hold("b", 2)  # b holds half of it (an earlier overflow): no copy bound
        view = await r.scorer.assess(small_turn(9, 0), r.cands)
        chosen = _decide_past_the_usual_cap(r, view)
        assert chosen is r.by("a" if small else "b"), small
        assert r.scorer.capped == (0 if small else 1)
        r.by("a").in_flight = 15  # wide ceil(1.5 * 20 / 2) = 15: over that too
        assert r.scorer.decide(view, r.cands) is r.by("b")


async def test_a_prompt_with_more_than_one_backends_share_of_the_traffic_spreads() -> None:
    """Staying home is for a prompt that fits on one engine: one with more than a
    backend's share of the recent requests (a single product prompt with short turns)
    needs several engines anyway, and copies of it pay for themselves, so the usual cap
    spreads it."""
    instant = ConversationScoringConfig(load_window_seconds=0)
    for others in (20, 0):
        r = rig(("a", "b"), scoring=instant)
        r.hold("a", 4)
        await _others(r, others)
        for q in range(3):
            for turn in range(2):
                await _ask(r, small_turn(q, turn), "a")
        share = r.scorer.live.share(C(0))
        assert (share < 0.5) is (others == 20), share
        chosen = await _past_the_usual_cap(r, small_turn(9, 0))
        assert chosen is r.by("a" if others else "b")


def test_a_prompts_share_of_the_traffic_follows_the_recent_requests() -> None:
    live = LiveConversations(300.0, FakeClock(0.0))
    assert live.share(C(0)) == 0.0
    for i in range(300):
        live.placed(b"x%d" % i, C(i % 3), "a", 100, size=400)  # three prompts in turn
    shares = [live.share(C(k)) for k in range(3)]
    assert sum(shares) == pytest.approx(1.0) and max(shares) - min(shares) < 0.01
    for i in range(3000):  # then one prompt alone: the others fade
        live.placed(b"y%d" % i, C(7), "a", 100, size=400)
    assert live.share(C(7)) > 0.9 and live.share(C(0)) < 0.05


async def test_the_admin_counts_prompts_by_how_their_conversations_go() -> None:
    """``/admin/kv-index/stats`` shows how many prompts the router treats as worth only
    their shared prefix, so an operator can tell why a prompt's sessions stay on one
    engine."""
    r = rig(("a", "b"), scoring=ConversationScoringConfig())
    r.hold("a", 4)
    for q in range(10):  # C(0): single requests only
        await _ask(r, question(q), "a")
    for q in range(3):  # C(4): short turns; C(8): a chunk a turn
        for turn in range(2):
            await _ask(r, small_turn(q, turn, first=4), "a")
            await _ask(r, question(q, first=8, turn=turn), "a")
    assert r.scorer.prompt_kinds() == {"tracked": 3, "one_shot": 1, "small_turns": 1}


async def test_too_few_later_requests_say_nothing_of_a_prompts_turns() -> None:
    """Two later requests are not yet evidence (a burst of new sessions spreads by the
    usual cap until three have gone on)."""
    r = rig(("a", "b"), scoring=ConversationScoringConfig(load_window_seconds=0))
    r.hold("a", 4)
    for q in range(2):
        await _ask(r, small_turn(q, 0), "a")
        await _ask(r, small_turn(q, 1), "a")
    assert await _past_the_usual_cap(r, small_turn(9, 0)) is r.by("b")
