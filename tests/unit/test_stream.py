"""EventHub: ids, fan-out, resumption from the ring, resync blocks, overflow, races."""

from __future__ import annotations

import asyncio
import random

import orjson
import pytest

from bus.events import KvEvent
from bus.sse import SseParser, encode_record
from listener.stream import (
    EventHub,
    HubRecord,
    Subscription,
    UnknownBackendError,
    parse_event_id,
)

B = "vllm-1"
EPOCH = "e0e0e0e0"


def created(i: int, backend: str = B) -> KvEvent:
    return KvEvent("cache_created", backend, f"{i:064x}", token_count=16 * i, tier="gpu")


def evicted(i: int, backend: str = B) -> KvEvent:
    return KvEvent("cache_evicted", backend, f"{i:064x}")


def hub(history: int = 100, queue: int = 100, **kw: object) -> EventHub:
    return EventHub(history, queue, backends=[B, "other"], epoch=EPOCH, **kw)


def seqs(records: list[HubRecord]) -> list[int]:
    out = []
    for r in records:
        parsed = parse_event_id(r.id)
        assert parsed is not None and parsed[0] == EPOCH, r.id
        out.append(parsed[1])
    return out


def payload(r: HubRecord) -> dict[str, object]:
    return orjson.loads(r.data)


def resumed(h: EventHub, last: str | None, snapshot: list[KvEvent] | None = None) -> Subscription:
    return h.subscribe(B, last, (lambda: snapshot) if snapshot is not None else None)


# -- ids and encoding ------------------------------------------------------------------------


def test_default_epoch_is_8_hex_and_differs_per_hub() -> None:
    a, b = EventHub(), EventHub()
    for h in (a, b):
        assert len(h.epoch) == 8 and int(h.epoch, 16) >= 0
    assert a.epoch != b.epoch


def test_publish_assigns_rising_ids_and_encodes_once() -> None:
    h = hub()
    ids = [h.publish(B, created(i)) for i in range(1, 4)]
    assert ids == [f"{EPOCH}-1", f"{EPOCH}-2", f"{EPOCH}-3"]
    assert h.publish("other", created(1, "other")) == f"{EPOCH}-1"  # per backend
    assert h.last_event_id(B) == f"{EPOCH}-3"
    sub = resumed(h, f"{EPOCH}-0")
    recs = sub.ready()
    assert seqs(recs) == [1, 2, 3]
    ev = created(1)
    assert recs[0].sse == encode_record(ev.to_json(), event="cache_created", id=f"{EPOCH}-1")
    assert recs[0].data == ev.to_json() and recs[0].event == "cache_created"


def test_publish_checks_backend() -> None:
    h = hub()
    with pytest.raises(UnknownBackendError):
        h.publish("nope", created(1, "nope"))
    with pytest.raises(ValueError, match="published on"):
        h.publish(B, created(1, "other"))
    with pytest.raises(UnknownBackendError):
        h.subscribe("nope")


@pytest.mark.parametrize(
    ("value", "parsed"),
    [
        ("abc-12", ("abc", 12)),
        ("a-b-3", ("a-b", 3)),
        ("e.s4-2", ("e.s4", 2)),
        ("abc", None),
        ("-3", None),
        ("abc-", None),
        ("abc-x", None),
    ],
)
def test_parse_event_id(value: str, parsed: tuple[str, int] | None) -> None:
    assert parse_event_id(value) == parsed


# -- live fan-out ----------------------------------------------------------------------------


async def test_live_fan_out_shares_bytes_and_order() -> None:
    h = hub()
    subs = [resumed(h, f"{EPOCH}-0") for _ in range(3)]
    for i in range(1, 6):
        h.publish(B, created(i))
    got = [await s.batch() for s in subs]
    for recs in got:
        assert seqs(recs) == [1, 2, 3, 4, 5]
    for a, b in zip(got[0], got[1], strict=True):
        assert a.sse is b.sse  # encoded once, shared
    assert h.stats()["backends"][B]["subscribers"] == 3


async def test_batch_waits_and_is_cancel_safe() -> None:
    h = hub()
    sub = resumed(h, f"{EPOCH}-0")
    waiting = asyncio.ensure_future(sub.batch())
    await asyncio.sleep(0)
    assert not waiting.done()
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    h.publish(B, created(1))
    assert seqs(await sub.batch()) == [1]
    task = asyncio.ensure_future(sub.batch())
    await asyncio.sleep(0)
    h.publish(B, created(2))
    assert seqs(await task) == [2]


