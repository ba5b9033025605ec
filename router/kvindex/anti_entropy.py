"""Anti-entropy: the router's index for a backend against a fresh listener snapshot.

Events can be lost or misapplied in ways no stream position reveals (an entry removed
behind the router's back, a Redis that dropped keys, a bug): every
``kv_cache_index.anti_entropy.interval_seconds`` the router fetches each backend's
snapshot from its listener (the entries a resync block would state, and the id of the
last record they reflect; how, below) and compares it with what its indexes hold for that
backend:

* **missing**: an entry the snapshot states that the index lacks (the key read back
  without this backend, ``peek_many``: no LRU or hit counts touched);
* **extra**: the index's entries for the backend beyond those the snapshot states
  (``backend_counts`` minus the matches: the index is not enumerated).

Both kinds of keys are counted: prefix keys in the KV index, conversation keys in the
chain index. A snapshot entry is expected in the index as ``apply`` would write it (a
storage-tier entry only with ``storage_offloading`` on).

**In-flight events.** The comparison is exact only at one stream position. A check reads
the consumer's position (its last applied event id, and whether it is applying a chunk
now), fetches the snapshot, reads the index, and reads the position again; it counts only
when the consumer stood idle at exactly the snapshot's id before and after (no event was
applied in between, none was pending before the snapshot's id). Otherwise it tries again
``attempts`` times, ``retry_delay`` apart, and is counted ``unsettled``; the gauges keep
the last settled figures. A fetch that fails is counted ``failed``.

**Repair** (``repair: true``): a backend found divergent by two settled checks in a row is
resynced (its stream starts over without its id: the listener answers ``resync`` + its
snapshot, and the backend's entries are rebuilt whole), counted in ``repairs``. Divergence
seen once may be a transient the next events heal; twice is not.

Presence per (key, backend) is compared, not tiers or token counts. ``backend_counts`` is
the indexes' admin count: a scan of the whole index per backend checked, hence a long
default interval.

How the snapshot is had: a pull-mode backend's from ``GET /snapshot/<backend>``, a
push-mode one's (``transport: event_bus``: the router cannot reach the listener, which
dials it) by a ``SnapshotRequest`` on the listener's event bus session, answered with the
same document; the check below is the same for both.

Predictions (``conversation.predict_ttl_seconds``) are entries no snapshot states: while
they live they count as extra conversation entries.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from bus.events import KvEvent
from router.config.models import StorageOffloadingConfig

from .apply import entry_of
from .base import Key, KvIndex

__all__ = ["AntiEntropy", "Divergence", "Position", "divergence"]

log = logging.getLogger("continuum.kvindex.anti_entropy")

Outcome = Literal["settled", "unsettled", "failed"]
KINDS = ("prefix", "conversation")


@dataclass(frozen=True, slots=True)
class Position:
    """Where the router's consumer of a backend stands."""

    last_event_id: str | None
    applying: bool


@dataclass(frozen=True, slots=True)
class Divergence:
    """Entries the snapshot states that the index lacks, and the index's beyond them, per
    kind of key (``prefix``, ``conversation``)."""

    missing: dict[str, int] = field(default_factory=dict)
    extra: dict[str, int] = field(default_factory=dict)

    @property
    def total_missing(self) -> int:
        return sum(self.missing.values())

    @property
    def total_extra(self) -> int:
        return sum(self.extra.values())

    @property
    def clean(self) -> bool:
        return not self.total_missing and not self.total_extra


async def _one_kind(index: KvIndex, backend: str, keys: Sequence[Key]) -> tuple[int, int]:
    rows = await index.peek_many(keys) if keys else []
    present = sum(1 for row in rows if any(e.backend == backend for e in row))
    count = (await index.backend_counts()).get(backend, 0)
    return len(keys) - present, max(0, count - present)


async def divergence(
    index: KvIndex,
    chain_index: KvIndex | None,
    backend: str,
    events: Sequence[KvEvent],
    offloading: StorageOffloadingConfig,
) -> Divergence:
    """``backend``'s entries in the indexes against ``events`` (a snapshot of it)."""
    keys: dict[bool, dict[Key, None]] = {False: {}, True: {}}
    for ev in events:
        entry = entry_of(ev, offloading, chain_index is not None) if ev.backend == backend else None
        if entry is not None:
            keys[entry[0]][entry[1]] = None
    out = Divergence()
    out.missing["prefix"], out.extra["prefix"] = await _one_kind(index, backend, list(keys[False]))
    if chain_index is not None:
        m, e = await _one_kind(chain_index, backend, list(keys[True]))
        out.missing["conversation"], out.extra["conversation"] = m, e
    return out


