"""gRPC TLS credentials from PEM files: the one place the router's and the listener's
servers and the listener's event-bus channel read their certificates.

Reads are plain blocking file reads: servers build their credentials once at start-up,
and the event-bus client, which re-reads per connection so a rotated certificate is
picked up, calls :func:`channel_credentials` through ``asyncio.to_thread``. A file that
cannot be read raises the ``OSError`` of the read, which names the path; callers with a
configuration path of their own (``dynamo.event_bus.tls``) wrap it in their error.
"""

from __future__ import annotations

from pathlib import Path

import grpc

__all__ = ["channel_credentials", "server_credentials"]


def server_credentials(
    cert_file: str, key_file: str, client_ca_file: str | None = None
) -> grpc.ServerCredentials:
    """Server credentials for one certificate chain and its key.

    With ``client_ca_file`` every client must present a certificate signed by it: gRPC has
    no "request, and verify if presented" mode.

    Raises:
        OSError: a file could not be read.
    """
    cert = Path(cert_file).read_bytes()
    key = Path(key_file).read_bytes()
    ca = Path(client_ca_file).read_bytes() if client_ca_file else None
    return grpc.ssl_server_credentials(
        [(key, cert)], root_certificates=ca, require_client_auth=ca is not None
    )


def channel_credentials(
    ca_file: str | None = None,
    cert_file: str | None = None,
    key_file: str | None = None,
) -> grpc.ChannelCredentials:
    """TLS channel credentials: ``ca_file`` verifies the server (None: the system roots);
    a client certificate is presented only when both ``cert_file`` and ``key_file`` are
    given.

    Raises:
        OSError: a file could not be read.
    """
    ca = Path(ca_file).read_bytes() if ca_file else None
    cert = key = None
    if cert_file and key_file:
        cert = Path(cert_file).read_bytes()
        key = Path(key_file).read_bytes()
    return grpc.ssl_channel_credentials(
        root_certificates=ca, private_key=key, certificate_chain=cert
    )
