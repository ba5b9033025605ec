"""A tracker's state through a checkpoint file and back: after loading, the tracker is the
one that was saved (same exported state, same snapshot, same invariants), and it goes on
exactly as the original would (same events for the same further engine events), for
random event streams in prefix mode (pending chains and attribution included) and in
conversation mode. Malformed state is refused without leaving a half-loaded tracker."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from listener.chains import ChainTracker, StateError, export_state, import_state
from listener.checkpoint import Checkpoint, Resume, decode_checkpoint, encode_checkpoint
from listener.engine_events import EngineEvent
from tests.unit import test_chain_conversation as conv
from tests.unit import test_chains as chains


def through_file(tracker: ChainTracker) -> Any:
    """The tracker's exported state after a trip through the checkpoint encoding."""
    cp = Checkpoint({"backend": "b1"}, time.time(), (Resume("tcp://x:1", 7, b"d" * 16),),
                    export_state(tracker))  # fmt: skip
    back = decode_checkpoint(encode_checkpoint(cp))
    assert back.resume == cp.resume and back.identity == cp.identity
    return back.state


def same_tracker(a: ChainTracker, b: ChainTracker) -> None:
    a.check_invariants()
    b.check_invariants()
    assert export_state(a) == export_state(b)
    assert a.snapshot() == b.snapshot()
    sa, sb = a.stats(), b.stats()
    for k in ("tracked_blocks", "retained_tokens", "attributed_prefixes", "keyed_blocks",
              "pending_blocks", "unattributed_blocks"):  # fmt: skip
        assert sa[k] == sb[k], k
    for k in ("chain_keys", "chain_nodes", "chain_retained_bytes"):
        assert sa.get(k) == sb.get(k), k


@settings(max_examples=150, deadline=None)
@given(
    events=chains.chain_events()
    | st.lists(st.tuples(chains.engine_events(), st.integers(0, 1)), max_size=40),
    split=st.integers(0, 60),
    max_tracked=st.integers(1, 40),
    max_retained=st.integers(1, 40),
    settle=st.booleans(),
)
def test_property_prefix_state_round_trips(
    events: list[tuple[EngineEvent, int]],
    split: int,
    max_tracked: int,
    max_retained: int,
    settle: bool,
) -> None:
    limits = {
        "max_tracked_blocks": max_tracked,
        "max_retained_tokens": max_retained,
        "max_chain_tokens": 24,
        "max_prefix_length": 3,
    }

    async def scenario() -> None:
        original, r1, _ = chains.make(**limits)  # type: ignore[arg-type]
        for ev, dp in events[:split]:
            original.apply(chains.batch(ev, dp=dp))
            if settle:
                await original.idle()
        loaded, r2, _ = chains.make(**limits)  # type: ignore[arg-type]
        import_state(loaded, through_file(original))
        same_tracker(original, loaded)
        r2.state = dict(r1.state)  # what subscribers were told, e.g. by a snapshot
        mark1, mark2 = len(r1.events), len(r2.events)
        for ev, dp in events[split:]:
            for t in (original, loaded):
                t.apply(chains.batch(ev, dp=dp))
                if settle:
                    await t.idle()
        await original.idle()
        await loaded.idle()
        if settle:  # attribution ran in the same order: the same events, one by one
            assert r1.events[mark1:] == r2.events[mark2:]
            same_tracker(original, loaded)
        assert r1.state == r2.state
        chains.check(loaded, r2)
        await original.aclose()
        await loaded.aclose()

    asyncio.run(scenario())


@settings(max_examples=150, deadline=None)
@given(
    events=conv.engine_runs(),
    split=st.integers(0, 40),
    chunk=st.sampled_from([4, 8, 12]),
    max_tracked=st.integers(1, 30),
    max_bytes=st.integers(1, 200),
)
def test_property_conversation_state_round_trips(
    events: list[EngineEvent], split: int, chunk: int, max_tracked: int, max_bytes: int
) -> None:
    limits = {"max_tracked_blocks": max_tracked, "max_retained_bytes": max_bytes, "chunk": chunk}
    original, r1 = conv.make(**limits)  # type: ignore[arg-type]
    for ev in events[:split]:
        original.apply(conv.batch(ev))
    loaded, r2 = conv.make(**limits)  # type: ignore[arg-type]
    import_state(loaded, through_file(original))
    same_tracker(original, loaded)
    r2.keys = dict(r1.keys)
    mark1, mark2 = len(r1.events), len(r2.events)
    for ev in events[split:]:
        original.apply(conv.batch(ev))
        loaded.apply(conv.batch(ev))
        assert r1.events[mark1:] == r2.events[mark2:]
    same_tracker(original, loaded)
    conv.check(loaded, r2)


def _filled() -> ChainTracker:
    tracker, _, _ = chains.make()
    b = chains.body("sys", "q")
    toks = chains.tokens_of(b)
    tracker.apply(chains.batch(chains.stored(toks, hashes=list(range(1, len(toks) // 4 + 1)))))
    return tracker


def test_a_tracker_with_state_refuses_an_import() -> None:
    tracker = _filled()
    with pytest.raises(RuntimeError):
        import_state(tracker, export_state(tracker))


@pytest.mark.parametrize(
    "damage",
    [
        lambda s: None,
        lambda s: [],
        lambda s: {**s, "blocks": "x"},
        lambda s: {**s, "blocks": [[0] * 15]},
        lambda s: {**s, "blocks": [*s["blocks"], s["blocks"][0]]},  # a key twice
        lambda s: {**s, "blocks": [[*s["blocks"][0][:7], 9, *s["blocks"][0][8:]]]},  # state
        lambda s: {**s, "blocks": [[*s["blocks"][0][:10], 99, *s["blocks"][0][11:]]]},  # ref
        lambda s: {**s, "blocks": [[*s["blocks"][0][:9], b"abc", *s["blocks"][0][10:]]]},
        lambda s: {**s, "blocks": [[*b[:4], b[5] + 1, *b[5:]] for b in s["blocks"]]},  # start
        lambda s: {**s, "blocks": [[*b[:7], 1, *b[8:]] for b in s["blocks"]]},  # keyed, no key
        lambda s: {**s, "prefixes": [["k", 0, 0, None, 0]]},
        lambda s: {**s, "conversation": {"refs": [], "nodes": []}},
        lambda s: {**s, "media": [[0, 0, [1]]]},
    ],
)
def test_malformed_state_is_refused_and_leaves_the_tracker_empty(damage: Any) -> None:
    state = export_state(_filled())
    assert state["blocks"], "the fixture must hold blocks"
    fresh, _, _ = chains.make()
    with pytest.raises(StateError):
        import_state(fresh, damage(state))
    assert fresh.stats()["tracked_blocks"] == 0 and fresh.snapshot() == []
    fresh.check_invariants()
    import_state(fresh, state)  # and it still takes a good one
    assert fresh.stats()["tracked_blocks"] == len(state["blocks"])


def test_state_over_the_entry_bound_is_refused() -> None:
    state = export_state(_filled())
    small, _, _ = chains.make(max_tracked_blocks=1)
    with pytest.raises(StateError, match="max_tracked_blocks"):
        import_state(small, state)


def test_conversation_state_needs_conversation_mode() -> None:
    tracker, _ = conv.make()
    tracker.apply(conv.batch(conv.stored(b"abcdefgh" * 8)))
    plain, _, _ = chains.make()
    with pytest.raises(StateError, match="conversation"):
        import_state(plain, export_state(tracker))
    other, _ = conv.make(chunk=conv.C * 2)
    with pytest.raises(StateError, match="chunk_bytes"):
        import_state(other, export_state(tracker))
