"""SaePruningPolicy in the chain tracker: shared system-prompt chains survive a flood.

A fake clock advances one second per engine event. Keys come from router salts, so every
chain is keyed as soon as it is stored (no detokenize round trips).
"""

from __future__ import annotations

import itertools
from array import array
from collections.abc import Iterator

from bus.salt import encode_salt
from listener.chains import (
    KEYED,
    UNATTRIBUTED,
    BlockState,
    ChainTracker,
    LruPolicy,
    TrackedBlock,
)
from listener.engine_events import BlockHash
from listener.saecache.pruning import SaePruningPolicy
from tests.unit.test_chains import SECRET, Router, batch, check, make, stored


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _key(i: int) -> bytes:
    return bytes([i % 256, i // 256]) * 16


def _run_flood(policy_name: str) -> tuple[ChainTracker, Router, bytes]:
    clock = Clock()
    policy = SaePruningPolicy(clock) if policy_name == "saecache" else LruPolicy()
    tracker, router, _ = make(max_tracked_blocks=40, policy=policy)
    hashes: Iterator[int] = itertools.count(10_000)
    shared = _key(1)
    sys_hashes = [next(hashes) for _ in range(4)]
    tracker.apply(
        batch(stored([7] * 16, hashes=sys_hashes, salt=encode_salt(SECRET, "b1", shared)))
    )
    for _ in range(2):  # a popular prompt: two conversations use it before the flood
        clock.t += 1
        tracker.apply(batch(stored([8] * 8, parent=sys_hashes[-1])))
    check(tracker, router)
    one_off = itertools.count(2)
    for _round in range(12):
        clock.t += 1
        # a conversation under the shared system prompt: new blocks under its last block
        tracker.apply(batch(stored([8] * 8, parent=sys_hashes[-1])))
        # then a flood of one-off chains, more blocks than the tracker may hold
        for _ in range(30):
            clock.t += 1
            k = _key(next(one_off))
            tracker.apply(batch(stored([9] * 8, salt=encode_salt(SECRET, "b1", k))))
        check(tracker, router)
    return tracker, router, shared


def test_saecache_pruning_keeps_the_shared_system_prompt_chain() -> None:
    tracker, router, shared = _run_flood("saecache")
    assert shared.hex() in router.state  # the router still sees the shared prefix
    assert tracker.orphans == 0  # every conversation under it was tracked
    assert tracker.pruned > 0


def test_lru_pruning_loses_it_under_the_same_pressure() -> None:
    tracker, router, shared = _run_flood("lru")
    assert shared.hex() not in router.state
    assert tracker.orphans > 0  # later conversations under it could not be tracked


def _block(i: int, start: int, state: BlockState = KEYED, tokens: bool = False) -> TrackedBlock:
    b = TrackedBlock((0, 0, "GPU", BlockHash(i)), start, start + 16, "gpu")
    b.state = state
    if tokens:
        b.tokens = array("I", [1] * 16)
    return b


def test_victim_order_and_token_holders() -> None:
    clock = Clock()
    p = SaePruningPolicy(clock)
    a, b, c = _block(1, 0, tokens=True), _block(2, 16, tokens=True), _block(3, 32)
    for blk in (a, b, c):
        clock.t += 1
        p.added(blk)
    clock.t += 1
    p.touched(a)  # reused: structure queue
    clock.t += 10
    assert p.victim() is b  # oldest block seen once
    assert p.victim(holding_tokens=True) is b
    b.tokens = None
    p.released(b)
    assert p.victim(holding_tokens=True) is a  # the only holder left
    c.state = UNATTRIBUTED
    p.touched(c)  # an unattributed block goes first whatever its age
    assert p.victim() is c
    p.removed(c)
    p.removed(b)
    assert p.victim() is a
    p.clear()
    assert p.victim() is None and p.victim(holding_tokens=True) is None