Fetch = Callable[[str], Awaitable[tuple[str, list[KvEvent]]]]
"""A backend's snapshot from its listener: (the id of the last record it reflects, its
entries as ``cache_created`` / ``chain_created`` events)."""


class AntiEntropy:
    """The periodic check of every given backend (module docstring).

    Args:
        backends: the backends to check.
        fetch: their listener's snapshot.
        position: where the router's consumer of a backend stands (None: no consumer).
        repair: resync one backend's stream (None: never repair).
        interval: seconds between rounds (> 0).
    """

    def __init__(
        self,
        backends: Sequence[str],
        index: KvIndex,
        chain_index: KvIndex | None,
        offloading: StorageOffloadingConfig,
        *,
        fetch: Fetch,
        position: Callable[[str], Position | None],
        repair: Callable[[str], Awaitable[object]] | None,
        interval: float,
        attempts: int = 20,
        retry_delay: float = 0.05,
    ) -> None:
        if interval <= 0 or attempts < 1:
            raise ValueError("interval and attempts must be positive")
        self._index, self._chains, self._offloading = index, chain_index, offloading
        self._fetch, self._position, self._repair = fetch, position, repair
        self.interval, self.attempts, self.retry_delay = interval, attempts, retry_delay
        self.checks: dict[str, dict[Outcome, int]] = {}
        self.last: dict[str, Divergence] = {}
        """Each backend's divergence at its last settled check."""
        self.repairs: dict[str, int] = {}
        self._streak: dict[str, int] = {}
        self.backends: list[str] = []
        self.follow(backends)

    def follow(self, backends: Sequence[str]) -> None:
        """Check ``backends`` from the next round on (the event sources were reloaded); a
        backend checked before keeps its counts."""
        self.backends = list(backends)
        for b in self.backends:
            self.checks.setdefault(b, {"settled": 0, "unsettled": 0, "failed": 0})
            self.repairs.setdefault(b, 0)
            self._streak.setdefault(b, 0)

    async def check(self, backend: str) -> Outcome:
        """One check of ``backend``: counted, the gauges set when it settles, a repair
        when it is the second divergent one in a row."""
        outcome = await self._attempt(backend)
        self.checks[backend][outcome] += 1
        if outcome == "settled":
            found = self.last[backend]
            if found.clean:
                self._streak[backend] = 0
            else:
                self._streak[backend] += 1
                log.warning(
                    "KV index of %s diverges from its listener: %d missing, %d extra (%s)",
                    backend,
                    found.total_missing,
                    found.total_extra,
                    ", ".join(f"{k} {found.missing[k]}/{found.extra[k]}" for k in found.missing),
                )
                if self._repair is not None and self._streak[backend] >= 2:
                    self._streak[backend] = 0
                    self.repairs[backend] += 1
                    log.warning("KV index of %s: resyncing its event stream", backend)
                    await self._repair(backend)
        return outcome

    async def _attempt(self, backend: str) -> Outcome:
        for n in range(self.attempts):
            if n:
                await asyncio.sleep(self.retry_delay)
            before = self._position(backend)
            if before is None or before.applying or before.last_event_id is None:
                continue
            try:
                event_id, events = await self._fetch(backend)
            except Exception as exc:
                log.info("anti-entropy: no snapshot of %s: %r", backend, exc)
                return "failed"
            if event_id != before.last_event_id:
                continue
            found = await divergence(self._index, self._chains, backend, events, self._offloading)
            after = self._position(backend)
            if after is None or after.applying or after.last_event_id != event_id:
                continue
            self.last[backend] = found
            return "settled"
        return "unsettled"

    async def run(self) -> None:
        """Check every backend once per ``interval``, until cancelled."""
        while True:
            await asyncio.sleep(self.interval)
            for backend in self.backends:
                try:
                    await self.check(backend)
                except asyncio.CancelledError:
                    raise
                except Exception:  # the index is unavailable: the next round tries again
                    self.checks[backend]["failed"] += 1
                    log.exception("anti-entropy check of %s failed", backend)

    def document(self) -> dict[str, object]:
        """The admin view: per backend, the checks, repairs and last settled divergence."""
        out: dict[str, object] = {}
        for b in self.backends:
            d = self.last.get(b)
            out[b] = {
                "checks": dict(self.checks[b]),
                "repairs": self.repairs[b],
                "divergence": None if d is None else {"missing": d.missing, "extra": d.extra},
            }
        return out
