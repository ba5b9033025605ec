"""The router's KV event consumer against real servers on loopback ephemeral ports.

The listener side is the listener's own ``EventHub`` + ``SseServer`` (what production
serves) or a scripted raw aiohttp server for malformed streams. ``apply`` is a recorder,
backoff a recording strategy that returns 0 and sleeps are gated, so nothing waits on a
timer; conditions are polled with a timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from collections.abc import Set as AbstractSet
from datetime import UTC, datetime
from typing import Any

import aiohttp
import orjson
import pytest
import pytest_asyncio
from aiohttp import web

from bus.events import KvEvent
from bus.sse import encode_record
from listener.sse_server import SseServer
from listener.stream import EventHub
from router.config.models import EventSourceConfig
from router.ingest import (
    ConsumerStats,
    KvEventConsumer,
    KvEventConsumerManager,
    SourceUnavailable,
    default_backoff,
)
from tests import waiting

B = "vllm-1"
WAIT_S = 5.0
NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
LABELS = {
    "cache_created": "created",
    "cache_evicted": "evicted",
    "cache_offloaded": "offloaded",
    "cache_cleared": "cleared",
    "resync": "resync",
}


def created(i: int, backend: str = B) -> KvEvent:
    return KvEvent("cache_created", backend, f"{i:064x}", token_count=i, tier="gpu")


def record(id: str, obj: dict[str, Any] | bytes, event: str | None = None) -> bytes:
    data = obj if isinstance(obj, bytes) else orjson.dumps(obj)
    return encode_record(data, event=event, id=id)


def bare(i: int) -> KvEvent:
    """What ``created_json(i)`` parses to."""
    return KvEvent("cache_created", B, f"{i:064x}")


def created_json(i: int, backend: str = B) -> dict[str, Any]:
    return {"event": "cache_created", "backend": backend, "prefix_hash": f"{i:064x}"}


async def wait_until(cond: Callable[[], bool], what: str) -> None:
    await waiting.eventually(cond, WAIT_S, 0.002, what)


class Recorder:
    """The ``apply`` callable: records events; can fail once on chosen events."""

    def __init__(self) -> None:
        self.events: list[KvEvent] = []
        self.fail_once: set[KvEvent] = set()

    async def __call__(self, ev: KvEvent) -> str:
        if ev in self.fail_once:
            self.fail_once.discard(ev)
            raise RuntimeError("index unavailable")
        self.events.append(ev)
        return LABELS[ev.event]

    def kinds(self) -> list[str]:
        return [e.event for e in self.events]


class RecordingBackoff:
    def __init__(self) -> None:
        self.computed: list[int] = []
        self.resets = 0

    def compute(self, failures: int) -> float:
        self.computed.append(failures)
        return 0.0

    def reset(self) -> None:
        self.resets += 1


class Gate:
    """The consumer's ``sleep``: records delays; blocks while closed."""

    def __init__(self, block_after: int | None = None) -> None:
        self.delays: list[float] = []
        self.opened = asyncio.Event()
        self.opened.set()
        self.block_after = block_after

    async def __call__(self, delay: float) -> None:
        self.delays.append(delay)
        if self.block_after is not None and len(self.delays) >= self.block_after:
            self.opened.clear()
        await asyncio.sleep(0)
        await self.opened.wait()


Step = bytes | str | int | Callable[[], Awaitable[None]]
"""A scripted step: bytes (str: a WebSocket text message) to send, an HTTP status to answer
with (first step only), or a coroutine function to await before the next step."""


class ScriptedServer:
    """Raw aiohttp server: connection i plays ``scripts[i]``, later ones send nothing.

    A connection is held open after its script until teardown unless ``end`` lists it.
    With ``ws=True`` each bytes step is one WebSocket message (str steps: text messages).
    """

    def __init__(
        self, scripts: list[list[Step]], *, end: AbstractSet[int] = frozenset(), ws: bool = False
    ) -> None:
        self.scripts = scripts
        self.end = end
        self.ws = ws
        self.requests: list[dict[str, str]] = []
        self.release = asyncio.Event()
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_get("/events/{backend}", self._ws if self.ws else self._sse)
        self.runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"{'ws' if self.ws else 'http'}://127.0.0.1:{port}/events/{B}"
        return self.url

    async def stop(self) -> None:
        self.release.set()
        if self.runner is not None:
            await self.runner.cleanup()

    def _script(self, request: web.Request) -> tuple[int, list[Step]]:
        i = len(self.requests)
        self.requests.append(dict(request.headers))
        return i, self.scripts[i] if i < len(self.scripts) else []

    async def _sse(self, request: web.Request) -> web.StreamResponse:
        i, script = self._script(request)
        if script and isinstance(script[0], int):
            return web.Response(status=script[0], text="unavailable")
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        try:
            for step in script:
                if isinstance(step, bytes):
                    await resp.write(step)
                else:
                    assert callable(step), step  # an SSE script is bytes and callables
                    await step()
            if i not in self.end:
                await self.release.wait()
            await resp.write_eof()
        except ConnectionError:
            pass
        return resp

    async def _ws(self, request: web.Request) -> web.WebSocketResponse:
        i, script = self._script(request)
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        for step in script:
            if isinstance(step, str):
                await ws.send_str(step)
            else:
                assert isinstance(step, bytes), step  # a WebSocket script is str and bytes
                await ws.send_bytes(step)
        if i not in self.end:
            await self.release.wait()
        await ws.close()
        return ws


