"""``continuum-router serve``: one asyncio process running HTTP, gRPC and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from pathlib import Path

from .app import Router
from .config import RouterConfig, log_warnings, parse_hostport
from .config.loader import ConfigIssue
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


async def _start_grpc(listen: str) -> tuple[object, int]:
    import grpc
    from grpc_health.v1 import health, health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection

    server = grpc.aio.server()
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    reflection.enable_server_reflection(
        [health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME],
        server,
    )
    port = server.add_insecure_port(listen)
    await server.start()
    return server, port


async def serve(config_path: Path, config: RouterConfig, warnings: list[ConfigIssue]) -> int:
    log_warnings(warnings)
    router = Router(config)
    await router.start()
    host, port = parse_hostport(config.server.listen)
    port = _resolve_port(host, port)
    http = EmbeddedServer(RSGIApp(router.handle, config.server.max_body_bytes), host, port)
    await http.start()
    grpc_server = None
    announce = f"READY http={host}:{port}"
    if config.server.grpc_listen:
        grpc_server, gport = await _start_grpc(config.server.grpc_listen)
        announce += f" grpc={parse_hostport(config.server.grpc_listen)[0]}:{gport}"
    reloader = ConfigReloader(config_path, router)
    watcher = asyncio.get_running_loop().create_task(reloader.watch())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGHUP, reloader.reload, "SIGHUP")
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    log.info("listening on http://%s:%d", host, port)
    print(announce, flush=True)
    await stop.wait()
    log.info("shutting down")
    watcher.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await watcher
    await http.stop()
    if grpc_server is not None:
        await grpc_server.stop(grace=2)  # type: ignore[attr-defined]
    await router.stop()
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
