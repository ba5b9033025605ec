"""The per-backend event hub: sequence numbers, history ring, resumption, bounded fan-out.

Both transports (``GET /events/{backend}`` and gRPC ``Listener.Subscribe``) read from one
``EventHub``, so they carry the same records with the same ids.

Ids (docs/ARCHITECTURE.md §4). Every record published for a backend gets the SSE id
``<epoch>-<seq>``:

* ``epoch`` is 8 lowercase hex characters drawn at random when the hub is created (once
  per process start). Random rather than the start time: two processes never share one
  even when restarted within the same millisecond or across a clock step. Consumers only
  compare it for equality.
* ``seq`` starts at 1 and rises by 1 per published record of that backend, with no gaps.
  ``<epoch>-<n>`` therefore means "the backend's state after its first n records", and
  ``<epoch>-0`` the state before any.

Resumption (``subscribe``), given the consumer's last event id:

* ``<epoch>-<n>`` of this epoch with records n+1 .. current all still in the history
  ring: those records are replayed, then the stream goes live. Nothing is duplicated and
  nothing is skipped.
* no id, an id of another epoch, one older than the ring, one from the future or one
  that does not parse: a **resync block**, then live. The block is a ``resync`` record
  followed by the backend's snapshot as ``cache_created`` records (an offloaded prefix
  keeps its ``tier``), then its conversation keys as ``chain_created`` records (likewise).
  A consumer without
  an id gets a resync block too, so its index is complete from the first record and not
  only from "now".

Resync blocks are private to one subscriber and numbered outside the shared sequence:
every record of the block but the last gets an id in a private epoch, ``<epoch>.s<S>-<i>``
(S is the backend's seq when the snapshot was taken, i the record's place in the block,
from 1), and the last one gets ``<epoch>-<S>``. So a consumer that drops mid-block resumes
with a foreign epoch and gets a fresh block, and one that finished the block resumes
exactly after S. Every record carries a non-empty id, so even a consumer that only
remembers the ids it sees ends up correct; and the ids depend only on the position, so
SSE and gRPC subscribers at the same position get the same ids.

Race freedom: ``publish``, ``resync`` and the bookkeeping part of ``subscribe`` are plain
(non-async) methods run on the event loop thread. ``subscribe`` reads the ring (or takes
the snapshot) and registers the subscriber without awaiting in between, so no publish
can fall between the replayed part and the live part. Snapshot providers must therefore
be synchronous; they are called once per resync block.

Backpressure: each subscriber has a bounded queue of live records (``queue_size``);
replayed and snapshot records are not counted against it. A publish that finds the
queue full closes that subscriber: it still gets what was queued (contiguous, so its last
id stays valid) followed by one explicit ``event: error`` record
``{"error":"buffer_overflow",...}`` without an id, then the stream ends. It is counted in
``stats()["backends"][name]["overflows"]``; nothing is ever dropped silently.

Every record is encoded once (``bus.sse.encode_record``) and the same bytes object is
shared by the ring and every subscriber.

Size: one module (about 520 lines): ids, the history ring, snapshots and fan-out are one
race-free state (see above) and must change together.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import secrets
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import orjson

from bus.errors import BUFFER_OVERFLOW, ERROR_EVENT
from bus.events import KvEvent
from bus.sse import encode_record

__all__ = [
    "EventHub",
    "HubRecord",
    "SnapshotProvider",
    "StatsProvider",
    "Subscription",
    "UnknownBackendError",
    "format_event_id",
    "parse_event_id",
]

log = logging.getLogger("continuum.listener.stream")


SnapshotProvider = Callable[[], Iterable[KvEvent]]
"""Returns the backend's current prefixes and chain keys as ``cache_created`` /
``chain_created`` events (or their ``*_offloaded`` forms). Synchronous."""


class StatsProvider(Protocol):
    """Per-source counters for ``/stats`` and ``/metrics``: backend name -> JSON-able dict."""

    def __call__(self) -> dict[str, dict[str, Any]]: ...


class UnknownBackendError(KeyError):
    """The backend is not configured on this hub."""

    def __init__(self, backend: str) -> None:
        super().__init__(backend)
        self.backend = backend

    def __str__(self) -> str:
        return f"unknown backend {self.backend!r}"


@dataclass(frozen=True, slots=True)
class HubRecord:
    """One record of a stream, in both transports' forms (encoded once)."""

    id: str
    """SSE id; empty only for the overflow error record."""
    event: str
    """SSE ``event:``: a KvEvent kind, or ``error``."""
    data: bytes
    """The JSON object (``KvEvent.to_json()`` or the error object)."""
    sse: bytes
    """The exact SSE bytes of this record."""


def format_event_id(epoch: str, seq: int) -> str:
    return f"{epoch}-{seq}"


