"""The development PKI: what it issues is what the event bus's TLS and auth rely on."""

from __future__ import annotations

import ipaddress
import ssl
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from certs import PkiError, dev_bundle, make_ca, make_client_cert, make_server_cert

ROOT = Path(__file__).resolve().parents[2]


def _cert(path: Path) -> x509.Certificate:
    return x509.load_pem_x509_certificate(path.read_bytes())


def test_server_and_client_certificates_chain_to_the_ca(tmp_path: Path) -> None:
    ca = make_ca(tmp_path)
    server = make_server_cert(ca, tmp_path, hostnames=["router.internal"], ips=["10.0.0.7"])
    client = make_client_cert(ca, tmp_path, "kv-listener-a")
    ca_cert, srv, cli = _cert(ca.cert), _cert(server.cert), _cert(client.cert)
    srv.verify_directly_issued_by(ca_cert)
    cli.verify_directly_issued_by(ca_cert)
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    sans = srv.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["router.internal"]
    assert sans.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("10.0.0.7")]
    eku = srv.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.SERVER_AUTH]
    # A client certificate's one SAN is DNS:<client id>: what the router matches.
    csans = cli.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert list(csans) == [x509.DNSName("kv-listener-a")]
    eku = cli.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_private_keys_are_owner_only(tmp_path: Path) -> None:
    bundle = dev_bundle(tmp_path, clients=["kv-a"])
    for pair in bundle.values():
        assert stat.S_IMODE(pair.key.stat().st_mode) == 0o600
        assert b"PRIVATE KEY" in pair.key.read_bytes()


def test_each_key_matches_its_certificate(tmp_path: Path) -> None:
    bundle = dev_bundle(tmp_path, clients=["kv-a"])
    for pair in bundle.values():
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(str(pair.cert), str(pair.key))  # raises on a mismatch


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"hostnames": ["bad host"], "ips": []}, "not a DNS name"),
        ({"hostnames": [], "ips": ["300.1.1.1"]}, "not an IP address"),
        ({"hostnames": [], "ips": []}, "at least one hostname or IP"),
    ],
)
def test_bad_names_are_refused(tmp_path: Path, kwargs: dict, message: str) -> None:
    ca = make_ca(tmp_path)
    with pytest.raises(PkiError, match=message):
        make_server_cert(ca, tmp_path, **kwargs)


def test_a_missing_ca_is_a_clear_error(tmp_path: Path) -> None:
    from certs import CertPair

    with pytest.raises(PkiError, match="cannot read CA"):
        make_client_cert(CertPair(tmp_path / "no.crt", tmp_path / "no.key"), tmp_path, "kv-a")


def test_command_line(tmp_path: Path) -> None:
    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "certs", *args], cwd=ROOT, capture_output=True, text=True
        )

    assert run("ca", "--out", str(tmp_path)).returncode == 0
    r = run("server", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path), "--host", "r1")
    assert r.returncode == 0 and str(tmp_path / "server.crt") in r.stdout
    r = run("client", "--ca", str(tmp_path / "ca.crt"), "--out", str(tmp_path), "--id", "kv-b")
    assert r.returncode == 0
    assert (tmp_path / "kv-b.crt").is_file() and (tmp_path / "kv-b.key").is_file()
    r = run("client", "--ca", str(tmp_path / "ca"), "--out", str(tmp_path), "--id", "no spaces")
    assert r.returncode == 1 and "not a DNS name" in r.stdout