class Listener:
    """The listener's own hub and SSE server, restartable on the same port."""

    def __init__(self, hub: EventHub) -> None:
        self.hub = hub
        self.server: SseServer | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/events/{B}"

    async def start(self, hub: EventHub | None = None) -> None:
        self.hub = hub or self.hub
        self.server = SseServer(self.hub, heartbeat_interval=30.0)
        self.port = await self.server.start("127.0.0.1", self.port)

    async def stop(self) -> None:
        if self.server is not None:
            server, self.server = self.server, None
            await server.stop()


class Harness:
    def __init__(self) -> None:
        self.sent_ids: list[str | None] = []
        """``Last-Event-ID`` of every request the consumers' session made."""
        self.tasks: list[asyncio.Task[None]] = []
        self.servers: list[ScriptedServer | Listener] = []
        self.session: aiohttp.ClientSession | None = None

    async def open(self) -> None:
        trace = aiohttp.TraceConfig()

        async def on_start(_s: Any, _c: Any, params: aiohttp.TraceRequestStartParams) -> None:
            self.sent_ids.append(params.headers.get("Last-Event-ID"))

        trace.on_request_start.append(on_start)
        self.session = aiohttp.ClientSession(trace_configs=[trace])

    async def close(self) -> None:
        for t in self.tasks:  # consumers first: they must not reconnect to a closing server
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        for s in self.servers:
            await s.stop()
        if self.session is not None:
            await self.session.close()

    async def scripted(self, scripts: list[list[Step]], **kw: Any) -> ScriptedServer:
        s = ScriptedServer(scripts, **kw)
        self.servers.append(s)
        await s.start()
        return s

    async def listener(self, hub: EventHub) -> Listener:
        lst = Listener(hub)
        self.servers.append(lst)
        await lst.start()
        return lst

    def consumer(
        self, endpoint: str, apply: Recorder, *, interval_ms: int = 1000, **kw: Any
    ) -> KvEventConsumer:
        src = EventSourceConfig(
            backend_name=B, endpoint=endpoint, reconnect_interval_ms=interval_ms
        )
        kw.setdefault("backoff", RecordingBackoff())
        kw.setdefault("sleep", Gate())
        return KvEventConsumer(src, apply, self.session, clock=lambda: NOW, **kw)

    def run(self, consumer: KvEventConsumer) -> asyncio.Task[None]:
        task = asyncio.create_task(consumer.run())
        self.tasks.append(task)
        return task


@pytest_asyncio.fixture
async def h() -> AsyncIterator[Harness]:
    harness = Harness()
    await harness.open()
    try:
        yield harness
    finally:
        await harness.close()


# -- against the listener's own hub and SSE server -----------------------------------------------


async def subscribed(h: Harness, hub: EventHub) -> tuple[Recorder, KvEventConsumer]:
    """A consumer of ``hub``'s backend through a real SSE server, past its resync block."""
    lst = await h.listener(hub)
    rec = Recorder()
    c = h.consumer(lst.url, rec)
    h.run(c)
    await wait_until(lambda: rec.kinds() == ["resync"], "the resync block")
    return rec, c


