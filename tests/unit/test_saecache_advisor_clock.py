"""The eviction advisor's clock: engine timestamps (any epoch) are taken only within
``max_clock_skew`` of where the server's own clock says the engine's should be; one far
off (a bug, a hostile client) is clamped there and counted, so it cannot poison the
backend's notion of now, its recency order or its sessions."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from listener.saecache.advisor import EvictionAdvisor


class Clock:
    def __init__(self) -> None:
        self.t = 5_000.0  # the server's monotonic clock: another epoch than the engine's

    def __call__(self) -> float:
        return self.t


class _Aborted(Exception):
    pass


class Context:
    async def abort(self, code: grpc.StatusCode, detail: str) -> None:
        raise _Aborted(code, detail)


def ev(kind: Any, h: bytes = b"", **kw: Any) -> pb.BlockEvent:
    return pb.BlockEvent(kind=kind, block_hash=h, **kw)


def inserted(h: bytes, t: float) -> pb.BlockEvent:
    return ev(pb.BLOCK_EVENT_KIND_INSERTED, h, session_id="s1", timestamp=t)


def hit(h: bytes, t: float) -> pb.BlockEvent:
    return ev(pb.BLOCK_EVENT_KIND_HIT, h, session_id="s1", timestamp=t)


def released(h: bytes, t: float) -> pb.BlockEvent:
    return ev(pb.BLOCK_EVENT_KIND_RELEASED, h, timestamp=t)


async def victim(advisor: EvictionAdvisor, timestamp: float = 0.0) -> list[bytes]:
    req = pb.RankVictimsRequest(
        backend="e1", candidate_hashes=[b"A", b"B"], n=1, timestamp=timestamp
    )
    resp = await advisor.RankVictims(req, Context())
    return list(resp.block_hashes)


@pytest.fixture
def setup() -> tuple[EvictionAdvisor, Clock, Any]:
    clock = Clock()
    advisor = EvictionAdvisor(["e1"], clock=clock, max_clock_skew=60.0)
    b = advisor._backend("e1")
    assert b is not None
    start = ev(pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id="s1", timestamp=100.0)
    advisor.apply(b, [start, inserted(b"A", 100.0), inserted(b"B", 100.0)])
    advisor.apply(b, [released(b"A", 100.0), released(b"B", 100.0)])
    return advisor, clock, b


async def test_a_far_future_timestamp_is_clamped_and_counted(setup: Any) -> None:
    advisor, clock, b = setup
    clock.t += 10
    advisor.apply(b, [hit(b"A", 1e15)])  # "now" is 110 on the engine's clock
    clock.t += 40
    advisor.apply(b, [hit(b"B", 150.0)])
    assert b.clamped == 1
    assert b.now == 150.0  # not 1e15
    clock.t += 50
    # A was last used at 110 (clamped), B at 150: A is the older, the victim.
    assert await victim(advisor, 200.0) == [b"A"]
    assert await victim(advisor) == [b"A"]  # the default now is the backend's, unpoisoned


async def test_timestamps_within_the_skew_are_taken_as_sent(setup: Any) -> None:
    advisor, clock, b = setup
    clock.t += 10
    advisor.apply(b, [hit(b"B", 130.0)])  # 20 s ahead of the server's estimate: within 60
    advisor.apply(b, [hit(b"A", 135.0)])
    assert b.clamped == 0 and b.now == 135.0
    assert await victim(advisor, 140.0) == [b"B"]


async def test_a_far_past_timestamp_is_clamped_too(setup: Any) -> None:
    advisor, clock, b = setup
    clock.t += 100
    advisor.apply(b, [hit(b"B", 195.0), hit(b"A", 1.0)])  # A: now (200), not long ago
    assert b.clamped == 1
    assert await victim(advisor, 210.0) == [b"B"]


def test_the_skew_bound_has_a_documented_default() -> None:
    from listener.config import ListenerConfig

    assert ListenerConfig().eviction_advisor_max_clock_skew_s == 60.0
