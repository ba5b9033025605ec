"""The listener's SSE server and gRPC service end to end, on loopback ephemeral ports.

Streams are read with the router's parser (``bus.sse.SseParser``) from a real aiohttp
server; the gRPC ``Subscribe`` is compared record for record with the SSE stream.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from bus._gen.continuum.listener.v1 import listener_pb2, listener_pb2_grpc
from bus.events import KvEvent
from bus.sse import SseParser, SseRecord
from listener.config import GrpcTlsConfig, parse_listener_config
from listener.grpc_service import SERVICE_NAME, GrpcServer, ListenerServicer
from listener.sse_server import SseServer
from listener.stream import EventHub

B = "vllm-1"
EPOCH = "c0ffee00"
WAIT_S = 5.0


def created(i: int, backend: str = B) -> KvEvent:
    return KvEvent("cache_created", backend, f"{i:064x}", token_count=i, tier="gpu")


SNAPSHOT = [created(100), created(101)]


def source_stats() -> dict[str, dict[str, Any]]:
    return {
        B: {"batches_total": 7, "chains": {"tracked": 3}, "state": "running"},
        "intruder": {"batches_total": 1},  # not configured: never becomes a label
    }


class Reader:
    """An open SSE response read incrementally with ``SseParser``."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SseParser()
        self.records: list[SseRecord] = []
        self.raw = bytearray()
        self.eof = False

    async def _read_once(self) -> None:
        chunk = await self.resp.content.readany()
        if not chunk:
            self.eof = True
            return
        self.raw += chunk
        self.records += self.parser.feed(chunk)

    async def until(self, predicate: Callable[[Reader], bool], what: str) -> None:
        async with asyncio.timeout(WAIT_S):
            while not predicate(self):
                if self.eof:
                    raise AssertionError(f"stream ended before {what}")
                await self._read_once()

    async def take(self, n: int) -> list[SseRecord]:
        await self.until(lambda r: len(r.records) >= n, f"{n} records")
        return self.records[:n]

    async def to_eof(self) -> list[SseRecord]:
        async with asyncio.timeout(WAIT_S):
            while not self.eof:
                await self._read_once()
        return self.records


class Env:
    def __init__(self, hub: EventHub, server: SseServer, session: aiohttp.ClientSession) -> None:
        self.hub = hub
        self.server = server
        self.session = session
        self.base = f"http://127.0.0.1:{server.port}"
        self._open: list[aiohttp.ClientResponse] = []

    async def stream(
        self, backend: str = B, headers: dict[str, str] | None = None, query: str = ""
    ) -> Reader:
        resp = await self.session.get(f"{self.base}/events/{backend}{query}", headers=headers)
        self._open.append(resp)
        assert resp.status == 200, await resp.text()
        return Reader(resp)

    async def close(self) -> None:
        for r in self._open:
            r.close()


async def wait_for(predicate: Callable[[], bool], what: str) -> None:
    """Poll observable server state until ``predicate()`` holds; fail after WAIT_S."""
    deadline = asyncio.get_running_loop().time() + WAIT_S
    while True:
        if predicate():
            return
        if asyncio.get_running_loop().time() >= deadline:
            raise AssertionError(f"timed out after {WAIT_S}s waiting for {what}")
        await asyncio.sleep(0.01)


def make_hub(queue: int = 64) -> EventHub:
    h = EventHub(history_size=100, queue_size=queue, epoch=EPOCH)
    h.add_backend(B, lambda: SNAPSHOT)
    h.add_backend("sglang-1")
    return h


@pytest_asyncio.fixture
async def env() -> AsyncIterator[Env]:
    hub = make_hub()
    server = SseServer(hub, heartbeat_interval=0.05, stats_provider=source_stats)
    await server.start("127.0.0.1", 0)
    session = aiohttp.ClientSession()
    e = Env(hub, server, session)
    try:
        yield e
    finally:
        await e.close()
        await session.close()
        await server.stop()


# -- SSE -------------------------------------------------------------------------------------


async def test_unknown_backend_is_a_404_with_an_error_body(env: Env) -> None:
    async with env.session.get(f"{env.base}/events/nope") as resp:
        assert resp.status == 404
        body = await resp.json()
    assert body["error"]["type"] == "not_found" and body["error"]["code"] == 404
    assert "unknown backend 'nope'" in body["error"]["message"]
    assert "vllm-1" in body["error"]["message"]


