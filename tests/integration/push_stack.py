"""Helpers of the push-mode tests (``test_push_*.py``): PKI, processes, index views.

* :func:`make_pki`: a fresh dev CA with the router's server certificate and client
  certificates ``kv-a``, ``kv-b``, ``intruder`` (a valid certificate whose SAN is no
  entry id), plus an unrelated CA with its own ``kv-a`` certificate.
* :class:`Publisher`: the engine side, ``python -m harness.publisher``:
  the simulator's vLLM KV event encoder and ZMQ PUB, with router-issued cache salts on
  every chain's first block, so the listener attributes every chain (``burst B E``
  publishes B batches of E block events; each burst starts a new 64-block chain).
* :class:`ListenerProc`: ``python -m listener``; :func:`listener_state` reads a backend's
  whole state from ``GET /events/{backend}`` (the resync block), :func:`router_state`
  the router's index for that backend through ``KvIndex`` gRPC.
* :class:`BusPeer`: a hand-driven EventBus client for the refusal and malformed-input
  tests (it speaks the wire protocol directly, as a hostile peer would).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest

from bus._gen.continuum.bus.v1 import bus_pb2 as bpb
from bus._gen.continuum.bus.v1 import bus_pb2_grpc as bpb_grpc
from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as kpb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as kpb_grpc
from bus.events import KvEvent
from bus.sse import SseParser
from certs import CertPair, dev_bundle, make_client_cert
from harness.procs import DISCARD, ChildProcess, Service, launch, python_module

from .conftest import wait_until

SALT_ENV = "CONTINUUM_BENCH_SALT_SECRET"  # harness/publisher.py reads it
SALT_SECRET = "push-tests-salt-secret-0123456789"
TOKENS = {"kv-a": "token-of-kv-a-0123456789", "kv-b": "token-of-kv-b-0123456789"}
TOKEN_ENV = "CONTINUUM_BUS_TOKEN"


def token_hash(token: str) -> str:
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


# -- PKI -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    dir: Path
    ca: CertPair
    server: CertPair
    clients: dict[str, CertPair]
    foreign_ca: CertPair
    foreign_kv_a: CertPair


def make_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """Fresh certificates (each test module's session-scoped ``pki`` fixture calls it)."""
    base = tmp_path_factory.mktemp("pki")
    bundle = dev_bundle(base / "dev", clients=["kv-a", "kv-b", "intruder"])
    foreign = dev_bundle(base / "foreign")
    return Pki(
        dir=base,
        ca=bundle["ca"],
        server=bundle["server"],
        clients={k: bundle[k] for k in ("kv-a", "kv-b", "intruder")},
        foreign_ca=foreign["ca"],
        foreign_kv_a=make_client_cert(foreign["ca"], base / "foreign", "kv-a"),
    )


# -- configs -------------------------------------------------------------------------------


def broker(
    entry_id: str, backends: list[str], *, role: str = "kv_listener", token: bool = True
) -> dict[str, Any]:
    out: dict[str, Any] = {"id": entry_id, "role": role, "backends": backends}
    if token:
        out["token_hash"] = token_hash(TOKENS[entry_id])
    return out


def router_config(
    pki: Pki,
    bus_port: int,
    sources: list[str],
    brokers: list[dict[str, Any]],
    *,
    client_ca: bool = False,
    pull: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A router whose ``sources`` are consumed over the event bus (``pull``: name -> SSE
    endpoint, consumed by pull instead)."""
    pull = pull or {}
    names = [*sources, *pull]
    tls: dict[str, Any] = {"cert": str(pki.server.cert), "key": str(pki.server.key)}
    if client_ca:
        tls["client_ca"] = str(pki.ca.cert)
    return {
        "server": {"listen": "127.0.0.1:0", "grpc_listen": "127.0.0.1:0"},
        "backends": [
            {"name": n, "url": "http://127.0.0.1:9", "type": "vllm", "models": ["demo-model"]}
            for n in names
        ],
        "health_check": {"enabled": False},
        "prefix_routing": {"enabled": True},
        "dynamo": {
            "event_bus": {
                "enabled": True,
                "listen": f"127.0.0.1:{bus_port}",
                "tls": tls,
                "brokers": brokers,
            }
        },
        "kv_cache_index": {
            "enabled": True,
            "event_sources": [
                {"backend_name": n, "transport": "event_bus", "reconnect_interval_ms": 50}
                for n in sources
            ]
            + [
                {"backend_name": n, "endpoint": url, "reconnect_interval_ms": 50}
                for n, url in pull.items()
            ],
        },
    }


def listener_config(
    pki: Pki,
    bus_port: int,
    client_id: str,
    sources: dict[str, int],
    *,
    mtls: bool = False,
    token: bool = True,
    ca: CertPair | None = None,
    **top: Any,
) -> dict[str, Any]:
    """``sources``: backend name -> the publisher's ZMQ port."""
    bus: dict[str, Any] = {
        "url": f"https://localhost:{bus_port}",
        "ca_file": str((ca or pki.ca).cert),
        "client_id": client_id,
        "reconnect_backoff": "50ms",
        "drain_deadline": "5s",
        "connect_timeout": "5s",
    }
    if token:
        bus["credential_env"] = TOKEN_ENV
    if mtls:
        pair = pki.clients[client_id]
        bus["client_cert_file"] = str(pair.cert)
        bus["client_key_file"] = str(pair.key)
    return {
        "listen": "127.0.0.1:0",
        "salt_secret_env": SALT_ENV,
        "event_bus": bus,
        "sources": [
            {
                "backend_name": name,
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{port}",
                "zmq_mode": "connect",
                "allowed_publishers": ["127.0.0.1"],
            }
            for name, port in sources.items()
        ],
        **top,
    }


# -- processes -----------------------------------------------------------------------------


class Publisher:
    """The engine: salted vLLM KV event bursts on a bound ZMQ PUB."""

    def __init__(self, port: int, backend: str) -> None:
        self.port = port
        self.backend = backend
        self.child: ChildProcess | None = None

    async def start(self) -> Publisher:
        argv = python_module(
            "harness.publisher", "--endpoint", f"tcp://*:{self.port}",
            "--salted", "--prefixes", "0", "--backend", self.backend, "--hwm", "100000",
        )  # fmt: skip
        self.child = await launch(
            "publisher",
            argv,
            ready_timeout=20,
            log=DISCARD,
            stdin=True,
            env={SALT_ENV: SALT_SECRET},
        )
        return self

    async def burst(self, batches: int, events_per_batch: int = 8) -> dict[str, Any]:
        assert self.child is not None and self.child.proc.stdin is not None
        self.child.proc.stdin.write(f"burst {batches} {events_per_batch}\n".encode())
        await self.child.proc.stdin.drain()
        report = await self.child.expect(r"^\{", 60, what="the burst's report")
        return orjson.loads(report.string)

    async def stop(self) -> None:
        """Closing stdin ends the publisher; SIGKILL if it has not gone after 5 s."""
        if self.child is not None and self.child.running:
            assert self.child.proc.stdin is not None
            self.child.proc.stdin.close()
            await self.child.stop(5, sig=None)


class ListenerProc(Service):
    """``python -m listener`` with push mode; restartable (``listen`` pinned after start)."""

    def __init__(self, config: dict[str, Any], path: Path, token: str | None = None) -> None:
        env = {SALT_ENV: SALT_SECRET, **({TOKEN_ENV: token} if token else {})}
        super().__init__("listener", ["listener"], config, path, env=env, stop_grace=15)
        self.token = token

    async def start(self) -> ListenerProc:
        await super().start()
        self.config["listen"] = self.url.removeprefix("http://")
        return self

    async def stats(self) -> dict[str, Any]:
        async with aiohttp.ClientSession() as s, s.get(self.url + "/stats") as r:
            assert r.status == 200
            return await r.json()

    async def warm_up(self, pub: Publisher) -> None:
        """Bursts of one event until the listener saw a frame (ZMQ's slow joiner)."""
        backend = pub.backend

        async def got_frame() -> bool:
            await pub.burst(1, 1)
            return (await self.stats())["sources"][backend]["frames"] > 0

        await wait_until(got_frame, within=15, interval=0.05, what="the listener's first frame")

    async def terminate(self) -> int:
        """SIGTERM; fails the test when the listener needs SIGKILL after the grace period."""
        rc = await self.stop()
        if self.child is not None and self.child.ignored_signal:
            raise AssertionError(f"listener ignored SIGTERM; log:\n{self.log()}")
        return rc


@contextlib.asynccontextmanager
async def running(*procs: Any) -> AsyncIterator[None]:
    """Stops listeners (SIGTERM, asserting exit 0) and publishers at the end."""
    try:
        yield
    finally:
        for p in procs:
            if isinstance(p, ListenerProc) and p.running:
                rc = await p.terminate()
                assert rc == 0, p.log()
            elif isinstance(p, Publisher):
                await p.stop()


# -- state views ---------------------------------------------------------------------------


State = dict[str, int]
"""prefix hash -> token count of one backend."""

STATE_READS: collections.Counter[str] = collections.Counter()
"""Resync blocks this module caused, per listener URL (each :func:`listener_state`)."""


async def listener_state(url: str, backend: str) -> State:
    """The backend's whole state: a fresh ``GET /events/{backend}`` starts with a resync
    block whose last record carries the shared id ``<epoch>-<S>`` (no ``.s``)."""
    parser = SseParser()
    state: State = {}
    STATE_READS[url] += 1
    async with aiohttp.ClientSession() as s, s.get(f"{url}/events/{backend}") as r:
        assert r.status == 200
        async for chunk in r.content.iter_any():
            for rec in parser.feed(chunk):
                ev = KvEvent.from_json(rec.data, event_field=rec.event)
                if ev.event == "cache_created" and ev.prefix_hash:
                    state[ev.prefix_hash] = ev.token_count or 0
                if rec.id and ".s" not in rec.id:
                    return state
    raise AssertionError("stream ended inside the resync block")


async def router_state(target: str, backend: str, prefixes: list[str]) -> tuple[int, State]:
    """(entries the router holds for ``backend``, token counts of ``prefixes`` there)."""
    async with grpc.aio.insecure_channel(target) as ch:
        stub = kpb_grpc.KvIndexStub(ch)
        backends = await stub.Backends(kpb.BackendsRequest())
        entries = next((b.entries for b in backends.backends if b.name == backend), 0)
        state: State = {}
        for p in prefixes:
            resp = await stub.Query(kpb.QueryRequest(prefix_hash=p))
            for e in resp.entries:
                if e.backend == backend:
                    state[p] = e.token_count
        return entries, state


async def backend_status(target: str, backend: str) -> kpb.BackendStatus:
    async with grpc.aio.insecure_channel(target) as ch:
        resp = await kpb_grpc.KvIndexStub(ch).Backends(kpb.BackendsRequest())
        return next(b for b in resp.backends if b.name == backend)


async def streaming_from(
    target: str, backend: str, listeners: list[ListenerProc]
) -> ListenerProc | None:
    """The listener whose epoch the router's last applied event id of ``backend`` carries:
    the one its stream comes from (None before the first event). A listener that no
    longer answers is left out."""
    epochs: dict[str, ListenerProc] = {}
    for p in listeners:
        with contextlib.suppress(aiohttp.ClientError):  # one that is exiting
            epochs[(await p.stats())["epoch"]] = p
    st = await backend_status(target, backend)
    return epochs.get(st.last_event_id.partition("-")[0])


async def wait_router_matches(
    grpc_target: str, listener: ListenerProc, backend: str, within: float = 20.0
) -> State:
    """Until the router's index for ``backend`` equals the listener's state exactly (no
    missing, no stale entry, same token counts); returns that state."""
    last: list[Any] = []

    async def same() -> bool:
        want = await listener_state(listener.url, backend)
        entries, got = await router_state(grpc_target, backend, list(want))
        last[:] = [len(want), entries, sum(1 for k in want if got.get(k) != want[k])]
        return entries == len(want) and got == want

    await wait_until(same, within, interval=0.1, what=f"router index == listener state ({last})")
    return await listener_state(listener.url, backend)


# -- a hand-driven peer --------------------------------------------------------------------


class BusPeer:
    """Speaks EventBus directly over TLS (for refusals and malformed input)."""

    def __init__(
        self,
        pki: Pki,
        port: int,
        *,
        token: str | None = None,
        client: CertPair | None = None,
        ca: CertPair | None = None,
    ) -> None:
        root = (ca or pki.ca).cert.read_bytes()
        key = client.key.read_bytes() if client else None
        chain = client.cert.read_bytes() if client else None
        creds = grpc.ssl_channel_credentials(root, key, chain)
        self.channel = grpc.aio.secure_channel(f"localhost:{port}", creds)
        self.stub = bpb_grpc.EventBusStub(self.channel)
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()

    async def close(self) -> None:
        await self.channel.close()

    async def hello(
        self, client_id: str, sources: list[str], role: bpb.Role = bpb.ROLE_KV_LISTENER
    ) -> tuple[Any, Any]:
        """Open a Session with a Hello; returns (call, first message or EOF)."""
        call = self.stub.Session(metadata=self.metadata)
        await asyncio.wait_for(call.initial_metadata(), 10)  # the router admitted the call
        if call.done():
            return call, grpc.aio.EOF
        await call.write(
            bpb.SessionRequest(hello=bpb.Hello(client_id=client_id, role=role, sources=sources))
        )
        first = await asyncio.wait_for(call.read(), 10)
        return call, first

    @staticmethod
    async def finish(call: Any, within: float = 10) -> grpc.StatusCode:
        """The Session's status once every message still in flight has been read.

        gRPC hands a call's status over only after its messages: the router's consumers
        may Subscribe on a fresh session at any moment, and a test that awaits
        ``call.code()`` without reading them waits forever.
        """

        async def drain() -> grpc.StatusCode:
            try:
                while await call.read() is not grpc.aio.EOF:
                    pass
            except grpc.aio.AioRpcError as exc:  # read() raises a status other than OK
                return exc.code()
            code: grpc.StatusCode = await call.code()
            return code

        return await asyncio.wait_for(drain(), within)

    async def refusal(
        self, client_id: str, sources: list[str], role: bpb.Role = bpb.ROLE_KV_LISTENER
    ) -> tuple[grpc.StatusCode, str]:
        """The status a Hello is refused with (fails if it is welcomed)."""
        try:
            call, first = await self.hello(client_id, sources, role)
        except grpc.aio.AioRpcError as exc:
            return exc.code(), exc.details() or ""
        assert first is grpc.aio.EOF, f"expected a refusal, got {first}"
        return await call.code(), await call.details() or ""
