"""Client-facing error bodies: OpenAI's shape everywhere, Anthropic's on its own endpoint.

Both carry ``error.message`` and ``error.type``, so either SDK surfaces the message.
"""

from __future__ import annotations

import orjson

from .http.types import Response

__all__ = ["anthropic_error", "openai_error"]

_JSON = "application/json"

_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
}


def openai_error(
    status: int,
    message: str,
    type: str = "invalid_request_error",
    code: str | None = None,
    param: str | None = None,
    headers: list[tuple[str, str]] | None = None,
) -> Response:
    body = orjson.dumps({"error": {"message": message, "type": type, "param": param, "code": code}})
    return Response(status, body, [("content-type", _JSON), *(headers or ())])


def anthropic_error(status: int, message: str, code: str | None = None) -> Response:
    etype = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    body = orjson.dumps(
        {"type": "error", "error": {"type": etype, "message": message, "code": code}}
    )
    return Response(status, body, [("content-type", _JSON)])
