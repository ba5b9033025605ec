"""The router's client-side TLS: every TLS connection it opens starts at TLS 1.2.

Python's default context already refuses older versions, but a context handed in from
elsewhere may not, and the floor belongs in one place the tests can pin. Used by the
upstream HTTP client (backends, Gemini, embeddings), the KV event streams' HTTP session
and, as ``MINIMUM_VERSION``, the Redis client. (gRPC's TLS is BoringSSL/OpenSSL inside
grpc core, whose minimum is TLS 1.2 already; ``tests`` pin that too.)
"""

from __future__ import annotations

import ssl

__all__ = ["MINIMUM_VERSION", "client_context", "enforce_minimum"]

MINIMUM_VERSION = ssl.TLSVersion.TLSv1_2


def enforce_minimum(ctx: ssl.SSLContext) -> ssl.SSLContext:
    """``ctx`` with its minimum raised to TLS 1.2 when it allowed less."""
    low = ctx.minimum_version
    # The sentinels: MINIMUM_SUPPORTED (-2) is "anything", MAXIMUM_SUPPORTED (-1) the newest.
    if low != ssl.TLSVersion.MAXIMUM_SUPPORTED and low < MINIMUM_VERSION:
        ctx.minimum_version = MINIMUM_VERSION
    return ctx


def client_context(alpn: tuple[str, ...] = ()) -> ssl.SSLContext:
    """A verifying client context (system roots, host names checked), TLS 1.2 at least."""
    ctx = ssl.create_default_context()
    if alpn:
        ctx.set_alpn_protocols(list(alpn))
    return enforce_minimum(ctx)
