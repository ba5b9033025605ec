"""An HTTP/2-aware TLS proxy on loopback that injects ``RST_STREAM`` and ``GOAWAY``.

gRPC runs on HTTP/2, and the failures a real path deals it are often not TCP's: a load
balancer or service mesh in between resets one stream (``RST_STREAM``) and leaves the
connection up, or goes away gracefully (``GOAWAY`` with the last stream id it will still
serve) and closes. :class:`H2Proxy` plays such an intermediary between a gRPC client and
server of the project (the listener's event-bus client and the router's ``EventBus``):

* it terminates TLS (offering ``h2`` by ALPN, with a certificate the client trusts) and
  dials the server over TLS again, so it sees the HTTP/2 frames in the clear;
* it forwards every frame verbatim, one whole frame per write, both ways; it decodes the
  client's header blocks (HPACK, one decoder per connection, fed every block in order as
  the server's decoder is) to learn each stream's ``:path``;
* :meth:`reset_streams` sends ``RST_STREAM`` on every open stream of a path, to both
  ends, as an intermediary that cancels a stream does; frames still in flight on a reset
  stream are dropped, and a dropped ``DATA`` frame is credited back to its sender with a
  connection ``WINDOW_UPDATE`` (else the connection's flow-control window would shrink
  for good by what nobody received);
* :meth:`goaway` sends ``GOAWAY`` (``NO_ERROR``, last-stream-id the highest stream the
  client opened) on every connection to the client, and closes each connection (FIN both
  ways) ``linger`` seconds later: the streams it named keep running until then, new calls
  must go to a new connection.

Not a general HTTP/2 proxy (no stream multiplexing of its own, no server push); it exists
for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import struct
from dataclasses import dataclass, field
from pathlib import Path

from hpack import Decoder

__all__ = ["FRAME_DATA", "FRAME_GOAWAY", "FRAME_RST_STREAM", "H2Proxy", "frame", "parse_header"]

log = logging.getLogger("harness.h2proxy")

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
FRAME_DATA = 0x0
FRAME_HEADERS = 0x1
FRAME_RST_STREAM = 0x3
FRAME_GOAWAY = 0x7
FRAME_WINDOW_UPDATE = 0x8
FRAME_CONTINUATION = 0x9
FLAG_END_STREAM = 0x1
FLAG_END_HEADERS = 0x4
FLAG_PADDED = 0x8
FLAG_PRIORITY = 0x20
NO_ERROR = 0x0
CANCEL = 0x8
_MAX_FRAME = 1 << 24


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One HTTP/2 frame (RFC 9113 §4.1)."""
    return (
        struct.pack(">I", len(payload))[1:]
        + bytes((kind, flags))
        + struct.pack(">I", stream_id & 0x7FFFFFFF)
        + payload
    )


def parse_header(head: bytes) -> tuple[int, int, int, int]:
    """(length, type, flags, stream id) of a 9-byte frame header."""
    if len(head) != 9:
        raise ValueError("a frame header is 9 bytes")
    length = int.from_bytes(head[:3], "big")
    return length, head[3], head[4], int.from_bytes(head[5:9], "big") & 0x7FFFFFFF


def header_fragment(flags: int, payload: bytes) -> bytes:
    """The header block fragment of a HEADERS frame: padding and priority removed."""
    pad = 0
    if flags & FLAG_PADDED:
        if not payload:
            raise ValueError("PADDED HEADERS frame without a pad length")
        pad, payload = payload[0], payload[1:]
    if flags & FLAG_PRIORITY:
        payload = payload[5:]
    if pad > len(payload):
        raise ValueError("padding longer than the frame")
    return payload[: len(payload) - pad]


@dataclass(eq=False)
class _Conn:
    down_w: asyncio.StreamWriter
    up_w: asyncio.StreamWriter
    decoder: Decoder = field(default_factory=Decoder)
    #: ``:path`` of each client stream whose headers were seen and that has not ended.
    paths: dict[int, str] = field(default_factory=dict)
    #: Streams this proxy reset: their frames are dropped from then on.
    reset: set[int] = field(default_factory=set)
    last_stream: int = 0
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    _block: tuple[int, bytearray] | None = None
    closed: bool = False


