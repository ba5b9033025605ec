"""The TLS-only grpc.aio server of ``dynamo.event_bus``, on the router's event loop."""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

import grpc
from cryptography.x509.oid import ExtendedKeyUsageOID

from bus._gen.continuum.bus.v1 import bus_pb2 as pb
from bus.grpc_server import start_server
from bus.grpc_tls import has_extended_key_usage, server_credentials
from bus.stream_data import decode_stream_request

from ..config.models import EventBusConfig
from .service import EventBusServicer, lenient
from .sessions import SessionRegistry

__all__ = ["SERVICE_NAME", "EventBusConfigError", "EventBusServer", "method_handlers"]

log = logging.getLogger("continuum.eventbus")

SERVICE_NAME: str = pb.DESCRIPTOR.services_by_name["EventBus"].full_name


def keepalive_options(config: EventBusConfig) -> list[tuple[str, int]]:
    """HTTP/2 keepalive: a listener that vanished without a FIN (host down, partition, a
    NAT that lost its state) is noticed within ``keepalive_time_ms`` +
    ``keepalive_timeout_ms`` (30 s by default), and its sources move to another session.
    Listeners ping too (their own ``keepalive_time``); one pinging more often than
    ``min_client_ping_interval_ms`` would be sent GOAWAY (too_many_pings).

    gRPC core waits for a ping's ack ``grpc.http2.ping_timeout_ms`` (a minute by default),
    not ``keepalive_timeout_ms`` alone: without it a silent connection took 20 s + 60 s to
    be noticed; both are set to the same bound.
    """
    return [
        ("grpc.keepalive_time_ms", config.keepalive_time_ms),
        ("grpc.keepalive_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.http2.ping_timeout_ms", config.keepalive_timeout_ms),
        ("grpc.http2.min_ping_interval_without_data_ms", config.min_client_ping_interval_ms),
        ("grpc.keepalive_permit_without_calls", 1),
        ("grpc.http2.max_pings_without_data", 0),
    ]


# HTTP/2 flow control at gRPC's fixed 64 KiB per stream, without BDP probing (which grows
# the window towards megabytes on a fast link): a call is refused before the servicer
# reads a message, but gRPC's core takes in whatever the window allows meanwhile, so with
# probing a flood of unauthenticated calls with large first messages held hundreds of MB
# (measured: 90 -> 370 MB under 50 such callers; 108 MB without probing). A listener's
# stream needs far less than 64 KiB per round trip.
_FLOW_CONTROL = (("grpc.http2.bdp_probe", 0),)


def method_handlers(servicer: EventBusServicer) -> dict[str, grpc.RpcMethodHandler]:
    """The EventBus method table, written out instead of ``add_EventBusServicer_to_server``
        for one difference: Stream requests are read by ``bus.stream_data.decode_stream_request``,
        which hands a data message's payload over without two protobuf copies; and both
    deserializers are :func:`~.service.lenient`, so a message that does not parse is the
    servicer's to refuse (INVALID_ARGUMENT). A unit test holds
        it to the proto's service descriptor, so an RPC added there cannot be missed here."""
    return {
        "Session": grpc.stream_stream_rpc_method_handler(
            servicer.Session,
            request_deserializer=lenient(pb.SessionRequest.FromString),
            response_serializer=pb.SessionResponse.SerializeToString,
        ),
        "Stream": grpc.stream_unary_rpc_method_handler(
            servicer.Stream,
            request_deserializer=lenient(decode_stream_request),
            response_serializer=pb.StreamResponse.SerializeToString,
        ),
    }


def _add_servicer(servicer: EventBusServicer, server: grpc.aio.Server) -> str:
    """Registers :func:`method_handlers`; a :data:`bus.grpc_server.Registrar`."""
    handlers = method_handlers(servicer)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    # As the generated code does: gRPC's core matches registered methods itself, sparing
    # each call the lookup through the generic handler.
    server.add_registered_method_handlers(SERVICE_NAME, handlers)
    return SERVICE_NAME


class EventBusConfigError(RuntimeError):
    """The server cannot start: TLS material missing or unreadable."""


class EventBusServer:
    """Owns the grpc.aio server; ``start`` returns the bound port."""

    def __init__(self, config: EventBusConfig, sessions: SessionRegistry) -> None:
        self.config = config
        self.sessions = sessions
        self._server: Any = None
        self.port: int | None = None
        self.servicer: EventBusServicer | None = None

    def _credentials(self) -> grpc.ServerCredentials:
        tls = self.config.tls
        if not tls.cert or not tls.key:
            raise EventBusConfigError(
                "dynamo.event_bus requires tls.cert and tls.key: the event bus is TLS only"
            )
        # With client_ca, every client must present a certificate signed by it; the entry
        # is still chosen by the bearer token when one is sent, else by the certificate's
        # DNS SAN.
        try:
            pem = Path(tls.cert).read_bytes()
            credentials = server_credentials(tls.cert, tls.key, tls.client_ca)
        except OSError as exc:
            raise EventBusConfigError(f"dynamo.event_bus.tls: {exc}") from exc
        # Listeners' TLS stacks refuse it at every handshake ("unsupported certificate
        # purpose"): say so once, at start-up, naming the file.
        if not has_extended_key_usage(pem, ExtendedKeyUsageOID.SERVER_AUTH):
            raise EventBusConfigError(
                f"dynamo.event_bus.tls.cert: {tls.cert} is not a server certificate"
                " (its ExtendedKeyUsage does not include serverAuth)"
            )
        return credentials

    def _servicer(self) -> EventBusServicer:
        cfg = self.config
        self.servicer = EventBusServicer(
            self.sessions, max_sessions=cfg.max_sessions, max_streams=cfg.max_streams
        )
        return self.servicer

    async def start(self) -> int:
        """Bind and serve. Raises EventBusConfigError, or RuntimeError if the port is taken."""
        limit = self.config.max_message_bytes
        started = await start_server(
            self.config.listen,
            [functools.partial(_add_servicer, self._servicer())],
            credentials=self._credentials(),
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                *keepalive_options(self.config),
                *_FLOW_CONTROL,
            ],
        )
        self._server = started.server
        self.port = started.port
        log.info(
            "event bus listening on %s (TLS%s)",
            self.config.listen,
            ", client certificates" if self.config.tls.client_ca else "",
        )
        return started.port

    async def stop(self, grace: float = 2.0) -> None:
        """End every session (UNAVAILABLE), then stop the server. Idempotent."""
        self.sessions.close()
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)
