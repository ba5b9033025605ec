"""The grpc.aio server set-up every Continuum gRPC server shares.

:func:`start_server` builds a server with the given channel options, registers the given
services, adds gRPC health (``grpc.health.v1.Health``, with a status per service name,
``""`` being the whole server) and reflection (listing every registered service, health
and reflection itself) when asked, binds TLS when credentials are given (plain TCP
otherwise), starts it, and returns the server, the bound port and the health servicer
(stopping is the caller's: ``health.enter_graceful_shutdown()``, then ``server.stop``).

Health statuses are set before the server starts, so the first Check already sees them.
A service is registered by a :data:`Registrar`: a callable that adds it to the server and
returns its full name (:func:`generated` makes one from a grpc-generated
``add_XServicer_to_server``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn, TypeVar

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection as grpc_reflection

__all__ = [
    "HEALTH_SERVICE_NAME",
    "Registrar",
    "StartedServer",
    "abort",
    "generated",
    "start_server",
]

HEALTH_SERVICE_NAME: str = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name

Registrar = Callable[[grpc.aio.Server], str]
"""Adds one service to a server; returns the service's full name (for reflection)."""

S = TypeVar("S")


async def abort(
    context: grpc.aio.ServicerContext[Any, Any], code: grpc.StatusCode, detail: str
) -> NoReturn:
    """End the call with ``code`` and ``detail``. ``context.abort`` always raises; typed
    ``NoReturn`` here so that the code after a refusal is known to run only when it did not
    refuse."""
    await context.abort(code, detail)
    raise AssertionError("unreachable: abort raises")


def generated(add: Callable[[S, grpc.aio.Server], object], servicer: S, name: str) -> Registrar:
    """A registrar from a generated ``add_XServicer_to_server`` and the service's name."""

    def register(server: grpc.aio.Server) -> str:
        add(servicer, server)
        return name

    return register


@dataclass(frozen=True, slots=True)
class StartedServer:
    """What :func:`start_server` returns."""

    server: grpc.aio.Server
    port: int
    """The bound port (the one picked, for a ``:0`` address)."""
    health: health.aio.HealthServicer | None
    """None when the server has no health service."""


async def start_server(
    listen: str,
    services: Sequence[Registrar],
    *,
    credentials: grpc.ServerCredentials | None = None,
    options: Sequence[tuple[str, Any]] | None = None,
    health_status: Mapping[str, bool] | None = None,
    reflection: bool = False,
) -> StartedServer:
    """Build, bind and start one grpc.aio server on the running loop.

    Args:
        listen: ``host:port`` to bind (port 0: any free port).
        services: Registrars of the application's services, in order.
        credentials: TLS server credentials (:func:`bus.grpc_tls.server_credentials`);
            None binds plain TCP.
        options: gRPC channel arguments (message limits, keepalive).
        health_status: Service name -> serving (True) or not (False); ``""`` is the
            server as a whole. None: no health service.
        reflection: Serve reflection for every registered service.

    Raises:
        RuntimeError: the address could not be bound.
    """
    server = grpc.aio.server(options=options)
    names = [register(server) for register in services]
    servicer = None
    if health_status is not None:
        servicer = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
        names.append(HEALTH_SERVICE_NAME)
        for name, serving in health_status.items():
            await servicer.set(
                name,
                health_pb2.HealthCheckResponse.SERVING
                if serving
                else health_pb2.HealthCheckResponse.NOT_SERVING,
            )
    if reflection:
        grpc_reflection.enable_server_reflection([*names, grpc_reflection.SERVICE_NAME], server)
    if credentials is not None:
        port = server.add_secure_port(listen, credentials)
    else:
        port = server.add_insecure_port(listen)
    if port == 0:
        raise RuntimeError(f"cannot bind gRPC on {listen}")
    await server.start()
    return StartedServer(server, port, servicer)
