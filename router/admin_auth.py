"""The admin bearer token: who may call ``/admin/*`` and the gRPC KvIndex ``Clear``.

``server.admin_token_file`` (stripped) or ``server.admin_token_env``; with neither, or an
empty one, there is no token and admin calls are not authenticated. Compared in constant
time. Read once at start (``server`` is restart-only).
"""

from __future__ import annotations

import hmac
import os
from pathlib import Path

from .config import ServerConfig

__all__ = ["AdminToken"]


class AdminToken:
    __slots__ = ("_token",)

    def __init__(self, token: bytes | None) -> None:
        self._token = token

    @classmethod
    def from_config(cls, server: ServerConfig) -> AdminToken:
        """Start-up only, before serving: a blocking file read is fine here."""
        token = ""
        if server.admin_token_file:
            token = Path(server.admin_token_file).read_text(encoding="utf-8").strip()
        elif server.admin_token_env:
            token = os.environ.get(server.admin_token_env, "").strip()
        return cls(token.encode() if token else None)

    @property
    def required(self) -> bool:
        return self._token is not None

    def allows(self, authorization: str | None) -> bool:
        """Whether an ``Authorization`` value (``Bearer <token>``) grants admin access."""
        if self._token is None:
            return True
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer":
            return False
        return hmac.compare_digest(token.strip().encode(), self._token)
