"""A ZMQ source resuming after a checkpoint's batch (``ZmqSource.resume``), against a fake
vLLM publisher on real sockets: replay from the checkpoint on, verified by the batch's
digest; what the bounded buffer lost is reported (``on_gap``), never a resync to empty;
an engine that restarted meanwhile (seq below the checkpoint's, or another batch at its
seq) drops the checkpoint's view."""

from __future__ import annotations

from collections.abc import Callable

from listener.checkpoint import payload_digest
from listener.zmq_source import ZmqSource, ZmqSourceConfig
from tests.unit.test_zmq_source import (
    FakeEngine,
    Recorder,
    batch_payload,
    engine_factory,
    eventually,
    running,
    zctx,
)

__all__ = ["engine_factory", "zctx"]  # the fixtures, used by name


def resumed(
    rec: Recorder, cfg: ZmqSourceConfig, seq: int, digest: bytes | None, gaps: list[int]
) -> ZmqSource:
    source = rec.source(cfg)
    source.resume(seq, digest, gaps.append)
    return source


async def offline(engine: FakeEngine, n: int) -> None:
    """Batches published while no listener ran (they reach only the replay buffer)."""
    for _ in range(n):
        await engine.publish(live=False)


async def test_resume_is_verified_and_replays_what_followed(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    cfg = ZmqSourceConfig(endpoint=engine.bind(), replay_endpoint=engine.bind_replay())
    await offline(engine, 5)  # 0..4; the checkpoint was taken after 2
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 2, payload_digest(batch_payload(2)), gaps)
    assert source.position() == (2, payload_digest(batch_payload(2)))
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 5
        await eventually(lambda: rec.seqs()[-1:] == [5])
    assert engine.replay_requests == [2]
    assert rec.items == [("batch", s, 0) for s in (3, 4, 5)]
    st = source.stats
    assert (st.resumes, st.resumes_verified, st.gap_batches, st.resyncs) == (1, 1, 0, 0)
    assert gaps == []
    assert source.position() == (5, payload_digest(batch_payload(5)))


async def test_a_short_buffer_loses_batches_reported_without_a_resync(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory(buffer_steps=2)
    cfg = ZmqSourceConfig(endpoint=engine.bind(), replay_endpoint=engine.bind_replay())
    await offline(engine, 6)  # 0..5; the checkpoint has 1
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 1, payload_digest(batch_payload(1)), gaps)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 6; the buffer keeps 5 and 6
        await eventually(lambda: rec.seqs()[-1:] == [6])
    assert rec.items == [("batch", s, 0) for s in (5, 6)]  # no resync: the view is kept
    assert gaps == [3]  # 2, 3 and 4
    st = source.stats
    assert (st.resumes_verified, st.gap_batches, st.resyncs) == (0, 3, 0)


async def test_without_replay_the_missed_batches_are_reported(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    cfg = ZmqSourceConfig(endpoint=engine.bind())
    await offline(engine, 4)  # 0..3; the checkpoint has 0
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 0, None, gaps)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 4
        await engine.publish()  # 5
        await eventually(lambda: rec.seqs()[-1:] == [5])
    assert rec.items == [("batch", 4, 0), ("batch", 5, 0)]
    assert gaps == [3]
    assert (source.stats.gap_batches, source.stats.resyncs) == (3, 0)


async def test_the_next_batch_continues_once_the_engine_is_verified(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    cfg = ZmqSourceConfig(endpoint=engine.bind(), replay_endpoint=engine.bind_replay())
    await offline(engine, 3)  # 0..2; the checkpoint has 2
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 2, payload_digest(batch_payload(2)), gaps)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs() == [3])
        await engine.publish()  # 4
        await eventually(lambda: rec.seqs() == [3, 4])
    assert engine.replay_requests == [2] and gaps == [] and source.stats.resyncs == 0
    assert (source.stats.resumes_verified, source.stats.replayed_batches) == (1, 1)


async def test_a_seq_below_the_checkpoint_is_an_engine_restart(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    cfg = ZmqSourceConfig(endpoint=engine.bind())
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 10, b"x" * 16, gaps)  # the old engine had reached 10
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # the restarted engine's 0
        await engine.publish()  # 1
        await eventually(lambda: rec.seqs()[-1:] == [1])
    assert rec.items == [("resync", "restart"), ("batch", 0, 0), ("batch", 1, 0)]
    assert (source.stats.restarts, gaps) == (1, [])


async def test_another_batch_at_the_checkpoints_seq_is_an_engine_restart(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """The engine restarted and already ran past the checkpoint's seq: its batch there is
    not the one the checkpoint applied, so the view is dropped and its start replayed."""
    engine = engine_factory()
    cfg = ZmqSourceConfig(endpoint=engine.bind(), replay_endpoint=engine.bind_replay())
    await offline(engine, 5)  # the new engine's 0..4
    rec, gaps = Recorder(), list[int]()
    source = resumed(rec, cfg, 2, payload_digest(b"the old engine's batch 2"), gaps)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 5
        await eventually(lambda: rec.seqs()[-1:] == [5])
    assert engine.replay_requests == [2, 0]
    assert rec.items == [("resync", "restart")] + [("batch", s, 0) for s in range(6)]
    assert (source.stats.restarts, source.stats.resumes_verified, gaps) == (1, 0, [])
