"""gRPC TLS credentials from PEM files: the one place the router's and the listener's
servers and the listener's event-bus channel read their certificates.

Reads are plain blocking file reads: servers build their credentials once at start-up,
and the event-bus client, which re-reads per connection so a rotated certificate is
picked up, calls :func:`channel_credentials` through ``asyncio.to_thread``. A file that
cannot be read raises the ``OSError`` of the read, which names the path; callers with a
configuration path of their own (``dynamo.event_bus.tls``) wrap it in their error.

Versions: gRPC's TLS stack negotiates TLS 1.2 or 1.3 only, on both ends; Python's gRPC
offers no setting to lower (or raise) that minimum, and ``tests/unit/test_eventbus_tls.py``
holds it. Purposes: the same stack refuses a peer certificate whose ExtendedKeyUsage is for
the other end ("unsupported certificate purpose"); :func:`has_extended_key_usage` lets the
bus also refuse certificates without the extension and its own misissued one at start-up.
"""

from __future__ import annotations

from pathlib import Path

import grpc
from cryptography import x509

__all__ = ["channel_credentials", "has_extended_key_usage", "server_credentials"]


def has_extended_key_usage(pem: bytes, usage: x509.ObjectIdentifier) -> bool:
    """Whether the PEM certificate (the first of a chain) names ``usage``
    (``ExtendedKeyUsageOID.SERVER_AUTH`` / ``CLIENT_AUTH``) in its ExtendedKeyUsage.

    False without the extension: RFC 5280 reads that as "any purpose", but a bus
    certificate must say which end of a connection it is for. False for what does not
    parse.
    """
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ext = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage)
    except (ValueError, x509.ExtensionNotFound):
        return False
    return usage in ext.value


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
