"""ZmqSource against real ZMQ sockets on loopback.

The publisher side is built the way vLLM's ``ZmqEventPublisher`` works
(listener/ENGINE_FORMATS.md §1, §6): frames ``[topic, seq(8 BE), payload]`` on a PUB
socket (an XPUB here, only so the test can await the subscription instead of sleeping past
the slow-joiner window), a ROUTER answering replay requests from its buffer in either
reply layout, and a separate process for the engine-restart case. The decoder is a stub
that understands the encoding-A batches these tests publish; ``listener.decode`` is tested
on its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import socket
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, Literal

import msgpack
import pytest
import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from bus.backoff import ExponentialBackoff, NoBackoff
from harness.procs import free_port
from listener.engine_events import BlockHash, BlockStored, EventBatch, normalize_hash
from listener.zmq_source import (
    END_SEQ,
    PublisherAllowlist,
    PublisherNotAllowedError,
    ZmqSource,
    ZmqSourceConfig,
    expand_dp_endpoints,
    offset_endpoint,
)
from tests import waiting

TIMEOUT = 5.0
HASH_BASE = (1 << 63) + 12345
"""Batch ``seq`` carries block hash ``HASH_BASE + seq`` (a uint64 above 2**63, as vLLM sends)."""


# --------------------------------------------------------------------------------------------
# Helpers


def batch_payload(seq: int, ts: float = 1_700_000_000.5) -> bytes:
    """A vLLM 0.10.2 encoding-A ``EventBatch`` whose block hash identifies ``seq``; ``ts``
    its timestamp (what makes another engine instance's batch ``seq`` differ)."""
    stored = ["BlockStored", [HASH_BASE + seq], None, [101, 102, 103, 104], 4, None, "GPU"]
    return msgpack.packb([ts, [stored], 0])


def _hash(value: object) -> BlockHash:
    h = normalize_hash(value)
    assert h is not None, value  # the payloads here carry only uint64 hashes
    return h


def stub_decode(payload: bytes, engine: str) -> EventBatch:
    try:
        top = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as exc:
        raise ValueError("not msgpack") from exc
    if not isinstance(top, list) or len(top) < 2 or not isinstance(top[1], list):
        raise ValueError("not an EventBatch")
    events: list[Any] = []
    for ev in top[1]:
        if ev[0] == "BlockStored":
            events.append(
                BlockStored(
                    block_hashes=[_hash(h) for h in ev[1]],
                    parent_block_hash=None,
                    token_ids=list(ev[3]),
                    block_size=ev[4],
                    medium=ev[6],
                )
            )
    return EventBatch(ts=top[0], events=events, dp_rank=top[2] if len(top) > 2 else None)


def seq_of(batch: EventBatch) -> int:
    ev = batch.events[0]
    assert isinstance(ev, BlockStored)
    h = ev.block_hashes[0]
    assert isinstance(h, int)
    return h - HASH_BASE


async def eventually(pred: Callable[[], bool]) -> None:
    await waiting.eventually(pred, TIMEOUT, 0.001)


class Recorder:
    """Callbacks: an async ``on_batch`` and a sync ``on_resync``, recorded in call order.

    ``SyncRecorder`` has a plain ``on_batch`` (the in-order path that calls it directly)
    and records ``on_drained``.
    """

    def __init__(self) -> None:
        self.items: list[tuple[Any, ...]] = []
        self.payloads: list[tuple[bytes, str]] = []

    def decode(self, payload: bytes, engine: str) -> EventBatch:
        self.payloads.append((payload, engine))
        return stub_decode(payload, engine)

    async def on_batch(self, batch: EventBatch, dp_rank: int | None) -> None:
        self.items.append(("batch", seq_of(batch), dp_rank))

    def on_resync(self, reason: str) -> None:
        self.items.append(("resync", reason))

    def seqs(self) -> list[int]:
        return [item[1] for item in self.items if item[0] == "batch"]

    def source(self, config: ZmqSourceConfig, **kw: Any) -> ZmqSource:
        kw.setdefault("backoff", NoBackoff())
        return ZmqSource(
            config,
            decode=self.decode,
            on_batch=self.on_batch,
            on_resync=self.on_resync,
            **kw,
        )


class SyncRecorder(Recorder):
    def __init__(self) -> None:
        super().__init__()
        self.drained: list[int] = []
        """Batches delivered so far, at each ``on_drained`` call."""

    def on_batch(self, batch: EventBatch, dp_rank: int | None) -> None:  # type: ignore[override]
        self.items.append(("batch", seq_of(batch), dp_rank))

    def on_drained(self) -> None:
        self.drained.append(len(self.seqs()))

    def source(self, config: ZmqSourceConfig, **kw: Any) -> ZmqSource:
        return super().source(config, on_drained=self.on_drained, **kw)


RECORDERS = pytest.mark.parametrize("recorder", [Recorder, SyncRecorder], ids=["async", "sync"])


@contextlib.asynccontextmanager
async def running(source: ZmqSource) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(source.run())
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


class FakeEngine:
    """vLLM's ``ZmqEventPublisher``: live PUB frames, a replay ROUTER over a bounded buffer."""

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        *,
        topic: bytes = b"",
        layout: Literal["old", "new"] = "new",
        buffer_steps: int = 10_000,
    ) -> None:
        self.pub = ctx.socket(zmq.XPUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        # Every subscription reaches the test, a duplicate too: a SUB that reconnects
        # before the XPUB noticed its old connection's end subscribes a second time, and a
        # plain XPUB passes that on as nothing (the topic is already subscribed), so a
        # test waiting for the resubscription would wait forever.
        self.pub.setsockopt(zmq.XPUB_VERBOSE, 1)
        self.ctx = ctx
        self.topic = topic
        self.layout = layout
        self.buffer: list[tuple[int, bytes]] = []
        self.buffer_steps = buffer_steps
        self.next_seq = 0
        self.instance = 0
        """Restarts so far: the timestamp in its batches, so another instance's differ."""
        self.router: zmq.asyncio.Socket | None = None
        self.replay_requests: list[int] = []
        self.hold: asyncio.Event | None = None
        """When set, replay requests are answered only once this event is set."""
        self._task: asyncio.Task[None] | None = None

    def bind(self) -> str:
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        return f"tcp://127.0.0.1:{port}"

    def bind_replay(self) -> str:
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self._task = asyncio.create_task(self._serve_replay())
        return f"tcp://127.0.0.1:{port}"

    async def subscribed(self) -> None:
        async with asyncio.timeout(TIMEOUT):
            assert await self.pub.recv() == b"\x01" + self.topic

    async def publish(self, *, live: bool = True, payload: bytes | None = None) -> int:
        seq = self.next_seq
        self.next_seq += 1
        data = batch_payload(seq, 1_700_000_000.5 + self.instance) if payload is None else payload
        self.buffer = [*self.buffer, (seq, data)][-self.buffer_steps :]
        if live:
            await self.pub.send_multipart([self.topic, seq.to_bytes(8, "big"), data])
        return seq

    def restart(self) -> None:
        """The engine process restarted: the sequence and the replay buffer start over."""
        self.next_seq = 0
        self.buffer = []
        self.instance += 1

    async def _serve_replay(self) -> None:
        assert self.router is not None
        while True:
            frame = await self.router.recv_multipart()
            if len(frame) != 3:
                continue
            client_id, _, start_seq_bytes = frame
            start_seq = int.from_bytes(start_seq_bytes, "big")
            self.replay_requests.append(start_seq)
            if self.hold is not None:
                await self.hold.wait()
            for seq, buf in self.buffer:
                if seq >= start_seq:
                    if self.layout == "new":
                        reply = [client_id, b"", self.topic, seq.to_bytes(8, "big"), buf]
                    else:
                        reply = [client_id, b"", seq.to_bytes(8, "big"), buf]
                    await self.router.send_multipart(reply)
            if self.layout == "new":
                await self.router.send_multipart([client_id, b"", b"", END_SEQ, b""])
            else:
                await self.router.send_multipart([client_id, b"", END_SEQ, b""])

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self.pub.close(0)
        if self.router is not None:
            self.router.close(0)


@pytest.fixture
async def zctx() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def engine_factory(
    zctx: zmq.asyncio.Context,
) -> AsyncIterator[Callable[..., FakeEngine]]:
    engines: list[FakeEngine] = []

    def make(**kw: Any) -> FakeEngine:
        engines.append(FakeEngine(zctx, **kw))
        return engines[-1]

    yield make
    for engine in engines:
        await engine.close()


# --------------------------------------------------------------------------------------------
# Live delivery, both socket modes


@RECORDERS
@pytest.mark.parametrize("topic", ["", "kv@vllm-1"])
async def test_connect_mode_delivers_batches_in_order(
    engine_factory: Callable[..., FakeEngine], topic: str, recorder: type[Recorder]
) -> None:
    engine = engine_factory(topic=topic.encode())
    endpoint = engine.bind()
    rec = recorder()
    cfg = ZmqSourceConfig(endpoint=endpoint, engine="sglang", topic=topic, dp_rank=3)
    source = rec.source(cfg)
    async with running(source):
        await engine.subscribed()
        for _ in range(5):
            await engine.publish()
        await eventually(lambda: len(rec.items) == 5)
    assert rec.items == [("batch", s, 3) for s in range(5)]
    assert rec.payloads == [(batch_payload(s), "sglang") for s in range(5)]
    st = source.stats
    assert (st.frames, st.batches, st.events, st.last_seq) == (5, 5, 5, 4)
    assert (st.gaps, st.restarts, st.resyncs, st.malformed_frames, st.decode_errors) == (
        0,
        0,
        0,
        0,
        0,
    )
    assert source.last_seq == 4


async def test_bind_mode_engine_connects(zctx: zmq.asyncio.Context) -> None:
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint="tcp://127.0.0.1:*", mode="bind"))
    engine = FakeEngine(zctx)
    try:
        async with running(source):
            endpoint = await asyncio.wait_for(source.wait_ready(), TIMEOUT)
            assert endpoint.startswith("tcp://127.0.0.1:") and not endpoint.endswith("*")
            engine.pub.connect(endpoint)
            await engine.subscribed()
            for _ in range(3):
                await engine.publish()
            await eventually(lambda: len(rec.items) == 3)
    finally:
        await engine.close()
    # The batch's own dp_rank (0 in the payload) is passed on when the config has none.
    assert rec.items == [("batch", 0, 0), ("batch", 1, 0), ("batch", 2, 0)]
    assert source.stats.connects == 1