async def test_applies_resync_then_events_in_order(h: Harness) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    rec, c = await subscribed(h, hub)
    assert c.stats.connected
    hub.publish(B, created(1))
    hub.publish(B, KvEvent("cache_offloaded", B, f"{1:064x}", tier="storage"))
    hub.publish(B, KvEvent("cache_evicted", B, f"{1:064x}"))
    hub.publish(B, created(2))
    await wait_until(lambda: len(rec.events) == 5, "4 live events")
    assert rec.events[1:] == [
        created(1),
        KvEvent("cache_offloaded", B, f"{1:064x}", tier="storage"),
        KvEvent("cache_evicted", B, f"{1:064x}"),
        created(2),
    ]
    assert rec.events[0].reason == "no_event_id"
    st = c.stats
    assert (st.received, st.processed, st.dropped) == (5, 5, 0)
    assert (st.index_created, st.index_evicted, st.resyncs) == (2, 1, 1)
    assert st.last_event_id == hub.last_event_id(B) == "e1-4"
    assert st.last_event_at == NOW and st.reconnects == 0
    assert h.sent_ids == [None]


async def test_the_latest_resync_says_whether_the_view_may_be_incomplete(h: Harness) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    rec, c = await subscribed(h, hub)
    assert c.stats.view_incomplete is False
    hub.set_incomplete(B, True)
    hub.resync(B, "checkpoint_gap", [created(1)])
    await wait_until(lambda: c.stats.view_incomplete, "the incomplete resync")
    assert rec.events[1].incomplete and rec.events[1].reason == "checkpoint_gap"
    hub.set_incomplete(B, False)
    hub.resync(B, "restart")
    await wait_until(lambda: not c.stats.view_incomplete, "a complete resync")


async def test_server_restart_resumes_from_last_event_id_without_gap_or_duplicate(
    h: Harness,
) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    lst = await h.listener(hub)
    rec, gate = Recorder(), Gate()
    c = h.consumer(lst.url, rec, sleep=gate)
    h.run(c)
    await wait_until(lambda: rec.kinds() == ["resync"], "the resync block")
    for i in range(1, 6):
        hub.publish(B, created(i))
    await wait_until(lambda: len(rec.events) == 6, "resync + 5 events")
    for i in range(6, 11):  # maybe written, maybe not, when the server goes away
        hub.publish(B, created(i))
    gate.opened.clear()
    await lst.stop()
    await wait_until(lambda: not c.stats.connected and bool(gate.delays), "the disconnect")
    for i in range(11, 16):  # published while the consumer is away
        hub.publish(B, created(i))
    await lst.start()  # same hub (same epoch), same port
    gate.opened.set()
    await wait_until(lambda: len(rec.events) == 16, "all 15 events")
    await wait_until(lambda: c.stats.connected, "the reconnection")
    assert rec.events == [rec.events[0], *(created(i) for i in range(1, 16))]
    assert rec.kinds().count("resync") == 1
    assert hub.stats()["backends"][B]["resync_blocks"] == 1  # the resume was a replay
    assert h.sent_ids[0] is None and h.sent_ids[-1] is not None
    assert h.sent_ids[-1].startswith("e1-")
    assert c.stats.reconnects == len(h.sent_ids) - 1 >= 1
    assert c.stats.last_event_id == "e1-15"


async def test_listener_restart_with_new_epoch_yields_resync_and_snapshot(h: Harness) -> None:
    lst = await h.listener(EventHub(backends=[B], epoch="e1"))
    rec, gate = Recorder(), Gate()
    c = h.consumer(lst.url, rec, sleep=gate)
    h.run(c)
    await wait_until(lambda: rec.kinds() == ["resync"], "the resync block")
    lst.hub.publish(B, created(1))
    await wait_until(lambda: len(rec.events) == 2, "resync + 1 event")
    gate.opened.clear()
    await lst.stop()
    await wait_until(lambda: bool(gate.delays), "the disconnect")
    hub2 = EventHub(epoch="e2")
    hub2.add_backend(B, snapshot=lambda: [created(100), created(101)])
    await lst.start(hub2)
    gate.opened.set()
    await wait_until(lambda: len(rec.events) == 5, "the second resync block")
    hub2.publish(B, created(102))
    await wait_until(lambda: len(rec.events) == 6, "a live event of the new epoch")
    assert h.sent_ids[-1] == "e1-1"
    assert rec.events[2].event == "resync" and rec.events[2].reason == "unknown_epoch"
    assert rec.events[3:] == [created(100), created(101), created(102)]
    assert c.stats.resyncs == 2 and c.stats.last_event_id == "e2-1"
    # The first stream's resync starts the view; the second replaced held state.
    assert c.stats.resync_losses == 1 and c.stats.stream_overflows == 0