class H2Proxy:
    """Listens on loopback with TLS (``cert``/``key``) and forwards each connection to
    ``upstream_host:upstream_port`` over TLS verified against ``ca`` as
    ``server_name`` (module docstring).
    """

    def __init__(
        self,
        upstream_port: int,
        *,
        cert: Path,
        key: Path,
        ca: Path,
        upstream_host: str = "127.0.0.1",
        server_name: str = "localhost",
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.server_name = server_name
        self._server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        self._server_ctx.load_cert_chain(str(cert), str(key))
        self._server_ctx.set_alpn_protocols(["h2"])
        self._client_ctx = ssl.create_default_context(cafile=str(ca))
        self._client_ctx.set_alpn_protocols(["h2"])
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self.port = 0
        self.accepted = 0
        """Connections accepted so far."""
        self.streams_seen: dict[str, int] = {}
        """Streams the client opened, by ``:path``."""
        self.rst_sent = 0
        """Streams reset by :meth:`reset_streams`."""
        self.goaways_sent = 0
        """Connections sent a GOAWAY by :meth:`goaway`."""
        self.dropped_frames = 0
        """Frames that arrived on a stream after this proxy reset it."""

    async def start(self) -> H2Proxy:
        self._server = await asyncio.start_server(
            self._accept, "127.0.0.1", 0, ssl=self._server_ctx
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for conn in list(self._conns):
            self._close(conn)

    @property
    def connections(self) -> int:
        return len(self._conns)

    # -- injection -----------------------------------------------------------------------

    def open_streams(self, path: str) -> list[int]:
        """Ids of the open client streams of ``path`` on every connection."""
        return [sid for c in self._conns for sid, p in c.paths.items() if p == path]

    def reset_streams(self, path: str, error_code: int = CANCEL) -> int:
        """RST_STREAM every open stream of ``path``, to the client and to the server; how
        many were reset."""
        n = 0
        payload = struct.pack(">I", error_code)
        for conn in list(self._conns):
            for sid in [s for s, p in conn.paths.items() if p == path]:
                conn.reset.add(sid)
                conn.paths.pop(sid, None)
                conn.down_w.write(frame(FRAME_RST_STREAM, 0, sid, payload))
                conn.up_w.write(frame(FRAME_RST_STREAM, 0, sid, payload))
                n += 1
        self.rst_sent += n
        return n

    def goaway(self, linger: float = 0.2) -> int:
        """GOAWAY (NO_ERROR, the highest client stream as last-stream-id) on every
        connection to the client, each closed ``linger`` seconds later; how many."""
        conns = list(self._conns)
        for conn in conns:
            payload = struct.pack(">II", conn.last_stream, NO_ERROR) + b"h2proxy going away"
            conn.down_w.write(frame(FRAME_GOAWAY, 0, 0, payload))
            asyncio.get_running_loop().call_later(linger, self._close, conn)
        self.goaways_sent += len(conns)
        return len(conns)

    # -- internals -----------------------------------------------------------------------

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        self._conns.discard(conn)
        for w in (conn.down_w, conn.up_w):
            with contextlib.suppress(Exception):
                w.close()
        current = asyncio.current_task()
        for t in conn.tasks:
            if t is not current:
                t.cancel()

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            up_r, up_w = await asyncio.open_connection(
                *self.upstream, ssl=self._client_ctx, server_hostname=self.server_name
            )
        except OSError:
            down_w.close()
            return
        conn = _Conn(down_w, up_w)
        self._conns.add(conn)
        task = asyncio.current_task()
        assert task is not None
        conn.tasks.append(task)
        pipes = [
            asyncio.create_task(self._pipe(conn, down_r, up_w, up_to_server=True)),
            asyncio.create_task(self._pipe(conn, up_r, down_w, up_to_server=False)),
        ]
        conn.tasks.extend(pipes)
        try:
            await asyncio.gather(*pipes, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            self._close(conn)

    async def _pipe(
        self,
        conn: _Conn,
        r: asyncio.StreamReader,
        w: asyncio.StreamWriter,
        *,
        up_to_server: bool,
    ) -> None:
        back = conn.down_w if up_to_server else conn.up_w
        try:
            if up_to_server:
                preface = await r.readexactly(len(PREFACE))
                if preface != PREFACE:
                    raise ValueError("not an HTTP/2 client preface")
                w.write(preface)
            while True:
                head = await r.readexactly(9)
                length, kind, flags, sid = parse_header(head)
                if length >= _MAX_FRAME:
                    raise ValueError("frame too large")
                payload = await r.readexactly(length)
                if sid and sid in conn.reset:
                    self.dropped_frames += 1
                    if kind == FRAME_DATA and length:  # credit the connection window
                        back.write(frame(FRAME_WINDOW_UPDATE, 0, 0, struct.pack(">I", length)))
                    continue
                if up_to_server:
                    self._observe(conn, kind, flags, sid, payload)
                elif kind == FRAME_RST_STREAM or (
                    kind in (FRAME_DATA, FRAME_HEADERS) and flags & FLAG_END_STREAM
                ):
                    conn.paths.pop(sid, None)
                w.write(head + payload)
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError, OSError, ValueError):
            pass
        finally:
            self._close(conn)

    def _observe(self, conn: _Conn, kind: int, flags: int, sid: int, payload: bytes) -> None:
        """Track the client's streams: their ``:path`` from the decoded header blocks."""
        if kind == FRAME_HEADERS:
            conn.last_stream = max(conn.last_stream, sid)
            conn._block = (sid, bytearray(header_fragment(flags, payload)))
        elif kind == FRAME_CONTINUATION and conn._block is not None:
            conn._block[1].extend(payload)
        elif kind == FRAME_RST_STREAM:
            conn.paths.pop(sid, None)
        if kind in (FRAME_HEADERS, FRAME_CONTINUATION) and flags & FLAG_END_HEADERS:
            assert conn._block is not None
            block_sid, block = conn._block
            conn._block = None
            headers = dict(conn.decoder.decode(bytes(block), raw=True))
            path = headers.get(b":path", b"").decode("ascii", "replace")
            if path:  # a request's headers (trailers have no :path)
                self.streams_seen[path] = self.streams_seen.get(path, 0) + 1
                conn.paths[block_sid] = path
