"""Push mode: the listener dials the router's event bus and streams its sources to it.

``config`` holds the ``event_bus`` section; ``client`` runs the session (Hello, then the
router's Subscribe/Unsubscribe/Forbidden, Draining on SIGTERM, reconnect with backoff);
``writer`` serves one Subscribe as one Stream call, from the same code path as
``GET /events/{backend}`` (``listener.sse_server.sse_batches``), in batches framed by
``bus.stream_data``.
"""

from .config import EventBusClientConfig

__all__ = ["EventBusClientConfig"]
