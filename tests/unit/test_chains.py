"""Chain tracker: chains across batches, removal, tiers, salts, mismatches, limits.

Requests are rendered through ChatML and tokenized with the exact toy tokenizer from
``test_recovery``; keys are checked against the router's ``extract_prefix_key``. After
every step the tracker's derived state is recomputed from scratch (``check_invariants``)
and a model of the router, fed only the emitted events, must equal ``snapshot()``.
"""

from __future__ import annotations

import asyncio
import gc
import itertools
from collections.abc import Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from bus.backoff import NoBackoff
from bus.events import KvEvent
from bus.prefix_key import PrefixKey, extract_prefix_key
from bus.salt import encode_salt
from listener.chains import ChainTracker, TrackedBlock
from listener.engine_events import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
)
from listener.recovery import Attributor, DetokenizeError
from listener.templates import CHATML
from tests.unit.test_recovery import decode, encode, render

SECRET = b"0123456789abcdef-secret"
BS = 4


class FakeDetokenizer:
    """In-process /detokenize with the toy tokenizer; can fail or hold answers."""

    def __init__(self) -> None:
        self.calls = 0
        self.fail = 0
        self.retryable = True
        self.gate: asyncio.Event | None = None
        self.called = asyncio.Event()

    async def detokenize_many(self, seqs: Sequence[Sequence[int]]) -> list[str]:
        self.calls += len(seqs)
        self.called.set()
        if self.gate is not None:
            await self.gate.wait()
        await asyncio.sleep(0)
        if self.fail:
            self.fail -= 1
            raise DetokenizeError("down", status=503 if self.retryable else 400)
        return [decode(list(s)) for s in seqs]


