"""The anti-entropy check: a backend's entries in the router's indexes against its
listener's snapshot (``router.kvindex.anti_entropy``), the snapshot's wire form on both
sides (``EventHub.snapshot``, ``router.ingest.snapshot``), and when a check counts.

What an operator relies on: the divergence reads 0 when the index matches, the exact
number of entries when some are missing or extra (of both kinds of keys), a check taken
while events move is not counted as divergence, and a repair resyncs only after two
divergent checks in a row.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

from bus.events import KvEvent
from listener.sse_server import SseServer
from listener.stream import EventHub
from router.config.models import StorageOffloadingConfig
from router.ingest.snapshot import (
    SnapshotError,
    fetch_snapshot,
    parse_snapshot,
    snapshot_session,
    snapshot_url,
)
from router.kvindex.anti_entropy import AntiEntropy, Position, divergence
from router.kvindex.base import StorageTier
from router.kvindex.memory import InMemoryKvIndex

OFF = StorageOffloadingConfig()
GPU = StorageTier.GPU_HOT


def pk(i: int) -> str:
    return f"{i:064x}"


def ck(i: int) -> str:
    return f"{i:032x}"


def created(backend: str, i: int, chain: bool = False, tier: str = "gpu") -> KvEvent:
    if chain:
        return KvEvent("chain_created", backend, None, 10, tier, None, ck(i))  # type: ignore[arg-type]
    return KvEvent("cache_created", backend, pk(i), 10, tier)  # type: ignore[arg-type]


async def filled(
    prefixes: range, chains: range, backend: str = "b1"
) -> tuple[InMemoryKvIndex, InMemoryKvIndex]:
    index, chain_index = InMemoryKvIndex(1000, 600), InMemoryKvIndex(1000, 600)
    for i in prefixes:
        await index.upsert(pk(i), backend, 10, GPU)
    for i in chains:
        await chain_index.upsert(bytes.fromhex(ck(i)), backend, 10, GPU)
    return index, chain_index


SNAPSHOT = [created("b1", i) for i in range(5)] + [created("b1", i, True) for i in range(7)]


async def test_a_matching_index_has_no_divergence() -> None:
    index, chains = await filled(range(5), range(7))
    await index.upsert(pk(99), "b2", 10, GPU)  # another backend's entries do not count
    d = await divergence(index, chains, "b1", SNAPSHOT, OFF)
    assert d.clean and d.missing == {"prefix": 0, "conversation": 0}


async def test_missing_and_extra_are_counted_per_kind() -> None:
    index, chains = await filled(range(2, 8), range(4))  # lacks 0,1; 5,6,7 extra
    d = await divergence(index, chains, "b1", SNAPSHOT, OFF)
    assert d.missing == {"prefix": 2, "conversation": 3}
    assert d.extra == {"prefix": 3, "conversation": 0}
    assert (d.total_missing, d.total_extra, d.clean) == (5, 3, False)


async def test_storage_entries_are_expected_only_with_offloading() -> None:
    index, chains = await filled(range(0), range(0))
    snap = [created("b1", 1, tier="storage")]
    assert (await divergence(index, chains, "b1", snap, OFF)).clean
    on = StorageOffloadingConfig(enabled=True)
    assert (await divergence(index, chains, "b1", snap, on)).missing["prefix"] == 1


async def test_without_a_chain_index_only_prefixes_count() -> None:
    index, _ = await filled(range(5), range(0))
    d = await divergence(index, None, "b1", SNAPSHOT, OFF)
    assert d.clean and set(d.missing) == {"prefix"}


class Fake:
    """The collaborators: a listener at ``snap_id``, a consumer at ``pos``."""

    def __init__(self, pos: Position | None, snap_id: str = "e-5") -> None:
        self.pos = pos
        self.snap_id = snap_id
        self.fetches = 0
        self.repaired: list[str] = []
        self.fail = False

    async def fetch(self, backend: str) -> tuple[str, list[KvEvent]]:
        self.fetches += 1
        if self.fail:
            raise OSError("refused")
        return self.snap_id, list(SNAPSHOT)

    def position(self, backend: str) -> Position | None:
        return self.pos

    async def repair(self, backend: str) -> None:
        self.repaired.append(backend)


async def checker(fake: Fake, index: Any, chains: Any, repair: bool = True) -> AntiEntropy:
    return AntiEntropy(
        ["b1"],
        index,
        chains,
        OFF,
        fetch=fake.fetch,
        position=fake.position,
        repair=fake.repair if repair else None,
        interval=60,
        attempts=3,
        retry_delay=0,
    )


async def test_a_check_at_the_snapshots_position_settles_and_sets_the_figures() -> None:
    index, chains = await filled(range(5), range(7))
    fake = Fake(Position("e-5", False))
    ae = await checker(fake, index, chains)
    assert await ae.check("b1") == "settled"
    assert ae.last["b1"].clean and ae.checks["b1"]["settled"] == 1
    doc = ae.document()["b1"]
    assert doc == {
        "checks": {"settled": 1, "unsettled": 0, "failed": 0},
        "repairs": 0,
        "divergence": {
            "missing": {"prefix": 0, "conversation": 0},
            "extra": {"prefix": 0, "conversation": 0},
        },
    }


@pytest.mark.parametrize(
    "pos",
    [Position("e-4", False), Position("e-5", True), Position(None, False), None],
    ids=["behind", "applying", "no-id", "no-consumer"],
)
async def test_a_check_while_events_move_is_unsettled_and_keeps_the_figures(
    pos: Position | None,
) -> None:
    index, chains = await filled(range(0), range(0))
    fake = Fake(pos)
    ae = await checker(fake, index, chains)
    assert await ae.check("b1") == "unsettled"
    assert "b1" not in ae.last and ae.checks["b1"]["unsettled"] == 1
    assert not fake.repaired


async def test_a_failed_fetch_is_counted() -> None:
    index, chains = await filled(range(0), range(0))
    fake = Fake(Position("e-5", False))
    fake.fail = True
    ae = await checker(fake, index, chains)
    assert await ae.check("b1") == "failed"
    assert ae.checks["b1"] == {"settled": 0, "unsettled": 0, "failed": 1}


async def test_repair_only_after_two_divergent_checks_in_a_row() -> None:
    index, chains = await filled(range(4), range(7))  # one prefix missing
    fake = Fake(Position("e-5", False))
    ae = await checker(fake, index, chains)
    await ae.check("b1")
    assert ae.last["b1"].total_missing == 1 and not fake.repaired
    await index.upsert(pk(4), "b1", 10, GPU)  # healed by itself: the streak restarts
    await ae.check("b1")
    await index.remove(pk(4), "b1")
    await ae.check("b1")
    assert not fake.repaired
    await ae.check("b1")
    assert fake.repaired == ["b1"] and ae.repairs["b1"] == 1
    # and without repair configured nothing is resynced
    quiet = await checker(fake, index, chains, repair=False)
    for _ in range(3):
        await quiet.check("b1")
    assert fake.repaired == ["b1"] and quiet.last["b1"].total_missing == 1


def test_hub_snapshot_is_the_state_at_its_event_id() -> None:
    hub = EventHub(epoch="abcd")
    state = [created("b1", 1), KvEvent("chain_offloaded", "b1", None, 3, "storage", None, ck(2))]
    hub.add_backend("b1", lambda: state)
    assert hub.snapshot("b1") == ("abcd-0", [state[0], state[1].__class__(
        "chain_created", "b1", None, 3, "storage", None, ck(2)
    )])  # fmt: skip
    hub.publish("b1", created("b1", 1))
    assert hub.snapshot("b1")[0] == "abcd-1"


def wire(backend: str, event_id: Any, events: list[Any]) -> bytes:
    return orjson.dumps({"backend": backend, "event_id": event_id, "events": events})


def test_parse_snapshot_reads_the_listeners_body() -> None:
    body = wire("b1", "e-3", [orjson.loads(ev.to_json()) for ev in SNAPSHOT])
    event_id, events = parse_snapshot(body, "b1")
    assert event_id == "e-3" and events == SNAPSHOT


@pytest.mark.parametrize(
    "raw",
    [
        b"not json",
        b"[]",
        wire("b2", "e-1", []),
        wire("b1", "", []),
        wire("b1", 5, []),
        wire("b1", "e-1", None),  # type: ignore[arg-type]
        wire("b1", "e-1", [1]),
        wire("b1", "e-1", [{"event": "cache_created"}]),
        wire("b1", "e-1", [{"event": "nonsense", "prefix_hash": pk(1)}]),
    ],
)
def test_parse_snapshot_refuses_malformed_bodies(raw: bytes) -> None:
    with pytest.raises(SnapshotError):
        parse_snapshot(raw, "b1")


@given(st.binary(max_size=200))
def test_parse_snapshot_never_raises_anything_else(raw: bytes) -> None:
    try:
        parse_snapshot(raw, "b1")
    except SnapshotError:
        pass


def test_snapshot_url_sits_beside_the_event_stream() -> None:
    assert snapshot_url("http://l:7817/events/sim-1") == "http://l:7817/snapshot/sim-1"
    assert snapshot_url("https://l/x/events/a%20b") == "https://l/x/snapshot/a%20b"
    assert snapshot_url("wss://l:1/events/b") == "https://l:1/snapshot/b"
    for no in (None, "http://l:7817/stream/sim-1", "http://l/events/", "ftp://l/events/b"):
        assert snapshot_url(no) is None


@given(st.text(max_size=60))
def test_snapshot_url_is_total(endpoint: str) -> None:
    url = snapshot_url(endpoint)
    assert url is None or url.startswith(("http://", "https://"))


async def test_fetch_reads_a_large_snapshot_from_the_listeners_server_whole() -> None:
    """Over real HTTP from the listener's own server: thousands of entries arrive in many
    chunks and are read whole; an unknown backend and an oversized body are errors."""
    hub = EventHub(epoch="feed")
    state = [created("b1", i) for i in range(3000)] + [created("b1", i, True) for i in range(3000)]
    hub.add_backend("b1", lambda: state)
    for i in range(4):
        hub.publish("b1", created("b1", i))
    server = SseServer(hub)
    port = await server.start("127.0.0.1", 0)
    session = snapshot_session(10.0)
    try:
        url = f"http://127.0.0.1:{port}/snapshot/b1"
        event_id, events = await fetch_snapshot(session, url, "b1")
        assert event_id == "feed-4" and events == state
        with pytest.raises(SnapshotError, match="HTTP 404"):
            await fetch_snapshot(session, f"http://127.0.0.1:{port}/snapshot/nope", "nope")
        with pytest.raises(SnapshotError, match="larger than"):
            await fetch_snapshot(session, url, "b1", max_bytes=100_000)
    finally:
        await session.close()
        await server.stop()


async def test_reloaded_sources_are_followed_and_earlier_counts_kept() -> None:
    """A reload of ``event_sources`` adds a backend: the next round checks it (no KeyError
    for a backend the checker never saw) and the first backend's counts stay."""
    index, chains = await filled(range(5), range(7))
    fake = Fake(Position("e-5", False))
    ae = await checker(fake, index, chains)
    assert await ae.check("b1") == "settled"
    ae.follow(["b1", "b2"])
    assert ae.backends == ["b1", "b2"]
    assert await ae.check("b2") == "settled"
    assert ae.checks["b1"]["settled"] == 1 and ae.checks["b2"]["settled"] == 1
    assert set(ae.document()) == {"b1", "b2"}
