"""Reading the admin bearer token from where ``server`` says it is.

A configured source that yields nothing (a missing, empty or non-UTF-8 file, an unset or
empty variable) is a config error naming the field, never "no authentication": an
operator who names a token source means to require one, and a deploy that lost its
secret must not come up open. Used by validation (``check_config``) and by start-up
(``router.admin_auth``), so both read the same thing.
"""

from __future__ import annotations

import os
from pathlib import Path

from bus.config import ConfigError, ConfigIssue

from .models import ServerConfig

__all__ = ["read_admin_token"]


def _refuse(field: str, why: str) -> ConfigError:
    return ConfigError([ConfigIssue("error", f"server.{field}", why)])


def read_admin_token(server: ServerConfig) -> bytes | None:
    """The token (whitespace stripped), or None when no source is configured.

    Raises:
        ConfigError: a configured source yields no token.
    """
    if server.admin_token_file:
        name = server.admin_token_file
        try:
            token = Path(name).read_text(encoding="utf-8").strip()
        except UnicodeDecodeError:
            raise _refuse("admin_token_file", f"file {name!r} is not UTF-8 text") from None
        except OSError as exc:
            raise _refuse(
                "admin_token_file", f"cannot read {name!r}: {exc.strerror or exc}"
            ) from None
        if not token:
            raise _refuse(
                "admin_token_file",
                f"file {name!r} is empty: put the token in it (an empty token does not "
                "turn authentication off)",
            )
        return token.encode()
    if server.admin_token_env:
        name = server.admin_token_env
        token = os.environ.get(name, "").strip()
        if not token:
            raise _refuse(
                "admin_token_env",
                f"environment variable {name} is unset or empty: set it to the token (an "
                "empty token does not turn authentication off)",
            )
        return token.encode()
    return None
