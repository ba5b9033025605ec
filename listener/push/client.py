"""The listener's session with the router's event bus: a supervisor over one connection.

:meth:`EventBusClient.run` runs a :class:`bus.supervisor.Supervisor` over
:meth:`_run_once`, which holds one channel and one Session call (Hello -> Welcome -> the
router's Subscribe / Unsubscribe / Forbidden), one :class:`StreamWriter` task per
Subscribe; when the call ends for any reason the writers are stopped and, unless the
listener is draining, the supervisor waits ``reconnect_backoff`` doubling per failure up
to max(reconnect_backoff, reconnect_backoff_max) and dials again (a session that got its
Welcome resets the count). ``CancelledError`` always propagates.

The router's ``SnapshotRequest`` (its anti-entropy check, which cannot reach the
listener's ``GET /snapshot/{backend}`` in push mode) is answered on the session by
``SnapshotChunk`` messages holding the same JSON body (``listener.snapshot``), each of at
most ``batch_max_bytes`` (the bound StreamData keeps under the router's message limit),
one answer at a time: every write on the session call goes through one lock.

Drain (SIGTERM, :meth:`drain`): send ``Draining``, close every open stream with
``CLOSE_REASON_DRAINING`` after its in-flight write, half-close the session and wait for
the router to end it, all within ``drain_deadline``; whatever is left is then cancelled.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Sequence
from pathlib import Path

import grpc

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
from bus.backoff import Backoff, ExponentialBackoff
from bus.grpc_tls import channel_credentials
from bus.stream_data import encode_stream_request
from bus.supervisor import Attempt, Supervisor, Verdict
from bus.tasks import cancel_and_wait

from ..snapshot import snapshot_body
from ..stream import EventHub, UnknownBackendError
from .config import EventBusClientConfig
from .writer import OpenStream, StreamWriter

__all__ = ["EventBusClient", "SessionEnded", "SessionRefused"]

log = logging.getLogger("continuum.listener.push")


def keepalive_options(cfg: EventBusClientConfig) -> list[tuple[str, int | str]]:
    """HTTP/2 keepalive pings (``keepalive_time``/``keepalive_timeout``): without them a
    session whose path went silent would wait for a FIN that never comes. gRPC core waits
    for the ack ``grpc.http2.ping_timeout_ms`` (a minute by default) whatever
    ``keepalive_timeout_ms`` says, so both are set to ``keepalive_timeout``."""
    timeout_ms = round(cfg.keepalive_timeout_s * 1000)
    return [
        ("grpc.keepalive_time_ms", round(cfg.keepalive_time_s * 1000)),
        ("grpc.keepalive_timeout_ms", timeout_ms),
        ("grpc.http2.ping_timeout_ms", timeout_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


class SessionRefused(Exception):
    """The router answered the Hello with something other than a Welcome."""


class SessionEnded(Exception):
    """The router ended the session with a status other than OK."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self.code = code


async def _raise_status(call: grpc.aio.StreamStreamCall) -> None:
    """Raise SessionEnded unless the finished call's status is OK."""
    code = await call.code()
    if code != grpc.StatusCode.OK:
        raise SessionEnded(code, await call.details() or "")


def _stream_method(channel: grpc.aio.Channel) -> OpenStream:
    """EventBus.Stream whose serializer lets the writer's pre-framed StreamData through
    (``bus.stream_data``); the generated stub's would insist on a message object."""
    return channel.stream_unary(
        "/continuum.bus.v1.EventBus/Stream",
        request_serializer=encode_stream_request,
        response_deserializer=pb.StreamResponse.FromString,
        _registered_method=True,
    )


def _read_text(path: str) -> bytes:
    return Path(path).read_bytes()


_EXPECTED = (SessionEnded, SessionRefused, TimeoutError, OSError, grpc.RpcError)
"""How a session ends in the normal run of things; anything else is logged as a bug."""


def _why(exc: Exception | None) -> str:
    """How a session ended, for ``last_error`` and the log."""
    if exc is None:
        return "session ended"
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    if isinstance(exc, SessionEnded):
        return str(exc)
    return f"{type(exc).__name__}: {exc}"


