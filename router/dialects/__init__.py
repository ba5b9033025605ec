"""The client APIs the router speaks, one module each.

* ``openai_chat``: ``POST /v1/chat/completions`` (gemini backends through the Gemini
  adapter);
* ``anthropic_messages``: ``POST /anthropic/v1/messages`` (the prompt-caching marker of
  :mod:`.cache_control`; gemini backends through the Gemini adapter);
* ``embeddings``: ``POST /v1/embeddings``;
* ``completions``: ``POST /v1/completions`` (legacy text completions; the prompt's leading
  text as the prefix anchor) and ``responses``: ``POST /v1/responses`` (the Responses API,
  mapped to a chat conversation by :mod:`.responses_input`); these and chat share one
  flow in :mod:`.generation` (response cache, prefix key, session affinity, the
  cache-salt step of :mod:`.cache_salt`).

Each validates its requests, prepares a :class:`~router.forwarder.ForwardSpec`, and is the
:class:`~router.forwarder.UpstreamFormat` for the backends that speak its API; ``base``
holds what they share.
"""

from .anthropic_messages import AnthropicMessages
from .cache_salt import CacheSalter
from .completions import Completions
from .embeddings import Embeddings
from .openai_chat import ChatCompletions
from .responses import Responses

__all__ = [
    "AnthropicMessages",
    "CacheSalter",
    "ChatCompletions",
    "Completions",
    "Embeddings",
    "Responses",
]
