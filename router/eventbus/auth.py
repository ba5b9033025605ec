"""Who is calling: one ``dynamo.event_bus.brokers[]`` entry per authenticated call.

Two credentials, checked on every call (``Session`` and ``Stream``):

* **Bearer token** in the call metadata (``authorization: Bearer <token>``): its SHA-256 is
  compared with every entry's ``token_hash`` with ``hmac.compare_digest`` (constant time
  per entry, and every entry is compared, so timing does not tell which one matched).
* **mTLS client certificate** (only when ``tls.client_ca`` is set, which makes gRPC verify
  the chain): a DNS SubjectAlternativeName equal to an entry ``id``. Only DNS SANs count;
  the common name and IP SANs never do. A presented certificate must name clientAuth in
  its ExtendedKeyUsage, with a token too: the TLS stack refuses one for another purpose,
  this refuses one without the extension (which the TLS stack takes as any purpose).

A token that matches no entry is UNAUTHENTICATED even when a certificate would match:
a caller that sends a wrong secret is refused, not silently re-identified. No credential
at all is UNAUTHENTICATED. Authorisation (role, client id, backends) is the session registry's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import grpc
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from bus.grpc_tls import has_extended_key_usage

from ..config.models import BrokerConfig

__all__ = ["AuthError", "Authenticator", "Principal", "dns_sans", "hash_token"]

_BEARER = "bearer "


def hash_token(token: str) -> str:
    """The ``token_hash`` form of a token: ``sha256:<64 lowercase hex>``."""
    return "sha256:" + hashlib.sha256(token.encode()).hexdigest()


class AuthError(Exception):
    """A call is refused; ``code`` is the gRPC status to end it with."""

    def __init__(self, code: grpc.StatusCode, detail: str) -> None:
        super().__init__(detail)
        self.code = code
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Principal:
    """The entry a call authenticated as, and how."""

    entry: BrokerConfig
    method: str
    """``token`` or ``certificate``."""


def dns_sans(pem: bytes) -> list[str]:
    """The DNS SANs of a PEM certificate ([] when it has none or does not parse)."""
    try:
        cert = x509.load_pem_x509_certificate(pem)
        ext = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except (ValueError, x509.ExtensionNotFound):
        return []
    return [str(n) for n in ext.value.get_values_for_type(x509.DNSName)]


class Authenticator:
    """Matches a call's credential to a broker entry. Replace ``brokers`` on reload.

    Args:
        brokers: The configured entries.
        certificates: Whether client certificates are verified (``tls.client_ca`` set);
            without it a presented certificate is never trusted.
    """

    def __init__(self, brokers: Sequence[BrokerConfig], *, certificates: bool) -> None:
        self.certificates = certificates
        self.update(brokers)

    def update(self, brokers: Iterable[BrokerConfig]) -> None:
        self._brokers = list(brokers)
        self._hashes = [
            (b, bytes.fromhex(b.token_hash.removeprefix("sha256:")))
            for b in self._brokers
            if b.token_hash is not None
        ]

    def entry(self, entry_id: str) -> BrokerConfig | None:
        return next((b for b in self._brokers if b.id == entry_id), None)

    def authenticate(
        self,
        metadata: Iterable[tuple[str, str | bytes]],
        auth_context: Mapping[str, Sequence[bytes]],
    ) -> Principal:
        """The entry this call speaks for.

        Raises:
            AuthError: UNAUTHENTICATED, with a detail that names no secret.
        """
        pems = (auth_context.get("x509_pem_cert") or []) if self.certificates else []
        if pems and not has_extended_key_usage(pems[0], ExtendedKeyUsageOID.CLIENT_AUTH):
            raise AuthError(
                grpc.StatusCode.UNAUTHENTICATED,
                "the client certificate's ExtendedKeyUsage does not include clientAuth",
            )
        token = None
        for key, value in metadata:
            if key.lower() == "authorization":
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                if not text.lower().startswith(_BEARER):
                    raise AuthError(
                        grpc.StatusCode.UNAUTHENTICATED,
                        "authorization metadata must be 'Bearer <token>'",
                    )
                token = text[len(_BEARER) :].strip()
                break
        if token is not None:
            digest = hashlib.sha256(token.encode()).digest()
            found = None
            for entry, want in self._hashes:
                if hmac.compare_digest(digest, want) and found is None:
                    found = entry
            if found is None:
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED,
                    "bearer token matches no dynamo.event_bus.brokers entry",
                )
            return Principal(found, "token")
        if self.certificates:
            if pems:
                names = dns_sans(pems[0])
                for b in self._brokers:
                    if b.id in names:
                        return Principal(b, "certificate")
                raise AuthError(
                    grpc.StatusCode.UNAUTHENTICATED,
                    f"client certificate DNS SANs {names} match no broker entry id",
                )
        raise AuthError(
            grpc.StatusCode.UNAUTHENTICATED,
            "no credential: send 'authorization: Bearer <token>' metadata"
            + (" or a client certificate" if self.certificates else ""),
        )