async def test_a_queued_backlog_is_drained_in_runs_and_on_drained_follows_each_run(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """Batches already queued are delivered back to back; ``on_drained`` (where the
    listener flushes its prefix events) comes after each run and after the last batch."""
    engine = engine_factory()
    endpoint = engine.bind()
    rec = SyncRecorder()
    source = rec.source(ZmqSourceConfig(endpoint=endpoint))
    async with running(source):
        await engine.subscribed()
        await engine.publish()
        await eventually(lambda: rec.drained == [1])
        n = 400
        for _ in range(n):  # queued faster than one loop turn
            await engine.publish()
        await eventually(lambda: rec.drained[-1:] == [n + 1])
    assert rec.seqs() == list(range(n + 1))
    assert rec.drained == sorted(rec.drained)
    assert len(rec.drained) < n  # runs of several batches, not one call per batch
    steps = [b - a for a, b in itertools.pairwise(rec.drained)]
    assert max(steps) <= 65  # at most _DRAIN_BATCH + 1 per run: other tasks get the loop


# --------------------------------------------------------------------------------------------
# Gaps and replay


async def test_an_idle_engine_is_replayed_without_waiting_for_a_live_batch(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """A listener started beside a running engine that publishes nothing (no router sends
    it a request: they learn what it holds only from this listener) learns the engine's
    buffer after ``idle_replay_after_s``; a live batch afterwards follows on, and a live
    copy of a replayed batch is a duplicate, not an engine restart."""
    engine = engine_factory()
    endpoint = engine.bind()
    replay = engine.bind_replay()
    for _ in range(3):
        await engine.publish(live=False)  # 0, 1, 2: before the listener started
    rec = Recorder()
    cfg = ZmqSourceConfig(endpoint=endpoint, replay_endpoint=replay, idle_replay_after_s=0.2)
    source = rec.source(cfg)
    async with running(source):
        await engine.subscribed()
        await eventually(lambda: rec.seqs() == [0, 1, 2])
        assert engine.replay_requests == [0]
        await engine.pub.send_multipart([engine.topic, (2).to_bytes(8, "big"), batch_payload(2)])
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs() == [0, 1, 2, 3])
    st = source.stats
    assert (st.idle_replays, st.replayed_batches, st.duplicates, st.restarts) == (1, 3, 1, 0)
    assert not [i for i in rec.items if i[0] == "resync"]


@RECORDERS
@pytest.mark.parametrize("layout", ["old", "new"])
async def test_gap_is_replayed_in_order_without_duplicates(
    engine_factory: Callable[..., FakeEngine],
    layout: Literal["old", "new"],
    recorder: type[Recorder],
) -> None:
    engine = engine_factory(layout=layout, topic=b"kv")
    endpoint = engine.bind()
    replay = engine.bind_replay()
    rec = recorder()
    cfg = ZmqSourceConfig(
        endpoint=endpoint,
        topic="kv",
        replay_endpoint=replay,
        allowed_publishers=("127.0.0.1",),
    )
    source = rec.source(cfg)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await eventually(lambda: rec.seqs() == [0])

        engine.hold = asyncio.Event()
        await engine.publish(live=False)  # 1: lost on the wire, still in the replay buffer
        await engine.publish(live=False)  # 2
        await engine.publish()  # 3: reveals the gap
        # Asked from the last batch delivered, so the engine shows it is the same one.
        await eventually(lambda: engine.replay_requests == [0])
        # Published while the replay is in flight: replay returns them, and the live socket
        # delivers them too; the live copies must be dropped.
        await engine.publish()  # 4
        await engine.publish()  # 5
        engine.hold.set()
        await eventually(lambda: rec.seqs()[-1:] == [5])
        await engine.publish()  # 6
        await eventually(lambda: rec.seqs()[-1:] == [6])
        await eventually(lambda: source.stats.duplicates == 2)

    assert rec.items == [("batch", s, 0) for s in range(7)]
    assert [p for p, _ in rec.payloads] == [batch_payload(s) for s in range(7)]
    st = source.stats
    assert (st.gaps, st.replays, st.replay_failures, st.replayed_batches) == (1, 1, 0, 5)
    assert (st.duplicates, st.resyncs, st.frames, st.last_seq) == (2, 0, 5, 6)


async def test_gap_without_replay_endpoint_resyncs(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint=engine.bind()))
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await engine.publish(live=False)  # 1 lost
        await engine.publish()  # 2
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs()[-1:] == [3])
    assert rec.items == [
        ("batch", 0, 0),
        ("resync", "gap"),
        ("batch", 2, 0),
        ("batch", 3, 0),
    ]
    assert (source.stats.gaps, source.stats.resyncs, source.stats.replays) == (1, 1, 0)


