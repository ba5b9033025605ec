"""The stack a fault row runs on: engines, the KV listener and the router, real processes.

Built from the integration tests' own launchers (``SimFleet``, the tier-4 ``Listener``,
``RouterLauncher``) in the tier-4 layout: each engine publishes vLLM KV events on its own
ZMQ port (with a replay port unless a row turns it off), one listener serves them as SSE,
the router pulls ``/events/<backend>`` into its KV index (memory, or Redis behind its
memory fallback), or in push mode the listener dials the router's event bus (TLS from a
fresh dev PKI, a bearer token, as ``tests/integration/push_stack.py`` sets it up). Every
backend takes router-issued cache salts, so the listener keys a chain from its first block
and the engine's oracle (``GET /sim/held-prefixes``) and an exact listener agree block for
block (see ``harness.sim.held``).

Every component can be killed (SIGKILL) and started again on the same ports, so a row
heals the fault the way an operator's supervisor would. The truth and the index are read
here: ``truth`` asks every engine, ``index`` peeks the router's index over gRPC
(``KvIndex.Query``, which reads without touching LRU order or hit counts).
"""

from __future__ import annotations

import asyncio
import copy
import os
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from certs import dev_bundle
from harness.h2proxy import H2Proxy
from harness.netproxy import BlackholeProxy
from harness.procs import free_port
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json
from tests.integration.conftest import RouterLauncher, RouterProc, http, wait_until
from tests.integration.push_stack import TOKEN_ENV, TOKENS, broker
from tests.integration.test_tier4_e2e import SALT_ENV, SECRET, Listener
from tests.redis_fixture import RedisServer

from .record import Comparison, compare, pairs
from .traffic import tenant_body

__all__ = ["FaultStack", "StackOptions"]

MODEL = "demo-model"
FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
"""Debian's ``libfaketime`` (``apt-get install faketime``), for ``StackOptions.faketime``."""


@dataclass(frozen=True)
class StackOptions:
    engines: int = 2
    #: Engines keep a replay buffer and the listener asks it for gaps.
    replay: bool = True
    #: Batches each engine keeps for replay (vLLM's ``buffer_steps``).
    buffer_steps: int = 10_000
    #: ``memory`` or ``redis`` (a private redis-server this stack owns, which the response
    #: cache uses too).
    index: str = "memory"
    #: Large enough that nothing is evicted in a row: every fault's effect is its own.
    capacity_blocks: int = 65_536
    #: ``pull`` (the router reads SSE) or ``push`` (the listener dials the router's event
    #: bus over TLS with a bearer token, as the push-mode integration tests set it up).
    transport: str = "pull"
    #: Merged into the listener's YAML at its top level (SSE limits, ``heartbeat_interval_ms``,
    #: ``history_size``).
    listener_extra: Mapping[str, Any] = field(default_factory=dict)
    #: Merged into the router's ``server`` section (an abuse row's HTTP limits).
    router_server: Mapping[str, Any] = field(default_factory=dict)
    #: ``(backend, engine endpoint) -> endpoint the listener connects to`` for live events
    #: (a row's proxy between the engine and the listener); None: the engine's own.
    source_endpoint: Callable[[str, str], str] | None = None
    #: Merged into every listener source (``max_frame_bytes``, say).
    source_extra: Mapping[str, Any] = field(default_factory=dict)
    #: Router replicas besides ``router`` (``start_replicas``), on the same Redis index
    #: and cache, each pulling every source itself: a fleet behind a load balancer.
    replicas: int = 0
    #: Replicas run under libfaketime (wall clock only) with a clock file each, which
    #: ``step_clock`` rewrites at runtime.
    faketime: bool = False
    #: ``kv_cache_index.cleanup_interval_ms`` of the replicas (None: the default, 30 s).
    replica_sweep_ms: int | None = None
    #: The listener<->router event path goes through a loopback ``BlackholeProxy``
    #: (``FaultStack.net``): in pull the router's SSE GETs, in push the listener's dial.
    net_proxy: bool = False
    #: Extra keys of every router event source (``read_timeout_ms``, say).
    event_source_extra: tuple[tuple[str, Any], ...] = ()
    #: Push: extra keys of the listener's ``event_bus`` (``keepalive_time``, say) and of
    #: the router's ``dynamo.event_bus`` (``keepalive_time_ms``).
    listener_bus_extra: tuple[tuple[str, Any], ...] = ()
    router_bus_extra: tuple[tuple[str, Any], ...] = ()
    #: sim-1's ZMQ sockets (events and replay) reach the listener through loopback
    #: ``BlackholeProxy``s (``FaultStack.engine_net``).
    engine_proxy: bool = False
    #: ``SO_RCVBUF``/``SO_SNDBUF`` of the proxies' sockets (None: the kernel's).
    proxy_sock_buf: int | None = None
    #: The listener checkpoints its sources (``checkpoint_dir`` in the stack's directory,
    #: the default interval) and resumes from them when restarted.
    checkpoint: bool = False
    #: Conversation keys on both sides (the listener's ``conversation`` with Qwen2's
    #: ``tokenizer.json``, the router's ``kv_cache_index.conversation`` with its template),
    #: multi-turn chat traffic, and every comparison over both kinds of keys (the engine's
    #: ``GET /sim/held-conversation`` is their oracle).
    conversation: bool = True
    #: Bytes per conversation key (router, listener and oracle alike); small, so each
    #: turn of the traffic's chats spans several keys.
    chunk_bytes: int = 256
    #: The router's ``kv_cache_index.anti_entropy`` (seconds between checks; 0: off),
    #: and whether it repairs a divergent backend.
    anti_entropy_s: float = 0.0
    anti_entropy_repair: bool = False
    #: Push: the listener's dial to the router's event bus goes through a loopback
    #: ``H2Proxy`` (``FaultStack.h2``) that terminates TLS with the stack's server
    #: certificate and injects HTTP/2 ``RST_STREAM`` / ``GOAWAY``.
    h2_proxy: bool = False


