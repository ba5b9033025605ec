"""Certificate issuing with the ``cryptography`` package (ECDSA P-256, SHA-256).

Files are PEM: ``<name>.crt`` (certificate) and ``<name>.key`` (PKCS#8 private key,
written with mode 0600). Issued leaf certificates carry the extensions gRPC's TLS stack
(BoringSSL) and Python's ``ssl`` check: SubjectAlternativeName, BasicConstraints
``ca=False``, KeyUsage ``digitalSignature`` and the right ExtendedKeyUsage (serverAuth
for the router, clientAuth for listeners). A client certificate's only SAN is
``DNS:<client id>``, which is what the router matches against a broker entry ``id``.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = [
    "CertPair",
    "PkiError",
    "dev_bundle",
    "load_pair",
    "make_ca",
    "make_client_cert",
    "make_server_cert",
]

_DNS_RE = re.compile(
    r"^(?=.{1,253}$)(?:\*\.)?(?:[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9])?$"
)


class PkiError(ValueError):
    """Bad input (a name that cannot be a SAN, a missing or unreadable CA)."""


@dataclass(frozen=True, slots=True)
class CertPair:
    """Paths of one issued certificate and its key."""

    cert: Path
    key: Path


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _write(
    pair_dir: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey
) -> CertPair:
    pair_dir.mkdir(parents=True, exist_ok=True)
    cert_path = pair_dir / f"{name}.crt"
    key_path = pair_dir / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_bytes = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    # Create with 0600 from the start: the key is never world-readable, not even briefly.
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key_bytes)
    os.chmod(key_path, 0o600)
    return CertPair(cert_path, key_path)


def load_pair(pair: CertPair) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """Read a CA written by :func:`make_ca`. Raises PkiError when unreadable."""
    try:
        cert = x509.load_pem_x509_certificate(pair.cert.read_bytes())
        key = serialization.load_pem_private_key(pair.key.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise PkiError(f"cannot read CA {pair.cert} / {pair.key}: {exc}") from exc
    if not isinstance(key, ec.EllipticCurvePrivateKey):
        raise PkiError(f"{pair.key}: expected an EC private key")
    return cert, key


def _validity(days: int) -> tuple[dt.datetime, dt.datetime]:
    if days < 1:
        raise PkiError(f"days must be >= 1, got {days}")
    now = dt.datetime.now(dt.UTC)
    # Back-date a little: a peer whose clock is slightly behind still accepts it.
    return now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)


def make_ca(
    out_dir: Path, *, name: str = "ca", common_name: str = "Continuum dev CA", days: int = 365
) -> CertPair:
    """A self-signed CA (path length 0: it signs leaves only)."""
    key = _new_key()
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    not_before, not_after = _validity(days)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return _write(Path(out_dir), name, cert, key)


def _sans(hostnames: Iterable[str], ips: Iterable[str]) -> list[x509.GeneralName]:
    out: list[x509.GeneralName] = []
    for h in hostnames:
        if not _DNS_RE.match(h):
            raise PkiError(f"not a DNS name: {h!r}")
        out.append(x509.DNSName(h))
    for ip in ips:
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(ip)))
        except ValueError as exc:
            raise PkiError(f"not an IP address: {ip!r}") from exc
    if not out:
        raise PkiError("at least one hostname or IP address is required")
    return out


def _leaf(
    ca: CertPair,
    out_dir: Path,
    name: str,
    common_name: str,
    sans: list[x509.GeneralName],
    usage: Iterable[x509.ObjectIdentifier],
    days: int,
) -> CertPair:
    ca_cert, ca_key = load_pair(ca)
    key = _new_key()
    not_before, not_after = _validity(days)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=True,
                key_cert_sign=False,
                crl_sign=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
    )
    usages = list(usage)
    if usages:  # none: no ExtendedKeyUsage extension at all (any purpose, RFC 5280)
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    cert = builder.sign(ca_key, hashes.SHA256())
    return _write(Path(out_dir), name, cert, key)


def make_server_cert(
    ca: CertPair,
    out_dir: Path,
    *,
    hostnames: Iterable[str] = ("localhost",),
    ips: Iterable[str] = ("127.0.0.1", "::1"),
    name: str = "server",
    days: int = 90,
    extended_key_usage: Iterable[x509.ObjectIdentifier] = (ExtendedKeyUsageOID.SERVER_AUTH,),
) -> CertPair:
    """The router's event bus certificate: SANs for every name and address clients dial.

    ``extended_key_usage`` other than serverAuth only makes certificates the bus refuses
    (tests of that refusal)."""
    hostnames, ips = list(hostnames), list(ips)
    sans = _sans(hostnames, ips)
    cn = hostnames[0] if hostnames else ips[0]
    return _leaf(ca, out_dir, name, cn, sans, extended_key_usage, days)


def make_client_cert(
    ca: CertPair,
    out_dir: Path,
    client_id: str,
    *,
    name: str | None = None,
    days: int = 90,
    extended_key_usage: Iterable[x509.ObjectIdentifier] = (ExtendedKeyUsageOID.CLIENT_AUTH,),
) -> CertPair:
    """A listener's client certificate: its one SAN is ``DNS:<client_id>``.

    ``extended_key_usage`` other than clientAuth only makes certificates the bus refuses
    (tests of that refusal)."""
    sans = _sans([client_id], [])
    return _leaf(ca, out_dir, name or client_id, client_id, sans, extended_key_usage, days)


def dev_bundle(
    out_dir: Path,
    *,
    hostnames: Iterable[str] = ("localhost",),
    ips: Iterable[str] = ("127.0.0.1", "::1"),
    clients: Iterable[str] = (),
) -> dict[str, CertPair]:
    """A CA, a server certificate and one client certificate per id, in ``out_dir``.

    Returns ``{"ca": ..., "server": ..., "<client id>": ...}``.
    """
    out_dir = Path(out_dir)
    ca = make_ca(out_dir)
    bundle = {"ca": ca, "server": make_server_cert(ca, out_dir, hostnames=hostnames, ips=ips)}
    for cid in clients:
        if cid in bundle:
            raise PkiError(f"client id {cid!r} collides with a file name of the bundle")
        bundle[cid] = make_client_cert(ca, out_dir, cid)
    return bundle