async def test_fresh_stream_gets_resync_snapshot_then_live(env: Env) -> None:
    env.hub.publish(B, created(1))
    reader = await env.stream()
    assert reader.resp.headers["Content-Type"].startswith("text/event-stream")
    assert reader.resp.headers["Cache-Control"] == "no-cache"
    head = await reader.take(3)
    assert [r.event for r in head] == ["resync", "cache_created", "cache_created"]
    assert [r.id for r in head] == [f"{EPOCH}.s1-1", f"{EPOCH}.s1-2", f"{EPOCH}-1"]
    assert orjson.loads(head[0].data) == {
        "event": "resync",
        "backend": B,
        "reason": "no_event_id",
        "snapshot_size": len(SNAPSHOT),
    }
    assert [KvEvent.from_json(r.data, event_field=r.event, backend=B) for r in head[1:]] == SNAPSHOT
    env.hub.publish(B, created(2))
    env.hub.publish(B, created(3))
    live = (await reader.take(5))[3:]
    assert [(r.event, r.id) for r in live] == [
        ("cache_created", f"{EPOCH}-2"),
        ("cache_created", f"{EPOCH}-3"),
    ]
    assert [KvEvent.from_json(r.data, event_field=r.event) for r in live] == [
        created(2),
        created(3),
    ]


async def test_heartbeats_while_idle(env: Env) -> None:
    reader = await env.stream("sglang-1", headers={"Last-Event-ID": f"{EPOCH}-0"})
    await reader.until(lambda r: r.raw.count(b": heartbeat\n\n") >= 2, "two heartbeats")
    assert reader.records == []  # comments are not records
    env.hub.publish("sglang-1", created(1, "sglang-1"))
    await reader.take(1)
    assert reader.records[0].id == f"{EPOCH}-1"


async def test_last_event_id_resume_header_and_query(env: Env) -> None:
    for i in range(1, 6):
        env.hub.publish(B, created(i))
    by_header = await env.stream(headers={"Last-Event-ID": f"{EPOCH}-2"})
    by_query = await env.stream(query=f"?last_event_id={EPOCH}-3")
    both = await env.stream(headers={"Last-Event-ID": f"{EPOCH}-4"}, query="?last_event_id=x-1")
    assert [r.id for r in await by_header.take(3)] == [f"{EPOCH}-{i}" for i in (3, 4, 5)]
    assert [r.id for r in await by_query.take(2)] == [f"{EPOCH}-{i}" for i in (4, 5)]
    assert [r.id for r in await both.take(1)] == [f"{EPOCH}-5"]  # the header wins
    env.hub.publish(B, created(6))
    for reader, n in ((by_header, 4), (by_query, 3), (both, 2)):
        recs = await reader.take(n)
        assert [r.id for r in recs][-1] == f"{EPOCH}-6"
        assert len({r.id for r in recs}) == n  # no duplicate
    # A resumed stream of another epoch gets a resync block.
    other = await env.stream(headers={"Last-Event-ID": "deadbeef-6"})
    head = await other.take(3)
    assert head[0].event == "resync" and head[-1].id == f"{EPOCH}-6"


async def test_client_disconnect_ends_the_stream(env: Env) -> None:
    reader = await env.stream(headers={"Last-Event-ID": f"{EPOCH}-0"})
    await wait_for(lambda: env.server.open_streams == 1, "stream open")
    assert env.hub.stats()["backends"][B]["subscribers"] == 1
    reader.resp.close()
    await wait_for(lambda: env.server.open_streams == 0, "stream closed by the server")
    assert env.hub.stats()["backends"][B]["subscribers"] == 0


async def test_overflow_ends_the_stream_with_an_error_record() -> None:
    hub = make_hub(queue=4)
    server = SseServer(hub, heartbeat_interval=5.0)
    await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as session:
            url = f"http://127.0.0.1:{server.port}/events/{B}"
            async with session.get(url, headers={"Last-Event-ID": f"{EPOCH}-0"}) as resp:
                await wait_for(lambda: server.open_streams == 1, "stream open")
                for i in range(1, 11):  # no await in between: the handler cannot keep up
                    hub.publish(B, created(i))
                records = await Reader(resp).to_eof()
        assert [r.id for r in records[:4]] == [f"{EPOCH}-{i}" for i in range(1, 5)]
        assert records[-1].event == "error" and len(records) == 5
        assert records[-1].id == f"{EPOCH}-4"  # the error record has no id of its own
        assert orjson.loads(records[-1].data)["error"] == "buffer_overflow"
        assert hub.stats()["backends"][B]["overflows"] == 1
        await wait_for(lambda: server.open_streams == 0, "stream closed")
    finally:
        await server.stop()


