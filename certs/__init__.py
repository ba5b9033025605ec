"""Development PKI: a CA, router server certificates and listener client certificates.

For test runs, demos and lab deployments of the event bus (push mode, docs/ARCHITECTURE.md §4),
where the router serves TLS and listeners may authenticate with an mTLS client
certificate whose DNS SAN is their broker entry ``id``. Production deployments bring
their own PKI; nothing this tool writes belongs in the repository.
"""

from .pki import (
    CertPair,
    PkiError,
    dev_bundle,
    load_pair,
    make_ca,
    make_client_cert,
    make_server_cert,
)

__all__ = [
    "CertPair",
    "PkiError",
    "dev_bundle",
    "load_pair",
    "make_ca",
    "make_client_cert",
    "make_server_cert",
]