async def test_replay_buffer_overrun_resyncs(engine_factory: Callable[..., FakeEngine]) -> None:
    engine = engine_factory(buffer_steps=2)
    endpoint = engine.bind()
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint=endpoint, replay_endpoint=engine.bind_replay()))
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        for _ in range(3):
            await engine.publish(live=False)  # 1, 2, 3; the buffer keeps only 2 batches
        await engine.publish()  # 4: replay from 0 starts at 3, so 1 and 2 are gone
        await eventually(lambda: rec.seqs()[-1:] == [4])
    # After the resync the buffer is learned from where it starts: 3 is known too.
    assert engine.replay_requests == [0, 0]
    assert rec.items == [("batch", 0, 0), ("resync", "gap"), ("batch", 3, 0), ("batch", 4, 0)]
    st = source.stats
    assert (st.gaps, st.replays, st.replay_failures, st.resyncs) == (1, 1, 1, 1)


async def test_unanswered_replay_times_out_and_resyncs(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    endpoint = engine.bind()
    replay = engine.bind_replay()
    engine.hold = asyncio.Event()  # never set: the ROUTER takes the request and stays silent
    rec = Recorder()
    cfg = ZmqSourceConfig(endpoint=endpoint, replay_endpoint=replay, replay_timeout_s=0.2)
    source = rec.source(cfg)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await engine.publish(live=False)  # 1
        await engine.publish()  # 2
        await eventually(lambda: rec.seqs()[-1:] == [2])
    assert rec.items == [("batch", 0, 0), ("resync", "gap"), ("batch", 2, 0)]
    # The gap's replay, then the one that would learn the buffer again after the resync.
    assert source.stats.replay_failures == 2


# --------------------------------------------------------------------------------------------
# Engine restarts


async def test_seq_drop_is_a_restart_and_replays_the_new_engines_start(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory(layout="old")
    endpoint = engine.bind()
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint=endpoint, replay_endpoint=engine.bind_replay()))
    async with running(source):
        await engine.subscribed()
        for _ in range(3):
            await engine.publish()  # 0, 1, 2
        await eventually(lambda: rec.seqs() == [0, 1, 2])
        engine.restart()
        await engine.publish(live=False)  # new 0 and 1: lost to the slow-joiner rule
        await engine.publish(live=False)
        await engine.publish()  # new 2: not above last_seq, so a restart
        await eventually(lambda: len(rec.items) == 7)
    assert rec.items == [
        *(("batch", s, 0) for s in range(3)),
        ("resync", "restart"),
        *(("batch", s, 0) for s in range(3)),
    ]
    # First: does the engine still hold batch 2 as delivered? (It holds another one.)
    assert engine.replay_requests == [2, 0]
    assert (source.stats.restarts, source.stats.gaps, source.stats.resyncs) == (1, 0, 1)