async def test_stop_ends_open_streams_cleanly() -> None:
    hub = make_hub()
    server = SseServer(hub, heartbeat_interval=5.0)
    await server.start("127.0.0.1", 0)
    async with aiohttp.ClientSession() as session:
        url = f"http://127.0.0.1:{server.port}/events/{B}"
        async with session.get(url, headers={"Last-Event-ID": f"{EPOCH}-0"}) as resp:
            await wait_for(lambda: server.open_streams == 1, "stream open")
            await server.stop()
            assert await Reader(resp).to_eof() == []
    assert hub.stats()["backends"][B]["subscribers"] == 0


async def test_health_stats_metrics(env: Env) -> None:
    env.hub.publish(B, created(1))
    async with env.session.get(f"{env.base}/health") as resp:
        assert resp.status == 200
        assert await resp.json() == {
            "status": "ok",
            "epoch": EPOCH,
            "backends": [B, "sglang-1"],
        }
    async with env.session.get(f"{env.base}/stats") as resp:
        stats = await resp.json()
    assert stats["epoch"] == EPOCH
    assert stats["sources"][B]["chains"] == {"tracked": 3}
    assert stats["hub"]["backends"][B]["seq"] == 1
    async with env.session.get(f"{env.base}/metrics") as resp:
        assert resp.headers["Content-Type"].startswith("text/plain")
        text = await resp.text()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("continuum_kv_listener_events_published_total", (("backend", B),))] == 1
    assert samples[("continuum_kv_listener_event_seq", (("backend", "sglang-1"),))] == 0
    assert samples[("continuum_kv_listener_source_batches_total", (("backend", B),))] == 7
    assert samples[("continuum_kv_listener_source_chains_tracked", (("backend", B),))] == 3
    backends = {dict(labels).get("backend") for _, labels in samples}
    assert backends <= {B, "sglang-1", None}  # "intruder" never becomes a label


# -- gRPC ------------------------------------------------------------------------------------


async def _grpc_take(
    stub: listener_pb2_grpc.ListenerStub, n: int, last_event_id: str = "", backend: str = B
) -> list[tuple[str, str, bytes]]:
    call = stub.Subscribe(
        listener_pb2.SubscribeRequest(backend=backend, last_event_id=last_event_id)
    )
    out: list[tuple[str, str, bytes]] = []
    async with asyncio.timeout(WAIT_S):
        async for msg in call:
            out.append((msg.id, msg.event, msg.json))
            if len(out) == n:
                break
    call.cancel()
    return out


def _config() -> Any:
    cfg, _ = parse_listener_config(
        {
            "salt_secret_env": "X",
            "sources": [
                {
                    "backend_name": B,
                    "engine": "vllm",
                    "zmq_endpoint": "tcp://127.0.0.1:5557",
                    "dp_ranks": 2,
                    "model": "m",
                },
                {
                    "backend_name": "sglang-1",
                    "engine": "sglang",
                    "zmq_endpoint": "tcp://127.0.0.1:5600",
                },
            ],
        }
    )
    return cfg


GrpcEnv = tuple[Env, listener_pb2_grpc.ListenerStub, grpc.aio.Channel]


@pytest_asyncio.fixture
async def grpc_env(env: Env) -> AsyncIterator[GrpcEnv]:
    servicer = ListenerServicer(env.hub, _config().sources, source_stats)
    server = GrpcServer(servicer)
    port = await server.start("127.0.0.1:0")
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield env, listener_pb2_grpc.ListenerStub(channel), channel
    finally:
        await channel.close()
        await server.stop(0)


async def test_grpc_subscribe_matches_sse_ids_and_payloads(
    grpc_env: GrpcEnv,
) -> None:
    env, stub, _ = grpc_env
    for i in range(1, 4):
        env.hub.publish(B, created(i))
    for last in ("", f"{EPOCH}-1", "deadbeef-1"):
        headers = {"Last-Event-ID": last} if last else None
        reader = await env.stream(headers=headers)
        n = 2 if last == f"{EPOCH}-1" else 3  # replay of 2, 3 | resync + 2-record snapshot
        sse = [(r.id, r.event, r.data) for r in await reader.take(n)]
        via_grpc = await _grpc_take(stub, n, last)
        assert via_grpc == sse, last
    # Live records too.
    reader = await env.stream(headers={"Last-Event-ID": f"{EPOCH}-3"})
    task = asyncio.ensure_future(_grpc_take(stub, 2, f"{EPOCH}-3"))
    await wait_for(lambda: env.hub.stats()["backends"][B]["subscribers"] >= 2, "both open")
    env.hub.publish(B, created(4))
    env.hub.publish(B, created(5))
    sse = [(r.id, r.event, r.data) for r in await reader.take(2)]
    assert await task == sse
    assert [i for i, _, _ in sse] == [f"{EPOCH}-4", f"{EPOCH}-5"]


