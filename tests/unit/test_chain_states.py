"""Block states: the transition table, the single place that changes a state, and the
tracker's use of it.

The table is pinned as a whole (a change to it is a change of the tracker's contract),
every entry is exercised on a block, every missing entry raises without touching the
block or the tracker, each reachable cause is produced by the tracker in the situation
it documents, and under random engine event streams every state change a block goes
through is one the table allows and goes through ``TrackedBlock.transition``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bus.prefix_key import PrefixKey
from bus.salt import encode_salt
from listener import chains
from listener.chains import (
    KEYED,
    PENDING,
    TRANSITIONS,
    UNATTRIBUTED,
    BlockState,
    Cause,
    ChainTracker,
    IllegalTransition,
    TrackedBlock,
)
from listener.chains.prefixes import Prefix
from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
)
from tests.unit.test_chains import (
    BS,
    SECRET,
    batch,
    body,
    chain_events,
    check,
    engine_events,
    make,
    stored,
    tokens_of,
)
from tests.unit.test_recovery import encode

Record = tuple[TrackedBlock, BlockState, Cause, BlockState]
"""(block, state before, cause, state after) of one ``transition`` call."""


@contextlib.contextmanager
def recording_transitions() -> Iterator[list[Record]]:
    """Every ``TrackedBlock.transition`` that succeeds, in order, while the block is open."""
    log: list[Record] = []
    original = TrackedBlock.transition

    def recording(self: TrackedBlock, cause: Cause, prefix: Prefix | None = None) -> BlockState:
        before = self.state
        after = original(self, cause, prefix)
        log.append((self, before, cause, after))
        return after

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TrackedBlock, "transition", recording)
        yield log


@pytest.fixture
def transitions() -> Iterator[list[Record]]:
    with recording_transitions() as log:
        yield log


def causes(log: list[Record]) -> set[Cause]:
    return {cause for _, _, cause, _ in log}


# -- the table -----------------------------------------------------------------------------


def test_the_table_is_exactly_the_changes_the_tracker_makes() -> None:
    allowed = {(s, c, t) for s, row in TRANSITIONS.items() for c, t in row.items()}
    given_up = set(Cause) - {Cause.KEY_DECIDED}
    assert allowed == {(PENDING, Cause.KEY_DECIDED, KEYED)} | {
        (PENDING, c, UNATTRIBUTED) for c in given_up
    }
    assert set(TRANSITIONS) == set(BlockState)
    assert not TRANSITIONS[KEYED] and not TRANSITIONS[UNATTRIBUTED]  # final states
    assert all(s != t for s, _, t in allowed)  # no self-transitions


def test_state_names_are_the_enum_and_keep_their_values() -> None:
    # SaePruningPolicy compares with 2 (it does not import the tracker), stats index by value.
    assert (chains.PENDING, chains.KEYED, chains.UNATTRIBUTED) == tuple(BlockState)
    assert (PENDING, KEYED, UNATTRIBUTED) == (0, 1, 2)
    assert all(isinstance(s, BlockState) for s in (PENDING, KEYED, UNATTRIBUTED))


ALLOWED = [(s, c, t) for s, row in TRANSITIONS.items() for c, t in row.items()]
ILLEGAL = [(s, c) for s in BlockState for c in Cause if c not in TRANSITIONS[s]]


@pytest.mark.parametrize(("state", "cause", "to"), ALLOWED)
def test_every_allowed_transition_works(state: BlockState, cause: Cause, to: BlockState) -> None:
    b = TrackedBlock((0, 0, "GPU", BlockHash(1)), 0, BS, "gpu", state)
    prefix = Prefix(b"\x01" * 32) if to is KEYED else None
    assert b.transition(cause, prefix) is to
    assert b.state is to and b.prefix is prefix


def _tracker_with_every_state() -> tuple[ChainTracker, dict[BlockState, TrackedBlock]]:
    """No event loop runs: the pending chain stays pending."""
    tracker, _, _ = make()
    salt = encode_salt(SECRET, "b1", PrefixKey(b"\x02" * 32))
    tracker.apply(batch(stored([5] * 2 * BS, salt=salt)))  # keyed by its salt
    mismatch = BlockStored([BlockHash(9001)], None, [1, 2, 3], BS)  # mismatch: length only
    tracker.apply(batch(mismatch))
    tracker.apply(batch(stored(tokens_of(body("Pending.", "q")))))  # waits for /detokenize
    by_state = {b.state: b for b in tracker._nodes.values()}
    assert set(by_state) == set(BlockState)
    return tracker, by_state


@pytest.mark.parametrize(("state", "cause"), ILLEGAL)
def test_every_other_transition_raises_and_changes_nothing(state: BlockState, cause: Cause) -> None:
    tracker, by_state = _tracker_with_every_state()
    b = by_state[state]
    prefix, before = b.prefix, tracker.stats()
    offered = Prefix(b"\x03" * 32)
    with pytest.raises(IllegalTransition) as err:
        b.transition(cause, offered)
    assert (err.value.state, err.value.cause) == (state, cause)
    assert b.state is state and b.prefix is prefix
    assert tracker.stats() == before
    tracker.check_invariants()


def test_illegal_transitions_cover_both_final_states() -> None:
    assert {s for s, _ in ILLEGAL} == {KEYED, UNATTRIBUTED}
    assert len(ILLEGAL) == 2 * len(Cause)


# -- each cause where the tracker documents it ------------------------------------------


async def test_key_decided_moves_the_decision_block_and_its_subtree(
    transitions: list[Record],
) -> None:
    tracker, router, _ = make()
    tracker.apply(batch(stored(tokens_of(body("Rules.", "question")))))
    await tracker.idle()
    assert causes(transitions) == {Cause.KEY_DECIDED}
    moved = {b for b, before, _, after in transitions if (before, after) == (PENDING, KEYED)}
    assert moved == {b for b in tracker._nodes.values() if b.state is KEYED}
    assert len(moved) == len(transitions) and tracker.stats()["pending_blocks"] > 0
    check(tracker, router)


def test_removing_a_pending_block_gives_its_subtree_up_uncounted(
    transitions: list[Record],
) -> None:
    tracker, router, _ = make()
    ev = stored(tokens_of(body("Removed.", "q")))
    tracker.apply(batch(ev))
    tracker.apply(batch(BlockRemoved(ev.block_hashes[:1])))
    assert causes(transitions) == {Cause.ANCESTOR_REMOVED}
    assert len(transitions) == len(ev.block_hashes) - 1
    stats = tracker.stats()
    assert stats["unattributed_blocks"] == len(ev.block_hashes) - 1
    assert stats["unattributed_chains"] == 0
    check(tracker, router)


def test_the_token_bound_takes_the_oldest_text(transitions: list[Record]) -> None:
    tracker, router, _ = make(max_retained_tokens=5 * BS)
    tracker.apply(batch(stored(tokens_of(body("x" * 60, "q"))[: 6 * BS])))
    assert causes(transitions) == {Cause.TEXT_PRUNED}
    stats = tracker.stats()
    assert stats["retained_tokens"] <= 5 * BS and stats["unattributed_chains"] == 1
    check(tracker, router)


async def test_insufficient_text_at_the_chain_cap_is_given_up(
    transitions: list[Record],
) -> None:
    tracker, router, _ = make(max_chain_tokens=40)
    tracker.apply(batch(stored(tokens_of(body("y" * 200, "q")))))
    await tracker.idle()
    assert causes(transitions) == {Cause.TEXT_INSUFFICIENT}
    assert {after for _, _, _, after in transitions} == {UNATTRIBUTED}
    check(tracker, router)


async def test_a_blocked_block_under_insufficient_text_is_given_up(
    transitions: list[Record],
) -> None:
    tracker, router, _ = make("sglang")
    root = stored(encode("<|im_start|>user\nquestion")[: 2 * BS])  # the anchor is cut: NEED_MORE
    child = BlockStored([BlockHash(9101)], root.block_hashes[-1], [1, 2, 3], BS)  # no text
    tracker.apply(batch(root, child))
    await tracker.idle()
    assert [(b.key[3], c) for b, _, c, _ in transitions] == [(9101, Cause.TEXT_INSUFFICIENT)]
    assert tracker.stats()["pending_blocks"] == 2  # the root may still get more text
    check(tracker, router)


async def test_text_without_an_anchor_is_given_up(transitions: list[Record]) -> None:
    tracker, router, _ = make()
    ev = stored(encode("plain text, no chat template here")[: 4 * BS])
    tracker.apply(batch(ev))
    await tracker.idle()
    # The leaf whose path was read goes; its ancestors wait for other continuations.
    assert [(b.key[3], c) for b, _, c, _ in transitions] == [(ev.block_hashes[-1], Cause.NO_ANCHOR)]
    check(tracker, router)


async def test_a_refused_detokenize_gives_the_chain_up(transitions: list[Record]) -> None:
    tracker, router, fake = make()
    fake.fail, fake.retryable = 1, False
    tracker.apply(batch(stored(tokens_of(body("Nope.", "q")))))
    await tracker.idle()
    assert causes(transitions) == {Cause.DETOKENIZE_REFUSED}
    check(tracker, router)


def test_births_are_not_transitions(transitions: list[Record]) -> None:
    tracker, router, _ = make()
    salted = stored([5] * BS, salt=encode_salt(SECRET, "b1", PrefixKey(b"\x04" * 32)))
    tracker.apply(batch(salted))  # born keyed
    tracker.apply(batch(stored([6] * BS, salted.block_hashes[-1])))  # inherits: fast path
    tracker.apply(batch(BlockStored([BlockHash(9201)], None, [1, 2, 3], BS)))  # born unattributed
    tracker.apply(batch(stored(tokens_of(body("P.", "q")))))  # born pending
    assert transitions == []
    assert {b.state for b in tracker._nodes.values()} == set(BlockState)
    check(tracker, router)


# -- random event streams ------------------------------------------------------------------


_TEXTS = [
    encode("<|im_start|>system\nab<|im_end|>\n<|im_start|>user\nhi"),
    encode("<|im_start|>system\nab<|im_end|>\n<|im_start|>user\nho"),
    encode("<|im_start|>system\ncd<|im_end|>\n<|im_start|>user\nhi"),
    encode("<|im_start|>user\na question"),  # NEED_MORE until the turn ends
    encode("plain words, no template"),  # no anchor
]
_SALTS = [
    None,
    None,
    None,
    encode_salt(SECRET, "b1", b"\x05" * 32),
    encode_salt(SECRET, "x", b"\x05" * 32),  # bad MAC: discarded
]


@st.composite
def state_events(draw: st.DrawFn) -> list[tuple[EngineEvent, int]]:
    """Chains of real text grown a block or two at a time, with removals anywhere in a
    chain (pending subtrees cut off), text-less blocks, salted roots and clears."""
    chains_: list[tuple[int, list[int], list[BlockHash]]] = []  # (dp, text, hashes so far)
    out: list[tuple[EngineEvent, int]] = []
    next_hash = 1
    for _ in range(draw(st.integers(1, 40))):
        action = draw(st.sampled_from(["root"] * 2 + ["grow"] * 6 + ["remove"] * 2 + ["odd"]))
        if draw(st.integers(0, 39)) == 0:
            out.append((AllBlocksCleared(), 0))
            chains_.clear()
            continue
        if action == "root" or not chains_:
            dp, text = draw(st.integers(0, 1)), draw(st.sampled_from(_TEXTS))
            n = draw(st.integers(1, 3))
            hashes = [BlockHash(h) for h in range(next_hash, next_hash + n)]
            next_hash += n
            salt = draw(st.sampled_from(_SALTS))
            out.append((BlockStored(hashes, None, text[: n * BS], BS, cache_salt=salt), dp))
            chains_.append((dp, text, hashes))
            continue
        dp, text, hashes = draw(st.sampled_from(chains_))
        if action == "remove":
            h = draw(st.sampled_from(hashes))
            out.append((BlockRemoved([h]), dp))
            continue
        if action == "odd":
            out.append((BlockStored([BlockHash(next_hash)], hashes[-1], [7] * (BS - 1), BS), dp))
            next_hash += 1
            continue
        n = draw(st.integers(1, 2))
        at = len(hashes) * BS
        toks = (text + encode("c" * 64))[at : at + n * BS]
        new = [BlockHash(h) for h in range(next_hash, next_hash + n)]
        next_hash += n
        medium = draw(st.sampled_from([None, None, None, "CPU"]))
        out.append((BlockStored(new, hashes[-1], toks, BS, medium=medium), dp))
        hashes.extend(new)
    return out


class History:
    """What each block's state was, as far as the recorded transitions tell."""

    def __init__(self, log: list[Record]) -> None:
        self._log = log
        self._seen = 0
        self.known: dict[TrackedBlock, BlockState] = {}

    def check(self, tracker: ChainTracker) -> None:
        for b, before, cause, after in self._log[self._seen :]:
            assert TRANSITIONS[before][cause] is after
            if b in self.known:  # else born (in ``before``) since the last check
                assert self.known[b] is before, "state changed outside transition()"
            self.known[b] = after
        self._seen = len(self._log)
        for b in tracker._nodes.values():
            assert type(b.state) is BlockState
            if b in self.known:
                assert b.state is self.known[b], "state changed outside transition()"
            else:
                self.known[b] = b.state