class Router:
    """What a router would believe after applying the emitted events."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []
        self.state: dict[str, tuple[str, int]] = {}

    def __call__(self, ev: KvEvent) -> None:
        self.events.append(ev)
        if ev.event == "cache_cleared":
            self.state.clear()
        elif ev.event == "cache_evicted":
            assert ev.prefix_hash in self.state, "evicted a prefix never announced"
            del self.state[ev.prefix_hash]
        else:
            assert ev.prefix_hash is not None and ev.tier and ev.token_count is not None
            self.state[ev.prefix_hash] = (ev.tier, ev.token_count)

    def kinds(self) -> list[str]:
        return [e.event for e in self.events]


def make(
    engine: str = "vllm", *, detok: bool = True, max_prefix_length: int = 1024, **limits: Any
) -> tuple[ChainTracker, Router, FakeDetokenizer]:
    fake = FakeDetokenizer()
    att = Attributor(
        model="m",
        template=CHATML,
        backend="b1",
        detokenizer=fake if detok else None,  # type: ignore[arg-type]
        max_prefix_length=max_prefix_length,
        salt_secret=SECRET,
    )
    router = Router()
    tracker = ChainTracker("b1", router, att, engine=engine, backoff=NoBackoff(), **limits)  # type: ignore[arg-type]
    return tracker, router, fake


def check(tracker: ChainTracker, router: Router) -> None:
    tracker.check_invariants()
    snap = {e.prefix_hash: (e.tier, e.token_count) for e in tracker.snapshot()}
    assert snap == router.state


def body(system: str | None, user: str) -> dict[str, Any]:
    msgs: list[dict[str, Any]] = [{"role": "user", "content": user}]
    if system is not None:
        msgs.insert(0, {"role": "system", "content": system})
    return {"model": "m", "messages": msgs}


def tokens_of(b: dict[str, Any]) -> list[int]:
    toks = encode(render(b, "chatml"))
    return toks[: len(toks) // BS * BS]


_ids = itertools.count(1)


def stored(
    toks: list[int],
    parent: int | None = None,
    *,
    hashes: list[int] | None = None,
    medium: str | None = None,
    salt: str | None = None,
    bs: int = BS,
) -> BlockStored:
    if hashes is None:
        hashes = [next(_ids) for _ in range(len(toks) // bs)]
    return BlockStored(
        [BlockHash(h) for h in hashes],
        None if parent is None else BlockHash(parent),
        toks,
        bs,
        medium=medium,
        cache_salt=salt,
    )


def batch(*events: EngineEvent, dp: int = 0) -> EventBatch:
    return EventBatch(1.0, list(events), dp)


def key_hex(b: dict[str, Any]) -> str:
    k = extract_prefix_key(b)
    assert k is not None
    return k.hex()


# -- chains and events --------------------------------------------------------------------


async def test_chain_built_across_batches_gets_the_router_key() -> None:
    tracker, router, _ = make()
    req = body("You are a helpful bot.", "hi there")
    toks = tokens_of(req)
    first = stored(toks[:12])
    tracker.apply(batch(first))
    await tracker.idle()
    assert router.events == [] and tracker.stats()["pending_blocks"] == 3
    rest = stored(toks[12:], first.block_hashes[-1])
    tracker.apply(batch(rest))
    await tracker.idle()
    assert router.events == [
        KvEvent("cache_created", "b1", key_hex(req), len(toks), "gpu"),
    ]
    check(tracker, router)
    # The key sits on the block holding <|im_end|>: its ancestors stay pending, the
    # rest is keyed and holds no tokens.
    end_block = encode(render(req, "chatml")).index(2) // BS
    stats = tracker.stats()
    assert stats["pending_blocks"] == end_block
    assert stats["retained_tokens"] == end_block * BS


async def test_same_system_prompt_costs_no_more_detokenize_calls() -> None:
    tracker, router, fake = make()
    a, b = (
        body("Shared rules.", "first question"),
        body("Shared rules.", "another, longer question"),
    )
    ta, tb = tokens_of(a), tokens_of(b)
    ev_a = stored(ta)
    tracker.apply(batch(ev_a))
    await tracker.idle()
    calls = fake.calls
    common = next(i for i in range(0, len(ta), BS) if ta[i : i + BS] != tb[i : i + BS]) // BS
    ev_b = stored(tb[common * BS :], ev_a.block_hashes[common - 1])
    tracker.apply(batch(ev_b))
    await tracker.idle()
    assert fake.calls == calls
    assert key_hex(a) == key_hex(b)
    assert router.events[-1] == KvEvent("cache_created", "b1", key_hex(a), len(tb), "gpu")
    check(tracker, router)


async def test_two_system_prompts_sharing_a_first_block_get_their_own_keys() -> None:
    tracker, router, _ = make()
    a, b = body("Same start, then A.", "q"), body("Same start, then B!", "q")
    ta, tb = tokens_of(a), tokens_of(b)
    ev_a = stored(ta)
    tracker.apply(batch(ev_a))
    common = next(i for i in range(0, len(ta), BS) if ta[i : i + BS] != tb[i : i + BS]) // BS
    assert common >= 1
    tracker.apply(batch(stored(tb[common * BS :], ev_a.block_hashes[common - 1])))
    await tracker.idle()
    assert router.state == {key_hex(a): ("gpu", len(ta)), key_hex(b): ("gpu", len(tb))}
    check(tracker, router)


async def test_restore_is_idempotent_and_removal_evicts_on_the_last_block() -> None:
    tracker, router, _ = make()
    req = body("Rules.", "question")
    ev = stored(tokens_of(req))
    tracker.apply(batch(ev))
    await tracker.idle()
    before = (list(router.events), tracker.stats())
    tracker.apply(batch(ev))  # vLLM 0.33 "full" report mode re-announces hit blocks
    await tracker.idle()
    assert (router.events, tracker.stats()) == before
    hashes = ev.block_hashes
    # The prefix's blocks start at the one holding the anchor's end marker.
    first = encode(render(req, "chatml")).index(2) // BS
    tracker.apply(batch(BlockRemoved(hashes[-1:])))  # tail first, like vLLM
    tracker.apply(batch(BlockRemoved(hashes[first + 1 : -1])))
    assert router.kinds() == ["cache_created"]
    tracker.apply(batch(*(BlockRemoved([h]) for h in reversed(hashes[: first + 1]))))
    assert router.kinds() == ["cache_created", "cache_evicted"]
    assert tracker.stats()["tracked_blocks"] == 0
    check(tracker, router)


async def test_offload_then_evict_and_back_to_gpu() -> None:
    tracker, router, _ = make()
    req = body("Offload me.", "q")
    ev = stored(tokens_of(req))
    tracker.apply(batch(ev))
    await tracker.idle()
    k = key_hex(req)
    depth = len(ev.token_ids)
    cpu = stored(ev.token_ids, hashes=list(ev.block_hashes), medium="CPU")
    tracker.apply(batch(cpu))
    assert router.kinds() == ["cache_created"]  # GPU copies still there
    tracker.apply(batch(BlockRemoved(list(ev.block_hashes), medium="GPU")))
    assert router.events[-1] == KvEvent("cache_offloaded", "b1", k, depth, "storage")
    tracker.apply(batch(stored(ev.token_ids, hashes=list(ev.block_hashes))))
    assert router.events[-1] == KvEvent("cache_created", "b1", k, depth, "gpu")
    tracker.apply(
        batch(BlockRemoved(list(ev.block_hashes)), BlockRemoved(list(ev.block_hashes), "CPU"))
    )
    assert router.kinds()[-1] == "cache_evicted" and router.state == {}
    check(tracker, router)


async def test_namespaces_keep_dp_ranks_and_groups_apart() -> None:
    tracker, router, _ = make()
    req = body("Ranked.", "q")
    ev = stored(tokens_of(req), hashes=[7000 + i for i in range(len(tokens_of(req)) // BS)])
    tracker.apply(batch(ev, dp=0))
    tracker.apply(batch(ev, dp=1))
    await tracker.idle()
    assert tracker.stats()["tracked_blocks"] == 2 * len(ev.block_hashes)
    tracker.apply(batch(BlockRemoved(list(ev.block_hashes)), dp=0))
    assert router.kinds() == ["cache_created"]  # rank 1 still holds it
    tracker.apply(batch(BlockRemoved(list(ev.block_hashes), group_idx=1), dp=1))
    assert router.kinds() == ["cache_created"]  # other group: nothing removed
    check(tracker, router)


async def test_all_blocks_cleared_and_reset() -> None:
    tracker, router, _ = make()
    tracker.apply(batch(stored(tokens_of(body("A.", "q")))))
    await tracker.idle()
    tracker.apply(batch(AllBlocksCleared()))
    assert router.kinds() == ["cache_created", "cache_cleared"]
    assert tracker.stats()["tracked_blocks"] == 0 and tracker.snapshot() == []
    tracker.apply(batch(stored(tokens_of(body("B.", "q")))))
    await tracker.idle()
    n = len(router.events)
    tracker.reset()
    assert len(router.events) == n and tracker.snapshot() == []
    check(tracker, Router())


async def test_cleared_blocks_are_freed_though_a_worker_attributed_them() -> None:
    """An idle attribution worker must not keep the last root it worked on: through the
    parent and children links that root holds its whole tree (with a shared system
    prompt, every chain), which would then outlive a clear or a reset, up to
    ``max_tracked_blocks`` of dead blocks beside the live ones."""

    def blocks_in_memory() -> int:
        gc.collect()
        return sum(1 for o in gc.get_objects() if isinstance(o, TrackedBlock))

    before = blocks_in_memory()  # other tests' (none, unless something else leaks)
    tracker, router, _ = make()
    first = stored(tokens_of(body("Shared rules.", "first question")))
    tracker.apply(batch(first))
    await tracker.idle()
    assert router.kinds() == ["cache_created"]
    assert blocks_in_memory() - before == tracker.stats()["tracked_blocks"] > 0
    tracker.apply(batch(AllBlocksCleared()))
    await tracker.idle()
    assert blocks_in_memory() == before
    await tracker.aclose()


# -- salts ---------------------------------------------------------------------------------


async def test_salt_echo_keys_without_detokenizing_and_bad_mac_discards() -> None:
    tracker, router, fake = make()
    key = PrefixKey(bytes(range(32)))
    good = stored([5] * 8, salt=encode_salt(SECRET, "b1", key))
    tracker.apply(batch(good))
    assert router.events == [KvEvent("cache_created", "b1", key.hex(), 8, "gpu")]
    tracker.apply(batch(stored([6] * 4, good.block_hashes[-1])))
    assert router.events[-1].token_count == 12
    bad = stored([5] * 8, salt=encode_salt(SECRET, "other-backend", key))
    tracker.apply(batch(bad))
    tracker.apply(batch(stored([6] * 4, bad.block_hashes[-1])))  # orphan of the discarded
    await tracker.idle()
    stats = tracker.stats()
    assert stats["salt_failures"] == 1 and stats["orphan_blocks"] == 1
    assert stats["tracked_blocks"] == 3 and fake.calls == 0
    check(tracker, router)


async def test_trtllm_needs_a_salt_and_uses_per_block_counts() -> None:
    tracker, router, _ = make("trtllm", detok=False)
    tracker.apply(batch(stored([1] * 8)))
    assert tracker.stats()["discarded_chains"] == 1 and router.events == []
    key = PrefixKey(b"\x07" * 32)
    hashes = [BlockHash(1), BlockHash(2), BlockHash(3)]
    ev = BlockStored(hashes, None, [9] * 70, 32, cache_salt=encode_salt(SECRET, "b1", key))
    ev.block_token_counts = [32, 32, 6]  # partial last block
    tracker.apply(batch(ev))
    assert router.events == [KvEvent("cache_created", "b1", key.hex(), 70, "gpu")]
    assert tracker.stats()["retained_tokens"] == 0
    check(tracker, router)


# -- block sizes ---------------------------------------------------------------------------


async def test_mismatched_block_is_length_only_and_counted() -> None:
    tracker, router, _ = make("sglang")
    req = body("Sized.", "question")
    ev = stored(tokens_of(req))
    tracker.apply(batch(ev))
    await tracker.idle()
    # Under a keyed chain the mismatched block still extends the prefix (length only).
    tracker.apply(batch(BlockStored([BlockHash(90001)], ev.block_hashes[-1], [1, 2, 3], BS)))
    assert router.events[-1].token_count == len(ev.token_ids) + 3
    # A mismatched root has no text: its chain is unattributed.
    tracker.apply(batch(BlockStored([BlockHash(90002)], None, [1, 2, 3, 4, 5], BS)))
    tracker.apply(batch(BlockStored([BlockHash(90003)], BlockHash(90002), [1, 2, 3, 4], BS)))
    stats = tracker.stats()
    assert stats["mismatches"] == 2 and stats["unattributed_blocks"] == 2
    check(tracker, router)


async def test_vllm_null_blocks_fold_into_the_first_hash() -> None:
    """Sliding window: 3 block spans of tokens but only 2 hashes (the null one skipped)."""
    tracker, router, _ = make("vllm")
    req = body("Windowed.", "q")
    toks = tokens_of(req)
    n = len(toks) // BS
    hashes = [BlockHash(h) for h in range(500, 500 + n - 1)]
    tracker.apply(batch(BlockStored(list(hashes), None, toks, BS)))
    await tracker.idle()
    assert router.events == [KvEvent("cache_created", "b1", key_hex(req), len(toks), "gpu")]
    assert tracker.stats()["mismatches"] == 0
    sg, _, _ = make("sglang")  # SGLang never skips: the same event is a mismatch there
    sg.apply(batch(BlockStored(list(hashes), None, toks, BS)))
    assert sg.stats()["mismatches"] == 1


# -- limits --------------------------------------------------------------------------------


async def test_pruning_removes_single_prefixes_not_the_backend() -> None:
    tracker, router, _ = make(max_tracked_blocks=6)
    keys = [PrefixKey(bytes([i]) * 32) for i in range(4)]
    for k in keys:
        tracker.apply(batch(stored([3] * 8, salt=encode_salt(SECRET, "b1", k))))
        check(tracker, router)
    # 8 blocks stored, 6 kept: the oldest prefix lost both blocks, the next one survives.
    assert set(router.state) == {k.hex() for k in keys[1:]}
    assert router.kinds().count("cache_evicted") == 1
    assert tracker.stats()["pruned_entries"] == 2


async def test_token_budget_prunes_oldest_pending_text_only() -> None:
    tracker, router, _ = make(max_retained_tokens=20)
    salted = stored([3] * 8, salt=encode_salt(SECRET, "b1", PrefixKey(b"\x01" * 32)))
    tracker.apply(batch(salted))
    long_req = body("x" * 60, "q")  # pending: its system turn needs > 20 tokens
    tracker.apply(batch(stored(tokens_of(long_req)[:24])))
    check(tracker, router)
    stats = tracker.stats()
    assert stats["retained_tokens"] <= 20 and stats["pruned_entries"] >= 1
    assert stats["unattributed_blocks"] >= 1
    assert router.state == {(b"\x01" * 32).hex(): ("gpu", 8)}


async def test_chain_longer_than_max_chain_tokens() -> None:
    tracker, router, _ = make(max_chain_tokens=40)
    short = body("Short.", "q")
    long_anchor = body("y" * 200, "q")
    tracker.apply(batch(stored(tokens_of(short) + [1000 + ord("z")] * 60)))
    tracker.apply(batch(stored(tokens_of(long_anchor))))
    await tracker.idle()
    # The short anchor is decided within 40 tokens: the whole chain counts for it.
    assert router.state == {key_hex(short): ("gpu", len(tokens_of(short)) + 60)}
    # The long one never becomes decidable within the cap (max_prefix_length 1024): the
    # block at the cap and everything below it give up; only its ancestors keep text.
    stats = tracker.stats()
    assert stats["unattributed_blocks"] == len(tokens_of(long_anchor)) // BS - 9
    short_pending = encode(render(short, "chatml")).index(2) // BS  # above its key block
    assert stats["pending_blocks"] == 9 + short_pending
    assert stats["retained_tokens"] == stats["pending_blocks"] * BS
    check(tracker, router)


# -- attribution jobs ----------------------------------------------------------------------


async def test_detokenize_failure_is_retried() -> None:
    tracker, router, fake = make()
    fake.fail = 2
    req = body("Retry me.", "q")
    tracker.apply(batch(stored(tokens_of(req))))
    await tracker.idle()
    assert tracker.stats()["detokenize_failures"] == 2
    assert router.state == {key_hex(req): ("gpu", len(tokens_of(req)))}
    check(tracker, router)


async def test_non_retryable_failure_gives_the_chain_up() -> None:
    tracker, router, fake = make()
    fake.fail, fake.retryable = 1, False
    tracker.apply(batch(stored(tokens_of(body("Nope.", "q")))))
    await tracker.idle()
    assert router.events == [] and tracker.stats()["unattributed_chains"] == 1
    check(tracker, router)


async def test_chain_removed_before_its_job_finishes_is_forgotten() -> None:
    tracker, router, fake = make()
    fake.gate = asyncio.Event()
    ev = stored(tokens_of(body("Slow.", "q")))
    tracker.apply(batch(ev))
    await fake.called.wait()
    tracker.apply(batch(BlockRemoved(list(ev.block_hashes))))
    fake.gate.set()
    await tracker.idle()
    assert router.events == [] and tracker.stats()["tracked_blocks"] == 0
    check(tracker, router)
    await tracker.aclose()


async def test_apply_outside_a_loop_queues_work_for_later() -> None:
    tracker, router, _ = make()
    req = body("Later.", "q")
    await asyncio.to_thread(tracker.apply, batch(stored(tokens_of(req))))
    assert router.events == []
    await tracker.idle()
    assert router.state == {key_hex(req): ("gpu", len(tokens_of(req)))}


def test_tracked_blocks_hold_only_their_own_segment() -> None:
    tracker, _, _ = make()
    toks = tokens_of(body("z" * 40, "q"))
    tracker.apply(batch(stored(toks)))
    blocks: list[TrackedBlock] = list(tracker._nodes.values())
    assert all(b.tokens is None or len(b.tokens) == BS for b in blocks)
    assert sorted(b.depth for b in blocks) == list(range(BS, len(toks) + 1, BS))


# -- the memory bound under random event streams ------------------------------------------

_HASHES = st.integers(1, 40).map(BlockHash)


@st.composite
def engine_events(draw: st.DrawFn) -> EngineEvent:
    kind = draw(st.sampled_from(["store", "store", "store", "remove", "clear"]))
    if kind == "remove":
        return BlockRemoved(
            draw(st.lists(_HASHES, max_size=4)), draw(st.sampled_from([None, "CPU"]))
        )
    if kind == "clear":
        return AllBlocksCleared()
    n = draw(st.integers(1, 3))
    size = draw(st.sampled_from([1, 2, 4]))
    text = draw(
        st.sampled_from(
            ["<|im_start|>system\nab<|im_end|>", "<|im_start|>user\nq", "<|im_start|>", "zz"]
        )
    )
    base = encode(text + "c" * 6)
    length = n * size + draw(st.sampled_from([0, 0, 0, 1, size]))
    toks = [base[i % len(base)] for i in range(length)]
    salt = draw(
        st.sampled_from(
            [
                None,
                None,
                encode_salt(SECRET, "b1", b"\x05" * 32),
                encode_salt(SECRET, "x", b"\x05" * 32),
            ]
        )
    )
    return BlockStored(
        draw(st.lists(_HASHES, min_size=n, max_size=n, unique=True)),
        draw(st.none() | _HASHES),
        toks,
        size,
        medium=draw(st.sampled_from([None, "GPU", "CPU"])),
        cache_salt=salt,
    )


@settings(max_examples=150, deadline=None)
@given(
    events=st.lists(st.tuples(engine_events(), st.integers(0, 1)), max_size=40),
    max_tracked=st.integers(1, 12),
    max_retained=st.integers(1, 30),
    max_chain=st.integers(1, 24),
    engine=st.sampled_from(["vllm", "sglang"]),
)
def test_property_memory_bound_and_router_view(
    events: list[tuple[EngineEvent, int]],
    max_tracked: int,
    max_retained: int,
    max_chain: int,
    engine: str,
) -> None:
    async def scenario() -> None:
        tracker, router, _ = make(
            engine,
            max_tracked_blocks=max_tracked,
            max_retained_tokens=max_retained,
            max_chain_tokens=max_chain,
            max_prefix_length=3,
        )
        bound = min(max_retained, max_tracked * max_chain)
        for ev, dp in events:
            tracker.apply(batch(ev, dp=dp))
            assert tracker.stats()["retained_tokens"] <= bound
            check(tracker, router)
            await tracker.idle()
            check(tracker, router)
        await tracker.aclose()

    asyncio.run(scenario())


@st.composite
def chain_events(draw: st.DrawFn) -> list[tuple[EngineEvent, int]]:
    """Chains grown a block at a time (the ``_extend`` shape), with salted, unsalted and
    badly salted roots, other media, wrong-size blocks and removals mixed in."""
    salts = [
        None,
        encode_salt(SECRET, "b1", b"\x05" * 32),
        encode_salt(SECRET, "b1", b"\x06" * 32),
        encode_salt(SECRET, "x", b"\x05" * 32),
    ]
    tips: list[tuple[int, BlockHash] | None] = []  # per chain: (dp, last hash)
    out: list[tuple[EngineEvent, int]] = []
    next_hash = itertools.count(1)
    for _ in range(draw(st.integers(1, 60))):
        action = draw(st.sampled_from(["grow"] * 6 + ["root", "remove", "odd"]))
        live = [i for i, t in enumerate(tips) if t is not None]
        if action == "root" or not live:
            dp, h = draw(st.integers(0, 1)), BlockHash(next(next_hash))
            salt = draw(st.sampled_from(salts))
            out.append((BlockStored([h], None, [1] * BS, BS, cache_salt=salt), dp))
            tips.append((dp, h))
            continue
        i = draw(st.sampled_from(live))
        tip = tips[i]
        assert tip is not None
        dp, parent = tip
        if action == "remove":
            out.append((BlockRemoved([parent], draw(st.sampled_from([None, "CPU"]))), dp))
            tips[i] = None
            continue
        h = BlockHash(next(next_hash))
        medium = draw(st.sampled_from([None, None, "GPU", "gpu", "CPU"]))
        size = BS if action == "grow" else draw(st.sampled_from([BS - 1, 2 * BS]))
        out.append((BlockStored([h], parent, [2] * size, BS, medium=medium), dp))
        tips[i] = (dp, h)
    return out


@settings(max_examples=150, deadline=None)
@given(
    events=chain_events() | st.lists(st.tuples(engine_events(), st.integers(0, 1)), max_size=40),
    max_tracked=st.integers(1, 40),
    engine=st.sampled_from(["vllm", "sglang"]),
)
def test_property_fast_path_changes_nothing_observable(
    events: list[tuple[EngineEvent, int]], max_tracked: int, engine: str
) -> None:
    """``_extend`` (one block under a keyed parent) is only a shortcut: with it switched
    off the tracker emits the same events and reports the same counters."""

    async def run(fast: bool) -> tuple[list[KvEvent], dict[str, int], list[Any]]:
        tracker, router, _ = make(engine, max_tracked_blocks=max_tracked, max_prefix_length=3)
        if not fast:
            tracker._extend = lambda dp, ev: False  # type: ignore[method-assign]
        for ev, dp in events:
            tracker.apply(batch(ev, dp=dp))
            await tracker.idle()
        tracker.check_invariants()
        await tracker.aclose()
        pruning_order = [b.key for b in tracker._policy._all]  # type: ignore[attr-defined]
        return router.events, tracker.stats(), pruning_order

    async def scenario() -> None:
        assert await run(True) == await run(False)

    asyncio.run(scenario())


@settings(max_examples=100, deadline=None)
@given(events=st.lists(st.tuples(engine_events(), st.integers(0, 1)), max_size=40))
def test_property_deferred_flush_reaches_the_same_state(
    events: list[tuple[EngineEvent, int]],
) -> None:
    """Batches applied with ``flush=False`` and then one ``flush`` leave subscribers with
    the state a flush per batch gives, in fewer events (never more)."""

    async def scenario() -> None:
        each, r_each, _ = make(detok=False, max_tracked_blocks=8)
        deferred, r_deferred, _ = make(detok=False, max_tracked_blocks=8)
        for ev, dp in events:
            each.apply(batch(ev, dp=dp))
            deferred.apply(batch(ev, dp=dp), flush=False)
        deferred.flush()
        check(deferred, r_deferred)
        assert r_deferred.state == r_each.state
        assert len(r_deferred.events) <= len(r_each.events)

    asyncio.run(scenario())


def test_deferred_flush_announces_a_backlog_once() -> None:
    tracker, router, _ = make(detok=False)
    salt = encode_salt(SECRET, "b1", b"\x07" * 32)
    tracker.apply(batch(stored([1] * BS, hashes=[100], salt=salt)), flush=False)
    for h in range(101, 110):
        tracker.apply(batch(stored([2] * BS, h - 1, hashes=[h])), flush=False)
    assert router.events == []
    tracker.flush()
    assert [(e.event, e.token_count) for e in router.events] == [("cache_created", 10 * BS)]
    check(tracker, router)
