"""A TCP proxy on loopback that tests switch between forwarding, a blackhole and resets.

Network faults between two of the project's processes (the router's SSE consumer and the
listener, the listener's event-bus client and the router's bus, the listener and an
engine's ZMQ socket) are played by putting one of these between them:

* **forward** — bytes go both ways, at most ``chunk`` bytes in hand per direction (the
  sockets' own buffers, and a transport write buffer bounded by ``drain``, hold the rest:
  a sender that outruns its peer blocks, as it would on a real path);
* **blackhole** — nothing is read or written in either direction and every socket stays
  open: no FIN, no RST, which is what a dead network path or a crashed NAT looks like to
  both ends. Bytes already sent stay in the kernel's buffers, so a heal (back to
  forward) delivers them, as TCP retransmission would after a partition. A connection
  accepted during a blackhole is not dialled upstream until the heal (its SYN was lost);
* **strand** — a NAT that restarted and lost its state: the connections open now stay
  blackholed for good (neither end hears anything, ever), new ones are forwarded;
* **reset** — every open connection, both sides, is closed with ``SO_LINGER`` 0 (an
  RST), and so is each one accepted while in this mode, until switched back;
* **throttle** — forwarding at most ``rate`` bytes per second per direction (a slow
  path, or a slow reader seen from the writer).

asyncio only; one proxy per listening port. Not for production use: it exists for tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from dataclasses import dataclass, field
from enum import Enum

__all__ = ["BlackholeProxy", "Mode"]

_LINGER_0 = struct.pack("ii", 1, 0)


class Mode(Enum):
    FORWARD = "forward"
    BLACKHOLE = "blackhole"
    RESET = "reset"


@dataclass(eq=False)
class _Conn:
    down_w: asyncio.StreamWriter
    flowing: asyncio.Event
    up_w: asyncio.StreamWriter | None = None
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    stranded: bool = False


def _rst(writer: asyncio.StreamWriter | None) -> None:
    """Close with an RST (SO_LINGER 0), whatever is buffered."""
    if writer is None:
        return
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_0)
    writer.transport.abort()


class BlackholeProxy:
    """Listens on ``listen_host:listen_port`` (0: any free port) and forwards each
    connection to ``upstream_host:upstream_port`` (module docstring for the modes).

    Args:
        chunk: Most bytes read at once per direction (the proxy's own buffer).
        rate: Bytes per second per direction when throttled (None: unthrottled).
        sock_buf: ``SO_RCVBUF``/``SO_SNDBUF`` of the proxy's sockets, set before they
            connect (None: the kernel's autotuned buffers, megabytes on loopback). Small
            ones make a throttled or blackholed path push back on the sender at once, as
            a slow reader across a real network does, instead of absorbing megabytes.
    """

    def __init__(
        self,
        upstream_host: str,
        upstream_port: int,
        *,
        listen_host: str = "127.0.0.1",
        listen_port: int = 0,
        chunk: int = 65_536,
        rate: float | None = None,
        sock_buf: int | None = None,
    ) -> None:
        if chunk < 1:
            raise ValueError("chunk must be positive")
        self.upstream = (upstream_host, upstream_port)
        self.listen_host = listen_host
        self.listen_port = listen_port
        self.chunk = chunk
        self.rate = rate
        self.sock_buf = sock_buf
        self.mode = Mode.FORWARD
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self.accepted = 0
        """Connections accepted so far."""
        self.resets = 0
        """Connections closed with an RST by :meth:`reset` or while in reset mode."""
        self.forwarded = {"up": 0, "down": 0}
        """Bytes forwarded towards the upstream and back."""

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> BlackholeProxy:
        sock = self._socket()
        sock.bind((self.listen_host, self.listen_port))
        self._server = await asyncio.start_server(self._accept, sock=sock, limit=self.chunk)
        self.listen_port = int(self._server.sockets[0].getsockname()[1])
        return self

    @property
    def port(self) -> int:
        return self.listen_port

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.listen_port}"

    @property
    def connections(self) -> int:
        """Connections open now (accepted and not yet closed)."""
        return len(self._conns)

    async def close(self) -> None:
        """Stop listening and close every connection (RST: nothing is owed to anyone)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._drop_all(count=False)

    async def __aenter__(self) -> BlackholeProxy:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- modes ---------------------------------------------------------------------------

    def forward(self) -> None:
        """Forward again (the heal): held bytes flow, held connections dial upstream."""
        self.mode = Mode.FORWARD
        for conn in self._conns:
            if not conn.stranded:
                conn.flowing.set()

    def blackhole(self) -> None:
        """Stop forwarding both ways; keep every socket open."""
        self.mode = Mode.BLACKHOLE
        for conn in self._conns:
            conn.flowing.clear()

    def strand(self) -> None:
        """The open connections go silent for good (sockets kept open); new ones forward."""
        for conn in self._conns:
            conn.stranded = True
            conn.flowing.clear()
        self.mode = Mode.FORWARD

    def reset(self) -> None:
        """RST every open connection now, and each new one until :meth:`forward`."""
        self.mode = Mode.RESET
        self._drop_all(count=True)

    def throttle(self, rate: float | None) -> None:
        """Forward at most ``rate`` bytes per second per direction (None: no limit)."""
        if rate is not None and rate <= 0:
            raise ValueError("rate must be positive")
        self.rate = rate

    # -- internals -----------------------------------------------------------------------

    def _socket(self) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if self.sock_buf is not None:  # before connect/listen: the window is sized then
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.sock_buf)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.sock_buf)
        sock.setblocking(False)
        return sock

    async def _dial(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = self._socket()
        try:
            await asyncio.get_running_loop().sock_connect(sock, self.upstream)
        except BaseException:
            sock.close()
            raise
        return await asyncio.open_connection(sock=sock, limit=self.chunk)

    def _drop_all(self, *, count: bool) -> None:
        for conn in list(self._conns):
            self._drop(conn, count=count)

    def _drop(self, conn: _Conn, *, count: bool) -> None:
        if conn not in self._conns:
            return
        self._conns.discard(conn)
        if count:
            self.resets += 1
        _rst(conn.down_w)
        _rst(conn.up_w)
        current = asyncio.current_task()
        for t in conn.tasks:
            if t is not current:
                t.cancel()

    async def _accept(self, down_r: asyncio.StreamReader, down_w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        conn = _Conn(down_w, asyncio.Event())
        if self.mode is Mode.FORWARD:
            conn.flowing.set()
        self._conns.add(conn)
        if self.mode is Mode.RESET:
            self._drop(conn, count=True)
            return
        task = asyncio.current_task()
        assert task is not None
        conn.tasks.append(task)
        try:
            await conn.flowing.wait()
            if self.mode is Mode.RESET or conn not in self._conns:
                self._drop(conn, count=True)
                return
            try:
                up_r, up_w = await self._dial()
            except OSError:
                self._drop(conn, count=False)  # nothing upstream: the client sees an RST
                return
            conn.up_w = up_w
            if conn not in self._conns:  # reset while dialling
                _rst(up_w)
                return
            pipes = [
                asyncio.create_task(self._pipe(conn, down_r, up_w, "up")),
                asyncio.create_task(self._pipe(conn, up_r, down_w, "down")),
            ]
            conn.tasks.extend(pipes)
            await asyncio.gather(*pipes, return_exceptions=True)
        except asyncio.CancelledError:
            pass
        finally:
            if conn in self._conns:
                self._conns.discard(conn)
                for w in (conn.down_w, conn.up_w):
                    if w is not None:
                        w.close()

    async def _pipe(
        self, conn: _Conn, r: asyncio.StreamReader, w: asyncio.StreamWriter, way: str
    ) -> None:
        """One direction; a FIN is passed on as a FIN (half-close), an error as an RST."""
        try:
            while True:
                await conn.flowing.wait()
                size = self.chunk
                if self.rate is not None:
                    size = max(1, min(size, int(self.rate / 10)))
                # A read begun before a blackhole: its bytes, EOF or error are held (one
                # chunk at most) until the heal, not passed on through it.
                try:
                    data = await r.read(size)
                except (ConnectionError, OSError):
                    await conn.flowing.wait()
                    raise
                await conn.flowing.wait()
                if not data:
                    if w.can_write_eof():
                        w.write_eof()
                    return
                w.write(data)
                await w.drain()
                self.forwarded[way] += len(data)
                if self.rate is not None:
                    await asyncio.sleep(len(data) / self.rate)
        except (ConnectionError, OSError):
            self._drop(conn, count=False)