class EventBusClient:
    """Runs push mode for one listener process (module docstring).

    Args:
        cfg: The ``event_bus`` section.
        hub: The listener's event hub (the same one the SSE server reads).
        sources: Source ids announced in the Hello (the hub's backends).
        heartbeat_interval: SSE heartbeat interval of streams.
        backoff: Reconnect strategy (tests inject one that does not sleep).
    """

    def __init__(
        self,
        cfg: EventBusClientConfig,
        hub: EventHub,
        sources: Sequence[str],
        *,
        heartbeat_interval: float = 15.0,
        backoff: Backoff | None = None,
    ) -> None:
        self.cfg = cfg
        self.hub = hub
        self.sources = list(sources)
        self.heartbeat_interval = heartbeat_interval
        base = cfg.reconnect_backoff_s
        self._draining = False
        self._supervisor = Supervisor(
            self._connection,
            self._classify,
            backoff=backoff
            or ExponentialBackoff(base, max(base, cfg.reconnect_backoff_max_s), 0.2),
            on_retry=self._log_retry,
            should_stop=lambda: self._draining,
        )
        self._call: grpc.aio.StreamStreamCall | None = None
        self._write_lock = asyncio.Lock()
        self._snapshots: set[asyncio.Task[None]] = set()
        self._writers: dict[str, tuple[StreamWriter, asyncio.Task[None]]] = {}
        self._done_draining = asyncio.Event()
        self.session_id: str | None = None
        self.stats: dict[str, int | str | None] = {
            "connected": 0,
            "sessions": 0,
            "subscribes": 0,
            "snapshots": 0,
            "last_error": None,
        }

    # -- credentials ---------------------------------------------------------------------

    async def _credentials(self) -> tuple[grpc.ChannelCredentials, list[tuple[str, str]]]:
        cfg = self.cfg
        # Re-read per connection, so a rotated token or certificate is picked up.
        creds = await asyncio.to_thread(
            channel_credentials, cfg.ca_file, cfg.client_cert_file, cfg.client_key_file
        )
        token = None
        if cfg.credential_file:
            token = (await asyncio.to_thread(_read_text, cfg.credential_file)).decode().strip()
        elif cfg.credential_env:
            token = os.environ.get(cfg.credential_env, "").strip() or None
            if token is None:
                log.warning("event bus: environment variable %s is empty", cfg.credential_env)
        metadata = [("authorization", f"Bearer {token}")] if token else []
        return creds, metadata

    # -- supervisor ----------------------------------------------------------------------

    async def run(self) -> None:
        """Keep a session up until drained or cancelled."""
        await self._supervisor.run()
        self._done_draining.set()

    async def _connection(self) -> None:
        """One session for the supervisor; its writers stop with it, however it ends."""
        try:
            await self._run_once()
        finally:
            self.stats["connected"] = 0
            self._stop_writers(pb.CLOSE_REASON_ERROR)
            for task in list(self._snapshots):  # their session is gone: nobody to answer
                task.cancel()

    def _classify(self, exc: Exception | None) -> Verdict:
        """Every ending is retried (until the drain): the listener stays up whatever."""
        if exc is not None and not isinstance(exc, _EXPECTED):
            log.exception("event bus: unexpected error")
        return Verdict.RETRY

    def _log_retry(self, attempt: Attempt) -> None:
        why = _why(attempt.error)
        self.stats["last_error"] = why
        failures = attempt.failures
        # The first failure of an outage is a warning, then every tenth (the delay
        # doubles, so that is rarely); the others are routine.
        level = logging.WARNING if failures == 1 or failures % 10 == 0 else logging.INFO
        if attempt.healthy and why.startswith("UNAVAILABLE"):
            level = logging.INFO  # the router went away (restart): routine, retrying
        log.log(
            level,
            "event bus: %s (%s); reconnecting in %.2fs (failure %d)",
            why,
            self.cfg.url,
            attempt.delay,
            failures,
        )

    async def _run_once(self) -> None:
        """One channel, one Session call; healthy once the router's Welcome arrives."""
        cfg = self.cfg
        creds, metadata = await self._credentials()
        options = keepalive_options(cfg)
        if cfg.tls_server_name:
            options.append(("grpc.ssl_target_name_override", cfg.tls_server_name))
        async with grpc.aio.secure_channel(cfg.target, creds, options=options) as channel:
            stub = pb_grpc.EventBusStub(channel)
            call = stub.Session(metadata=metadata)
            self._call = call
            try:
                hello = pb.Hello(
                    client_id=cfg.client_id, role=pb.ROLE_KV_LISTENER, sources=self.sources
                )
                async with asyncio.timeout(cfg.connect_timeout_s):
                    # The router sends the initial metadata once it has admitted the call:
                    # writing the Hello only then keeps a refusal's status intact.
                    await call.initial_metadata()
                    if call.done():
                        await _raise_status(call)
                    await call.write(pb.SessionRequest(hello=hello))
                    first = await call.read()
                if first is grpc.aio.EOF:
                    await _raise_status(call)
                    raise SessionRefused("the router ended the session before its Welcome")
                if first.WhichOneof("kind") != "welcome":
                    raise SessionRefused(f"expected a Welcome, got {first.WhichOneof('kind')}")
                self._supervisor.healthy()
                self.session_id = first.welcome.session_id
                self.stats["connected"] = 1
                self.stats["sessions"] = int(self.stats["sessions"] or 0) + 1
                log.info(
                    "event bus: session %s with %s; the router consumes %s",
                    self.session_id,
                    cfg.url,
                    ", ".join(first.welcome.accepted_sources) or "nothing yet",
                )
                await self._serve(_stream_method(channel), call, metadata)
                await _raise_status(call)
            finally:
                self._call = None
                if not call.done():
                    call.cancel()

    async def _serve(
        self,
        open_stream: OpenStream,
        call: grpc.aio.StreamStreamCall,
        metadata: list[tuple[str, str]],
    ) -> None:
        loop = asyncio.get_running_loop()
        while True:
            msg = await call.read()
            if msg is grpc.aio.EOF:
                return
            kind = msg.WhichOneof("kind")
            if kind == "subscribe":
                sub = msg.subscribe
                self.stats["subscribes"] = int(self.stats["subscribes"] or 0) + 1
                if self._draining:
                    continue  # the router stops asking once it saw Draining
                writer = StreamWriter(
                    open_stream,
                    metadata,
                    self.hub,
                    sub,
                    heartbeat_interval=self.heartbeat_interval,
                    batch_max_bytes=self.cfg.batch_max_bytes,
                    linger_s=self.cfg.batch_linger_ms / 1000,
                )
                task = loop.create_task(writer.run(), name=f"bus-stream:{sub.source}")
                self._writers[sub.stream_id] = (writer, task)
                task.add_done_callback(functools.partial(self._forget_writer, sub.stream_id))
                log.info(
                    "event bus: streaming %s (stream %s) from %s",
                    sub.source,
                    sub.stream_id,
                    sub.last_event_id or "the start",
                )
            elif kind == "unsubscribe":
                entry = self._writers.get(msg.unsubscribe.stream_id)
                log.info(
                    "event bus: the router unsubscribed stream %s: %s",
                    msg.unsubscribe.stream_id,
                    msg.unsubscribe.reason or "no reason given",
                )
                if entry is not None:
                    entry[0].stop(pb.CLOSE_REASON_UNSUBSCRIBED)
            elif kind == "snapshot_request":
                task = loop.create_task(
                    self._answer_snapshot(call, msg.snapshot_request),
                    name=f"bus-snapshot:{msg.snapshot_request.source[:64]}",
                )
                self._snapshots.add(task)
                task.add_done_callback(self._snapshots.discard)
            elif kind == "forbidden":
                log.error(
                    "event bus: the router ended the session: forbidden: %s",
                    msg.forbidden.reason,
                )

    async def _answer_snapshot(
        self, call: grpc.aio.StreamStreamCall, req: pb.SnapshotRequest
    ) -> None:
        """The snapshot of ``req.source`` in chunks (module docstring); a session that ends
        meanwhile ends the answer with it (the router forgets the request)."""
        try:
            body = snapshot_body(self.hub, req.source)
        except UnknownBackendError:
            chunks = [
                pb.SnapshotChunk(
                    request_id=req.request_id,
                    last=True,
                    error=f"unknown source {req.source[:64]!r}",
                )
            ]
        else:
            step = self.cfg.batch_max_bytes
            pieces = [body[i : i + step] for i in range(0, len(body), step)] or [b""]
            chunks = [
                pb.SnapshotChunk(request_id=req.request_id, data=piece, last=n == len(pieces) - 1)
                for n, piece in enumerate(pieces)
            ]
        with contextlib.suppress(grpc.RpcError, grpc.aio.UsageError, ConnectionError):
            for chunk in chunks:
                async with self._write_lock:
                    await call.write(pb.SessionRequest(snapshot=chunk))
            self.stats["snapshots"] = int(self.stats["snapshots"] or 0) + 1

    def _forget_writer(self, stream_id: str, _task: asyncio.Task[None]) -> None:
        self._writers.pop(stream_id, None)

    def _stop_writers(self, reason: pb.CloseReason) -> None:
        for writer, _task in list(self._writers.values()):
            writer.stop(reason)

    # -- shutdown ------------------------------------------------------------------------

    async def drain(self, run_task: asyncio.Task[None] | None = None) -> None:
        """SIGTERM: Draining, close streams, end the session, within ``drain_deadline``."""
        self._draining = True
        deadline = time.monotonic() + self.cfg.drain_deadline_s
        call = self._call
        if call is not None and not call.done():
            with contextlib.suppress(grpc.RpcError, grpc.aio.UsageError, ConnectionError):
                async with self._write_lock:
                    await call.write(pb.SessionRequest(draining=pb.Draining(reason="SIGTERM")))
        self._stop_writers(pb.CLOSE_REASON_DRAINING)
        tasks = [t for _w, t in self._writers.values()]
        if tasks:
            await asyncio.wait(tasks, timeout=max(0.0, deadline - time.monotonic()))
        if call is not None and not call.done():
            with contextlib.suppress(grpc.RpcError, grpc.aio.UsageError, ConnectionError):
                async with self._write_lock:
                    await call.done_writing()
        if run_task is not None and not run_task.done():
            if call is not None:  # wait for the router to end the session (OK)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(
                        asyncio.shield(self._done_draining.wait()),
                        max(0.0, deadline - time.monotonic()),
                    )
            # Whatever is left of it (a wait to reconnect, say) has nothing to drain.
            await cancel_and_wait(run_task)
        for _w, t in list(self._writers.values()):
            t.cancel()
        log.info("event bus: drained")