PUBLISHER_PROCESS = r"""
import sys

import msgpack
import zmq

port, count, base = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
ctx = zmq.Context()
pub = ctx.socket(zmq.XPUB)
pub.bind(f"tcp://127.0.0.1:{port}")
print("bound", flush=True)
assert pub.recv() == b"\x01"
for seq in range(count):
    stored = ["BlockStored", [base + seq], None, [101, 102, 103, 104], 4, None, "GPU"]
    pub.send_multipart([b"", seq.to_bytes(8, "big"), msgpack.packb([1.5, [stored], 0])])
print("sent", flush=True)
sys.stdin.read()
pub.close(linger=0)
ctx.term()
"""


async def test_engine_process_restart_resyncs() -> None:
    """A real publisher process exits and a new one takes its port: seq starts again at 0."""
    port = free_port()
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint=f"tcp://127.0.0.1:{port}"))

    async def engine_process(count: int) -> asyncio.subprocess.Process:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            PUBLISHER_PROCESS,
            str(port),
            str(count),
            str(HASH_BASE),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        assert await asyncio.wait_for(proc.stdout.readline(), TIMEOUT) == b"bound\n"
        return proc

    async def stop(proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), TIMEOUT)
            except TimeoutError:
                proc.kill()
                await proc.wait()

    first = await engine_process(3)
    try:
        async with running(source):
            await eventually(lambda: rec.seqs() == [0, 1, 2])
            await stop(first)
            assert first.returncode == 0
            second = await engine_process(2)
            try:
                await eventually(lambda: len(rec.items) == 6)
            finally:
                await stop(second)
    finally:
        await stop(first)
    # (The second engine's own exit may add one more resync before the source stops.)
    assert rec.items[:6] == [
        ("batch", 0, 0),
        ("batch", 1, 0),
        ("batch", 2, 0),
        # No replay endpoint to tell a restart from a network blip: the connection's end
        # forgets the view (the new engine publishes nothing yet to show its reset).
        ("resync", "disconnect"),
        ("batch", 0, 0),
        ("batch", 1, 0),
    ]
    assert source.stats.restarts == 0 and source.stats.connects == 1


# --------------------------------------------------------------------------------------------
# Bad input never ends the loop