async def test_buffer_overflow_error_record_resumes_from_last_id(h: Harness) -> None:
    hub = EventHub(queue_size=2, backends=[B], epoch="e1")
    lst = await h.listener(hub)
    rec, backoff = Recorder(), RecordingBackoff()
    c = h.consumer(lst.url, rec, backoff=backoff)
    h.run(c)
    await wait_until(lambda: rec.kinds() == ["resync"], "the resync block")
    await wait_until(lambda: hub.stats()["backends"][B]["subscribers"] == 1, "subscriber")
    for i in range(1, 11):  # no await in between: the subscriber's queue of 2 overflows
        hub.publish(B, created(i))
    await wait_until(lambda: len(rec.events) == 11, "all 10 events")
    assert rec.events[1:] == [created(i) for i in range(1, 11)]
    assert hub.stats()["backends"][B]["overflows"] == 1
    assert hub.stats()["backends"][B]["resync_blocks"] == 1
    assert h.sent_ids == [None, "e1-2"]
    assert c.stats.last_error == "listener closed the stream: buffer_overflow"
    assert c.stats.dropped == 0 and c.stats.received == 11
    assert backoff.computed == [1] and backoff.resets == 1
    # Backpressure is counted per backend: one stream closed for overflow, no loss.
    assert c.stats.stream_overflows == 1 and c.stats.resync_losses == 0


async def test_apply_failure_is_retried_not_skipped(h: Harness) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    lst = await h.listener(hub)
    rec = Recorder()
    rec.fail_once.add(created(2))
    c = h.consumer(lst.url, rec)
    h.run(c)
    await wait_until(lambda: rec.kinds() == ["resync"], "the resync block")
    for i in range(1, 4):
        hub.publish(B, created(i))
    await wait_until(lambda: len(rec.events) == 4, "every event applied")
    assert rec.events[1:] == [created(1), created(2), created(3)]
    assert h.sent_ids == [None, "e1-1"]
    assert "RuntimeError: index unavailable" in (c.stats.last_error or "")


async def test_cancellation_propagates_when_connected_and_when_waiting(h: Harness) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    lst = await h.listener(hub)
    c = h.consumer(lst.url, Recorder())
    task = h.run(c)
    await wait_until(lambda: c.stats.processed == 1, "the resync block")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert task.cancelled() and not c.stats.connected
    await wait_until(lambda: hub.stats()["backends"][B]["subscribers"] == 0, "unsubscribe")

    server = await h.scripted([[503]] * 2)
    gate = Gate(block_after=1)
    c2 = h.consumer(server.url, Recorder(), sleep=gate)
    task2 = h.run(c2)
    await wait_until(lambda: bool(gate.delays), "the backoff wait")
    task2.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task2
    assert task2.cancelled()


# -- scripted raw servers ------------------------------------------------------------------------


async def test_oversized_line_drops_stream_and_resumes_from_last_id(h: Harness) -> None:
    rec = Recorder()

    async def first_applied() -> None:
        await wait_until(lambda: len(rec.events) == 1, "the first event")

    big = b"data: " + b"x" * (2 << 20)  # 2 MiB, no end of line
    server = await h.scripted(
        [
            [record("x-1", created_json(1)), first_applied, big],
            [record("x-2", created_json(2))],
        ]
    )
    c = h.consumer(server.url, rec)
    h.run(c)
    await wait_until(lambda: len(rec.events) == 2, "the event after the reconnect")
    assert rec.events == [bare(1), rec.events[1]]
    assert rec.events[1].prefix_hash == f"{2:064x}"
    assert [r.get("Last-Event-ID") for r in server.requests] == [None, "x-1"]
    assert server.requests[0]["Accept"] == "text/event-stream"
    assert c.stats.overflows == 1 and c.stats.dropped == 1
    assert c.stats.last_error is not None and c.stats.last_error.startswith("overflow")
    assert c.stats.last_event_id == "x-2"


async def test_invalid_records_are_dropped_not_fatal(h: Harness) -> None:
    server = await h.scripted(
        [
            [
                record("x-1", created_json(1)),
                record("x-2", b"{not json"),
                record("x-3", {"event": "cache_exploded", "prefix_hash": "00" * 32}),
                record("x-4", {"event": "cache_created", "prefix_hash": "XYZ"}),
                record("x-5", b"[1, 2]"),
                b": a heartbeat comment\n\n",
                record("x-6", created_json(6)),
            ]
        ]
    )
    rec = Recorder()
    c = h.consumer(server.url, rec)
    h.run(c)
    await wait_until(lambda: c.stats.last_event_id == "x-6", "the last record")
    assert [e.prefix_hash for e in rec.events] == [f"{1:064x}", f"{6:064x}"]
    st = c.stats
    assert (st.received, st.processed, st.dropped) == (6, 2, 4)
    assert st.connected and st.reconnects == 0 and len(server.requests) == 1