@settings(max_examples=150, deadline=None)
@given(
    events=state_events()
    | chain_events()
    | st.lists(st.tuples(engine_events(), st.integers(0, 1)), max_size=40),
    failures=st.lists(st.sampled_from([None] * 8 + [True, False]), max_size=40),
    # a few regimes each: binding hard, binding sometimes, never binding
    max_tracked=st.sampled_from([1, 6, 20, 1000]),
    max_retained=st.sampled_from([3, 12, 40, 10_000]),
    max_chain=st.sampled_from([4, 13, 64]),
    engine=st.sampled_from(["vllm", "sglang"]),
)
def test_property_states_change_only_as_the_table_allows(
    events: list[tuple[EngineEvent, int]],
    failures: list[bool | None],
    max_tracked: int,
    max_retained: int,
    max_chain: int,
    engine: str,
) -> None:
    """``failures[i]``: the detokenize calls after batch ``i`` fail once (True: retryable)."""

    async def scenario(log: list[Record]) -> None:
        tracker, router, fake = make(
            engine,
            max_tracked_blocks=max_tracked,
            max_retained_tokens=max_retained,
            max_chain_tokens=max_chain,
            max_prefix_length=3,
        )
        history = History(log)
        for i, (ev, dp) in enumerate(events):
            retryable = failures[i] if i < len(failures) else None
            if retryable is not None:
                fake.fail, fake.retryable = 1, retryable
            tracker.apply(batch(ev, dp=dp))
            history.check(tracker)
            check(tracker, router)
            await tracker.idle()
            history.check(tracker)
            check(tracker, router)
        await tracker.aclose()

    with recording_transitions() as log:
        asyncio.run(scenario(log))