async def test_malformed_frames_and_undecodable_payloads_are_counted(
    engine_factory: Callable[..., FakeEngine], caplog: pytest.LogCaptureFixture
) -> None:
    engine = engine_factory()
    rec = Recorder()
    source = rec.source(ZmqSourceConfig(endpoint=engine.bind(), backend="vllm-1"))
    caplog.set_level(logging.WARNING, logger="listener.zmq_source")
    async with running(source):
        await engine.subscribed()
        seq0 = (0).to_bytes(8, "big")
        await engine.pub.send_multipart([b"", seq0])  # 2 frames
        await engine.pub.send_multipart([b"", seq0, batch_payload(0), b"extra"])  # 4 frames
        await engine.pub.send_multipart([b"", seq0[:7], batch_payload(0)])  # 7-byte seq
        await engine.pub.send_multipart([b"", END_SEQ, b""])  # a replay end marker, live
        await engine.publish()  # 0
        await engine.publish(payload=b"\xc1")  # 1: not msgpack
        await engine.publish(payload=msgpack.packb({"not": "a batch"}))  # 2
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs() == [0, 3])
    st = source.stats
    assert (st.frames, st.malformed_frames, st.decode_errors) == (8, 4, 2)
    # An undecodable batch is lost for sure (a replay brings back the same bytes): each one
    # resyncs, in order with the batches; a malformed frame has no seq and costs nothing.
    assert rec.items == [
        ("batch", 0, 0),
        ("resync", "decode_error"),
        ("resync", "decode_error"),
        ("batch", 3, 0),
    ]
    assert (st.batches, st.events, st.last_seq, st.gaps, st.resyncs) == (2, 2, 3, 0, 2)
    decode_logs = [r for r in caplog.records if "undecodable" in r.getMessage()]
    malformed_logs = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert len(decode_logs) == 1 and len(malformed_logs) == 1


def _replaying(
    engine_factory: Callable[..., FakeEngine], idle_replay_after_s: float = 2.0
) -> tuple[FakeEngine, Recorder, ZmqSource]:
    engine = engine_factory()
    rec = Recorder()
    config = ZmqSourceConfig(
        endpoint=engine.bind(),
        replay_endpoint=engine.bind_replay(),
        idle_replay_after_s=idle_replay_after_s,
    )
    return engine, rec, rec.source(config)