async def test_sse_event_field_wins_over_json_event(h: Harness) -> None:
    body = {"event": "cache_created", "backend": B, "prefix_hash": "ab" * 32}
    server = await h.scripted(
        [
            [
                record("x-1", body, event="cache_evicted"),
                record("x-2", {"backend": B, "prefix_hash": "cd" * 32}, event="cache_created"),
                record("x-3", body),  # no event: field: the JSON's applies
            ]
        ]
    )
    rec = Recorder()
    h.run(h.consumer(server.url, rec))
    await wait_until(lambda: len(rec.events) == 3, "3 events")
    assert rec.kinds() == ["cache_evicted", "cache_created", "cache_created"]


async def test_stream_backend_wins_over_json_backend(h: Harness) -> None:
    server = await h.scripted(
        [[record("x-1", created_json(1, backend="sglang-9")), record("x-2", {"event": "resync"})]]
    )
    rec = Recorder()
    c = h.consumer(server.url, rec)
    h.run(c)
    await wait_until(lambda: len(rec.events) == 2, "2 events")
    assert rec.events == [bare(1), rec.events[1]]
    assert rec.events[1] == KvEvent("resync", B)
    assert c.stats.dropped == 0


async def test_backoff_doubles_then_resets_after_a_delivering_connection(h: Harness) -> None:
    server = await h.scripted(
        [[503], [503], [503], [record("x-1", created_json(1))], [404]], end={3}
    )
    rec, backoff = Recorder(), RecordingBackoff()
    c = h.consumer(server.url, rec, backoff=backoff)
    h.run(c)
    await wait_until(lambda: len(server.requests) == 6, "6 connection attempts")
    assert backoff.computed == [1, 2, 3, 1, 2]
    assert backoff.resets == 1
    assert h.sent_ids == [None, None, None, None, "x-1", "x-1"]
    assert c.stats.reconnects == 5 and len(rec.events) == 1
    assert c.stats.last_error is not None and "HTTP 404" in c.stats.last_error


async def test_default_backoff_waits_interval_doubling_to_60s(h: Harness) -> None:
    server = await h.scripted([[503]] * 10)
    gate = Gate(block_after=10)
    src = EventSourceConfig(backend_name=B, endpoint=server.url, reconnect_interval_ms=250)
    c = h.consumer(server.url, Recorder(), backoff=default_backoff(src, jitter=0.0), sleep=gate)
    h.run(c)
    await wait_until(lambda: len(gate.delays) == 10, "10 waits")
    assert gate.delays == [0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 60.0, 60.0]


def test_default_backoff_cap_and_jitter() -> None:
    slow = EventSourceConfig(backend_name=B, endpoint="http://x/e", reconnect_interval_ms=120_000)
    assert [default_backoff(slow, jitter=0).compute(n) for n in (1, 2, 9)] == [120.0] * 3
    src = EventSourceConfig(backend_name=B, endpoint="http://x/e")
    b = default_backoff(src)  # jitter only ever shortens a delay
    for n, exact in ((1, 1.0), (3, 4.0), (7, 60.0), (50, 60.0)):
        assert exact * 0.8 <= b.compute(n) <= exact


async def test_websocket_messages_carry_sse_bytes(h: Harness) -> None:
    r1 = record("w-1", created_json(1))
    server = await h.scripted(
        [
            [r1[:10].decode(), r1[10:], record("w-2", created_json(2)).decode()],
            [record("w-3", created_json(3))],
        ],
        end={0},
        ws=True,
    )
    rec = Recorder()
    c = h.consumer(server.url, rec)
    h.run(c)
    await wait_until(lambda: len(rec.events) == 3, "3 events over 2 connections")
    assert [e.prefix_hash for e in rec.events] == [f"{i:064x}" for i in (1, 2, 3)]
    assert [r.get("Last-Event-ID") for r in server.requests] == [None, "w-2"]
    assert c.stats.connected


# -- the opener seam (push mode) -----------------------------------------------------------------