async def test_async_iteration_and_close() -> None:
    h = hub()
    sub = resumed(h, f"{EPOCH}-0")
    h.publish(B, created(1))
    it = aiter(sub)
    assert seqs([await anext(it)]) == [1]
    sub.close()
    assert sub.close_reason == "closed"
    with pytest.raises(StopAsyncIteration):
        await anext(it)
    assert h.stats()["backends"][B]["subscribers"] == 0
    h.publish(B, created(2))  # a closed subscriber gets nothing and costs nothing
    sub.close()  # idempotent


# -- resumption ------------------------------------------------------------------------------


async def test_resume_within_ring_replays_then_goes_live() -> None:
    h = hub()
    for i in range(1, 11):
        h.publish(B, created(i))
    sub = resumed(h, f"{EPOCH}-4")
    h.publish(B, created(11))
    recs = sub.ready(1000)
    assert seqs(recs) == list(range(5, 12))  # no duplicate of 4, no gap before 11
    assert [payload(r)["prefix_hash"] for r in recs] == [f"{i:064x}" for i in range(5, 12)]
    at_head = resumed(h, f"{EPOCH}-11")
    assert at_head.ready() == []
    h.publish(B, created(12))
    assert seqs(at_head.ready()) == [12]


async def test_resume_at_the_oldest_boundary() -> None:
    h = hub(history=5)
    for i in range(1, 11):
        h.publish(B, created(i))
    assert h.stats()["backends"][B]["oldest_seq"] == 6
    assert seqs(resumed(h, f"{EPOCH}-5").ready()) == [6, 7, 8, 9, 10]  # just in range
    sub = resumed(h, f"{EPOCH}-4", [created(9)])  # record 5 is gone
    recs = sub.ready()
    assert [r.event for r in recs] == ["resync", "cache_created"]
    assert payload(recs[0])["reason"] == "history_expired"


@pytest.mark.parametrize(
    ("last", "reason"),
    [
        (None, "no_event_id"),
        ("", "no_event_id"),
        ("garbage", "invalid_event_id"),
        ("deadbeef-3", "unknown_epoch"),
        (f"{EPOCH}-99", "unknown_event_id"),
    ],
)
async def test_unresumable_ids_get_resync_and_snapshot(last: str | None, reason: str) -> None:
    h = hub()
    for i in range(1, 4):
        h.publish(B, created(i))
    h.publish(B, evicted(2))
    snap = [created(1), created(3)]
    sub = resumed(h, last, snap)
    recs = sub.ready()
    assert [r.event for r in recs] == ["resync", "cache_created", "cache_created"]
    assert payload(recs[0]) == {
        "event": "resync",
        "backend": B,
        "reason": reason,
        "snapshot_size": 2,
    }
    assert [r.data for r in recs[1:]] == [e.to_json() for e in snap]
    # Every record has a fresh, non-empty id; only the last one is resumable, at seq 4.
    assert len({r.id for r in recs}) == 3 and all(recs)
    assert recs[-1].id == f"{EPOCH}-4"
    for r in recs[:-1]:
        epoch, _ = parse_event_id(r.id) or ("", 0)
        assert epoch == f"{EPOCH}.s4"
    h.publish(B, created(5))
    assert seqs(sub.ready()) == [5]  # live continues right after the snapshot's position


async def test_empty_snapshot_resync_record_carries_the_position() -> None:
    h = hub()
    h.publish(B, created(1))
    recs = resumed(h, None).ready()  # no provider registered: empty snapshot
    assert [(r.event, r.id) for r in recs] == [("resync", f"{EPOCH}-1")]


async def test_registered_snapshot_provider_is_used_and_overridable() -> None:
    h = hub()
    calls: list[int] = []

    def provider() -> list[KvEvent]:
        calls.append(1)
        return [created(7)]

    h.add_backend(B, provider)
    assert [r.event for r in h.subscribe(B).ready()] == ["resync", "cache_created"]
    assert calls == [1]
    assert [r.event for r in h.subscribe(B, None, lambda: []).ready()] == ["resync"]
    assert calls == [1]
    h.subscribe(B, f"{EPOCH}-0")  # resumable: no snapshot taken
    assert calls == [1]


