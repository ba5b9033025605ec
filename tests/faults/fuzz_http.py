"""The hypothesis strategy of the HTTP fuzzing row: whole requests (method, path, headers,
body) a client could send the router, most of them wrong."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import strategies as st

__all__ = ["requests"]

#: Not the admin API's clearing endpoints: the stack's router has no admin token (open on
#: loopback by design), so a POST there is an operator's, obeyed, and empties the index.
PATHS = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/messages",
    "/v1/embeddings",
    "/v1/models",
    "/v1/responses",
    "/health",
    "/metrics",
    "/admin/backends",
    "/admin/kv-index/stats",
    "/admin/response-cache/stats",
    "/v1beta/models/demo-model:generateContent",
    "/",
)
METHODS = ("GET", "POST", "POST", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "HEAD")
_TOKEN = st.text("abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=20)
_VALUE = st.text(
    st.characters(min_codepoint=0x20, max_codepoint=0xFF, exclude_characters="\x7f"), max_size=60
).map(lambda s: s.strip())

json_leaf = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=30),
)
json_value = st.recursive(
    json_leaf,
    lambda inner: st.one_of(
        st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)
    ),
    max_leaves=20,
)

FIELDS = ("model", "messages", "prompt", "max_tokens", "stream", "temperature", "n", "system",
          "tools", "input", "stop", "user", "contents", "cache_control")  # fmt: skip


def _shaped(draw: Any) -> bytes:
    """A body shaped like an API request with some fields of the wrong type."""
    body: dict[str, Any] = {
        "model": "demo-model",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
    }
    for k in draw(st.lists(st.sampled_from(FIELDS), max_size=4)):
        body[k] = draw(json_value)
    return json.dumps(body).encode()


@st.composite
def bodies(draw: Any) -> bytes:
    kind = draw(st.integers(0, 7))
    if kind == 0:
        return b""
    if kind == 1:
        return json.dumps(draw(json_value)).encode()
    if kind == 2:
        return _shaped(draw)
    if kind == 3:  # numbers no float holds
        digits = draw(st.integers(300, 5000))
        return b'{"model":"demo-model","max_tokens":1' + b"0" * digits + b',"messages":[]}'
    if kind == 4:  # deep nesting
        depth = draw(st.integers(100, 200_000))
        key = draw(st.sampled_from([b'{"messages":', b'{"model":"demo-model","messages":', b""]))
        return key + b"[" * depth + b"]" * depth + (b"}" if key else b"")
    if kind == 5:  # not UTF-8
        raw = draw(st.binary(max_size=200))
        return b'{"model":"demo-model","messages":[{"role":"user","content":"' + raw + b'\xff"}]}'
    if kind == 6:  # huge exponent and odd literals
        lit = draw(st.sampled_from([b"1e999", b"-1e999", b"NaN", b"Infinity", b"1E+400", b"-0"]))
        return (
            b'{"model":"demo-model","max_tokens":'
            + lit
            + b',"messages":[{"role":"user","content":"x"}]}'
        )
    return draw(st.binary(max_size=300))


@st.composite
def requests(draw: Any) -> tuple[str, str, list[tuple[str, str]], bytes]:
    method = draw(st.sampled_from(METHODS))
    path = draw(st.one_of(st.sampled_from(PATHS), _TOKEN.map(lambda s: "/" + s)))
    if draw(st.booleans()):
        path += "?" + draw(st.text("abc=&%0123456789xyz", max_size=20))
    headers = []
    ctype = draw(
        st.sampled_from(["application/json", "text/plain", "", "application/json; charset=latin-1"])
    )
    if ctype:
        headers.append(("Content-Type", ctype))
    for name, value in draw(st.lists(st.tuples(_TOKEN, _VALUE), max_size=4)):
        if name not in ("content-length", "transfer-encoding", "host", "connection"):
            headers.append((name, value))
    if draw(st.booleans()):
        headers.append(("Authorization", "Bearer " + draw(_VALUE)))
    return method, path, headers, draw(bodies())