async def test_stream_opener_seam_and_records_lost_with_an_overflow_are_asked_again() -> None:
    opened: list[str | None] = []

    async def opener(last_id: str | None) -> AsyncIterator[bytes]:
        opened.append(last_id)
        if len(opened) == 1:  # one chunk: a whole record, then an oversized line
            yield record("p-1", created_json(1)) + b"data: " + b"y" * (2 << 20)
        else:
            yield record("p-1", created_json(1))[:7]
            yield record("p-1", created_json(1))[7:] + record("p-2", created_json(2))
            await asyncio.Event().wait()

    src = EventSourceConfig(backend_name=B, transport="event_bus")
    rec = Recorder()
    c = KvEventConsumer(src, rec, None, RecordingBackoff(), stream_opener=opener, sleep=Gate())
    task = asyncio.create_task(c.run())
    try:
        await wait_until(lambda: len(rec.events) == 2, "2 events")
        assert opened == [None, None]  # p-1 was never applied, so it was asked for again
        assert [e.prefix_hash for e in rec.events] == [f"{1:064x}", f"{2:064x}"]
        assert c.stats.last_event_id == "p-2" and c.stats.overflows == 1
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def test_a_large_chunk_does_not_hold_the_event_loop() -> None:
    """An in-memory index never suspends; a chunk of thousands of records must still let
    the router's other tasks (requests, the gRPC reader) run while it is applied."""
    n = 5_000
    chunk = b"".join(record(f"p-{i}", created_json(i)) for i in range(1, n + 1))
    done = asyncio.Event()

    async def opener(last_id: str | None) -> AsyncIterator[bytes]:
        yield chunk
        done.set()
        await asyncio.Event().wait()

    src = EventSourceConfig(backend_name=B, transport="event_bus")
    rec = Recorder()
    seen: list[int] = []  # events applied each time the other task got the loop

    async def other_task() -> None:
        while not done.is_set():
            seen.append(len(rec.events))
            await asyncio.sleep(0)

    c = KvEventConsumer(src, rec, None, RecordingBackoff(), stream_opener=opener, sleep=Gate())
    ticker = asyncio.create_task(other_task())
    task = asyncio.create_task(c.run())
    try:
        await asyncio.wait_for(done.wait(), 10)
        assert len(rec.events) == n and c.stats.processed == n
        during = sorted({k for k in seen if 0 < k < n})
        assert len(during) >= n // 256 - 1, during  # it ran between slices of the chunk
        assert max(b - a for a, b in zip([0, *during], [*during, n], strict=True)) <= 256
    finally:
        task.cancel()
        ticker.cancel()
        await asyncio.gather(task, ticker, return_exceptions=True)


async def test_apply_many_takes_a_slice_at_once_and_a_failed_slice_is_asked_again() -> None:
    """With ``apply_many`` a chunk's events go over in slices of up to 256; when one call
    fails, none of its events counts as applied (it cannot say how many were), so the
    next connection resumes before the slice and every event is applied at least once."""
    n = 600
    chunk = b"".join(record(f"p-{i}", created_json(i)) for i in range(1, n + 1))
    chunk = chunk.replace(b"\n\n", b"\n\ndata: not json\n\n", 1)  # an invalid record
    opened: list[str | None] = []
    calls: list[int] = []
    applied: list[KvEvent] = []

    async def opener(last_id: str | None) -> AsyncIterator[bytes]:
        opened.append(last_id)
        if last_id is None:
            yield chunk
        else:  # the listener's replay: everything after the last applied id
            yield chunk[chunk.index(f"id: p-{int(last_id[2:]) + 1}\n".encode()) :]
        await asyncio.Event().wait()

    async def apply_many(events: list[KvEvent]) -> list[str]:
        calls.append(len(events))
        if len(calls) == 2:  # the second slice fails once
            raise RuntimeError("index unavailable")
        applied.extend(events)
        return ["created"] * len(events)

    src = EventSourceConfig(backend_name=B, transport="event_bus")
    c = KvEventConsumer(
        src, Recorder(), None, RecordingBackoff(), stream_opener=opener, sleep=Gate(),
        apply_many=apply_many,
    )  # fmt: skip
    task = asyncio.create_task(c.run())
    try:
        await wait_until(lambda: c.stats.processed == n, "every event")
        # The invalid record (no id of its own) sits in the first slice: 255 events.
        assert opened == [None, "p-255"]  # resumed after the first, fully applied slice
        assert calls == [255, 256, 256, 89]
        assert {e.prefix_hash for e in applied} == {f"{i:064x}" for i in range(1, n + 1)}
        assert c.stats.dropped == 1 and c.stats.index_created == n
        assert c.stats.last_event_id == f"p-{n}"
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_event_bus_without_opener_is_refused() -> None:
    src = EventSourceConfig(backend_name=B, transport="event_bus")
    with pytest.raises(ValueError, match="event_bus requires a stream_opener"):
        KvEventConsumer(src, Recorder(), None)


