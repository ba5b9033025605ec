"""Router-issued cache salts that carry the prefix key to the listener ("salt echo").

The router may set a request's ``cache_salt`` to a value binding (backend, prefix key)
with an HMAC. Engines fold the salt into their block hashes and echo it in the first
stored block's KV event, so the listener learns the prefix key of a chain without
detokenizing (the only way for TensorRT-LLM, which has no public /detokenize). The
MAC binds the backend too, so a salt copied to another backend does not verify.

Format (ASCII, safe in JSON and logs-free by policy)::

    ctm1.<prefix key, 64 hex>.<MAC, 22 chars base64url of 16 bytes>[.<caller's own salt>]

    MAC = HMAC-SHA256(secret, b"continuum-salt-v1" 0x00 backend 0x00 prefix_key
                              0x00 caller_salt)[:16]

A caller's own ``cache_salt`` (tenant isolation) is kept inside, so isolation survives
and the engine still sees a distinct salt per caller.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from dataclasses import dataclass
from pathlib import Path

from .errors import BusError

__all__ = [
    "SALT_PREFIX",
    "SaltError",
    "SaltInfo",
    "caller_salt",
    "encode_salt",
    "load_secret",
    "verify_salt",
]

SALT_PREFIX = "ctm1."
_DOMAIN = b"continuum-salt-v1"
_MAC_LEN = 16
_MAC_CHARS = 22  # base64url of 16 bytes, unpadded


class SaltError(BusError, ValueError):
    """A salt in our format whose MAC does not verify: the chain must be discarded."""


@dataclass(frozen=True, slots=True)
class SaltInfo:
    prefix_key: bytes
    caller_salt: str | None


def load_secret(file: str | os.PathLike[str] | None = None, env: str | None = None) -> bytes:
    """The shared HMAC secret, from a file (stripped) or an environment variable."""
    if file:
        secret = Path(file).read_bytes().strip()
    elif env:
        secret = os.environ.get(env, "").strip().encode()
    else:
        raise ValueError("a salt secret needs a file or an environment variable")
    if len(secret) < 16:
        raise ValueError("the salt secret must be at least 16 bytes")
    return secret


def _mac(secret: bytes, backend: str, prefix_key: bytes, caller_salt: str | None) -> str:
    msg = b"\x00".join(
        (
            _DOMAIN,
            backend.encode(),
            prefix_key,
            (caller_salt or "").encode("utf-8", "surrogatepass"),
        )
    )
    digest = hmac.new(secret, msg, hashlib.sha256).digest()[:_MAC_LEN]
    return base64.urlsafe_b64encode(digest).rstrip(b"=").decode()


def encode_salt(
    secret: bytes, backend: str, prefix_key: bytes, caller_salt: str | None = None
) -> str:
    if len(prefix_key) != 32:
        raise ValueError("prefix_key must be a 32-byte digest")
    salt = f"{SALT_PREFIX}{prefix_key.hex()}.{_mac(secret, backend, prefix_key, caller_salt)}"
    return f"{salt}.{caller_salt}" if caller_salt else salt


def verify_salt(secret: bytes, backend: str, salt: str) -> SaltInfo | None:
    """``None`` for a salt that is not ours; ``SaltError`` for ours with a bad MAC.

    Never raises anything else, whatever text follows the prefix: the engine echoes the
    client's ``cache_salt`` and the listener verifies it on its ingestion path.
    """
    if not isinstance(salt, str) or not salt.startswith(SALT_PREFIX):
        return None
    body = salt[len(SALT_PREFIX) :]
    key_hex, _, rest = body.partition(".")
    mac, _, caller = rest.partition(".")
    try:
        if len(key_hex) != 64:
            raise ValueError
        prefix_key = bytes.fromhex(key_hex)
    except ValueError:
        raise SaltError("malformed prefix key in cache salt") from None
    # The text is the client's: ``hmac.compare_digest`` raises TypeError on non-ASCII str.
    if len(mac) != _MAC_CHARS or not mac.isascii():
        raise SaltError("malformed MAC in cache salt")
    caller_salt = caller or None
    if not hmac.compare_digest(mac, _mac(secret, backend, prefix_key, caller_salt)):
        raise SaltError("cache salt MAC does not verify for this backend")
    return SaltInfo(prefix_key, caller_salt)


def caller_salt(salt: str | None) -> str | None:
    """The caller's own salt: the part a router-issued salt carries after its MAC (None when
    it carries none), or ``salt`` itself when it is not a router salt.

    Structural only, no MAC check: it names the tenant a conversation key is rooted at (the
    salt the client sent the router), which the engine's own block hashes already isolate.
    """
    if not salt or not salt.startswith(SALT_PREFIX):
        return salt or None
    _, _, rest = salt[len(SALT_PREFIX) :].partition(".")
    return rest.partition(".")[2] or None