async def test_an_engine_idle_after_an_unusable_batch_is_learned_again(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """The resync for an unusable batch forgets the backend; an engine that publishes
    nothing after it is replayed after ``idle_replay_after_s`` all the same."""
    engine, rec, source = _replaying(engine_factory, idle_replay_after_s=0.2)
    async with running(source):
        await engine.subscribed()
        # Idle at the start too: that replay finds an empty buffer (nothing to learn).
        await eventually(lambda: engine.replay_requests == [0])
        await engine.publish()  # 0
        await eventually(lambda: rec.seqs() == [0])
        await engine.pub.send_multipart([b"", (1).to_bytes(8, "big"), b"\xc1"])  # not ours
        await engine.publish(live=False)  # 1: the engine's own, only in its buffer
        await eventually(lambda: rec.seqs()[-2:] == [0, 1])
    assert rec.items == [
        ("batch", 0, 0),
        ("resync", "decode_error"),
        ("batch", 0, 0),
        ("batch", 1, 0),
    ]
    assert engine.replay_requests == [0, 0]
    assert (source.stats.relearns, source.stats.idle_replays) == (1, 1)


async def test_an_unusable_batch_under_a_real_seq_is_followed_by_a_replay_of_the_buffer(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """Garbage a peer slipped in under the engine's next sequence number resyncs (the
    backend's whole state is forgotten, good earlier batches too); the next live batch
    then fetches the engine's whole buffer, the real batch for that number among it."""
    engine, rec, source = _replaying(engine_factory)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await engine.publish()  # 1
        await eventually(lambda: rec.seqs() == [0, 1])
        await engine.pub.send_multipart([b"", (2).to_bytes(8, "big"), b"\xc1"])  # not ours
        await engine.publish(live=False)  # 2: the engine's own, only in its buffer
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs()[-1:] == [3])
    assert rec.items == [
        ("batch", 0, 0),
        ("batch", 1, 0),
        ("resync", "decode_error"),
        ("batch", 0, 0),
        ("batch", 1, 0),
        ("batch", 2, 0),
        ("batch", 3, 0),
    ]
    assert engine.replay_requests == [0]
    st = source.stats
    assert (st.decode_errors, st.resyncs, st.relearns, st.restarts, st.gaps) == (1, 1, 1, 0, 0)


async def test_a_bad_batch_in_the_engines_own_buffer_costs_one_replay(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    """The replay brings the bad batch back: it resyncs again but does not ask for the
    buffer again, so live delivery goes on after one replay."""
    engine, rec, source = _replaying(engine_factory)
    async with running(source):
        await engine.subscribed()
        await engine.publish()  # 0
        await engine.publish(payload=b"\xc1")  # 1: the engine's own bytes are bad
        await engine.publish()  # 2
        await engine.publish()  # 3
        await eventually(lambda: rec.seqs()[-1:] == [3])
    assert rec.items == [
        ("batch", 0, 0),
        ("resync", "decode_error"),
        ("batch", 0, 0),
        ("resync", "decode_error"),
        ("batch", 2, 0),
        ("batch", 3, 0),
    ]
    assert engine.replay_requests == [0]
    assert (source.stats.resyncs, source.stats.relearns) == (2, 1)


async def reconnected(engine: FakeEngine, monitor: zmq.asyncio.Socket | None) -> None:
    """Wait until the source's SUB is connected to ``engine`` again.

    Connect mode: a new subscription arrives (after the old connection's unsubscribe).
    Bind mode: the engine's PUB reconnects on its own; its pipe (and the subscription the
    XPUB already holds for it) survives, so the second completed handshake tells.
    """
    async with asyncio.timeout(TIMEOUT):
        if monitor is None:
            while await engine.pub.recv() != b"\x01" + engine.topic:
                pass
            return
        handshakes = 0
        while handshakes < 2:
            event = parse_monitor_message(await monitor.recv_multipart())
            handshakes += event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED


@pytest.mark.parametrize("mode", ["connect", "bind"])
async def test_a_frame_over_max_frame_bytes_is_dropped_counted_and_receiving_goes_on(
    zctx: zmq.asyncio.Context, mode: Literal["connect", "bind"]
) -> None:
    """ZMQ_MAXMSGSIZE: libzmq refuses the frame before any byte of it is buffered and drops
    the connection. The source counts that, reconnects (connect mode; in bind mode the
    engine does). In connect mode with no replay endpoint the connection's end already
    forgets the view (module docstring: a restart could not be told apart), so the next
    batch is a new baseline; in bind mode the lost batch is a gap like any other."""
    engine = FakeEngine(zctx)
    rec = Recorder()
    endpoint = engine.bind() if mode == "connect" else "tcp://127.0.0.1:*"
    source = rec.source(ZmqSourceConfig(endpoint=endpoint, mode=mode, max_frame_bytes=1024))
    monitor = None
    try:
        async with running(source):
            if mode == "bind":
                monitor = engine.pub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
                engine.pub.connect(await asyncio.wait_for(source.wait_ready(), TIMEOUT))
            await engine.subscribed()
            await engine.publish()  # 0
            await eventually(lambda: rec.seqs() == [0])
            await engine.publish(payload=batch_payload(1) + b"\x00" * 1024)  # 1: too large
            await reconnected(engine, monitor)
            await engine.publish()  # 2
            await eventually(lambda: rec.seqs() == [0, 2])
    finally:
        if monitor is not None:
            engine.pub.disable_monitor()
            monitor.close(0)
        await engine.close()
    connect = mode == "connect"
    reason = "disconnect" if connect else "gap"
    assert rec.items == [("batch", 0, 0), ("resync", reason), ("batch", 2, 0)]
    assert [p for p, _ in rec.payloads] == [batch_payload(0), batch_payload(2)]
    st = source.stats
    assert (st.disconnects, st.gaps, st.resyncs, st.decode_errors) == (1, int(not connect), 1, 0)
    assert st.connects == 1


def test_max_frame_bytes_is_validated() -> None:
    with pytest.raises(ValueError, match="max_frame_bytes"):
        ZmqSourceConfig(endpoint="tcp://127.0.0.1:5557", max_frame_bytes=0)


async def test_callback_errors_are_counted_and_do_not_stop_the_source(
    engine_factory: Callable[..., FakeEngine],
) -> None:
    engine = engine_factory()
    seen: list[Any] = []

    def on_batch(batch: EventBatch, dp_rank: int | None) -> None:
        seen.append(seq_of(batch))
        if len(seen) == 1:
            raise RuntimeError("consumer bug")

    source = ZmqSource(
        ZmqSourceConfig(endpoint=engine.bind()),
        decode=stub_decode,
        on_batch=on_batch,
        on_resync=seen.append,
        backoff=NoBackoff(),
    )
    async with running(source):
        await engine.subscribed()
        await engine.publish()
        await engine.publish()
        await eventually(lambda: len(seen) == 3)
    # What the callback did not finish is lost to the consumer: it resyncs.
    assert seen == [0, "callback_error", 1]
    assert (source.stats.callback_errors, source.stats.resyncs) == (1, 1)
    assert source.stats.connects == 1


# --------------------------------------------------------------------------------------------
# Supervisor


async def test_supervisor_retries_a_failed_bind_with_backoff(zctx: zmq.asyncio.Context) -> None:
    blocker = socket.socket()
    blocker.bind(("127.0.0.1", 0))
    blocker.listen()
    port = blocker.getsockname()[1]

    class ReleasingBackoff(NoBackoff):
        """Frees the port on the third failure, so the fourth bind succeeds."""

        def compute(self, failures: int) -> float:
            if failures == 3:
                blocker.close()
            return super().compute(failures)

    backoff = ReleasingBackoff()
    rec = Recorder()
    source = rec.source(
        ZmqSourceConfig(endpoint=f"tcp://127.0.0.1:{port}", mode="bind"), backoff=backoff
    )
    engine = FakeEngine(zctx)
    try:
        async with running(source):
            endpoint = await asyncio.wait_for(source.wait_ready(), TIMEOUT)
            assert backoff.computed == [1, 2, 3] and backoff.resets == 0
            engine.pub.connect(endpoint)
            await engine.subscribed()
            await engine.publish()
            await eventually(lambda: rec.seqs() == [0])
    finally:
        blocker.close()
        await engine.close()
    assert backoff.resets == 1  # the first good frame proves the connection healthy
    assert source.stats.connects == 1


# --------------------------------------------------------------------------------------------
# allowed_publishers


async def test_zap_refuses_a_publisher_outside_the_allowlist(zctx: zmq.asyncio.Context) -> None:
    """127.0.0.2 is loopback on Linux; the engine's connection is made from that address."""
    rec = Recorder()
    cfg = ZmqSourceConfig(
        endpoint="tcp://127.0.0.1:*", mode="bind", allowed_publishers=("127.0.0.0/31",)
    )
    source = rec.source(cfg)
    intruder, engine = FakeEngine(zctx), FakeEngine(zctx)
    try:
        async with running(source):
            endpoint = await asyncio.wait_for(source.wait_ready(), TIMEOUT)
            host_port = endpoint.removeprefix("tcp://")
            intruder.pub.connect(f"tcp://127.0.0.2:0;{host_port}")
            await eventually(lambda: source.stats.publishers_denied >= 1)

            engine.pub.connect(endpoint)  # from 127.0.0.1, inside 127.0.0.0/31
            await engine.subscribed()
            await engine.publish()
            await eventually(lambda: rec.seqs() == [0])
            # The refused peer never received the subscription, so it cannot deliver anything.
            assert await intruder.pub.poll(timeout=0) == 0
            await intruder.pub.send_multipart([b"", (7).to_bytes(8, "big"), batch_payload(7)])
            await engine.publish()
            await eventually(lambda: rec.seqs() == [0, 1])
    finally:
        await intruder.close()
        await engine.close()
    assert source.stats.frames == 2


async def test_zap_allows_a_listed_hostname(zctx: zmq.asyncio.Context) -> None:
    rec = Recorder()
    cfg = ZmqSourceConfig(
        endpoint="tcp://127.0.0.1:*", mode="bind", allowed_publishers=("localhost",)
    )
    source = rec.source(cfg)
    engine = FakeEngine(zctx)
    try:
        async with running(source):
            engine.pub.connect(await asyncio.wait_for(source.wait_ready(), TIMEOUT))
            await engine.subscribed()
            await engine.publish()
            await eventually(lambda: rec.seqs() == [0])
    finally:
        await engine.close()
    assert source.stats.publishers_denied == 0


async def test_connect_mode_refuses_a_host_outside_the_allowlist() -> None:
    rec = Recorder()
    source = rec.source(
        ZmqSourceConfig(
            endpoint=f"tcp://127.0.0.1:{free_port()}", allowed_publishers=("10.0.0.0/8",)
        )
    )
    with pytest.raises(PublisherNotAllowedError, match=r"'127\.0\.0\.1'.*allowed_publishers"):
        await asyncio.wait_for(source.run(), TIMEOUT)
    assert source.stats.connects == 0


async def test_connect_mode_checks_the_replay_host_and_resolves_names() -> None:
    rec = Recorder()
    source = rec.source(
        ZmqSourceConfig(
            endpoint="tcp://localhost:5557",  # resolves to 127.0.0.1: allowed
            replay_endpoint="tcp://127.0.0.2:5558",
            allowed_publishers=("127.0.0.1",),
        )
    )
    with pytest.raises(PublisherNotAllowedError) as info:
        await asyncio.wait_for(source.run(), TIMEOUT)
    assert info.value.host == "127.0.0.2"
    assert source.stats.connects == 0


async def test_allowlist_matching() -> None:
    allow = PublisherAllowlist(["10.1.0.0/16", "192.168.1.7", "::1", "localhost"])
    await allow.refresh()
    assert allow.allows_address("10.1.200.3")
    assert allow.allows_address("::ffff:10.1.0.9")  # IPv4-mapped peer
    assert allow.allows_address("192.168.1.7") and not allow.allows_address("192.168.1.8")
    assert allow.allows_address("::1") and allow.allows_address("127.0.0.1")  # via localhost
    assert not allow.allows_address("") and not allow.allows_address("not-an-ip")
    await allow.check_host("LOCALHOST")
    await allow.check_host("10.1.2.3")
    with pytest.raises(PublisherNotAllowedError):
        await allow.check_host("10.2.0.1")
    assert not PublisherAllowlist([])
    with pytest.raises(ValueError, match="not an IP address, CIDR or hostname"):
        PublisherAllowlist(["bad host!"])


# --------------------------------------------------------------------------------------------
# Data-parallel endpoints, config, backoff


def test_expand_dp_endpoints() -> None:
    assert expand_dp_endpoints("tcp://engine:5557", 3, "tcp://engine:5600") == [
        (0, "tcp://engine:5557", "tcp://engine:5600"),
        (1, "tcp://engine:5558", "tcp://engine:5601"),
        (2, "tcp://engine:5559", "tcp://engine:5602"),
    ]
    assert expand_dp_endpoints("tcp://*:5557", [0, 2]) == [
        (0, "tcp://*:5557", None),
        (2, "tcp://*:5559", None),
    ]
    assert expand_dp_endpoints("inproc://cache", 2) == [
        (0, "inproc://cache", None),
        (1, "inproc://cache_dp1", None),
    ]
    assert offset_endpoint("tcp://[::1]:5557", 4) == "tcp://[::1]:5561"
    with pytest.raises(ValueError, match="ipc"):
        offset_endpoint("ipc:///tmp/kv", 1)
    with pytest.raises(ValueError, match="exceeds 65535"):
        offset_endpoint("tcp://h:65535", 1)
    with pytest.raises(ValueError, match="non-numeric port"):
        offset_endpoint("tcp://h:*", 1)
    with pytest.raises(ValueError):
        offset_endpoint("udp://h:1", 1)


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="concrete host:port"):
        ZmqSourceConfig(endpoint="tcp://*:5557", mode="connect")
    with pytest.raises(ValueError, match="mode"):
        ZmqSourceConfig(endpoint="tcp://h:1", mode="listen")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="engine"):
        ZmqSourceConfig(endpoint="tcp://h:1", engine="trtllm")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="replay_endpoint"):
        ZmqSourceConfig(endpoint="tcp://h:1", replay_endpoint="http://h:2")
    with pytest.raises(ValueError, match="allowed_publishers"):
        ZmqSourceConfig(endpoint="tcp://h:1", allowed_publishers=("no way",))
    cfg = ZmqSourceConfig(endpoint="tcp://*:5557", mode="bind", allowed_publishers=["10.0.0.1"])  # type: ignore[arg-type]
    assert cfg.allowed_publishers == ("10.0.0.1",)


