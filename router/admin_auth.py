"""The admin bearer token: who may call ``/admin/*`` and every gRPC KvIndex method.

``server.admin_token_file`` (stripped) or ``server.admin_token_env``. With neither there is
no token and admin calls are not authenticated, which validation allows only on loopback
listeners or with ``server.allow_unauthenticated`` (``router.config.loader``); a source
that yields an empty token is a config error. Compared in constant time. Read once at
start (``server`` is restart-only).
"""

from __future__ import annotations

import hmac

from .config import ServerConfig
from .config.admin_token import read_admin_token

__all__ = ["AdminToken"]


class AdminToken:
    __slots__ = ("_token",)

    def __init__(self, token: bytes | None) -> None:
        self._token = token

    @classmethod
    def from_config(cls, server: ServerConfig) -> AdminToken:
        """Start-up only, before serving: a blocking file read is fine here.

        Raises:
            ConfigError: a configured token source yields no token.
        """
        return cls(read_admin_token(server))

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