# -- the manager ---------------------------------------------------------------------------------


async def test_manager_runs_one_consumer_per_source_and_restarts(h: Harness) -> None:
    hub = EventHub(backends=[B, "sglang-1"], epoch="e1")
    lst = await h.listener(hub)
    base = f"http://127.0.0.1:{lst.port}/events/"
    a = EventSourceConfig(backend_name=B, endpoint=base + B)
    b = EventSourceConfig(backend_name="sglang-1", endpoint=base + "sglang-1")
    bus = EventSourceConfig(backend_name="trt-1", transport="event_bus")
    rec = Recorder()
    sessions: list[aiohttp.ClientSession] = []

    def session_factory() -> aiohttp.ClientSession:
        sessions.append(aiohttp.ClientSession())
        return sessions[-1]

    mgr = KvEventConsumerManager(
        [a, b, bus, a],  # event_bus without an opener and a duplicate: skipped
        rec,
        session_factory=session_factory,
        backoff_factory=lambda s: RecordingBackoff(),
    )
    await mgr.start()
    try:
        assert set(mgr.stats()) == {B, "sglang-1"}
        await wait_until(lambda: len(rec.events) == 2, "two resync blocks")
        hub.publish(B, created(1))
        hub.publish("sglang-1", created(2, "sglang-1"))
        await wait_until(lambda: len(rec.events) == 4, "two resyncs and two events")
        stats = mgr.stats()
        assert isinstance(stats[B], ConsumerStats)
        assert stats[B].processed == 2 and stats["sglang-1"].processed == 2
        assert stats[B].connected and stats[B].last_event_id == "e1-1"
        stats[B].processed = 99  # a copy
        assert mgr.stats()[B].processed == 2
        assert stats[B].as_dict()["backend"] == B

        before = mgr.consumers[B]
        b2 = b.model_copy(update={"reconnect_interval_ms": 500})
        await mgr.restart([a, b2])  # a unchanged; b changed: restarted, resumes from its id
        assert mgr.consumers[B] is before
        await wait_until(lambda: mgr.stats()["sglang-1"].connected, "the restarted consumer")
        hub.publish("sglang-1", created(3, "sglang-1"))
        await wait_until(lambda: len(rec.events) == 5, "the event after the restart")
        assert rec.events[-1] == created(3, "sglang-1")
        assert hub.stats()["backends"]["sglang-1"]["resync_blocks"] == 1

        await mgr.restart([b2])
        assert set(mgr.stats()) == {"sglang-1"}
        await wait_until(lambda: hub.stats()["backends"][B]["subscribers"] == 0, "a's end")
    finally:
        await mgr.stop()
    assert mgr.stats() == {}
    assert len(sessions) == 1 and sessions[0].closed
    await mgr.stop()  # idempotent


async def test_manager_resync_starts_every_stream_over_from_a_snapshot(h: Harness) -> None:
    hub = EventHub(backends=[B], epoch="e1")
    lst = await h.listener(hub)
    src = EventSourceConfig(backend_name=B, endpoint=f"http://127.0.0.1:{lst.port}/events/{B}")
    rec = Recorder()
    mgr = KvEventConsumerManager([src], rec, backoff_factory=lambda s: RecordingBackoff())
    assert await mgr.resync() == []  # not started: nothing to do
    await mgr.start()
    try:
        await wait_until(lambda: len(rec.events) == 1, "the first resync")
        hub.publish(B, created(1))
        await wait_until(lambda: len(rec.events) == 2, "the event")
        assert mgr.stats()[B].last_event_id == "e1-1"
        # An index that lost its entries asks for everything again: a resumed stream
        # would send nothing (the router is at the listener's head).
        assert await mgr.resync() == [B]
        await wait_until(lambda: len(rec.events) == 3, "a second resync block")
        assert rec.events[2].event == "resync" and rec.events[2].reason == "no_event_id"
        assert hub.stats()["backends"][B]["resync_blocks"] == 2
        st = mgr.stats()[B]
        assert st.processed == 3 and st.connected  # counters carried over
        hub.publish(B, created(2))
        await wait_until(lambda: len(rec.events) == 4, "live again after the resync")
    finally:
        await mgr.stop()


