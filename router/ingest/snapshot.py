"""A backend's snapshot from its listener: ``GET /snapshot/<backend>``, for anti-entropy.

The listener serves, beside each ``/events/<backend>`` stream, the backend's current
entries as the ``cache_created`` / ``chain_created`` events of a resync block and the id
of the last record they reflect (``listener.sse_server``). The URL is the event source's
``endpoint`` with its last ``/events/`` segment read as ``/snapshot/`` (``ws``/``wss``
as ``http``/``https``); an endpoint without one has no snapshot.
"""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import orjson

from bus.events import EventError, KvEvent

from ..http.tls import client_context

__all__ = ["SnapshotError", "fetch_snapshot", "parse_snapshot", "snapshot_session", "snapshot_url"]

_SCHEMES = {"http": "http", "https": "https", "ws": "http", "wss": "https"}
_MAX_BYTES = 256 << 20


class SnapshotError(Exception):
    """The listener's answer is not a snapshot (status, body or an event in it)."""


def snapshot_url(endpoint: str | None) -> str | None:
    """The snapshot URL beside an event stream's ``endpoint`` (None: it has none)."""
    if endpoint is None:
        return None
    scheme, sep, rest = endpoint.partition("://")
    head, events, tail = rest.rpartition("/events/")
    if not sep or scheme not in _SCHEMES or not events or not tail or "/" not in rest:
        return None
    return f"{_SCHEMES[scheme]}://{head}/snapshot/{tail}"


def snapshot_session(timeout_s: float) -> aiohttp.ClientSession:
    """A session for snapshot fetches: each bounded by ``timeout_s``, TLS 1.2+."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=timeout_s),
        connector=aiohttp.TCPConnector(ssl=client_context()),
    )


async def fetch_snapshot(
    session: aiohttp.ClientSession, url: str, backend: str, max_bytes: int = _MAX_BYTES
) -> tuple[str, list[KvEvent]]:
    """(the id of the last record the snapshot reflects, its events) of ``backend``.

    Raises:
        SnapshotError: not a 200 with a snapshot of ``backend`` of at most ``max_bytes``.
        aiohttp.ClientError, TimeoutError: the listener did not answer.
    """
    async with session.get(url, headers={"Accept": "application/json"}) as resp:
        if resp.status != 200:
            raise SnapshotError(f"{url}: HTTP {resp.status}")
        chunks: list[bytes] = []
        size = 0
        async for chunk in resp.content.iter_chunked(1 << 16):
            size += len(chunk)
            if size > max_bytes:
                raise SnapshotError(f"{url}: snapshot larger than {max_bytes} bytes")
            chunks.append(chunk)
    return parse_snapshot(b"".join(chunks), backend)


def parse_snapshot(raw: bytes, backend: str) -> tuple[str, list[KvEvent]]:
    """The body of ``GET /snapshot/<backend>``; raises :class:`SnapshotError`."""
    try:
        doc = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise SnapshotError(f"not JSON: {exc}") from None
    if not isinstance(doc, dict):
        raise SnapshotError("not a JSON object")
    event_id, events = doc.get("event_id"), doc.get("events")
    if doc.get("backend") != backend:
        raise SnapshotError(f"a snapshot of {doc.get('backend')!r}, not of {backend!r}")
    if not isinstance(event_id, str) or not event_id or not isinstance(events, Sequence):
        raise SnapshotError("needs a string event_id and an events array")
    out: list[KvEvent] = []
    for i, ev in enumerate(events):
        if not isinstance(ev, dict):
            raise SnapshotError(f"events[{i}] is not an object")
        try:
            out.append(KvEvent.from_json(orjson.dumps(ev), backend=backend))
        except EventError as exc:
            raise SnapshotError(f"events[{i}]: {exc}") from None
    return event_id, out
