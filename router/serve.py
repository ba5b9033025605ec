"""``continuum-router serve``: one asyncio process running HTTP, gRPC and background tasks."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
import sys
from pathlib import Path

from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc
from bus.collector import tune_collector
from bus.grpc_server import generated, start_server
from bus.grpc_tls import server_credentials
from bus.tasks import cancel_and_wait

from .app import Router
from .config import RouterConfig, log_warnings, parse_hostport
from .config.loader import ConfigIssue
from .eventbus.server import EventBusConfigError, EventBusServer
from .eventbus.sessions import SessionRegistry
from .grpc_kvindex import SERVICE_NAME
from .http.rsgi import EmbeddedServer, RSGIApp
from .reload import ConfigReloader

__all__ = ["run"]

log = logging.getLogger("continuum.serve")


def _resolve_port(host: str, port: int) -> int:
    """Port 0 means any free port: find one so it can be announced before serving."""
    if port:
        return port
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


async def _start_grpc(router: Router, config: RouterConfig) -> tuple[object, int]:
    """Health, reflection and KvIndex (NOT_SERVING without Tier 4) on one grpc.aio server,
    on the same loop."""
    listen = config.server.grpc_listen
    assert listen is not None
    srv = config.server
    started = await start_server(
        listen,
        [
            generated(
                kvindex_pb2_grpc.add_KvIndexServicer_to_server,
                router.kvindex_service,
                SERVICE_NAME,
            )
        ],
        credentials=(
            # start-up: blocking is fine
            server_credentials(srv.grpc_tls_cert, srv.grpc_tls_key, srv.grpc_tls_client_ca)
            if srv.grpc_tls_cert and srv.grpc_tls_key
            else None
        ),
        health_status={"": True, SERVICE_NAME: router.kv is not None},
        reflection=True,
    )
    return started.server, started.port


async def _start_event_bus(
    sessions: SessionRegistry, config: RouterConfig
) -> EventBusServer | None:
    """The TLS-only EventBus server on ``sessions``; None (logged) when it cannot start."""
    bus = config.dynamo.event_bus
    server = EventBusServer(bus, sessions)
    try:
        await server.start()
    except (EventBusConfigError, RuntimeError) as exc:
        log.error("event bus: cannot start on %s: %s", bus.listen, exc)
        return None
    return server


async def serve(config_path: Path, config: RouterConfig, warnings: list[ConfigIssue]) -> int:
    log_warnings(warnings)
    router = Router(config)
    event_bus = router.event_bus
    await router.start()
    host, port = parse_hostport(config.server.listen)
    port = _resolve_port(host, port)
    srv = config.server
    app = RSGIApp(
        router.handle,
        srv.max_body_bytes,
        body_read_timeout_s=srv.body_read_timeout_ms / 1000,
        max_concurrent=srv.max_concurrent_requests,
        on_reject=router.metrics.rejected,
    )
    router.metrics.attach_http(lambda: app.in_flight)
    http = EmbeddedServer(app, host, port)
    await http.start()
    grpc_server = None
    announce = f"READY http={host}:{port}"
    if config.server.grpc_listen:
        grpc_server, gport = await _start_grpc(router, config)
        announce += f" grpc={parse_hostport(config.server.grpc_listen)[0]}:{gport}"
    bus_server = None
    hooks = []
    if event_bus is not None:
        bus_server = await _start_event_bus(event_bus, config)
        if bus_server is None:
            await http.stop()
            if grpc_server is not None:
                await grpc_server.stop(grace=0)  # type: ignore[attr-defined]
            await router.stop()
            return 1
        sessions = bus_server.sessions
        announce += f" bus={parse_hostport(config.dynamo.event_bus.listen)[0]}:{bus_server.port}"
        hooks.append(lambda new: sessions.update_brokers(new.dynamo.event_bus.brokers))
    reloader = ConfigReloader(
        config_path, router, on_apply=hooks, on_outcome=router.metrics.config_reload
    )
    watcher = asyncio.get_running_loop().create_task(reloader.watch())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    # Everything allocated so far lives for the process; requests' bodies are freed by
    # reference counting long before a collector pass would walk them.
    tune_collector()
    log.info("listening on http://%s:%d", host, port)
    print(announce, flush=True)
    await stop.wait()
    grace = config.server.shutdown_grace_ms / 1000
    log.info("shutting down: %d requests in flight, up to %gs to finish", app.in_flight, grace)
    await cancel_and_wait(watcher, log=log)
    app.close()
    left = await app.drain(grace)
    if left:
        log.warning("shutting down: %d requests still in flight after %gs are cut", left, grace)
    await http.stop(grace=0.5 if left else 10.0)
    if grpc_server is not None:
        await grpc_server.stop(grace=2)  # type: ignore[attr-defined]
    await router.stop()  # the KV consumers first: their bus streams end as unsubscribed
    if bus_server is not None:
        await bus_server.stop(grace=1)
    return 0


def run(config_path: Path, config: RouterConfig, warnings: list[ConfigIssue]) -> int:
    try:
        import uvloop

        return uvloop.run(serve(config_path, config, warnings))
    except ImportError:  # pragma: no cover - uvloop is a dependency; keep a plain fallback
        return asyncio.run(serve(config_path, config, warnings))
    except KeyboardInterrupt:
        return 0
    finally:
        sys.stdout.flush()
