"""``POST /v1/chat/completions``: OpenAI chat completions, streaming or not.

The flow (response cache, candidates, selection context, forward) is the one of
:mod:`.generation`; what is chat's own:

* validation: model, a non-empty ``messages`` array of objects with a string ``role``,
  ``stream``, ``cache_salt`` (OpenAI errors);
* the response cache keys the body itself (Tiers 2 and 3, the semantic path included);
* the prefix anchor is the system message, else the first non-empty message
  (``bus.prefix_key.anchor_text``);
* with conversation-depth routing the prompt chain is the body rendered with the model's
  chat template (``router.conversation``; None when it cannot be, and the prefix key
  routes it);
* upstream, for backends that speak OpenAI's API: ``/v1/chat/completions`` (gemini's
  OpenAI-compatible path for ``type: gemini``), the backend's bearer key, and the body as
  sent or with its cache salt bound to the chosen backend (:mod:`.cache_salt`);
  ``type: gemini`` backends get the Gemini adapter instead when one is configured.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bus.prefix_key import anchor_text

from ..cache.service import ResponseCacheService
from ..config import RouterConfig
from ..conversation import ConversationKeys
from ..errors import openai_error
from ..forward_spec import ForwardSpec
from ..forwarder import Forwarder
from ..gemini import GeminiService, TranslationError
from ..http.types import Response
from ..openai_api import chat_path
from ..pool import Backend, BackendPool
from .cache_salt import CacheSalter
from .generation import GenerationDialect, Observe, Prepared

__all__ = ["ChatCompletions"]


class ChatCompletions(GenerationDialect):
    """The chat completions handler and its upstream format.

    Args:
        gemini: the Gemini adapter factory, when the context cache or the native API is on.
        The others: as :class:`~.generation.GenerationDialect`.
    """

    endpoint = "chat"

    def __init__(
        self,
        *,
        config: Callable[[], RouterConfig],
        pool: BackendPool,
        forwarder: Forwarder,
        observe: Observe,
        cache: ResponseCacheService | None = None,
        gemini: GeminiService | None = None,
        salter: CacheSalter | None = None,
        conversation: ConversationKeys | None = None,
    ) -> None:
        super().__init__(
            config=config,
            pool=pool,
            forwarder=forwarder,
            observe=observe,
            cache=cache,
            salter=salter,
            conversation=conversation,
        )
        self._gemini = gemini

    def prepare(self, body: dict[str, Any]) -> Prepared | Response:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            return openai_error(400, "'model' is required and must be a string", param="model")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            return openai_error(400, "'messages' must be a non-empty array", param="messages")
        if not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages):
            return openai_error(
                400, "each message must be an object with a string 'role'", param="messages"
            )
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            return openai_error(400, "'stream' must be a boolean", param="stream")
        caller_salt = body.get("cache_salt")
        if caller_salt is not None and (not isinstance(caller_salt, str) or not caller_salt):
            return openai_error(400, "'cache_salt' must be a non-empty string", param="cache_salt")
        chain = None
        if self._conversation is not None:
            # The client's body, before the salt step binds a backend: the chain's root
            # takes the caller's own cache_salt, which the listener recovers too.
            keys = self._conversation
            chain = lambda: keys.chain(body, model)  # noqa: E731
        return Prepared(model, stream, anchor_text(body), chain, body)

    def adapt(self, spec: ForwardSpec, candidates: tuple[Backend, ...]) -> Response | None:
        """The Gemini adapter, when a candidate is a gemini backend; a request it cannot
        translate is the client's 400."""
        if self._gemini is not None and any(b.type == "gemini" for b in candidates):
            try:
                spec.gemini = self._gemini.chat(spec.parsed, spec.ctx.model, spec.stream, self)
            except TranslationError as exc:
                return openai_error(400, str(exc), param=exc.param)
        return None

    # -- upstream format ---------------------------------------------------------------

    def path(self, backend: Backend) -> str:
        return chat_path(backend)
