"""Command line of the development PKI.

::

    python -m certs ca     --out DIR [--days N]
    python -m certs server --ca DIR/ca --out DIR [--host NAME]... [--ip ADDR]...
    python -m certs client --ca DIR/ca --out DIR --id CLIENT_ID
    python -m certs dev    --out DIR [--host NAME]... [--ip ADDR]... [--client ID]...

``--ca`` is the CA's path without suffix (``DIR/ca`` for ``DIR/ca.crt`` + ``DIR/ca.key``).
Prints the written files; exit status 1 with a message on bad input.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from .pki import CertPair, PkiError, dev_bundle, make_ca, make_client_cert, make_server_cert

__all__ = ["main"]


def _ca(value: str) -> CertPair:
    base = Path(value)
    if base.suffix in (".crt", ".key"):
        base = base.with_suffix("")
    return CertPair(base.with_suffix(".crt"), base.with_suffix(".key"))


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m certs",
        description="Development PKI for the event bus: CA, router server and listener "
        "client certificates (ECDSA P-256). Never for production keys.",
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    ca = sub.add_parser("ca", help="a self-signed CA (ca.crt, ca.key)")
    ca.add_argument("--out", type=Path, required=True)
    ca.add_argument("--days", type=int, default=365)
    srv = sub.add_parser("server", help="the router's server certificate (server.crt/.key)")
    srv.add_argument("--ca", type=_ca, required=True, help="CA path without suffix")
    srv.add_argument("--out", type=Path, required=True)
    srv.add_argument("--host", action="append", default=[], help="DNS SAN (repeatable)")
    srv.add_argument("--ip", action="append", default=[], help="IP SAN (repeatable)")
    srv.add_argument("--days", type=int, default=90)
    cl = sub.add_parser("client", help="a listener client certificate (<id>.crt/.key)")
    cl.add_argument("--ca", type=_ca, required=True, help="CA path without suffix")
    cl.add_argument("--out", type=Path, required=True)
    cl.add_argument("--id", required=True, help="client id = DNS SAN = broker entry id")
    cl.add_argument("--days", type=int, default=90)
    dev = sub.add_parser("dev", help="CA + server + client certificates in one go")
    dev.add_argument("--out", type=Path, required=True)
    dev.add_argument("--host", action="append", default=[])
    dev.add_argument("--ip", action="append", default=[])
    dev.add_argument("--client", action="append", default=[])
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "ca":
            pairs = [make_ca(args.out, days=args.days)]
        elif args.cmd == "server":
            hosts = args.host or ([] if args.ip else ["localhost"])
            ips = args.ip or ([] if args.host else ["127.0.0.1", "::1"])
            pairs = [make_server_cert(args.ca, args.out, hostnames=hosts, ips=ips, days=args.days)]
        elif args.cmd == "client":
            pairs = [make_client_cert(args.ca, args.out, args.id, days=args.days)]
        else:
            bundle = dev_bundle(
                args.out,
                hostnames=args.host or ["localhost"],
                ips=args.ip or ["127.0.0.1", "::1"],
                clients=args.client,
            )
            pairs = list(bundle.values())
    except PkiError as exc:
        print(f"python -m certs: {exc}")
        return 1
    for pair in pairs:
        print(f"{pair.cert}\n{pair.key}")
    return 0