async def test_manager_resync_survives_a_consumer_that_loses_its_cancellation(
    h: Harness,
) -> None:
    """On Python 3.11 ``asyncio.wait_for`` (redis-py wraps each socket write in it) returns
    its result when a cancellation arrives as that result does, and the task goes on. A
    resync that waited once for the cancelled consumer then waited forever, with no
    consumer listed for the backend (seen after a Redis failover: the router's gRPC
    ``Backends`` had no position for either engine for a minute)."""
    hub = EventHub(backends=[B], epoch="e1")
    lst = await h.listener(hub)
    src = EventSourceConfig(backend_name=B, endpoint=f"http://127.0.0.1:{lst.port}/events/{B}")
    events: list[KvEvent] = []
    in_apply = asyncio.Event()
    stall = [True]

    async def apply(ev: KvEvent) -> str:
        if ev.event == "cache_created" and stall:
            stall.clear()
            in_apply.set()
            try:
                await asyncio.Event().wait()  # a Redis write in flight
            except asyncio.CancelledError:
                pass  # what 3.11's wait_for does when its operation completes right then
        events.append(ev)
        return LABELS[ev.event]

    mgr = KvEventConsumerManager([src], apply, backoff_factory=lambda s: RecordingBackoff())
    await mgr.start()
    try:
        await wait_until(lambda: len(events) == 1, "the first resync")
        hub.publish(B, created(1))
        await asyncio.wait_for(in_apply.wait(), WAIT_S)
        assert await asyncio.wait_for(mgr.resync(), WAIT_S) == [B]
        await wait_until(
            lambda: [e.event for e in events][-1:] == ["resync"] and len(events) >= 3,
            "the new consumer's resync block",
        )
        assert set(mgr.stats()) == {B}
    finally:
        await mgr.stop()


async def test_end_resync_runs_right_after_the_last_snapshot_record(h: Harness) -> None:
    """A sized ``resync`` block is swapped in by ``end_resync`` between its last snapshot
    record and the next live one, for a subscriber's own block and for a shared resync
    alike; when ``end_resync`` fails, that last record counts as not applied and the
    consumer asks again (a fresh block), so the swap is never skipped."""
    hub = EventHub(backends=[B], epoch="e1")
    hub.add_backend(B, lambda: [created(1), created(2), created(3)])
    lst = await h.listener(hub)
    log: list[str] = []
    fail = [True]

    async def apply_many(events: list[KvEvent]) -> list[str]:
        log.extend(f"{e.event}:{e.token_count}" for e in events)
        return [LABELS[e.event] for e in events]

    async def end_resync(backend: str) -> None:
        log.append(f"end:{backend}")
        if fail.pop() if fail else False:
            raise RuntimeError("swap failed")

    block = ["resync:None", "cache_created:1", "cache_created:2", "cache_created:3"]
    c = h.consumer(lst.url, Recorder(), apply_many=apply_many, end_resync=end_resync)
    h.run(c)
    await wait_until(lambda: log.count(f"end:{B}") == 2, "the swap, after one failure")
    assert log == [*block, f"end:{B}", *block, f"end:{B}"]
    assert h.sent_ids == [None, "e1.s0-3"]  # the failed last record was asked for again
    hub.publish(B, created(7))
    hub.resync(B, "restart", [created(8), created(9)])
    hub.publish(B, created(10))
    await wait_until(lambda: "cache_created:10" in log, "the live events")
    assert log[2 * len(block) + 2 :] == [
        "cache_created:7",
        "resync:None",
        "cache_created:8",
        "cache_created:9",
        f"end:{B}",
        "cache_created:10",
    ]
    assert c.stats.resyncs == 3 and c.stats.last_event_id == "e1-5"


async def test_waiting_for_a_session_is_not_counted_as_reconnects(h: Harness) -> None:
    """Push mode: while no listener session offers the backend (a partition), the opener
    is polled every ``reconnect_interval_ms``; those polls are not connection attempts, so
    a five-minute partition is one reconnect, not thousands."""
    calls = 0

    async def opener(last_id: str | None) -> AsyncIterator[bytes]:
        nonlocal calls
        calls += 1
        if calls == 1:
            yield record("x-1", created_json(1))
            return  # the session ends: the partition begins
        if calls < 42:
            raise SourceUnavailable("no session")
        yield record("x-2", created_json(2))
        await asyncio.Event().wait()

    rec = Recorder()
    c = h.consumer("http://unused.invalid/events", rec, stream_opener=opener)
    h.run(c)
    await wait_until(lambda: len(rec.events) == 2, "the event after the session is back")
    assert calls == 42
    assert c.stats.reconnects == 1