class FaultStack:
    def __init__(self, opts: StackOptions, tmp: Path) -> None:
        self.opts = opts
        self.tmp = tmp
        self.names = [f"sim-{i + 1}" for i in range(opts.engines)]
        self.fleet: SimFleet | None = None
        self.listener: Listener | None = None
        self.router: RouterProc | None = None
        self.redis: RedisServer | None = None
        self._launcher = RouterLauncher(tmp)
        self._channel: grpc.aio.Channel | None = None
        self.stub: pb_grpc.KvIndexStub | None = None
        self.replicas: list[RouterProc] = []
        self.net: BlackholeProxy | None = None
        self.engine_net: list[BlackholeProxy] = []
        self.h2: H2Proxy | None = None

    # -- lifecycle -----------------------------------------------------------------------

    async def start(self) -> FaultStack:
        o = self.opts
        ports = [(free_port(), free_port()) for _ in self.names]
        overrides: dict[int, dict[str, Any]] = {}
        for i, (pub, replay) in enumerate(ports):
            overrides[i] = {
                "kv_events": f"tcp://*:{pub}",
                "kv_events_buffer_steps": o.buffer_steps,
                "capacity_blocks": o.capacity_blocks,
            }
            if o.replay:
                overrides[i]["kv_events_replay"] = f"tcp://*:{replay}"
            if o.conversation:
                overrides[i]["conversation_chunk_bytes"] = o.chunk_bytes
        self.fleet = await SimFleet(
            n=len(self.names),
            model=MODEL,
            names=self.names,
            tokenizer="qwen2",
            kv_events_format="vllm-0.33",
            overrides=overrides,
        ).start()
        sources = []
        for name, url, (pub, replay) in zip(self.names, self.fleet.urls, ports, strict=True):
            src: dict[str, Any] = {
                "backend_name": name,
                "engine": "vllm",
                "zmq_endpoint": f"tcp://127.0.0.1:{pub}",
                "zmq_mode": "connect",
                "allowed_publishers": ["127.0.0.1"],
                "detokenize_endpoint": f"{url}/detokenize",
                "model": MODEL,
                "chat_template": "chatml",
            }
            if o.replay:
                src["replay_endpoint"] = f"tcp://127.0.0.1:{replay}"
            if o.conversation:
                src["tokenizer"] = str(bundled_qwen2_json())
            sources.append(src)
        if o.source_endpoint is not None:
            for src in sources:
                src["zmq_endpoint"] = o.source_endpoint(src["backend_name"], src["zmq_endpoint"])
        for src in sources:
            src.update(o.source_extra)
        if o.engine_proxy:
            pub, replay = ports[0]
            self.engine_net = [await BlackholeProxy("127.0.0.1", pub).start()]
            sources[0]["zmq_endpoint"] = f"tcp://127.0.0.1:{self.engine_net[0].port}"
            if o.replay:
                self.engine_net.append(await BlackholeProxy("127.0.0.1", replay).start())
                sources[0]["replay_endpoint"] = f"tcp://127.0.0.1:{self.engine_net[1].port}"
        config: dict[str, Any] = {
            "listen": "127.0.0.1:0",
            "salt_secret_env": SALT_ENV,
            "sources": sources,
        }
        config.update(o.listener_extra)
        if o.checkpoint:
            config["checkpoint_dir"] = str(self.tmp / "checkpoints")
        if o.conversation:
            config["conversation"] = {"enabled": True, "chunk_bytes": o.chunk_bytes}
        push = o.transport == "push"
        bus_port = free_port()
        if push:
            pki = dev_bundle(self.tmp / "pki", clients=["kv-a"])
            config["event_bus"] = {
                "url": f"https://localhost:{bus_port}",
                "ca_file": str(pki["ca"].cert),
                "client_id": "kv-a",
                "reconnect_backoff": "50ms",
                "drain_deadline": "5s",
                "connect_timeout": "5s",
                "credential_env": TOKEN_ENV,
            }
        if push:
            config["event_bus"].update(o.listener_bus_extra)
        if o.net_proxy and push:
            self.net = await BlackholeProxy(
                "127.0.0.1", bus_port, sock_buf=o.proxy_sock_buf
            ).start()
            config["event_bus"]["url"] = f"https://localhost:{self.net.port}"
        if o.h2_proxy and push:
            self.h2 = await H2Proxy(
                bus_port, cert=pki["server"].cert, key=pki["server"].key, ca=pki["ca"].cert
            ).start()
            config["event_bus"]["url"] = f"https://localhost:{self.h2.port}"
        self.listener = Listener(config, self.tmp / "listener.yaml")
        self.listener.env[TOKEN_ENV] = TOKENS["kv-a"]
        await self.listener.start()
        kv: dict[str, Any] = {
            "enabled": True,
            "salt_secret_env": SALT_ENV,
            "event_sources": [
                {"backend_name": name, "transport": "event_bus", "reconnect_interval_ms": 100}
                if push
                else {
                    "backend_name": name,
                    "endpoint": f"{self.listener.url}/events/{name}",
                    "reconnect_interval_ms": 100,
                }
                for name in self.names
            ],
        }
        for source in kv["event_sources"]:
            source.update(o.event_source_extra)
        if o.net_proxy and not push:
            lport = int(self.listener.url.rsplit(":", 1)[1])
            self.net = await BlackholeProxy("127.0.0.1", lport, sock_buf=o.proxy_sock_buf).start()
            for source in kv["event_sources"]:
                name = source["backend_name"]
                source["endpoint"] = f"http://127.0.0.1:{self.net.port}/events/{name}"
        if o.anti_entropy_s:
            kv["anti_entropy"] = {
                "interval_seconds": o.anti_entropy_s,
                "repair": o.anti_entropy_repair,
            }
        if o.conversation:
            kv["conversation"] = {
                "enabled": True,
                "chunk_bytes": o.chunk_bytes,
                # Only the engines' own events count: a prediction is an entry no engine
                # holds yet, by design, and would read as stale.
                "predict_ttl_seconds": 0,
                "templates": [
                    {
                        "model": MODEL,
                        "tokenizer_config": str(bundled_qwen2_config()),
                        "tokenizer": str(bundled_qwen2_json()),
                    }
                ],
            }
        rconf: dict[str, Any] = {
            "server": {"grpc_listen": "127.0.0.1:0"},
            "selection_strategy": "RoundRobin",
            "prefix_routing": {"enabled": True},
            "backends": [
                {"name": n, "url": u, "type": "vllm", "models": [MODEL], "cache_salt": True}
                for n, u in zip(self.names, self.fleet.urls, strict=True)
            ],
            "kv_cache_index": kv,
        }
        rconf["server"].update(o.router_server)
        if push:
            rconf["dynamo"] = {
                "event_bus": {
                    "enabled": True,
                    "listen": f"127.0.0.1:{bus_port}",
                    "tls": {"cert": str(pki["server"].cert), "key": str(pki["server"].key)},
                    "brokers": [broker("kv-a", self.names)],
                }
            }
        if push:
            rconf["dynamo"]["event_bus"].update(o.router_bus_extra)
        if o.index == "redis":
            self.redis = RedisServer("redis-server")
            await asyncio.to_thread(self.redis.start)
            kv["backend"] = "redis"
            # The response cache on the same Redis, so a Redis fault hits both of its users.
            # The fallback's monitor PINGs every second (the default is 30 s): recovery
            # time is bounded below by this period.
            rconf["response_cache"] = {
                "enabled": True,
                "backend": "redis",
                "redis": {"url": self.redis.url, "health_check_interval_ms": 1000},
            }
        self.router = await self._launcher.start(rconf, env={SALT_ENV: SECRET})
        # Pin the ports, so a restarted router is where clients and probes look.
        self.router.config["server"]["listen"] = self.router.url.removeprefix("http://")
        self.router.config["server"]["grpc_listen"] = self.router.grpc_address
        self._open_grpc()
        await self.wait_connected()
        return self

    def _open_grpc(self) -> None:
        assert self.router is not None
        self._channel = grpc.aio.insecure_channel(self.router.grpc_address)
        self.stub = pb_grpc.KvIndexStub(self._channel)

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
        try:
            await self._launcher.close()
        finally:
            if self.listener is not None and self.listener.running:
                await self.listener.stop()
            if self.fleet is not None:
                await self.fleet.stop()
            if self.redis is not None:
                await asyncio.to_thread(self.redis.close)
            if self.net is not None:
                await self.net.close()
            for proxy in self.engine_net:
                await proxy.close()
            if self.h2 is not None:
                await self.h2.close()

    # -- faults and heals ----------------------------------------------------------------

    async def kill_listener(self) -> None:
        assert self.listener is not None
        await self.listener.kill()

    async def start_listener(self) -> None:
        assert self.listener is not None
        await self.listener.start()

    async def kill_engine(self, i: int) -> None:
        assert self.fleet is not None
        await self.fleet.kill(i)

    async def start_engine(self, i: int) -> None:
        assert self.fleet is not None
        await self.fleet.restart(i)

    async def kill_router(self) -> None:
        assert self.router is not None
        await self.router.kill()

    async def start_router(self) -> None:
        assert self.router is not None
        if self._channel is not None:
            await self._channel.close()
        await self.router.start()
        self._open_grpc()

    # -- router replicas (opts.replicas) ---------------------------------------------------

    def clock_file(self, rp: RouterProc) -> Path:
        """The libfaketime clock file of a replica started with ``opts.faketime``."""
        return rp.config_path.with_suffix(".clock")

    async def start_replicas(self) -> list[RouterProc]:
        """Start ``opts.replicas`` routers with ``router``'s config on free ports (the
        same index, cache and sources), each pinned to its ports for restarts."""
        for _ in range(self.opts.replicas):
            await self.start_replica()
        return self.replicas

    async def start_replica(self) -> RouterProc:
        assert self.router is not None
        config = copy.deepcopy(self.router.config)
        config["server"] = {**config["server"], "listen": "127.0.0.1:0"}
        config["server"]["grpc_listen"] = "127.0.0.1:0"
        if self.opts.replica_sweep_ms is not None:
            config["kv_cache_index"]["cleanup_interval_ms"] = self.opts.replica_sweep_ms
        env = {SALT_ENV: SECRET}
        if self.opts.faketime:
            env |= self._faketime_env(self.next_router_path().with_suffix(".clock"))
        rp = await self._launcher.start(config, env=env)
        rp.config["server"]["listen"] = rp.url.removeprefix("http://")
        rp.config["server"]["grpc_listen"] = rp.grpc_address
        self.replicas.append(rp)
        await self.wait_connected_at(rp)
        return rp

    @staticmethod
    def _faketime_env(clock: Path) -> dict[str, str]:
        """libfaketime on the wall clock only, read from ``clock`` (rewritten at runtime)."""
        if not Path(FAKETIME_LIB).is_file():
            raise RuntimeError(f"{FAKETIME_LIB} is missing: apt-get install faketime")
        clock.write_text("+0\n")
        return {
            "LD_PRELOAD": FAKETIME_LIB,
            "FAKETIME_TIMESTAMP_FILE": str(clock),
            "FAKETIME_CACHE_DURATION": "1",
            # Wall clock only, as an NTP step: CLOCK_MONOTONIC (asyncio's timers) runs on.
            "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        }

    @property
    def routers(self) -> list[RouterProc]:
        """``router`` and the replicas, in start order."""
        return [r for r in (self.router, *self.replicas) if r is not None]

    def step_clock(self, rp: RouterProc, offset: str) -> None:
        """Step a faketime replica's wall clock to ``offset`` from the real one (``+2h``)."""
        self.clock_file(rp).write_text(offset + "\n")

    async def restart(self, rp: RouterProc, *, graceful: bool = True) -> int:
        """SIGTERM (or SIGKILL) one router and start it again on its ports; its exit code."""
        rc = await (rp.stop() if graceful else rp.kill())
        if rp is self.router:
            await self.start_router()
        else:
            await rp.start()
        await self.wait_connected_at(rp)
        return rc

    def next_router_path(self) -> Path:
        """The config path of the next router this stack starts (its ``--config``)."""
        return self.tmp / f"router-{len(self._launcher.started) + 1}.yaml"

    async def launch_router(self, config: dict[str, Any]) -> RouterProc:
        """One more router on ``config`` (with the salt secret), not a replica."""
        return await self._launcher.start(config, env={SALT_ENV: SECRET})

    def forget_router(self, rp: RouterProc) -> None:
        """A router killed on purpose: the teardown does not judge its exit status."""
        self._launcher.started.remove(rp)

    async def wait_connected_at(self, rp: RouterProc, within: float = 20.0) -> None:
        """Until every event consumer of router ``rp`` is connected."""

        async def connected() -> bool:
            r = await http("GET", rp.url + "/admin/kv-index/backends", headers=rp.admin_headers)
            backends = r.json()["backends"] if r.status == 200 else []
            return bool(backends) and all(b["connection"]["connected"] for b in backends)

        await wait_until(connected, within=within, what=f"{rp.config_path.name}'s consumers")

    async def kill_redis(self) -> None:
        assert self.redis is not None
        await asyncio.to_thread(self.redis.kill)

    async def start_redis(self) -> None:
        """Same port, empty (no persistence): what a Redis restarted without a volume is."""
        assert self.redis is not None
        await asyncio.to_thread(self.redis.start)

    def _redis_signal(self, sig: signal.Signals) -> None:
        assert self.redis is not None and self.redis._proc is not None
        os.kill(self.redis._proc.pid, sig)

    async def pause_redis(self) -> None:
        """SIGSTOP: connections stay open, commands time out (a hung or swapping Redis)."""
        self._redis_signal(signal.SIGSTOP)

    async def resume_redis(self) -> None:
        self._redis_signal(signal.SIGCONT)

    async def blackhole(self) -> None:
        """The listener<->router path goes dead: no bytes either way, sockets kept open."""
        assert self.net is not None
        self.net.blackhole()

    async def reset_path(self) -> None:
        """Every connection of the listener<->router path gets an RST, new ones too."""
        assert self.net is not None
        self.net.reset()

    async def heal_path(self) -> None:
        assert self.net is not None
        self.net.forward()

    async def throttle_path(self, rate: float | None) -> None:
        assert self.net is not None
        self.net.throttle(rate)

    async def strand_path(self) -> None:
        """A NAT restart: the open connections stay silent for good, new ones get through."""
        assert self.net is not None
        self.net.strand()

    async def blackhole_engine_path(self) -> None:
        """sim-1's ZMQ path to the listener goes dead (events and replay), sockets open."""
        assert self.engine_net
        for proxy in self.engine_net:
            proxy.blackhole()

    async def heal_engine_path(self) -> None:
        for proxy in self.engine_net:
            proxy.forward()

    async def serve_direct(self, i: int, tenants: range, *, concurrency: int = 4) -> None:
        """Requests of ``tenants`` straight to engine ``i``, bypassing the router: the
        engine then holds keys the client traffic never asks for (the router learns of
        them only from their events, and nothing refills or hides them)."""
        assert self.fleet is not None
        url = self.fleet.urls[i] + "/v1/chat/completions"
        gate = asyncio.Semaphore(concurrency)

        async def one(t: int) -> None:
            async with gate:
                r = await http("POST", url, json=tenant_body(t, 0), total_s=30)
                assert r.status == 200, r

        await asyncio.gather(*(one(t) for t in tenants))

    async def net_summary(self) -> str:
        """What the network fault did, by the listener's and the router's counters."""
        assert self.listener is not None
        r = await http("GET", self.listener.url + "/stats", total_s=5)
        assert r.status == 200, r
        hub = r.json()["hub"]["backends"].values()
        overflows = sum(int(b["overflows"]) for b in hub)
        blocks = sum(int(b["resync_blocks"]) for b in hub)
        reconnects = sum(int(b["connection"]["reconnect_count"]) for b in await self.kv_backends())
        proxies = [p for p in (self.net, *self.engine_net) if p is not None]
        accepted = "/".join(str(p.accepted) for p in proxies) or "-"
        return (
            f"listener: {overflows} buffer_overflow close(s), {blocks} resync block(s) sent "
            f"(from the start); router: {reconnects} reconnect(s); proxy connections "
            f"accepted: {accepted}"
        )

    async def clear_engine(self, i: int) -> None:
        """The engine drops its whole cache (``AllBlocksCleared``): the truth changes."""
        assert self.fleet is not None
        r = await http("POST", self.fleet.urls[i] + "/sim/reset", total_s=5)
        assert r.status == 200, r

    # -- observation ---------------------------------------------------------------------

    async def kv_backends(self) -> list[dict[str, Any]]:
        assert self.router is not None
        r = await http(
            "GET", self.router.url + "/admin/kv-index/backends", headers=self.router.admin_headers
        )
        assert r.status == 200, r
        data: list[dict[str, Any]] = r.json()["backends"]
        return data

    async def kv_stats(self) -> dict[str, Any]:
        assert self.router is not None
        r = await http(
            "GET", self.router.url + "/admin/kv-index/stats", headers=self.router.admin_headers
        )
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data

    async def wait_connected(self, within: float = 20.0) -> None:
        async def connected() -> bool:
            return all(b["connection"]["connected"] for b in await self.kv_backends())

        await wait_until(connected, within=within, what="the router's event consumers")

    async def truth(self) -> dict[str, set[str]]:
        """``{backend: keys it holds}`` from every running engine (a dead one holds none)."""
        assert self.fleet is not None
        out: dict[str, set[str]] = {}
        for sim in self.fleet:
            if not sim.running:
                out[sim.name] = set()
                continue
            r = await http("GET", sim.url + "/sim/held-prefixes", total_s=5)
            assert r.status == 200, r
            out[sim.name] = set(r.json()["held"])
        return out

    async def index(self, keys: set[str]) -> tuple[set[tuple[str, str]], int]:
        """(key, backend) pairs the router's index holds for ``keys``, and its entry count."""
        assert self.stub is not None
        stub = self.stub
        out: set[tuple[str, str]] = set()

        async def one(key: str) -> None:
            reply = await stub.Query(pb.QueryRequest(prefix_hash=key), timeout=5)
            out.update((key, e.backend) for e in reply.entries)

        await asyncio.gather(*(one(k) for k in keys))
        entry_count = int((await self.kv_stats())["index"]["entry_count"])
        return out, entry_count

    async def compare(self, keys: set[str]) -> Comparison:
        """The router's index against the engines' truth over ``keys`` and every key an
        engine holds."""
        truth = pairs(await self.truth())
        universe = set(keys) | {k for k, _ in truth}
        index, entry_count = await self.index(universe)
        return compare(truth, index, entry_count)

    def rss_mb(self) -> dict[str, float]:
        """Resident memory of the router and the listener (the processes running now)."""
        out: dict[str, float] = {}
        for name, svc in (("router", self.router), ("listener", self.listener)):
            if svc is None or not svc.running:
                continue
            try:
                status = Path(f"/proc/{svc.proc.pid}/status").read_text()
            except OSError:
                continue
            for line in status.splitlines():
                if line.startswith("VmRSS:"):
                    out[name] = int(line.split()[1]) / 1024
        return out

    async def listener_summary(self) -> str:
        """The running listener's own account of its sources (what explains a loss)."""
        assert self.listener is not None
        r = await http("GET", self.listener.url + "/stats", total_s=5)
        assert r.status == 200, r
        sources = r.json()["sources"].values()
        fields = ("replayed_batches", "replay_failures", "gaps", "restarts", "orphan_blocks")
        total = {f: sum(int(src.get(f, 0)) for src in sources) for f in fields}
        return "listener (last process): " + ", ".join(f"{f} {n}" for f, n in total.items())

    async def delivered(self) -> dict[str, int]:
        """Per backend, events the router received so far (this router process)."""
        return {b["backend_name"]: int(b["events"]["received"]) for b in await self.kv_backends()}

    # -- for abuse rows --------------------------------------------------------------------

    def bus_target(self) -> tuple[str, bytes]:
        """(``host:port`` of the router's event bus, the CA certificate its TLS chains to)
        in push mode, for a hostile peer that dials it."""
        assert self.router is not None and self.listener is not None
        listen = self.router.config["dynamo"]["event_bus"]["listen"]
        ca = Path(self.listener.config["event_bus"]["ca_file"]).read_bytes()
        return "localhost:" + listen.rsplit(":", 1)[1], ca

    def alive(self) -> dict[str, bool]:
        """Whether the router and the listener processes are still running."""
        return {
            "router": self.router is not None and self.router.running,
            "listener": self.listener is not None and self.listener.running,
        }

    # -- conversation keys ---------------------------------------------------------------

    async def truth_conversation(self) -> dict[str, set[str]]:
        """``{backend: conversation keys it holds}`` (``GET /sim/held-conversation``)."""
        assert self.fleet is not None
        sims = list(self.fleet)

        async def held(url: str, running: bool) -> set[str]:
            if not running:  # a dead engine holds none
                return set()
            r = await http("GET", url + "/sim/held-conversation", total_s=5)
            assert r.status == 200, r
            return set(r.json()["held"])

        found = await asyncio.gather(*(held(sim.url, sim.running) for sim in sims))
        return {sim.name: keys for sim, keys in zip(sims, found, strict=True)}

    async def index_conversation(self, keys: set[str]) -> tuple[set[tuple[str, str]], int]:
        """(chain key, backend) pairs the router's conversation index holds for ``keys``,
        and its entry count."""
        assert self.stub is not None
        stub = self.stub
        out: set[tuple[str, str]] = set()
        sem = asyncio.Semaphore(32)

        async def one(key: str) -> None:
            async with sem:
                reply = await stub.Query(pb.QueryRequest(chain_key=key), timeout=5)
            out.update((key, e.backend) for e in reply.entries)

        await asyncio.gather(*(one(k) for k in keys))
        stats = await self.kv_stats()
        entry_count = int(stats["conversation"]["index"]["entry_count"])
        return out, entry_count

    async def compare_kinds(self, keys: set[str]) -> dict[str, Comparison]:
        """Both kinds of keys against the engines' truth: ``prefix`` (over ``keys`` and
        every key an engine holds, as :meth:`compare`) and, with conversation keys on,
        ``conversation`` (over every key an engine holds; index entries for other keys
        count as stale through the entry count)."""
        out = {"prefix": await self.compare(keys)}
        if self.opts.conversation:
            truth = pairs(await self.truth_conversation())
            index, entry_count = await self.index_conversation({k for k, _ in truth})
            out["conversation"] = compare(truth, index, entry_count)
        return out