def test_exponential_backoff() -> None:
    b = ExponentialBackoff(base_s=1.0, cap_s=8.0, jitter=0.0)
    assert [b.compute(n) for n in range(0, 7)] == [0.0, 1.0, 2.0, 4.0, 8.0, 8.0, 8.0]
    assert b.compute(10_000) == 8.0  # no float overflow
    b.reset()
    jittered = ExponentialBackoff(base_s=1.0, cap_s=8.0, jitter=0.5, rng=random.Random(7))
    delays = [jittered.compute(3) for _ in range(200)]
    assert all(2.0 <= d <= 4.0 for d in delays) and len(set(delays)) > 100
    for bad in ({"base_s": 0}, {"cap_s": 0.1, "base_s": 1}, {"jitter": 1.5}):
        with pytest.raises(ValueError):
            ExponentialBackoff(**bad)
    none = NoBackoff()
    assert none.compute(5) == 0.0 and none.computed == [5]


# --------------------------------------------------------------------------------------------
# A restarted engine that publishes nothing


async def _engine_at(
    zctx: zmq.asyncio.Context, pub: str, replay: str, buffer: list[tuple[int, bytes]]
) -> FakeEngine:
    """An engine bound at fixed endpoints, holding ``buffer`` (empty: a fresh process)."""
    engine = FakeEngine(zctx)
    engine.pub.bind(pub)
    engine.buffer = list(buffer)
    engine.next_seq = buffer[-1][0] + 1 if buffer else 0
    engine.router = zctx.socket(zmq.ROUTER)
    engine.router.setsockopt(zmq.LINGER, 0)
    engine.router.bind(replay)
    engine._task = asyncio.create_task(engine._serve_replay())
    return engine


