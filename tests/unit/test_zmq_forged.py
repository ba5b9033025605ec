"""A ZMQ source against messages its engine never published, and against resyncs that
forget the position, on real sockets with a fake vLLM publisher (``test_zmq_source``).

Anything that can reach the SUB socket can publish under any sequence number. With a
replay endpoint the engine's own buffer is the judge: a number from the future (the
engine never published the batch before it) or below a batch the engine still holds
unchanged is dropped and counted (``forged_frames``), and the position does not move, so
the real batches that follow are neither taken for a gap nor for a restart. A gap is
replayed from the last batch delivered, so an engine restarted behind a partition that
already ran past that number is told apart by its payload. After any resync that forgets
the position, the engine's buffer is learned again, by the next live batch or, for an
engine that publishes nothing, by the idle replay, and the consumer catches up on it at
once (``on_drained``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import zmq.asyncio

from harness.procs import free_port
from listener.zmq_source import ZmqSource, ZmqSourceConfig
from tests.unit.test_zmq_source import (
    FakeEngine,
    Recorder,
    SyncRecorder,
    _engine_at,
    batch_payload,
    engine_factory,
    eventually,
    running,
    zctx,
)

__all__ = ["engine_factory", "zctx"]  # the fixtures, used by name


def _replaying(
    engine_factory: Callable[..., FakeEngine], **engine: Any
) -> tuple[FakeEngine, Recorder, ZmqSource]:
    fake = engine_factory(**engine)
    rec = Recorder()
    cfg = ZmqSourceConfig(endpoint=fake.bind(), replay_endpoint=fake.bind_replay())
    return fake, rec, rec.source(cfg)


async def _forge(engine: FakeEngine, seq: int, payload: bytes | None = None) -> None:
    """A message on the engine's PUB that the engine did not publish (not in its buffer)."""
    data = batch_payload(seq, ts=1.0) if payload is None else payload
    await engine.pub.send_multipart([engine.topic, seq.to_bytes(8, "big"), data])