async def test_dropping_mid_block_gives_a_new_block_and_finishing_it_resumes_live() -> None:
    h = hub()
    for i in range(1, 4):
        h.publish(B, created(i))
    snap = [created(1), created(2), created(3)]
    first = resumed(h, None, snap).ready(2)  # resync + one snapshot record, then drop
    again = resumed(h, first[-1].id, snap).ready()
    assert [r.event for r in again] == ["resync"] + ["cache_created"] * 3
    assert payload(again[0])["reason"] == "unknown_epoch"
    # Block ids depend only on the position: the same position gives the same ids.
    assert [r.id for r in again[:2]] == [r.id for r in first]
    assert [r.id for r in again] == [
        f"{EPOCH}.s3-1",
        f"{EPOCH}.s3-2",
        f"{EPOCH}.s3-3",
        f"{EPOCH}-3",
    ]
    h.publish(B, created(4))
    after = resumed(h, again[-1].id, snap).ready()  # finished the block: plain resume
    assert seqs(after) == [4]


async def test_shared_resync_is_published_in_sequence() -> None:
    h = hub()
    live = resumed(h, f"{EPOCH}-0")
    h.publish(B, created(1))
    rid = h.resync(B, "restart", [created(9)])
    assert rid == f"{EPOCH}-2"
    recs = live.ready()
    assert [(r.event, r.id) for r in recs] == [
        ("cache_created", f"{EPOCH}-1"),
        ("resync", f"{EPOCH}-2"),
        ("cache_created", f"{EPOCH}-3"),
    ]
    assert payload(recs[1]) == {
        "event": "resync",
        "backend": B,
        "reason": "restart",
        "snapshot_size": 1,
    }
    assert seqs(resumed(h, f"{EPOCH}-1").ready()) == [2, 3]  # replayable like any event
    st = h.stats()["backends"][B]
    assert (st["resyncs_published"], st["published"]) == (1, 3)


# -- overflow --------------------------------------------------------------------------------


async def test_overflow_closes_with_an_explicit_error_record_and_is_counted() -> None:
    h = hub(queue=3)
    slow = resumed(h, f"{EPOCH}-0")
    fast = resumed(h, f"{EPOCH}-0")
    for i in range(1, 6):
        h.publish(B, created(i))
        fast.ready()
    recs = await slow.batch(100)
    assert seqs(recs[:3]) == [1, 2, 3]  # what was queued is still delivered, in order
    err = recs[3]
    assert (err.event, err.id) == ("error", "")
    body = payload(err)
    assert body["error"] == "buffer_overflow" and body["backend"] == B
    assert "3 events" in str(body["detail"])
    assert await slow.batch() == []  # then the stream ends
    assert slow.close_reason == "buffer_overflow" and slow.finished
    # The SSE form: an error record without an id, so the reader keeps its last id.
    parser = SseParser()
    parsed = parser.feed(b"".join(r.sse for r in recs))
    assert [(p.event, p.id) for p in parsed][-2:] == [
        ("cache_created", f"{EPOCH}-3"),
        ("error", f"{EPOCH}-3"),
    ]
    st = h.stats()["backends"][B]
    assert (st["overflows"], st["subscribers"]) == (1, 1)  # the fast one is untouched
    h.publish(B, created(6))
    assert seqs(fast.ready()) == [6]
    # The slow reader resumes from its last id and loses nothing.
    assert seqs(resumed(h, parsed[-1].id).ready()) == [4, 5, 6]


async def test_backlog_does_not_count_against_the_queue() -> None:
    h = hub(history=50, queue=2)
    for i in range(1, 21):
        h.publish(B, created(i))
    sub = resumed(h, f"{EPOCH}-0")  # 20 replayed records > queue of 2
    h.publish(B, created(21))
    assert seqs(sub.ready(100)) == list(range(1, 22))
    assert sub.close_reason is None


async def test_hub_close_ends_streams_after_their_queue() -> None:
    h = hub()
    sub = resumed(h, f"{EPOCH}-0")
    h.publish(B, created(1))
    h.close()
    assert seqs(await sub.batch()) == [1]
    assert await sub.batch() == []
    assert sub.close_reason == "shutdown"
    late = resumed(h, f"{EPOCH}-1")
    assert await late.batch() == [] and late.close_reason == "shutdown"