def parse_event_id(value: str) -> tuple[str, int] | None:
    """``(epoch, seq)`` of ``<epoch>-<seq>``; None when it does not have that form."""
    epoch, sep, seq = value.strip().rpartition("-")
    if not sep or not epoch or not seq.isdigit() or len(seq) > 19:
        return None
    return epoch, int(seq)


def _record(data: bytes, event: str, id: str) -> HubRecord:
    # orjson over-allocates its result (~4 KiB for a ~150-byte event) and history rings
    # keep records for long: keep a right-sized copy.
    data = bytes(memoryview(data))
    return HubRecord(id, event, data, encode_record(data, event=event, id=id))


_AS_CREATED = {
    "cache_created": "cache_created",
    "cache_offloaded": "cache_created",
    "chain_created": "chain_created",
    "chain_offloaded": "chain_created",
}
"""Snapshot kinds: a state record, and the ``*_created`` kind it is sent as."""


def _snapshot_events(backend: str, events: Iterable[KvEvent]) -> list[KvEvent]:
    """A provider's snapshot as ``cache_created`` / ``chain_created`` events of ``backend``.

    ``*_offloaded`` becomes ``*_created`` with its tier (``storage`` if unset), so the block
    is exactly "resync, then created records"; events of another backend or of another
    kind cannot describe state and are left out (logged).
    """
    out: list[KvEvent] = []
    for ev in events:
        kind = _AS_CREATED.get(ev.event)
        if ev.backend != backend or kind is None:
            log.warning("snapshot of %s: left out %s event of %s", backend, ev.event, ev.backend)
            continue
        if kind != ev.event:
            ev = dataclasses.replace(ev, event=kind, tier=ev.tier or "storage")  # type: ignore[arg-type]
        out.append(ev)
    return out


class Subscription:
    """One consumer of one backend: an async iterator of ``HubRecord``.

    Iteration yields the backlog (replayed or resync-block records), then live records,
    and stops after the overflow error record or after ``close()``. Waiting is cancel-safe:
    a cancelled ``__anext__``/``batch`` loses nothing. Not thread-safe; one reader.
    """

    __slots__ = (
        "_backlog",
        "_done",
        "_hub",
        "_limit",
        "_live",
        "_waiter",
        "backend",
        "close_reason",
    )

    def __init__(
        self, hub: EventHub, backend: str, backlog: Iterator[HubRecord], limit: int
    ) -> None:
        self._hub = hub
        self.backend = backend
        self._backlog: Iterator[HubRecord] | None = backlog
        self._live: deque[HubRecord] = deque()
        self._limit = limit
        self._done = False
        self._waiter: asyncio.Future[None] | None = None
        self.close_reason: str | None = None
        """None while open; ``buffer_overflow``, ``closed`` (by the reader) or ``shutdown``."""

    # -- hub side --------------------------------------------------------------------------

    def _push(self, rec: HubRecord) -> bool:
        """Queue a live record; False (and the subscriber is finished) on overflow."""
        if len(self._live) >= self._limit:
            self._finish(BUFFER_OVERFLOW, self._overflow_record())
            return False
        self._live.append(rec)
        self._wake()
        return True

    def _overflow_record(self) -> HubRecord:
        data = orjson.dumps(
            {
                "error": BUFFER_OVERFLOW,
                "backend": self.backend,
                "detail": f"subscriber queue full ({self._limit} events); "
                "resume from the last event id",
            }
        )
        return HubRecord("", ERROR_EVENT, data, encode_record(data, event=ERROR_EVENT))

    def _finish(self, reason: str, final: HubRecord | None = None) -> None:
        if self._done:
            return
        self._done = True
        self.close_reason = reason
        if final is not None:
            self._live.append(final)
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- reader side -----------------------------------------------------------------------

    @property
    def done(self) -> bool:
        """True once no more live records will be queued (the queue may still hold some)."""
        return self._done

    def close(self, reason: str = "closed") -> None:
        """Stop the subscription and unregister it from the hub; records still queued are
        discarded (the reader resumes from its last id). Idempotent: the first reason stays.

        Args:
            reason: ``closed`` (the reader is gone) or ``shutdown`` (the server stops).
        """
        self._hub._unregister(self)
        self._backlog = None
        self._live.clear()
        self._finish(reason)

    def __aiter__(self) -> Subscription:
        return self

    async def __anext__(self) -> HubRecord:
        batch = await self.batch(1)
        if not batch:
            raise StopAsyncIteration
        return batch[0]

    def ready(self, limit: int = 256) -> list[HubRecord]:
        """Up to ``limit`` records available right now, without waiting (maybe [])."""
        out: list[HubRecord] = []
        if self._backlog is not None:
            out.extend(itertools.islice(self._backlog, limit))
            if len(out) < limit:
                self._backlog = None
        live = self._live
        while live and len(out) < limit:
            out.append(live.popleft())
        return out

    @property
    def finished(self) -> bool:
        """True when iteration is over: closed or overflowed, and everything was read."""
        return self._done and self._backlog is None and not self._live

    async def batch(self, limit: int = 256) -> list[HubRecord]:
        """Wait for at least one record and return up to ``limit``; [] at the end."""
        while True:
            out = self.ready(limit)
            if out or (self._done and not self._live):
                return out
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None