async def test_a_number_from_the_future_is_dropped_and_the_position_kept(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine, rec, source = _replaying(engine_factory)
    async with running(source):
        await engine.subscribed()
        for _ in range(3):
            await engine.publish()  # 0, 1, 2
        await eventually(lambda: rec.seqs() == [0, 1, 2])
        await _forge(engine, 1 << 62)  # a valid batch under a number far ahead
        await eventually(lambda: source.stats.forged_frames == 1)
        assert source.last_seq == 2
        await engine.publish()  # 3: in order, not a restart
        await eventually(lambda: rec.seqs() == [0, 1, 2, 3])
    assert not [i for i in rec.items if i[0] == "resync"]
    st = source.stats
    assert (st.gaps, st.restarts, st.resyncs, st.forged_frames) == (1, 0, 0, 1)
    assert engine.replay_requests == [2]  # asked from the last batch delivered


async def test_a_lower_number_under_an_engine_that_holds_its_batch_is_not_a_restart(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """Batch 0 forged after 0..2: without the check it read as a restart, reset the
    backend, and the engine's own batch 0 was never learned again (the next live batch
    was a gap from the forged 0, replayed from 1)."""
    engine, rec, source = _replaying(engine_factory)
    async with running(source):
        await engine.subscribed()
        for _ in range(3):
            await engine.publish()
        await eventually(lambda: rec.seqs() == [0, 1, 2])
        await _forge(engine, 0)
        await _forge(engine, 2)  # the position's own number, another payload
        await eventually(lambda: source.stats.forged_frames == 2)
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs() == [0, 1, 2, 3])
    assert not [i for i in rec.items if i[0] == "resync"]
    assert (source.stats.restarts, source.last_seq) == (0, 3)


async def test_a_gap_across_a_restart_that_ran_past_the_position_is_a_restart(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """The engine restarted unseen (a partition) and published more batches than the
    listener had seen: its sequence never fell below the position. The replay from the
    last batch delivered returns another payload under that number: a restart, and the
    new engine's buffer is learned from 0, not from the old position on."""
    engine, rec, source = _replaying(engine_factory)
    async with running(source):
        await engine.subscribed()
        for _ in range(2):
            await engine.publish()  # 0, 1
        await eventually(lambda: rec.seqs() == [0, 1])
        engine.restart()
        for _ in range(4):
            await engine.publish(live=False)  # the new 0..3, unseen
        await engine.publish()  # new 4: looks like a gap after 1
        await eventually(lambda: len(rec.seqs()) == 7)
    assert rec.items == [
        ("batch", 0, 0),
        ("batch", 1, 0),
        ("resync", "restart"),
        *(("batch", s, 0) for s in range(5)),
    ]
    assert engine.replay_requests == [1, 0]
    assert (source.stats.restarts, source.stats.forged_frames) == (1, 0)


async def test_after_the_restart_probe_an_idle_engine_is_learned_and_drained(
    zctx: zmq.asyncio.Context,
) -> None:
    """The probe finds a restarted engine that published behind the listener's back
    (batches only in its buffer) and then nothing: the idle replay is armed again by the
    probe's resync, fetches them, and the consumer is told (``on_drained``) without any
    live batch."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    rec = SyncRecorder()
    cfg = ZmqSourceConfig(
        endpoint=pub, replay_endpoint=replay, replay_timeout_s=2.0, idle_replay_after_s=0.2
    )
    source = rec.source(cfg)
    first = await _engine_at(zctx, pub, replay, [])
    second: FakeEngine | None = None
    try:
        async with running(source):
            await first.subscribed()
            for _ in range(3):
                await first.publish()
            await eventually(lambda: rec.seqs() == [0, 1, 2])
            await first.close()
            await eventually(lambda: source.stats.disconnects >= 1)
            second = await _engine_at(zctx, pub, replay, [])
            second.instance = 1
            await second.publish(live=False)  # the new 0 and 1, in its buffer only
            await second.publish(live=False)
            await eventually(lambda: ("resync", "restart") in rec.items)
            await eventually(lambda: rec.seqs() == [0, 1, 2, 0, 1])
            await eventually(lambda: bool(rec.drained) and rec.drained[-1] == 5)
    finally:
        if second is not None:
            await second.close()
    assert source.stats.idle_replays >= 1
    assert rec.items[3] == ("resync", "restart")


async def test_a_resync_for_a_lost_gap_learns_the_engines_buffer_again(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """A gap whose replay fails (the engine's bounded buffer no longer reaches the
    position) resyncs, forgetting what the backend held, and then learns the buffer from
    wherever it starts: the batches it still holds are known again."""
    engine, rec, source = _replaying(engine_factory, buffer_steps=3)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await eventually(lambda: rec.seqs() == [0])
        for _ in range(4):
            await engine.publish(live=False)  # 1..4; the buffer keeps 2, 3, 4
        await engine.publish()  # 5
        await eventually(lambda: rec.seqs()[-1:] == [5])
        await asyncio.sleep(0)
    assert rec.items == [
        ("batch", 0, 0),
        ("resync", "gap"),
        ("batch", 3, 0),
        ("batch", 4, 0),
        ("batch", 5, 0),
    ]


async def test_an_idle_replay_at_the_start_is_drained_without_a_live_batch(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """A listener restarted beside an engine that publishes nothing learns its buffer by
    the idle replay; the consumer defers work per batch until ``on_drained`` (the
    listener's tracker keys chains and publishes there), so without that call the
    replayed blocks reached no subscriber until the engine's next live batch, which may
    never come: the whole backend read as lost."""
    engine = engine_factory()
    for _ in range(3):
        await engine.publish(live=False)  # before the listener started
    rec = SyncRecorder()
    cfg = ZmqSourceConfig(
        endpoint=engine.bind(), replay_endpoint=engine.bind_replay(), idle_replay_after_s=0.2
    )
    source = rec.source(cfg)
    async with running(source):
        await engine.subscribed()
        await eventually(lambda: rec.seqs() == [0, 1, 2])
        await eventually(lambda: rec.drained == [3])
    assert source.stats.idle_replays == 1 and source.stats.frames == 0