@pytest.mark.parametrize("restarted", [True, False], ids=["restarted", "same-engine"])
async def test_a_reconnect_to_an_engine_that_lost_its_sequence_is_a_restart(
    zctx: zmq.asyncio.Context, restarted: bool
) -> None:
    """An engine restarted empty may publish nothing for a long time: the reconnect alone
    must reveal it (its replay buffer lacks the last batch seen), or the blocks it held
    stay announced. The same engine reconnecting (a socket re-bound, a network blip) still
    holds that batch and is not a restart."""
    pub, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    rec = Recorder()
    cfg = ZmqSourceConfig(endpoint=pub, replay_endpoint=replay, replay_timeout_s=2.0)
    source = rec.source(cfg)
    first = await _engine_at(zctx, pub, replay, [])
    second: FakeEngine | None = None
    try:
        async with running(source):
            await first.subscribed()
            for _ in range(3):
                await first.publish()
            await eventually(lambda: rec.seqs() == [0, 1, 2])
            kept = [] if restarted else first.buffer
            await first.close()
            await eventually(lambda: source.stats.disconnects >= 1)
            second = await _engine_at(zctx, pub, replay, kept)
            await second.subscribed()
            await eventually(lambda: bool(second and second.replay_requests))
            if restarted:
                await eventually(lambda: rec.items[-1] == ("resync", "restart"))
                assert source.stats.restarts == 1 and source.last_seq is None
                await second.publish()  # the new engine's first batch: a fresh baseline
                await eventually(lambda: rec.items[-1] == ("batch", 0, 0))
            else:
                await second.publish()  # seq 3: the same sequence goes on
                await eventually(lambda: rec.seqs() == [0, 1, 2, 3])
                assert source.stats.restarts == 0 and source.stats.resyncs == 0
            assert second.replay_requests[0] == 2  # the probe asked for the last batch seen
    finally:
        if second is not None:
            await second.close()
