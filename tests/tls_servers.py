"""Old-TLS peers for the TLS-minimum tests: contexts that speak only TLS 1.1 (OpenSSL
allows it at security level 0) or a chosen version, from the development PKI."""

from __future__ import annotations

import ssl
import warnings
from pathlib import Path

__all__ = ["pinned_client", "pinned_server", "tls11"]


def _pin(ctx: ssl.SSLContext, version: ssl.TLSVersion) -> ssl.SSLContext:
    with warnings.catch_warnings():  # TLS 1.1 is deprecated: that is the point
        warnings.simplefilter("ignore", DeprecationWarning)
        ctx.minimum_version = version
        ctx.maximum_version = version
    ctx.set_ciphers("DEFAULT:@SECLEVEL=0")
    return ctx


def tls11() -> ssl.TLSVersion:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return ssl.TLSVersion.TLSv1_1


def pinned_server(cert: Path, key: Path, version: ssl.TLSVersion) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return _pin(ctx, version)


def pinned_client(ca: Path, version: ssl.TLSVersion, alpn: str | None = None) -> ssl.SSLContext:
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.load_verify_locations(ca)
    if alpn:
        ctx.set_alpn_protocols([alpn])
    return _pin(ctx, version)