class _Backend:
    __slots__ = (
        "history",
        "incomplete",
        "name",
        "overflows",
        "published",
        "resync_blocks",
        "resyncs_published",
        "seq",
        "snapshot",
        "subscribers",
    )

    def __init__(self, name: str, history_size: int, snapshot: SnapshotProvider | None) -> None:
        self.name = name
        self.seq = 0
        self.history: deque[tuple[int, HubRecord]] = deque(maxlen=history_size)
        self.subscribers: set[Subscription] = set()
        self.snapshot = snapshot
        self.overflows = 0
        self.published = 0
        self.resync_blocks = 0
        self.resyncs_published = 0
        self.incomplete = False
        """Every ``resync`` carries ``incomplete`` while set (``set_incomplete``)."""


class EventHub:
    """Per-backend sequence, history ring and subscribers (see the module docstring).

    Args:
        history_size: Records kept per backend for resumption (``history_size``).
        queue_size: Live records queued per subscriber before it is closed with
            ``buffer_overflow`` (``subscriber_queue_size``).
        backends: Backend names to register now (no snapshot provider).
        epoch: Fixed epoch, for tests; default 8 random hex characters.
    """

    def __init__(
        self,
        history_size: int = 10_000,
        queue_size: int = 4096,
        *,
        backends: Iterable[str] = (),
        epoch: str | None = None,
    ) -> None:
        if history_size < 1 or queue_size < 1:
            raise ValueError("history_size and queue_size must be >= 1")
        if epoch is not None and (not epoch or "-" in epoch):
            raise ValueError("epoch must be non-empty and contain no '-'")
        self.epoch: str = epoch or secrets.token_hex(4)
        self.history_size = history_size
        self.queue_size = queue_size
        self._backends: dict[str, _Backend] = {}
        self._closed = False
        for name in backends:
            self.add_backend(name)

    # -- backends --------------------------------------------------------------------------

    def add_backend(self, name: str, snapshot: SnapshotProvider | None = None) -> None:
        """Register a backend, or replace its snapshot provider if already registered."""
        be = self._backends.get(name)
        if be is None:
            self._backends[name] = _Backend(name, self.history_size, snapshot)
        else:
            be.snapshot = snapshot

    @property
    def backends(self) -> tuple[str, ...]:
        return tuple(self._backends)

    def __contains__(self, name: object) -> bool:
        return name in self._backends

    def _get(self, name: str) -> _Backend:
        be = self._backends.get(name)
        if be is None:
            raise UnknownBackendError(name)
        return be

    def last_event_id(self, backend: str) -> str:
        """The id of the backend's latest record (``<epoch>-0`` before any)."""
        return format_event_id(self.epoch, self._get(backend).seq)

    # -- producing -------------------------------------------------------------------------

    def publish(self, backend: str, ev: KvEvent) -> str:
        """Append one event to the backend's sequence and fan it out; returns its id.

        Raises:
            UnknownBackendError: ``backend`` is not registered.
            ValueError: ``ev.backend`` is another backend.
        """
        be = self._get(backend)
        if ev.backend != backend:
            raise ValueError(f"event for backend {ev.backend!r} published on {backend!r}")
        be.seq += 1
        rec = _record(ev.to_json(), ev.event, format_event_id(self.epoch, be.seq))
        be.history.append((be.seq, rec))
        be.published += 1
        if ev.event == "resync":
            be.resyncs_published += 1
        overflowed = [s for s in be.subscribers if not s._push(rec)]
        for s in overflowed:
            be.subscribers.discard(s)
            be.overflows += 1
        return rec.id

    def set_incomplete(self, backend: str, incomplete: bool) -> None:
        """Whether the backend's state may lack entries (a checkpoint resume that could not
        replay everything): every ``resync`` record, shared or in a resync block, says so
        from now on (``KvEvent.incomplete``)."""
        self._get(backend).incomplete = incomplete

    def resync(self, backend: str, reason: str, snapshot: Iterable[KvEvent] = ()) -> str:
        """Publish a shared ``resync`` (a source restarted or found a gap), then ``snapshot``
        as ``cache_created`` records; every subscriber drops the backend's entries.

        Returns the id of the ``resync`` record.
        """
        events = _snapshot_events(backend, snapshot)
        head = KvEvent(
            "resync",
            backend,
            reason=reason,
            snapshot_size=len(events),
            incomplete=self._get(backend).incomplete,
        )
        rid = self.publish(backend, head)
        for ev in events:
            self.publish(backend, ev)
        return rid

    def snapshot(self, backend: str) -> tuple[str, list[KvEvent]]:
        """The backend's current state (its provider's snapshot, as a resync block states
        it) and the id of the last record it reflects: a consumer that applied every
        record up to that id holds exactly these entries. Taken without awaiting, so no
        publish falls between the two (the anti-entropy check's reference).

        Raises:
            UnknownBackendError: ``backend`` is not registered.
        """
        be = self._get(backend)
        provider = be.snapshot
        events = _snapshot_events(backend, provider() if provider is not None else ())
        return format_event_id(self.epoch, be.seq), events

    # -- consuming -------------------------------------------------------------------------

    def subscribe(
        self,
        backend: str,
        last_event_id: str | None = None,
        snapshot: SnapshotProvider | None = None,
    ) -> Subscription:
        """Open a stream of ``backend`` resuming after ``last_event_id``.

        Replays from the history ring when the id allows it, else starts with a resync
        block (module docstring). ``snapshot`` overrides the backend's registered provider;
        with neither the snapshot is empty. Atomic with respect to ``publish``.

        Raises:
            UnknownBackendError: ``backend`` is not registered.
        """
        be = self._get(backend)
        backlog: Iterator[HubRecord]
        reason = self._resume_problem(be, last_event_id)
        if reason is None:
            assert last_event_id is not None
            parsed = parse_event_id(last_event_id)
            assert parsed is not None
            after = parsed[1]
            if be.history:
                start = after + 1 - be.history[0][0]
                replay = [rec for _, rec in itertools.islice(be.history, start, None)]
            else:
                replay = []
            backlog = iter(replay)
        else:
            provider = snapshot if snapshot is not None else be.snapshot
            events = _snapshot_events(backend, provider() if provider is not None else ())
            backlog = self._resync_block(be, reason, events)
        sub = Subscription(self, backend, backlog, self.queue_size)
        if self._closed:
            sub._finish("shutdown")
        else:
            be.subscribers.add(sub)
        return sub

    def _resume_problem(self, be: _Backend, last_event_id: str | None) -> str | None:
        """None when ``last_event_id`` can be resumed from the ring, else the resync reason."""
        if last_event_id is None or not last_event_id.strip():
            return "no_event_id"
        parsed = parse_event_id(last_event_id)
        if parsed is None:
            return "invalid_event_id"
        epoch, seq = parsed
        if epoch != self.epoch:
            return "unknown_epoch"
        if seq > be.seq:
            return "unknown_event_id"
        oldest = be.history[0][0] if be.history else be.seq + 1
        if seq < oldest - 1:
            return "history_expired"
        return None

    def _resync_block(
        self, be: _Backend, reason: str, events: list[KvEvent]
    ) -> Iterator[HubRecord]:
        be.resync_blocks += 1
        private = f"{self.epoch}.s{be.seq}"
        final_id = format_event_id(self.epoch, be.seq)
        total = 1 + len(events)
        name = be.name

        def gen() -> Iterator[HubRecord]:
            # Encoded lazily: a large snapshot is not held twice in memory.
            head = KvEvent(
                "resync",
                name,
                reason=reason,
                snapshot_size=len(events),
                incomplete=be.incomplete,
            )
            yield _record(head.to_json(), "resync", final_id if total == 1 else f"{private}-1")
            for i, ev in enumerate(events, start=2):
                rid = final_id if i == total else f"{private}-{i}"
                yield _record(ev.to_json(), ev.event, rid)

        return gen()

    def _unregister(self, sub: Subscription) -> None:
        be = self._backends.get(sub.backend)
        if be is not None:
            be.subscribers.discard(sub)

    def close(self) -> None:
        """End every subscription (reason ``shutdown``); later subscriptions end at once."""
        self._closed = True
        for be in self._backends.values():
            for s in be.subscribers:
                s._finish("shutdown")
            be.subscribers.clear()

    # -- introspection ---------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """JSON-able counters: the epoch and, per backend, seq, ring and subscriber state."""
        return {
            "epoch": self.epoch,
            "history_size": self.history_size,
            "subscriber_queue_size": self.queue_size,
            "backends": {
                name: {
                    "seq": be.seq,
                    "last_event_id": format_event_id(self.epoch, be.seq),
                    "history": len(be.history),
                    "oldest_seq": be.history[0][0] if be.history else None,
                    "subscribers": len(be.subscribers),
                    "published": be.published,
                    "resyncs_published": be.resyncs_published,
                    "resync_blocks": be.resync_blocks,
                    "overflows": be.overflows,
                    "incomplete": be.incomplete,
                }
                for name, be in self._backends.items()
            },
        }