async def test_grpc_unknown_backend_is_not_found(
    grpc_env: GrpcEnv,
) -> None:
    _, stub, _ = grpc_env
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _grpc_take(stub, 1, backend="nope")
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert 'unknown backend "nope"' in (info.value.details() or "")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Stats(listener_pb2.StatsRequest(backend="nope"))
    assert info.value.code() == grpc.StatusCode.NOT_FOUND


async def test_grpc_overflow_sends_the_error_record_then_resource_exhausted() -> None:
    hub = make_hub(queue=2)
    server = GrpcServer(ListenerServicer(hub))
    port = await server.start("127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = listener_pb2_grpc.ListenerStub(channel)
            call = stub.Subscribe(
                listener_pb2.SubscribeRequest(backend=B, last_event_id=f"{EPOCH}-0")
            )
            await wait_for(lambda: hub.stats()["backends"][B]["subscribers"] == 1, "open")
            for i in range(1, 6):
                hub.publish(B, created(i))
            got: list[listener_pb2.SubscribeResponse] = []
            with pytest.raises(grpc.aio.AioRpcError) as info:
                async with asyncio.timeout(WAIT_S):
                    async for msg in call:
                        got.append(msg)
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "buffer_overflow" in (info.value.details() or "")
        assert [m.id for m in got] == [f"{EPOCH}-1", f"{EPOCH}-2", ""]
        assert got[-1].event == "error"
        assert orjson.loads(got[-1].json)["error"] == "buffer_overflow"
    finally:
        await server.stop(0)


async def test_grpc_sources_stats_health_reflection(
    grpc_env: GrpcEnv,
) -> None:
    env, stub, channel = grpc_env
    env.hub.publish(B, created(1))
    sources = await stub.Sources(listener_pb2.SourcesRequest())
    assert sources.epoch == EPOCH
    first = sources.sources[0]
    assert (first.backend_name, first.engine, first.model) == (B, listener_pb2.ENGINE_VLLM, "m")
    assert list(first.endpoints) == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    assert first.last_event_id == f"{EPOCH}-1"
    stats = await stub.Stats(listener_pb2.StatsRequest())
    assert [b.backend for b in stats.backends] == [B, "sglang-1"]
    vb = stats.backends[0]
    assert (vb.seq, vb.history_records, vb.oldest_seq, vb.events_published) == (1, 1, 1, 1)
    assert dict(vb.source_counters) == {"batches_total": 7.0, "chains_tracked": 3.0}
    only = await stub.Stats(listener_pb2.StatsRequest(backend="sglang-1"))
    assert [b.backend for b in only.backends] == ["sglang-1"]

    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        reply = await health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    refl = reflection_pb2_grpc.ServerReflectionStub(channel)
    call = refl.ServerReflectionInfo(
        iter([reflection_pb2.ServerReflectionRequest(list_services="")])
    )
    names = set()
    async for resp in call:
        names |= {s.name for s in resp.list_services_response.service}
        break
    assert {SERVICE_NAME, "grpc.health.v1.Health"} <= names


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI not on PATH")
async def test_grpc_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    proc = await asyncio.create_subprocess_exec(
        "openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
        "-nodes", "-keyout", str(key), "-out", str(cert), "-days", "1",
        "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()
    hub = make_hub()
    hub.publish(B, created(1))
    server = GrpcServer(ListenerServicer(hub), GrpcTlsConfig(cert=str(cert), key=str(key)))
    port = await server.start("127.0.0.1:0")
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        async with grpc.aio.secure_channel(f"localhost:{port}", creds) as channel:
            got = await _grpc_take(listener_pb2_grpc.ListenerStub(channel), 1, f"{EPOCH}-0")
        assert [i for i, _, _ in got] == [f"{EPOCH}-1"]
        # A plaintext client cannot talk to the TLS port.
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await listener_pb2_grpc.ListenerStub(channel).Sources(
                    listener_pb2.SourcesRequest(), timeout=5
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        # Nor can a TLS client that does not trust the certificate.
        async with grpc.aio.secure_channel(
            f"localhost:{port}", grpc.ssl_channel_credentials(root_certificates=None)
        ) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await listener_pb2_grpc.ListenerStub(channel).Sources(
                    listener_pb2.SourcesRequest(), timeout=5
                )
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await server.stop(0)