# -- concurrency -----------------------------------------------------------------------------


async def test_resumes_racing_with_publishes_see_no_gap_and_no_duplicate() -> None:
    """Publishers and readers interleave at every await; readers drop, overflow, fall out of
    the ring and resume at random points, from live ids and from ids inside resync blocks.
    Each reader must see, per connection, a contiguous run of seqs starting right after
    its resume id (or a resync block, then a contiguous run)."""
    rng = random.Random(7)
    overflows: list[int] = []
    h = hub(history=64, queue=32)
    total = 3000
    snapshot = [created(0)]
    h.add_backend(B, lambda: snapshot)

    async def publisher() -> None:
        for i in range(1, total + 1):
            h.publish(B, created(i) if i % 7 else evicted(i - 3))
            if rng.random() < 0.3:
                await asyncio.sleep(0)

    async def reader(n: int) -> int:
        last: str | None = None if n % 2 else f"{EPOCH}-0"
        connections = 0
        while True:
            connections += 1
            sub = h.subscribe(B, last)
            expect: int | None = None
            parsed = parse_event_id(last) if last else None
            if parsed and parsed[0] == EPOCH:
                expect = parsed[1] + 1
            budget = rng.randint(1, 400)
            while budget > 0:
                recs = await sub.batch(rng.randint(1, 50))
                if not recs:
                    break
                for r in recs:
                    budget -= 1
                    if r.event == "error":
                        overflows.append(n)
                        assert r.id == "" and r is recs[-1]
                        break
                    if r.event == "resync":
                        expect = None  # a resync block starts the position over
                    p = parse_event_id(r.id)
                    assert p is not None
                    if p[0] == EPOCH:
                        if expect is not None:
                            assert p[1] == expect, (n, connections, r.id, expect)
                        expect = p[1] + 1
                    else:  # inside a resync block
                        assert r.event in ("resync", "cache_created")
                    last = r.id
                if expect is not None and expect > total:
                    break
                pause = rng.randint(0, 40) if n < 2 else rng.randint(0, 1)  # two slow readers
                for _ in range(pause):
                    await asyncio.sleep(0)
            sub.close()
            if expect is not None and expect > total:
                return connections
            for _ in range(rng.choice((0, 0, 0, 100))):  # sometimes fall out of the ring
                await asyncio.sleep(0)

    pub = asyncio.ensure_future(publisher())
    counts = await asyncio.gather(*(reader(n) for n in range(8)))
    await pub
    assert all(c >= 1 for c in counts)
    st = h.stats()["backends"][B]
    assert st["seq"] == total and st["subscribers"] == 0
    # Every path was taken: ring resumes, resync blocks (no id, expired), overflows.
    assert st["resync_blocks"] > 8 and st["overflows"] >= len(overflows) > 0


async def test_snapshot_is_normalised_to_cache_created_of_the_backend() -> None:
    h = hub()
    off = KvEvent("cache_offloaded", B, f"{2:064x}", token_count=32)
    stray = [created(3, "other"), evicted(4), KvEvent("cache_cleared", B)]
    recs = resumed(h, None, [created(1), off, *stray]).ready()
    assert [r.event for r in recs] == ["resync", "cache_created", "cache_created"]
    assert payload(recs[2]) == {
        "event": "cache_created",
        "backend": B,
        "prefix_hash": f"{2:064x}",
        "token_count": 32,
        "tier": "storage",
    }
    assert recs[-1].id == f"{EPOCH}-0"


async def test_snapshot_carries_chain_keys_as_chain_created() -> None:
    h = hub()
    key = "ab" * 16
    gpu = KvEvent("chain_created", B, token_count=300, tier="gpu", chain_key=key)
    off = KvEvent("chain_offloaded", B, token_count=600, tier="storage", chain_key="cd" * 16)
    stray = [KvEvent("chain_evicted", B, chain_key=key)]
    recs = resumed(h, None, [created(1), gpu, off, *stray]).ready()
    assert [r.event for r in recs] == ["resync", "cache_created", "chain_created", "chain_created"]
    assert payload(recs[3]) == {
        "event": "chain_created",
        "backend": B,
        "chain_key": "cd" * 16,
        "token_count": 600,
        "tier": "storage",
    }
    assert KvEvent.from_json(recs[2].data) == gpu
