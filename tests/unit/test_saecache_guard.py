"""The safeguard: SAECache that follows LRU or LFU where its shadows say they do better.

The traces here are built so that one policy clearly wins: reused chain-of-thought blocks
next to one-off prompts (SAECache's strict evict-first queue throws away exactly what is
reused): with stable popularity LFU wins, with drifting popularity LRU does; and reused
user turns next to never-reused chain of thought (SAECache's own case).
"""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from bench.saecache.sim import LfuPolicy, LruPolicy, SaePolicy, replay
from bench.saecache.trace import Request
from listener.saecache import TokenType
from listener.saecache.guard import GuardConfig, GuardedSaeCache, Mode

EXACT = GuardConfig(sample=1, window=64)
RSN, USR = int(TokenType.REASONING), int(TokenType.USER)


def _req(t: float, sid: int, blocks: list[int], types: list[int]) -> Request:
    return Request(
        t=t,
        session=sid,
        kind="chat",
        first=False,
        tools=False,
        prompt_tokens=16 * len(blocks) + 1,
        blocks=blocks,
        types=bytes(types),
        n_prompt=len(blocks),
    )


def _reused_reasoning(n: int = 3000, seed: int = 1, period: int | None = None) -> list[Request]:
    """Every other request re-sends one of 30 reasoning-typed chains (Zipf popularity; a new
    set of 30 every ``period`` requests), the others are one-off user prompts."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        if i % 2:
            topic = min(int(rng.paretovariate(1.0)) - 1, 29)
            if period:
                topic += 30 * (i // period)
            chain = [10_000 * (topic + 1) + d for d in range(6)]
            out.append(_req(float(i), i, chain, [RSN] * 6))
        else:
            out.append(_req(float(i), i, [10_000_000 + 10 * i + d for d in range(4)], [USR] * 4))
    return out


def _hit(trace: list[Request], policy: object, cap: int) -> float:
    return replay(trace, policy, cap).hit_rate  # type: ignore[arg-type]


def test_follows_lru_where_saecache_evicts_what_is_reused() -> None:
    # popular chains drift: stale counts mislead LFU, the evict-first queue misleads SAECache
    trace = _reused_reasoning(period=300)
    cap = 60
    lru, lfu = _hit(trace, LruPolicy(), cap), _hit(trace, LfuPolicy(), cap)
    sae = _hit(trace, SaePolicy(), cap)
    guarded = SaePolicy(guard=EXACT)
    got = _hit(trace, guarded, cap)
    assert max(sae, lfu) < lru - 0.1  # the trace does what it is for
    assert guarded.cache.mode == Mode.LRU  # type: ignore[attr-defined]
    assert got >= lru - 0.01


def test_follows_lfu_where_popularity_is_stable() -> None:
    trace = _reused_reasoning()
    cap = 60
    lru, lfu = _hit(trace, LruPolicy(), cap), _hit(trace, LfuPolicy(), cap)
    sae = _hit(trace, SaePolicy(), cap)
    guarded = SaePolicy(guard=EXACT)
    got = _hit(trace, guarded, cap)
    assert max(sae, lru) < lfu - 0.1
    assert guarded.cache.mode == Mode.LFU  # type: ignore[attr-defined]
    assert got >= lfu - 0.02


def test_keeps_saecache_where_it_wins() -> None:
    # reused user chains, each request followed by never-reused chain of thought
    rng = random.Random(3)
    trace = []
    for i in range(3000):
        topic = rng.randrange(12)
        chain = [10_000 * (topic + 1) + d for d in range(4)]
        cot = [10_000_000 + 10 * i + d for d in range(4)]
        trace.append(_req(float(i), topic, chain + cot, [USR] * 4 + [RSN] * 4))
    cap = 50
    lru, sae = _hit(trace, LruPolicy(), cap), _hit(trace, SaePolicy(), cap)
    guarded = SaePolicy(guard=EXACT)
    got = _hit(trace, guarded, cap)
    assert sae > lru + 0.1
    assert guarded.cache.mode == Mode.SAE  # type: ignore[attr-defined]
    assert got >= sae - 0.01


def test_sampled_shadows_are_deterministic_for_a_seed() -> None:
    trace = _reused_reasoning(1500) + _reused_reasoning(1500, seed=4, period=200)
    trace = [_req(float(i), r.session, r.blocks, list(r.types)) for i, r in enumerate(trace)]
    runs = []
    for seed in (7, 7):
        pol = SaePolicy(guard=GuardConfig(sample=4, window=32, seed=seed, min_shadow=1))
        res = replay(trace, pol, 40)
        runs.append((res.hit_tokens, res.evictions, pol.cache.switches))  # type: ignore[attr-defined]
    assert runs[0] == runs[1]


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 9),  # session
            st.integers(0, 5),  # chain root
            st.integers(1, 6),  # depth
            st.sampled_from([int(t) for t in TokenType]),
        ),
        min_size=1,
        max_size=120,
    ),
    st.integers(1, 12),
    st.sampled_from([1, 2, 8]),
)
def test_capacity_and_tree_order_hold_in_every_mode(
    reqs: list[tuple[int, int, int, int]], cap: int, sample: int
) -> None:
    """Whatever the mode, a full cache evicts a leaf that is not in use, and stays full."""
    c = GuardedSaeCache(guard=GuardConfig(sample=sample, window=4, min_shadow=1))
    seen_modes = set()
    for i, (sid, root, depth, tt) in enumerate(reqs):
        now = float(i)
        c.begin_request(sid, now)
        held: list[int] = []
        parent = None
        for d in range(depth):
            key = root * 100 + d + (i if tt == RSN and d > 1 else 0) * 1000
            if key in c:
                c.hit(key, now=now, session=sid)
                held.append(key)
            else:
                while len(c) >= cap:
                    v = c.evict(now)
                    if v is None:
                        break
                    assert v not in held
                    assert all(k in c for k in held)
                if len(c) < cap:
                    c.insert(key, parent, ttype=TokenType(tt), offset=d, now=now, session=sid)
                    held.append(key)
            parent = key
            assert len(c) <= cap
        for k in reversed(held):
            c.release(k)
        seen_modes.add(c.mode)
        order = c.rank(list(range(0, 600)), 5, now)
        assert len(order) == len(set(order))
    assert len(c) <= cap


def test_the_capacity_is_learned_from_evictions() -> None:
    c = GuardedSaeCache(guard=GuardConfig(sample=1))
    for k in range(5):
        c.insert(k, k - 1 if k else None, ttype=TokenType.USER, offset=k, now=0.0, pinned=False)
    assert c.capacity == 0
    c.evict(1.0)
    assert c.capacity == 5
    c.remove(3)
    assert c.capacity == 5


def test_the_advisor_guards_each_backend_when_configured() -> None:
    from listener.config.models import ListenerConfig
    from listener.saecache.advisor import EvictionAdvisor

    assert ListenerConfig().eviction_advisor_safeguard is False
    guarded = EvictionAdvisor(["a"], guard=GuardConfig())
    plain = EvictionAdvisor(["a"])
    assert isinstance(guarded._backend("a").cache, GuardedSaeCache)  # type: ignore[union-attr]
    assert not isinstance(plain._backend("a").cache, GuardedSaeCache)  # type: ignore[union-attr]


def test_a_small_cache_samples_more_keys() -> None:
    def filled(cap: int) -> GuardedSaeCache:
        c = GuardedSaeCache(guard=GuardConfig(sample=8, min_shadow=100))
        for k in range(cap):
            c.insert(k, None, ttype=TokenType.USER, offset=0, now=float(k), pinned=False)
        c.evict(float(cap))
        return c

    assert filled(150).sample == 1
    assert filled(450).sample == 4
    big = filled(5000)
    assert big.sample == 8
    assert 400 < len(big._sae) < 850  # thinned to about one key in eight
