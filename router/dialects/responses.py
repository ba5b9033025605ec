"""``POST /v1/responses``: the OpenAI Responses API, streaming or not, as vLLM serves it.

The request is checked and mapped to the chat conversation the engine renders
(:mod:`.responses_input`, which documents the mapping), and then:

* the prefix anchor is ``instructions`` (tag ``S``: the engine renders them as the
  system message), else the first input message's text (``S`` for a system or developer
  message, ``M`` otherwise), exactly the chat rule over the mapped conversation;
* with conversation-depth routing, the chain of the mapped conversation rendered with the
  model's chat template (the chat dialect's renderer);
* ``previous_response_id``: when this router relayed that response, the request goes to
  the backend that produced it while that backend is a candidate (the engine keeps the
  stored conversation in its own memory); an unknown id, or a backend that is no longer
  a candidate, is routed by the strategy. The anchor is then ``instructions`` only and
  there is no chain (the stored conversation comes first in the prompt). The router
  remembers the last :data:`MAX_ORIGINS` response ids it relayed, in its own memory
  (another router replica does not know them);
* the response cache keys deterministic requests (temperature 0 or absent) on
  ``instructions`` and ``input``; tools, ``previous_response_id``, ``text``, ``reasoning``
  and the other fields the key does not cover bypass it;
* the engine's ``usage.input_tokens_details.cached_tokens`` (whole answer, or the
  ``response.completed`` event of a stream) is recorded as the delivered cached tokens
  against the prediction (``router.forwarder.openai_usage``).

Upstream: ``/v1/responses`` with the backend's bearer key (types ``openai``, ``vllm``,
``sglang``); streams (``event:``/``data:`` SSE with the Responses event types) are
relayed as they come.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

import orjson

from bus.prefix_key import anchor_text

from ..errors import openai_error
from ..http.types import Response
from ..pool import Backend
from .generation import GenerationDialect, Prepared, cache_view
from .responses_input import InputError, chat_body, check_request

__all__ = ["MAX_ORIGINS", "RESPONSES_UNKEYED", "Responses"]

MAX_ORIGINS = 65_536
"""Response ids remembered with the backend that produced them (about 150 bytes each)."""

RESPONSES_UNKEYED = (
    "previous_response_id",
    "conversation",
    "prompt",
    "text",
    "reasoning",
    "include",
    "background",
    "max_tool_calls",
    "truncation",
    "top_k",
    "min_p",
    "repetition_penalty",
)
"""Output-shaping (or server-state) fields of a Responses request the cache key does not
cover; ``tools``, ``tool_choice``, ``seed`` and the rest of the chat list apply too."""

_CREATED = b'"response.created"'


class Responses(GenerationDialect):
    """The Responses handler and its upstream format."""

    endpoint = "responses"
    upstream_path = "/v1/responses"

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._origins: OrderedDict[str, str] = OrderedDict()

    def prepare(self, body: dict[str, Any]) -> Prepared | Response:
        try:
            check_request(body)
        except InputError as exc:
            return openai_error(400, str(exc), param=exc.param)
        model: str = body["model"]
        stream: bool = body.get("stream", False)
        previous = body.get("previous_response_id")
        pinned = self._origins.get(previous) if previous is not None else None
        chat = chat_body(body)
        if chat is not None:
            anchor = anchor_text(chat)
        else:
            instructions = body.get("instructions")
            anchor = ("S", instructions) if instructions else None
        chain = None
        if self._conversation is not None and chat is not None:
            keys, rendered = self._conversation, chat
            chain = lambda: keys.chain(rendered, model)  # noqa: E731
        keyed = {"instructions": body.get("instructions"), "input": body["input"]}
        view = cache_view(body, "responses", keyed, RESPONSES_UNKEYED)
        if view is not None:
            view["max_tokens"] = body.get("max_output_tokens")
        return Prepared(model, stream, anchor, chain, view, pinned)

    # -- answers: remember which backend produced each response --------------------------

    def _remember(self, response_id: Any, backend: Backend) -> None:
        if type(response_id) is not str or not response_id:
            return
        origins = self._origins
        origins[response_id] = backend.name
        origins.move_to_end(response_id)
        while len(origins) > MAX_ORIGINS:
            origins.popitem(last=False)

    def origin_of(self, response_id: str) -> str | None:
        """The backend that produced ``response_id``, if this router relayed it."""
        return self._origins.get(response_id)

    def transform(self, backend: Backend, status: int, data: bytes) -> bytes:
        if status == 200:
            try:
                doc = orjson.loads(data)
            except orjson.JSONDecodeError:
                return data  # the forwarder answers 502 for it
            if type(doc) is dict:
                self._remember(doc.get("id"), backend)
        return data

    def stream(self, backend: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        return self._tap(backend, chunks)

    async def _tap(self, backend: Backend, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        """``chunks`` unchanged; the id of the ``response.created`` event is remembered."""
        pending: bytes | None = b""
        async for chunk in chunks:
            yield chunk
            if pending is None:
                continue
            pending += chunk
            end = pending.find(b"\n\n")
            if end < 0:
                if len(pending) > 1 << 20:
                    pending = None
                continue
            event, pending = pending[:end], None  # the stream's first event decides
            if _CREATED in event:
                self._remember(_response_id(event), backend)


def _response_id(event: bytes) -> Any:
    """``response.id`` of one SSE event's data, or None."""
    for line in event.split(b"\n"):
        if line.startswith(b"data:"):
            try:
                doc = orjson.loads(line[5:])
            except orjson.JSONDecodeError:
                return None
            inner = doc.get("response") if type(doc) is dict else None
            return inner.get("id") if type(inner) is dict else None
    return None
