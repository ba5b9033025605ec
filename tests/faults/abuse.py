"""Hostile clients for the fault matrix's abuse rows (``rows_abuse.py``).

Each :class:`Abuser` runs its attack as background tasks on the row's loop (``start`` at
the fault, ``stop`` at the heal) beside the matrix's normal traffic and KV events, counts
what the abused process answered, and says so in :meth:`Abuser.summary` (the row's
notes). Everything random is drawn from a seeded ``random.Random`` (or hypothesis with a
fixed seed and a bounded number of examples), so a row sends the same attack every run.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import random
import re
import socket
import struct
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import orjson
import yaml
import zmq
import zmq.asyncio

from bus._gen.continuum.bus.v1 import bus_pb2 as bpb
from harness.procs import free_port
from harness.sim.kv_wire import EventEncoder, get_format
from tests.integration.conftest import http
from tests.integration.push_stack import TOKENS

from .stack import FaultStack

__all__ = [
    "Abuser",
    "BusFlood",
    "BusFuzz",
    "Campaign",
    "HttpFuzz",
    "ReloadStorm",
    "SlowPosts",
    "SseStallers",
    "ZmqFuzzProxy",
]

SEED = 20261202
#: Cache salts no router issues: non-ASCII characters, a control byte.
POISONED_SALTS = ("sälz", "\u2603" * 8, "c1:\u00ff:" + "x" * 30, "\x00\x80")


def _identity(b: bytes) -> bytes:
    return b


class Abuser:
    """Background attack tasks and the counts of what they were answered."""

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []

    def spawn(self, n: int, fn: Callable[[int], Any]) -> None:
        self._tasks += [asyncio.create_task(fn(i)) for i in range(n)]

    async def start(self, stack: FaultStack) -> None:
        raise NotImplementedError

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.sleep(0)
        done, pending = (
            await asyncio.wait(self._tasks, timeout=10) if self._tasks else (set(), set())
        )
        for t in pending:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for t in done:
            if not t.cancelled() and (exc := t.exception()) is not None:
                self.counts[f"abuser crashed: {type(exc).__name__}: {exc}"[:160]] += 1

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def summary(self) -> list[str]:
        return [
            f"{type(self).__name__}: "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        ]


class Campaign:
    """One row's abuser, made at the fault (``inject``), stopped at the heal (``heal``),
    reported at the end (``report``): the three hooks of a :class:`Row`."""

    def __init__(self, make: Callable[[], Abuser]) -> None:
        self.make = make
        self.abuser: Abuser | None = None

    async def inject(self, stack: FaultStack) -> None:
        self.abuser = self.make()
        await self.abuser.start(stack)

    async def heal(self, stack: FaultStack) -> None:
        assert self.abuser is not None
        await self.abuser.stop()

    async def report(self, stack: FaultStack) -> list[str]:
        lines = self.abuser.summary() if self.abuser is not None else ["abuser never started"]
        alive = stack.alive()
        lines.append(
            "alive at the end: "
            + ", ".join(f"{k} {'yes' if v else 'NO'}" for k, v in alive.items())
        )
        return lines


# -- 1. the event bus, before authentication ----------------------------------------------


class BusFlood(Abuser):
    """Hundreds of calls with no or a wrong bearer token on fresh and shared TLS
    connections, oversize first messages among them, and raw TCP connections that never
    start TLS."""

    SESSION = "/continuum.bus.v1.EventBus/Session"
    STREAM = "/continuum.bus.v1.EventBus/Stream"

    def __init__(self, channels: int = 40, calls: int = 5, raw: int = 100) -> None:
        super().__init__()
        self.channels, self.calls, self.raw = channels, calls, raw
        self.details: dict[str, str] = {}

    async def start(self, stack: FaultStack) -> None:
        self.target, self.ca = stack.bus_target()
        self.spawn(self.channels, self._channel)
        self.spawn(self.raw, self._raw)

    def _open(self) -> grpc.aio.Channel:
        creds = grpc.ssl_channel_credentials(self.ca)
        return grpc.aio.secure_channel(
            self.target, creds, options=[("grpc.max_send_message_length", 64 << 20)]
        )

    async def _channel(self, i: int) -> None:
        while not self.stopping:
            channel = self._open()
            try:
                await asyncio.gather(
                    *(self._calls(channel, i * self.calls + j) for j in range(self.calls))
                )
            finally:
                await channel.close()
            self.counts["connections"] += 1

    async def _calls(self, channel: grpc.aio.Channel, k: int) -> None:
        hello = bpb.SessionRequest(
            hello=bpb.Hello(client_id="kv-a", role=bpb.ROLE_KV_LISTENER, sources=["sim-1"])
        ).SerializeToString()
        oversize = bpb.SessionRequest(
            hello=bpb.Hello(client_id="kv-a" * (1 << 20), role=bpb.ROLE_KV_LISTENER)
        ).SerializeToString()
        opened = bpb.StreamRequest(open=bpb.StreamOpen(stream_id="s-1")).SerializeToString()
        kinds = [
            ("session/no-token", self.SESSION, (), hello),
            ("session/wrong-token", self.SESSION, (("authorization", "Bearer wrong"),), hello),
            ("stream/wrong-token", self.STREAM, (("authorization", "Bearer x" * 50),), opened),
            ("session/oversize", self.SESSION, (("authorization", "Bearer wrong"),), oversize),
            ("stream/oversize/no-token", self.STREAM, (), oversize),
        ]
        n = 0
        while not self.stopping and n < 10:
            kind, method, md, msg = kinds[(k + n) % len(kinds)]
            n += 1
            self.counts[await self._one(channel, method, md, msg, kind)] += 1

    async def _one(
        self, channel: grpc.aio.Channel, method: str, md: Any, msg: bytes, kind: str
    ) -> str:
        mc = channel.stream_stream(
            method, request_serializer=_identity, response_deserializer=_identity
        )
        call = mc(metadata=md)
        try:
            async with asyncio.timeout(10):
                with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                    await call.write(msg)
                    await call.done_writing()
                got = await call.read()
                if got is grpc.aio.EOF:
                    return f"{kind} -> {(await call.code()).name}"
                return f"{kind} -> ANSWERED"
        except grpc.aio.AioRpcError as e:
            self.details.setdefault(f"{kind} {e.code().name}", (e.details() or "")[:120])
            return f"{kind} -> {e.code().name}"
        except TimeoutError:
            call.cancel()
            return f"{kind} -> no answer in 10 s"

    def summary(self) -> list[str]:
        return [
            *super().summary(),
            "BusFlood details: "
            + "; ".join(f"{k}: {v!r}" for k, v in sorted(self.details.items())),
        ]

    async def _raw(self, i: int) -> None:
        port = self.target.rsplit(":", 1)[1]
        while not self.stopping:
            try:
                reader, writer = await asyncio.open_connection("127.0.0.1", int(port))
            except OSError as e:
                self.counts[f"raw tcp: {type(e).__name__}"] += 1
                await asyncio.sleep(0.2)
                continue
            self.counts["raw tcp held"] += 1
            if i % 2:
                writer.write(os.urandom(64))  # not a TLS ClientHello
            with contextlib.suppress(TimeoutError, OSError):
                async with asyncio.timeout(2 + (i % 5)):
                    if await reader.read(1 << 16) == b"":
                        self.counts["raw tcp closed by the router"] += 1
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


# -- 2. slow request bodies ----------------------------------------------------------------


class SlowPosts(Abuser):
    """Clients that send a POST's headers and then its body a byte at a time (slowloris),
    each starting again when the router answers or drops it."""

    def __init__(self, clients: int = 200, interval_s: float = 0.5) -> None:
        super().__init__()
        self.clients, self.interval_s = clients, interval_s
        self._lat: dict[str, list[float]] = {}

    async def start(self, stack: FaultStack) -> None:
        assert stack.router is not None
        host, port = stack.router.url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.spawn(self.clients, self._client)

    async def _client(self, i: int) -> None:
        head = (
            b"POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
            b"Content-Type: application/json\r\nContent-Length: 4096\r\n\r\n{"
        )
        while not self.stopping:
            t0 = time.monotonic()
            try:
                reader, writer = await asyncio.open_connection(*self.addr)
            except OSError as e:
                self.counts[f"connect: {type(e).__name__}"] += 1
                await asyncio.sleep(0.2)
                continue
            outcome = "still trickling at the heal"
            try:
                writer.write(head)
                while not self.stopping:
                    try:
                        async with asyncio.timeout(self.interval_s):
                            data = await reader.read(4096)
                    except TimeoutError:
                        writer.write(b" ")
                        await writer.drain()
                        continue
                    if not data:
                        outcome = "closed without an answer"
                    else:
                        status = data.split(b" ", 2)[1].decode(errors="replace")
                        outcome = f"HTTP {status}"
                        self._lat.setdefault(status, []).append(time.monotonic() - t0)
                    break
            except OSError as e:
                outcome = f"reset: {type(e).__name__}"
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()
            self.counts[outcome] += 1

    def summary(self) -> list[str]:
        counts = {k: n for k, n in self.counts.items() if n}
        held = {s: f"{sorted(v)[len(v) // 2]:.1f} s" for s, v in self._lat.items()}
        return [
            f"SlowPosts ({self.clients} clients, a byte every {self.interval_s:g} s): "
            + ", ".join(f"{k} {n}" for k, n in sorted(counts.items()))
            + (f"; median time to the answer: {held}" if held else "")
        ]


# -- 3. SSE subscribers that never read -----------------------------------------------------


class SseStallers(Abuser):
    """Subscribers to the listener's event streams that read the status line and nothing
    more, on a small receive buffer, holding the stream until the heal."""

    def __init__(self, subscribers: int = 300, rcvbuf: int = 4096) -> None:
        super().__init__()
        self.subscribers, self.rcvbuf = subscribers, rcvbuf

    async def start(self, stack: FaultStack) -> None:
        assert stack.listener is not None
        host, port = stack.listener.url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self.names = stack.names
        self.spawn(self.subscribers, self._sub)

    async def _sub(self, i: int) -> None:
        name = self.names[i % len(self.names)]
        loop = asyncio.get_running_loop()
        while not self.stopping:
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, self.rcvbuf)
            sock.setblocking(False)
            try:
                await loop.sock_connect(sock, self.addr)
                await loop.sock_sendall(
                    sock, f"GET /events/{name} HTTP/1.1\r\nHost: listener\r\n\r\n".encode()
                )
                async with asyncio.timeout(10):
                    first = await loop.sock_recv(sock, 12)
                status = first.split(b" ")[1].decode() if first.count(b" ") else "?"
                self.counts[f"HTTP {status}"] += 1
                if status == "200":
                    await self._stop.wait()  # never read again
                else:
                    await asyncio.sleep(0.2)
            except (OSError, TimeoutError) as e:
                self.counts[f"error: {type(e).__name__}"] += 1
                await asyncio.sleep(0.2)
            finally:
                sock.close()

    async def stop(self) -> None:
        await super().stop()

    def summary(self) -> list[str]:
        return [
            f"SseStallers ({self.subscribers} subscribers that never read): "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        ]


async def listener_sse_stats(stack: FaultStack) -> str:
    assert stack.listener is not None
    r = await http("GET", stack.listener.url + "/stats", total_s=5)
    data = r.json()
    found = {k: v for k, v in _flat("", data) if re.search(r"stall|subscri|reject|open", k)}
    return "listener /stats: " + ", ".join(f"{k} {v}" for k, v in sorted(found.items()))


def _flat(prefix: str, v: Any) -> list[tuple[str, Any]]:
    if isinstance(v, dict):
        out: list[tuple[str, Any]] = []
        for k, x in v.items():
            out += _flat(f"{prefix}.{k}" if prefix else str(k), x)
        return out
    return [(prefix, v)] if isinstance(v, int | float) else []


# -- 4. hot-reload storm -------------------------------------------------------------------


class ReloadStorm(Abuser):
    """The router's config file replaced every ``period_s`` by a valid config (one more
    disabled backend ``storm-<n>``), an invalid one (bad YAML, a wrong type), or bytes that
    are not UTF-8, by atomic rename and by writing in place; the heal writes the last
    valid config (``storm-final``) and waits for the router to serve it."""

    def __init__(self, period_s: float = 0.05, hold_every: int = 40, hold_s: float = 2.5) -> None:
        super().__init__()
        self.period_s = period_s
        self.hold_every, self.hold_s = hold_every, hold_s
        self.final_seen: float | None = None
        self.held: collections.Counter[str] = collections.Counter()

    async def start(self, stack: FaultStack) -> None:
        assert stack.router is not None
        self.router = stack.router
        self.path = Path(stack.router.config_path)
        self.base = stack.router.config
        self.before = await self._reloads()
        self.spawn(1, self._storm)

    def _valid(self, tag: str) -> bytes:
        conf = dict(self.base)
        conf["backends"] = [
            *self.base["backends"],
            {
                "name": f"storm-{tag}",
                "url": "http://127.0.0.1:9",
                "type": "vllm",
                "models": ["storm-model"],
                "enabled": False,
            },
        ]
        return yaml.safe_dump(conf, sort_keys=False).encode()

    def _write(self, data: bytes, atomic: bool) -> None:
        if atomic:
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, self.path)
        else:
            with self.path.open("r+b") as f:
                f.truncate(0)
                f.write(data)

    async def _write_in_place_slowly(self, data: bytes) -> None:
        """Truncate, then the bytes in two writes 20 ms apart: a file a poll can catch
        empty or half-written."""
        with self.path.open("r+b") as f:
            f.truncate(0)
            f.flush()
            await asyncio.sleep(0.01)
            f.write(data[: len(data) // 2])
            f.flush()
            await asyncio.sleep(0.02)
            f.write(data[len(data) // 2 :])

    async def _storm(self, _: int) -> None:
        rng = random.Random(SEED)
        n = 0
        while not self.stopping:
            n += 1
            kind = rng.choice(["valid", "valid", "bad-yaml", "bad-type", "non-utf8"])
            atomic = rng.random() < 0.5
            if kind == "valid":
                data = self._valid(str(n))
            elif kind == "bad-yaml":
                data = self._valid(str(n))[: rng.randrange(10, 200)] + b"\n  - [unclosed: {"
            elif kind == "bad-type":
                data = self._valid(str(n)).replace(
                    b"selection_strategy: RoundRobin", b"selection_strategy: [1, 2]"
                )
            else:
                data = self._valid(str(n)).replace(b"storm-model", "störm-\u00e9".encode("latin-1"))
            if atomic or rng.random() < 0.5:
                self._write(data, atomic)
                how = "rename" if atomic else "in place"
            else:
                await self._write_in_place_slowly(data)
                how = "in place, slowly"
            self.counts[f"{kind} ({how})"] += 1
            if n % self.hold_every == 0:  # left alone long enough for a reload to see it
                self.held["valid" if kind == "valid" else "invalid"] += 1
                await asyncio.sleep(self.hold_s)
            else:
                await asyncio.sleep(self.period_s)

    async def _reloads(self) -> dict[str, float]:
        r = await http("GET", self.router.url + "/metrics", total_s=5)
        out: dict[str, float] = {}
        for m in re.finditer(
            r'^continuum_config_reloads_total\{result="(\w+)"\} (\S+)$', r.body.decode(), re.M
        ):
            out[m.group(1)] = float(m.group(2))
        return out

    async def stop(self) -> None:
        await super().stop()
        self._write(self._valid("final"), True)
        t0 = time.monotonic()
        while time.monotonic() - t0 < 10:
            r = await http(
                "GET", self.router.url + "/admin/backends", headers=self.router.admin_headers
            )
            names = [b["name"] for b in r.json()["backends"]]
            storm = [n for n in names if n.startswith("storm-")]
            if storm == ["storm-final"]:
                self.final_seen = time.monotonic() - t0
                break
            await asyncio.sleep(0.1)
        self.final_backends = storm
        self.after = await self._reloads()

    def summary(self) -> list[str]:
        delta = {k: int(v - self.before.get(k, 0)) for k, v in self.after.items()}
        final = (
            f"the last valid config serving {self.final_seen:.1f} s after it was written"
            if self.final_seen is not None
            else "the last valid config NOT serving after 10 s"
            f" (storm backends: {self.final_backends})"
        )
        return [
            f"ReloadStorm (a write every {self.period_s * 1000:.0f} ms): "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items())),
            f"files left alone for {self.hold_s:g} s (every {self.hold_every}th write):"
            f" {dict(self.held)}, so expected {self.held['valid']} applied and"
            f" {self.held['invalid']} rejected during the storm, then 1 applied (the last)",
            f"router reloads: {delta}; {final}",
        ]


# -- 5a. HTTP fuzzing ----------------------------------------------------------------------


class HttpFuzz(Abuser):
    """hypothesis-generated requests (methods, paths, headers, bodies of wrong shapes, huge
    numbers, deep nesting, bad UTF-8) over raw sockets, fixed seed, ``examples`` cases.
    Every answer must be a 200, or a 4xx/5xx with an OpenAI-style error body; a dropped
    connection or any other answer is a violation (the first few are listed)."""

    def __init__(self, examples: int = 400) -> None:
        super().__init__()
        self.examples = examples
        self.violations: list[str] = []

    async def start(self, stack: FaultStack) -> None:
        assert stack.router is not None
        host, port = stack.router.url.removeprefix("http://").rsplit(":", 1)
        self.addr = (host, int(port))
        self._tasks.append(asyncio.create_task(asyncio.to_thread(self._run)))

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)  # bounded: ``examples``
        await super().stop()

    def _run(self) -> None:
        from hypothesis import HealthCheck, given, seed, settings
        from hypothesis import strategies as st

        from .fuzz_http import requests

        @seed(SEED)
        @settings(
            max_examples=self.examples,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(requests())
        def case(req: tuple[str, str, list[tuple[str, str]], bytes]) -> None:
            self._send(*req)

        del st
        case()

    def _send(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes) -> None:
        head = f"{method} {path} HTTP/1.1\r\nHost: router\r\nConnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers)
        head += f"Content-Length: {len(body)}\r\n\r\n"
        what = f"{method} {path[:40]!r} headers {headers!r:.160} body {body[:40]!r}"
        try:
            with socket.create_connection(self.addr, timeout=20) as s:
                s.sendall(head.encode("latin-1") + body)
                chunks = []
                while True:
                    c = s.recv(1 << 16)
                    if not c:
                        break
                    chunks.append(c)
        except OSError as e:
            self._violation(f"{type(e).__name__} for {what}")
            return
        raw = b"".join(chunks)
        if not raw:
            self._violation(f"connection closed without an answer for {what}")
            return
        m = re.match(rb"HTTP/1\.[01] (\d{3})", raw)
        if m is None:
            self._violation(f"not HTTP: {raw[:40]!r} for {what}")
            return
        status = int(m.group(1))
        self.counts[f"{status // 100}xx"] += 1
        if status == 200:
            return
        if not 400 <= status < 600:
            self._violation(f"HTTP {status} for {what}")
            return
        if method == "HEAD":
            return
        _, _, payload = raw.partition(b"\r\n\r\n")
        if b"transfer-encoding: chunked" in raw.split(b"\r\n\r\n", 1)[0].lower():
            payload = _dechunk(payload)
        try:
            err = orjson.loads(payload)["error"]
            assert isinstance(err["message"], str) and err["message"]
            assert "type" in err
        except Exception:
            self._violation(
                f"HTTP {status} without an OpenAI-style error body {payload[:60]!r} for {what}"
            )

    def _violation(self, text: str) -> None:
        self.counts["violations"] += 1
        if len(self.violations) < 8:
            self.violations.append(text)

    def summary(self) -> list[str]:
        lines = [
            f"HttpFuzz ({self.examples} hypothesis cases, seed {SEED}): "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items()))
        ]
        lines += [f"violation: {v}" for v in self.violations]
        return lines


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size, _, rest = data.partition(b"\r\n")
        try:
            n = int(size, 16)
        except ValueError:
            return out + data
        if n == 0:
            break
        out += rest[:n]
        data = rest[n + 2 :]
    return out


# -- 5b. EventBus message fuzzing ----------------------------------------------------------


class BusFuzz(Abuser):
    """Seeded random Session and Stream calls with a valid token: garbage protobuf,
    fields of the wrong wire type, a Hello after a Hello, Draining or StreamClose first,
    data before an open, huge and unknown stream ids. Hellos never name the real
    listener's client id (a valid Hello of it would replace its session, by design).
    Every call must end with a status; none may crash the router."""

    def __init__(self, cases: int = 600, workers: int = 8) -> None:
        super().__init__()
        self.cases, self.workers = cases, workers
        self.details: dict[str, str] = {}

    async def start(self, stack: FaultStack) -> None:
        target, ca = stack.bus_target()
        self.channel = grpc.aio.secure_channel(
            target,
            grpc.ssl_channel_credentials(ca),
            options=[("grpc.max_send_message_length", 64 << 20)],
        )
        self.md = (("authorization", f"Bearer {TOKENS['kv-a']}"),)
        self._left = self.cases
        self.spawn(self.workers, self._worker)

    async def stop(self) -> None:
        await asyncio.gather(*self._tasks, return_exceptions=True)  # bounded: ``cases``
        await super().stop()
        await self.channel.close()

    def _session_msgs(self, rng: random.Random) -> list[bytes]:
        def hello() -> bytes:
            cid = rng.choice(
                ["fz", "", "kv-a ", "Kv-A", "fz-\u00e9\u2603", "x" * rng.randrange(1, 5000)]
            )
            srcs = [
                rng.choice(["sim-1", "sim-2", "", "../x", "s" * 300, "\u2603"])
                for _ in range(rng.randrange(0, 5))
            ]
            return bpb.SessionRequest(
                hello=bpb.Hello(
                    client_id=cid,
                    role=rng.choice([0, 1, 2, 3, 77, 0x7FFFFFFF]),  # type: ignore[arg-type]
                    sources=srcs,
                )
            ).SerializeToString()

        draining = bpb.SessionRequest(draining=bpb.Draining(reason="fuzz")).SerializeToString()
        kind = rng.randrange(6)
        if kind == 0:
            return [rng.randbytes(rng.randrange(0, 300))]
        if kind == 1:  # field 1 (hello) as a varint: the wrong wire type
            return [b"\x08" + rng.randbytes(5)]
        if kind == 2:
            return [hello(), hello()]
        if kind == 3:
            return [draining, hello()]
        if kind == 4:  # a Hello whose client_id is a nested message of garbage
            inner = (
                b"\x0a"
                + bytes([min(127, rng.randrange(0, 200))])
                + rng.randbytes(rng.randrange(0, 120))
            )
            return [b"\x0a" + bytes([len(inner) & 0x7F]) + inner]
        return [hello(), rng.randbytes(rng.randrange(1, 50))]

    def _stream_msgs(self, rng: random.Random) -> list[bytes]:
        def opened(sid: str) -> bytes:
            return bpb.StreamRequest(open=bpb.StreamOpen(stream_id=sid)).SerializeToString()

        data = bpb.StreamRequest(
            data=bpb.StreamData(data=rng.randbytes(rng.randrange(0, 2000)))
        ).SerializeToString()
        close = bpb.StreamRequest(
            close=bpb.StreamClose(
                reason=rng.choice(  # type: ignore[arg-type]
                    [0, 1, 2, 3, 4, 99]
                ),
                detail="fz",
            )
        ).SerializeToString()
        huge = str(rng.getrandbits(256)) * rng.choice([1, 100, 10_000])
        kind = rng.randrange(7)
        if kind == 0:
            return [rng.randbytes(rng.randrange(0, 300))]
        if kind == 1:
            return [data, opened("s-1")]
        if kind == 2:
            return [close]
        if kind == 3:
            return [opened(huge), data, close]
        if kind == 4:
            return [opened(""), data]
        if kind == 5:
            return [opened(f"{rng.getrandbits(64):x}"), opened("again"), data]
        return [b"\x12" + rng.randbytes(3)]  # StreamData with a truncated length

    async def _worker(self, w: int) -> None:
        rng = random.Random(SEED + w)
        while self._left > 0 and not self.stopping:
            self._left -= 1
            stream = rng.random() < 0.5
            method = "/continuum.bus.v1.EventBus/" + ("Stream" if stream else "Session")
            msgs = self._stream_msgs(rng) if stream else self._session_msgs(rng)
            if stream:
                call: Any = self.channel.stream_unary(
                    method, request_serializer=_identity, response_deserializer=_identity
                )(metadata=self.md)
            else:
                call = self.channel.stream_stream(
                    method, request_serializer=_identity, response_deserializer=_identity
                )(metadata=self.md)
            kind = "stream" if stream else "session"
            try:
                async with asyncio.timeout(10):
                    with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                        for m in msgs:
                            await call.write(m)
                        await call.done_writing()
                    if stream:
                        await call
                        code = "OK"
                    else:
                        while (got := await call.read()) is not grpc.aio.EOF:
                            self.counts[f"{kind} answered a message"] += 1
                            del got
                            call.cancel()
                            break
                        code = (await call.code()).name
            except grpc.aio.AioRpcError as e:
                code = e.code().name
                self.details.setdefault(f"{kind} {code}", (e.details() or "")[:100])
            except (TimeoutError, asyncio.CancelledError):
                call.cancel()
                code = "no status in 10 s"
            self.counts[f"{kind} -> {code}"] += 1

    def summary(self) -> list[str]:
        return [
            f"BusFuzz ({self.cases} seeded cases): "
            + ", ".join(f"{k} {n}" for k, n in sorted(self.counts.items())),
            "BusFuzz details: " + "; ".join(f"{k}: {v!r}" for k, v in sorted(self.details.items())),
        ]


# -- 5c. ZMQ frame fuzzing -----------------------------------------------------------------


class ZmqFuzzProxy(Abuser):
    """A ZMQ PUB between one engine and the listener: it forwards every engine message as
    it comes and, during the fault, publishes seeded random messages between them (wrong
    frame counts, garbage msgpack, valid batches with cache salts of non-ASCII characters,
    frames over the listener's ``max_frame_bytes``, sequence numbers colliding with the
    engine's). Built before the stack starts (``endpoint`` is the stack's
    ``source_endpoint`` hook); ``start``/``stop`` only turn the fuzzing on and off."""

    def __init__(self, backend: str = "sim-1", max_frame_bytes: int = 1 << 20) -> None:
        super().__init__()
        self.backend = backend
        self.max_frame_bytes = max_frame_bytes
        self._fuzzing = False
        self._ctx: zmq.asyncio.Context | None = None
        self._last_seq = 0
        self._forward: asyncio.Task[None] | None = None

    def endpoint(self, backend: str, engine: str) -> str:
        if backend != self.backend:
            return engine
        self._ctx = zmq.asyncio.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.setsockopt(zmq.RCVHWM, 100_000)
        self._sub.connect(engine)
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, 100_000)
        port = free_port()
        self._pub.bind(f"tcp://127.0.0.1:{port}")
        self._forward = asyncio.get_running_loop().create_task(self._forwarding())
        return f"tcp://127.0.0.1:{port}"

    async def _forwarding(self) -> None:
        while True:
            frames = await self._sub.recv_multipart()
            if len(frames) == 3 and len(frames[1]) == 8:
                self._last_seq = struct.unpack(">Q", frames[1])[0]
            await self._pub.send_multipart(frames)
            self.counts["engine messages forwarded"] += 1

    async def start(self, stack: FaultStack) -> None:
        self.spawn(1, self._fuzz)

    async def _fuzz(self, _: int) -> None:
        rng = random.Random(SEED)
        enc = EventEncoder(get_format("vllm-0.33"))
        while not self.stopping:
            kind = rng.choice(
                ["1 frame", "2 frames", "5 frames", "bad seq frame", "garbage msgpack",
                 "poisoned salt", "poisoned salt", "oversize", "next seq garbage"]
            )  # fmt: skip
            seq = rng.choice([self._last_seq + 1, self._last_seq, rng.getrandbits(63), 0])
            seq8 = struct.pack(">Q", seq)
            if kind == "1 frame":
                msg = [rng.randbytes(rng.randrange(0, 64))]
            elif kind == "2 frames":
                msg = [b"", seq8]
            elif kind == "5 frames":
                msg = [b"", seq8, b"", b"x", rng.randbytes(10)]
            elif kind == "bad seq frame":
                msg = [b"", rng.randbytes(rng.choice([0, 3, 9])), b"\x93"]
            elif kind == "garbage msgpack":
                msg = [b"", seq8, rng.randbytes(rng.randrange(1, 400))]
            elif kind == "next seq garbage":
                msg = [b"", struct.pack(">Q", self._last_seq + 1), b"\xc1\xc1"]
            elif kind == "poisoned salt":
                h = rng.getrandbits(60)
                ev = enc.stored(
                    [h], None, list(range(16)), 16,
                    cache_salt=rng.choice(POISONED_SALTS),
                    first_block=True,
                )  # fmt: skip
                msg = [b"", seq8, enc.batch(time.time(), [ev])]
            else:
                msg = [b"", seq8, b"\x00" * (self.max_frame_bytes + 1024)]
            await self._pub.send_multipart(msg)
            self.counts[f"sent {kind}"] += 1
            await asyncio.sleep(rng.uniform(0.01, 0.05))

    async def close(self) -> None:
        if self._forward is not None:
            self._forward.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._forward
        if self._ctx is not None:
            self._ctx.destroy(linger=0)
