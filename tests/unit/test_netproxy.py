"""harness.netproxy: the loopback proxy the network-fault tests put between processes.

Each mode is checked from both ends with real sockets: what the client and the upstream
server see (bytes, EOF, RST), never how long anything took.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import AsyncIterator

import pytest

from harness.netproxy import BlackholeProxy, Mode


class Upstream:
    """An echo server that records what each connection saw: its bytes and its end."""

    def __init__(self) -> None:
        self.accepted = 0
        self.ends: list[str] = []
        self.received = bytearray()
        self.server: asyncio.Server | None = None
        self.ended = asyncio.Event()

    async def handle(self, r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while data := await r.read(65536):
                self.received += data
                w.write(data)
                await w.drain()
            self.ends.append("eof")
            w.write_eof()
        except ConnectionResetError:
            self.ends.append("rst")
        finally:
            self.ended.set()
            w.close()

    async def start(self) -> int:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return int(self.server.sockets[0].getsockname()[1])


@pytest.fixture
async def pair() -> AsyncIterator[tuple[Upstream, BlackholeProxy]]:
    up = Upstream()
    port = await up.start()
    proxy = await BlackholeProxy("127.0.0.1", port).start()
    try:
        yield up, proxy
    finally:
        await proxy.close()
        assert up.server is not None
        up.server.close()


async def _connect(proxy: BlackholeProxy) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", proxy.port)


async def _connected(
    proxy: BlackholeProxy,
) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """A connection through ``proxy`` that carried one byte there and back."""
    r, w = await _connect(proxy)
    w.write(b"a")
    assert await r.readexactly(1) == b"a"
    return r, w


async def _nothing_within(r: asyncio.StreamReader, s: float = 0.3) -> bool:
    """True when ``r`` yields neither bytes nor EOF nor an error within ``s``."""
    try:
        await asyncio.wait_for(r.read(1), s)
    except TimeoutError:
        return True
    return False


async def test_forwards_both_ways_and_passes_a_fin_on(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    r, w = await _connect(proxy)
    w.write(b"hello")
    await w.drain()
    assert await r.readexactly(5) == b"hello"
    w.write_eof()
    assert await r.read() == b""  # the upstream's FIN came back through
    await asyncio.wait_for(up.ended.wait(), 5)
    assert up.ends == ["eof"]
    assert proxy.forwarded == {"up": 5, "down": 5}
    w.close()


async def test_blackhole_keeps_sockets_open_and_the_heal_delivers_what_was_held(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    r, w = await _connected(proxy)
    proxy.blackhole()
    assert proxy.mode is Mode.BLACKHOLE
    w.write(b"during")
    await w.drain()
    assert await _nothing_within(r)  # no bytes, no FIN, no RST
    assert up.received == b"a" and not up.ends  # the upstream saw nothing either
    proxy.forward()
    assert await asyncio.wait_for(r.readexactly(6), 5) == b"during"
    w.close()


async def test_blackhole_holds_new_connections_without_dialling_upstream(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    proxy.blackhole()
    r, w = await _connect(proxy)  # the kernel completes the handshake; nothing else
    w.write(b"x")
    assert await _nothing_within(r)
    assert up.accepted == 0
    proxy.forward()
    assert await asyncio.wait_for(r.readexactly(1), 5) == b"x"
    assert up.accepted == 1
    w.close()


async def test_blackhole_is_bounded_a_fast_sender_stalls(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    _r, w = await _connected(proxy)
    proxy.blackhole()
    before = dict(proxy.forwarded)
    w.write(b"z" * (64 << 20))  # far beyond every buffer on the way
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(w.drain(), 0.5)
    assert proxy.forwarded == before
    assert len(up.received) == 1
    proxy.reset()  # the sender's 64 MiB is not owed to anyone
    w.transport.abort()


async def test_reset_sends_rst_both_ways_then_new_ones_until_forward(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    r, w = await _connected(proxy)
    proxy.reset()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(r.read(1), 5)
    await asyncio.wait_for(up.ended.wait(), 5)
    assert up.ends == ["rst"]
    assert proxy.resets == 1
    r2, w2 = await _connect(proxy)  # accepted while in reset mode: reset at once
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(r2.read(1), 5)
    assert up.accepted == 1
    proxy.forward()
    r3, w3 = await _connect(proxy)
    w3.write(b"back")
    assert await asyncio.wait_for(r3.readexactly(4), 5) == b"back"
    for wr in (w, w2, w3):
        wr.close()


async def test_reset_during_a_blackhole_ends_held_connections(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    proxy.blackhole()
    r, w = await _connect(proxy)
    await asyncio.sleep(0.05)
    assert proxy.connections == 1
    proxy.reset()
    with pytest.raises(ConnectionResetError):
        await asyncio.wait_for(r.read(1), 5)
    assert up.accepted == 0 and proxy.connections == 0
    w.close()


async def test_an_upstream_rst_reaches_the_client_as_an_rst() -> None:
    async def rude(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(1)
        sock = w.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        w.transport.abort()

    server = await asyncio.start_server(rude, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    async with BlackholeProxy("127.0.0.1", port) as proxy:
        r, w = await _connect(proxy)
        w.write(b"x")
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(1), 5)
        w.close()
    server.close()


async def test_nothing_upstream_the_client_is_reset() -> None:
    probe = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = int(probe.sockets[0].getsockname()[1])
    probe.close()
    await probe.wait_closed()
    async with BlackholeProxy("127.0.0.1", port) as proxy:
        r, w = await _connect(proxy)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(1), 5)
        w.close()


async def test_throttled_forwarding_keeps_every_byte_in_order(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    _up, proxy = pair
    proxy.throttle(200_000)
    r, w = await _connect(proxy)
    payload = bytes(range(256)) * 200
    w.write(payload)
    await w.drain()
    assert await asyncio.wait_for(r.readexactly(len(payload)), 10) == payload
    with pytest.raises(ValueError):
        proxy.throttle(0)
    proxy.throttle(None)
    w.close()


async def test_close_ends_every_connection() -> None:
    up = Upstream()
    port = await up.start()
    proxy = await BlackholeProxy("127.0.0.1", port).start()
    r, w = await _connected(proxy)
    await proxy.close()
    with contextlib.suppress(ConnectionResetError):
        assert await asyncio.wait_for(r.read(1), 5) == b""
    assert proxy.connections == 0
    w.close()
    assert up.server is not None
    up.server.close()


async def test_strand_silences_open_connections_for_good_and_forwards_new_ones(
    pair: tuple[Upstream, BlackholeProxy],
) -> None:
    up, proxy = pair
    r, w = await _connected(proxy)
    proxy.strand()
    w.write(b"lost")
    await w.drain()
    r2, w2 = await _connect(proxy)
    w2.write(b"new")
    assert await asyncio.wait_for(r2.readexactly(3), 5) == b"new"
    proxy.blackhole()
    proxy.forward()  # a later heal does not bring a stranded connection back
    assert await _nothing_within(r)
    assert up.received == b"anew" and not up.ends
    for wr in (w, w2):
        wr.close()


async def test_an_rst_during_a_blackhole_is_held_until_the_heal() -> None:
    peers: list[asyncio.StreamWriter] = []
    accepted = asyncio.Event()

    async def keep(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        peers.append(w)
        accepted.set()
        await r.read()

    server = await asyncio.start_server(keep, "127.0.0.1", 0)
    port = int(server.sockets[0].getsockname()[1])
    async with BlackholeProxy("127.0.0.1", port, sock_buf=4096) as proxy:
        r, w = await _connect(proxy)
        w.write(b"x")
        await asyncio.wait_for(accepted.wait(), 5)
        proxy.blackhole()
        sock = peers[0].get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        peers[0].transport.abort()  # the upstream dies behind the partition
        assert await _nothing_within(r)  # the client hears nothing of it yet
        proxy.forward()
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(r.read(1), 5)
        w.close()
    server.close()
