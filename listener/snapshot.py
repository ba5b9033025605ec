"""The JSON body of a backend's snapshot, as both transports serve it.

``GET /snapshot/{backend}`` (``listener.sse_server``) serves it in pull mode; in push mode
the router cannot reach that port, so the listener answers the router's
``SnapshotRequest`` on the event bus session with the same bytes, cut into
``SnapshotChunk`` messages (``listener.push.client``). One builder, so both are the same
document: ``{"backend", "event_id", "events": [...]}``, the entries a resync block would
state and the id of the last record they reflect (``EventHub.snapshot``).
"""

from __future__ import annotations

import orjson

from .stream import EventHub

__all__ = ["snapshot_body"]


def snapshot_body(hub: EventHub, backend: str) -> bytes:
    """``backend``'s snapshot document.

    Raises:
        UnknownBackendError: ``backend`` is not registered.
    """
    event_id, events = hub.snapshot(backend)
    return b"".join(
        (
            orjson.dumps({"backend": backend, "event_id": event_id})[:-1],
            b',"events":[',
            b",".join(ev.to_json() for ev in events),
            b"]}",
        )
    )
