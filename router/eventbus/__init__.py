"""The router's side of push mode: the TLS-only gRPC ``continuum.bus.v1.EventBus``.

Listeners dial in, authenticate per ``dynamo.event_bus.brokers[]`` entry (``auth``),
announce their sources on a ``Session``; the KV event consumers of ``transport:
event_bus`` sources ask the session registry (``sessions``) for a stream, which sends a
``Subscribe`` down a session and hands the ``StreamData`` bytes of the matching
``Stream`` call to the consumer's SSE parser (``service``). ``server`` runs it.
"""

from .auth import Authenticator, AuthError, Principal, hash_token
from .server import EventBusServer
from .sessions import NoSession, SessionRegistry

__all__ = [
    "AuthError",
    "Authenticator",
    "EventBusServer",
    "NoSession",
    "Principal",
    "SessionRegistry",
    "hash_token",
]
