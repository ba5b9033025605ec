"""TensorRT-LLM source: polls trtllm-serve's ``POST /kv_cache_events`` (ENGINE_FORMATS.md §7).

The endpoint is a destructive drain: each call returns (and removes) every event queued
since the last one, as a JSON array; there is no replay. Older builds block about 2 s on an
idle poll and then return ``[]``, so the read timeout must exceed that. The listener must be
the only poller of a backend.

Ordering (per attention-DP rank, since ``event_id`` counts per rank)
--------------------------------------------------------------------
* ``created`` (id 0 after an engine start) resets the rank's tracking and calls
  ``on_resync("restart")``; the ``created`` events that follow it directly (one per window
  size) do not resync again.
* ``event_id <= last`` is a duplicate and ignored, except on the first events of a rank after
  a failed poll: a failed response may have carried a ``created`` that was drained and lost,
  so a smaller id there is taken as a restart.
* ``event_id > last + 1`` is a gap: ``on_resync("gap")`` and tracking continues from the new
  id (lost events cannot be fetched again).
* Sliding-window layers publish their own events; only events of the largest
  ``window_size`` are kept (what TensorRT-LLM's own ``kv_event_fanout.py`` does). When a
  larger window appears after smaller-window events were delivered, ``on_resync("window")``.

Mapping: ``stored`` -> :class:`BlockStored` (hashes per block: uint64 JSON numbers, possibly
above 2**63, or 64-hex strings with ``hash_algo: v2_sha256``, kept as bytes; tokens
concatenated from ``blocks[].tokens[].token_id`` with per-block counts, since the last block
may be partial; ``cache_salt`` from the first block; ``medium`` from ``cache_level``),
``removed`` -> :class:`BlockRemoved`; ``updated`` is counted and ignored.

JSON is parsed by the stdlib parser, which keeps integers exact at any size. Salts, bodies
and token ids are never logged.

Size: one module (about 500 lines): polling, per-rank ordering and the event decode are
one drain protocol.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from bus.backoff import Backoff, ExponentialBackoff
from bus.supervisor import Attempt, Supervisor, Verdict
from listener.endpoints import PublisherAllowlist, PublisherNotAllowedError
from listener.engine_events import (
    BlockHash,
    BlockRemoved,
    BlockStored,
    EngineEvent,
    EventBatch,
    normalize_hash,
)
from listener.zmq_source import BatchCallback, ResyncCallback

__all__ = [
    "TrtllmPollError",
    "TrtllmPoller",
    "TrtllmPollerConfig",
    "TrtllmPollerStats",
    "map_event",
]

logger = logging.getLogger(__name__)

_V2_HASH_ALGO = "v2_sha256"


class TrtllmPollError(Exception):
    """A poll failed in a way worth a reconnect: bad status, redirect, oversized body."""


@dataclass(frozen=True, slots=True)
class TrtllmPollerConfig:
    url: str
    """trtllm-serve's ``/kv_cache_events`` URL (``http://`` or ``https://``)."""
    allowed_publishers: tuple[str, ...]
    """IPs, CIDRs or hostnames; the URL's host must be among them (empty refuses all)."""
    backend: str = ""
    """Backend name, for logs."""
    poll_interval_ms: int = 100
    """Pause after a poll that returned no events, in milliseconds."""
    connect_timeout_s: float = 5.0
    read_timeout_s: float = 10.0
    """Longest silence while reading a response; must exceed the ~2 s an idle poll blocks."""
    max_response_bytes: int = 64 << 20
    """Larger responses are refused (and their events lost, detected as a gap later)."""

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"url must be an http:// or https:// URL, got {self.url!r}")
        if self.poll_interval_ms < 0:
            raise ValueError("poll_interval_ms must be >= 0")
        if self.read_timeout_s <= 2.0:
            raise ValueError("read_timeout_s must exceed 2 s (an idle poll blocks ~2 s)")
        if self.connect_timeout_s <= 0 or self.max_response_bytes <= 0:
            raise ValueError("connect_timeout_s and max_response_bytes must be > 0")
        object.__setattr__(self, "allowed_publishers", tuple(self.allowed_publishers))
        PublisherAllowlist(self.allowed_publishers)  # validates the entries


@dataclass(slots=True)
class TrtllmPollerStats:
    polls: int = 0
    """Successful polls (HTTP 200 with a JSON array)."""
    empty_polls: int = 0
    poll_errors: int = 0
    redirects: int = 0
    """3xx answers, refused (counted in ``poll_errors`` too)."""
    malformed_responses: int = 0
    """200 answers that were not a JSON array (their events are lost: a resync)."""
    received: int = 0
    """Events received, before any filtering."""
    batches: int = 0
    events: int = 0
    """Events delivered in batches."""
    skipped: int = 0
    """Events not understood (bad shape, unknown type, unparseable hash)."""
    malformed: int = 0
    """Of those, ``stored`` / ``removed`` events that do not map: lost, so a resync."""
    duplicates: int = 0
    gaps: int = 0
    restarts: int = 0
    resyncs: int = 0
    updated_ignored: int = 0
    window_filtered: int = 0
    callback_errors: int = 0
    last_event_ids: dict[int, int] = field(default_factory=dict)
    """Last event id seen per attention-DP rank."""


# --------------------------------------------------------------------------------------------
# Mapping one event


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _is_created(event: object) -> bool:
    data = event.get("data") if isinstance(event, dict) else None
    return isinstance(data, dict) and data.get("type") == "created"


def _hash(value: object, v2: bool) -> BlockHash | None:
    if isinstance(value, str):
        if not (v2 or len(value) == 64):
            return None
        try:
            return normalize_hash(bytes.fromhex(value))
        except ValueError:
            return None
    return normalize_hash(value) if _int(value) is not None else None


def _map_stored(data: dict[str, Any], v2: bool, group_idx: int) -> BlockStored | None:
    """``block_size`` is the longest block (0 when the engine sent no tokens)."""
    blocks = data.get("blocks")
    if not isinstance(blocks, list) or not blocks:
        return None
    hashes: list[BlockHash] = []
    tokens: list[int] = []
    counts: list[int] = []
    for block in blocks:
        if not isinstance(block, dict):
            return None
        h = _hash(block.get("block_hash"), v2)
        block_tokens = block.get("tokens", [])
        if h is None or not isinstance(block_tokens, list):
            return None
        for tok in block_tokens:
            tid = _int(tok.get("token_id")) if isinstance(tok, dict) else _int(tok)
            if tid is None:
                return None
            tokens.append(tid)
        hashes.append(h)
        counts.append(len(block_tokens))
    parent_raw = data.get("parent_hash")
    parent = None if parent_raw is None else _hash(parent_raw, v2)
    if parent_raw is not None and parent is None:
        return None
    first = blocks[0]
    level = _int(first.get("cache_level"))
    salt = first.get("cache_salt")
    lora_name = data.get("lora_name")
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=max(counts),
        medium="GPU" if not level else "CPU",
        lora_id=_int(first.get("lora_id")),
        lora_name=lora_name if isinstance(lora_name, str) else None,
        cache_salt=salt if isinstance(salt, str) and salt else None,
        group_idx=group_idx,
        block_token_counts=counts,
    )


def _map_removed(data: dict[str, Any], v2: bool, group_idx: int) -> BlockRemoved | None:
    raw = data.get("block_hashes")
    if not isinstance(raw, list) or not raw:
        return None
    hashes = [_hash(h, v2) for h in raw]
    if any(h is None for h in hashes):
        return None
    return BlockRemoved(block_hashes=hashes, group_idx=group_idx)  # type: ignore[arg-type]


def map_event(event: dict[str, Any]) -> EngineEvent | None:
    """One trtllm ``stored`` / ``removed`` event as an engine event; ``None`` if not understood.

    ``hash_algo`` and ``layer_group_id`` (KVCacheManagerV2) may sit on the event or its data.
    """
    data = event.get("data")
    if not isinstance(data, dict):
        return None
    algo = event.get("hash_algo", data.get("hash_algo"))
    v2 = algo == _V2_HASH_ALGO
    group_idx = _int(event.get("layer_group_id", data.get("layer_group_id"))) or 0
    kind = data.get("type")
    if kind == "stored":
        return _map_stored(data, v2, group_idx)
    if kind == "removed":
        return _map_removed(data, v2, group_idx)
    return None


# --------------------------------------------------------------------------------------------
# The poller


class TrtllmPoller:
    """Drains one trtllm-serve's KV events and hands them on in order.

    Args:
        config: where and how to poll.
        on_batch: ``on_batch(batch, dp_rank)``, one batch per run of same-rank events in a
            response. Sync or async.
        on_resync: ``on_resync(reason)`` with ``"restart"``, ``"gap"`` or ``"window"``, in
            order with the batches; ``"decode_error"`` after a response that is not a JSON
            array; ``"malformed_event"`` after a ``stored`` / ``removed`` event that does not
            map; ``"callback_error"`` after ``on_batch`` raised. Sync or async.
        backoff: delay strategy after failed polls (default ``ExponentialBackoff()``).

    Callback exceptions are logged (the first), counted and followed by a resync, never
    propagated.
    """

    def __init__(
        self,
        config: TrtllmPollerConfig,
        *,
        on_batch: BatchCallback,
        on_resync: ResyncCallback,
        backoff: Backoff | None = None,
    ) -> None:
        self.config = config
        self.stats = TrtllmPollerStats()
        self._on_batch = on_batch
        self._on_resync = on_resync
        self._allowlist = PublisherAllowlist(config.allowed_publishers)
        self._host = urlsplit(config.url).hostname or ""
        self._name = config.backend or self._host
        self._supervisor = Supervisor(
            self._run_once,
            self._classify,
            backoff=backoff if backoff is not None else ExponentialBackoff(),
            on_retry=self._log_retry,
        )
        self._last_ids = self.stats.last_event_ids
        self._uncertain: set[int] = set()
        """Ranks whose next event may follow a lost ``created`` (after a failed poll)."""
        self._created_run: dict[int, int] = {}
        """Per rank: id of the last event if it was a ``created``."""
        self._max_window: int | None = None
        self._delivered_windowed = False
        self._pending: list[EngineEvent] = []
        self._pending_rank: int | None = None
        self._pending_skipped = 0
        self._callback_error_logged = False

    async def run(self) -> None:
        """Poll until cancelled; after a failed poll wait per the backoff and go on.

        Raises:
            PublisherNotAllowedError: the URL's host is not in ``allowed_publishers``.
            asyncio.CancelledError: always propagated.
        """
        await self._supervisor.run()

    def _classify(self, error: Exception | None) -> Verdict:
        if isinstance(error, PublisherNotAllowedError):
            return Verdict.FATAL  # a configuration error: retrying cannot help
        self.stats.poll_errors += 1
        self._uncertain = set(self._last_ids)
        return Verdict.RETRY

    def _log_retry(self, attempt: Attempt) -> None:
        logger.warning(
            "trtllm source %s: poll failed (%s: %s); retrying in %.2fs (failure %d)",
            self._name,
            type(attempt.error).__name__,
            attempt.error,
            attempt.delay,
            attempt.failures,
        )

    async def _run_once(self) -> None:
        """Check the host, then own one HTTP session, polling until a poll fails."""
        if not self._allowlist:
            raise PublisherNotAllowedError(self._host, (), ())
        await self._allowlist.refresh()
        await self._allowlist.check_host(self._host)
        cfg = self.config
        timeout = aiohttp.ClientTimeout(
            total=None, connect=cfg.connect_timeout_s, sock_read=cfg.read_timeout_s
        )
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while True:
                received = await self._poll(session)
                if self._supervisor.failures:  # the first good poll after an outage
                    self._supervisor.healthy()
                if not received:
                    await asyncio.sleep(cfg.poll_interval_ms / 1000)

    async def _poll(self, session: aiohttp.ClientSession) -> int:
        """One ``POST``; returns how many events it carried."""
        async with session.post(self.config.url, allow_redirects=False) as resp:
            if 300 <= resp.status < 400:
                self.stats.redirects += 1
                raise TrtllmPollError(f"HTTP {resp.status} redirect refused")
            if resp.status != 200:
                raise TrtllmPollError(f"HTTP {resp.status}")
            body = bytearray()
            async for chunk in resp.content.iter_chunked(1 << 16):
                body += chunk
                if len(body) > self.config.max_response_bytes:
                    raise TrtllmPollError(
                        f"response exceeds {self.config.max_response_bytes} bytes"
                    )
        try:
            events = json.loads(body)
        except (ValueError, RecursionError):
            events = None
        if not isinstance(events, list):
            # The drain removed whatever it carried: lost for sure, so resync now rather
            # than at the next event's id.
            self.stats.malformed_responses += 1
            self._uncertain = set(self._last_ids)
            logger.warning(
                "trtllm source %s: response of %d bytes is not a JSON array", self._name, len(body)
            )
            await self._resync("decode_error")
            return 0
        self.stats.polls += 1
        if not events:
            self.stats.empty_polls += 1
            return 0
        await self._process(events)
        return len(events)

    # -- ordering ----------------------------------------------------------------------------

    async def _process(self, events: list[Any]) -> None:
        self.stats.received += len(events)
        if not _is_created(events[0]):
            await self._window_check(events, 0)
        for i, event in enumerate(events):
            if not isinstance(event, dict) or not isinstance(event.get("data"), dict):
                self._skip(None)
                continue
            rank = _int(event.get("attention_dp_rank")) or 0
            kind = event["data"].get("type")
            event_id = _int(event.get("event_id"))
            if kind == "created":
                await self._on_created(rank, event_id, events, i)
                continue
            self._created_run.pop(rank, None)
            if event_id is not None and not await self._track(rank, event_id):
                continue
            if kind == "updated":
                self.stats.updated_ignored += 1
                continue
            window = _int(event.get("window_size"))
            if window is not None and self._max_window is not None and window != self._max_window:
                self.stats.window_filtered += 1
                continue
            mapped = map_event(event)
            if mapped is None:
                self._skip(rank)
                if kind in ("stored", "removed"):  # a lost block event, not a new kind
                    self.stats.malformed += 1
                    await self._resync("malformed_event")
                continue
            if window is not None:
                self._delivered_windowed = True
            await self._add(rank, mapped)
        await self._flush()

    async def _track(self, rank: int, event_id: int) -> bool:
        """Update the rank's last id; False if the event is a duplicate."""
        last = self._last_ids.get(rank)
        uncertain = rank in self._uncertain
        self._uncertain.discard(rank)
        if last is not None and event_id <= last:
            if not uncertain:
                self.stats.duplicates += 1
                return False
            self.stats.restarts += 1
            logger.warning(
                "trtllm source %s: rank %d event id fell from %d to %d after a failed poll:"
                " engine restarted",
                self._name,
                rank,
                last,
                event_id,
            )
            await self._resync("restart")
        elif last is not None and event_id > last + 1:
            self.stats.gaps += 1
            logger.warning(
                "trtllm source %s: rank %d lost events %d..%d; resync",
                self._name,
                rank,
                last + 1,
                event_id - 1,
            )
            await self._resync("gap")
        self._last_ids[rank] = event_id
        return True

    async def _on_created(
        self, rank: int, event_id: int | None, events: list[Any], index: int
    ) -> None:
        """A (re)started engine: reset the rank and the window, resync once per run."""
        self._uncertain.discard(rank)
        previous = self._created_run.get(rank)
        if previous is None or event_id is None or event_id != previous + 1:
            self.stats.restarts += 1
            await self._resync("restart")
            self._max_window = None
            await self._window_check(events, index)
        if event_id is not None:
            self._last_ids[rank] = event_id
            self._created_run[rank] = event_id

    async def _window_check(self, events: list[Any], start: int) -> None:
        """Raise the window to the largest one in ``events[start:]`` (up to the next restart)."""
        largest: int | None = None
        for j in range(start, len(events)):
            event = events[j]
            if not isinstance(event, dict):
                continue
            if j > start and _is_created(event) and not _is_created(events[j - 1]):
                break  # the next restart starts a new segment
            window = _int(event.get("window_size"))
            if window is not None and (largest is None or window > largest):
                largest = window
        if largest is None or (self._max_window is not None and largest <= self._max_window):
            return
        if self._max_window is not None and self._delivered_windowed:
            await self._resync("window")
        self._max_window = largest

    # -- hand-off ----------------------------------------------------------------------------

    def _skip(self, rank: int | None) -> None:
        self.stats.skipped += 1
        if rank is not None and rank == self._pending_rank:
            self._pending_skipped += 1

    async def _add(self, rank: int, event: EngineEvent) -> None:
        if self._pending and rank != self._pending_rank:
            await self._flush()
        self._pending_rank = rank
        self._pending.append(event)

    async def _flush(self) -> None:
        """Deliver the pending run of same-rank events as one batch."""
        events, rank, skipped = self._pending, self._pending_rank, self._pending_skipped
        self._pending, self._pending_rank, self._pending_skipped = [], None, 0
        if not events:
            return
        self.stats.batches += 1
        self.stats.events += len(events)
        batch = EventBatch(ts=time.time(), events=events, dp_rank=rank, skipped=skipped)
        await self._call(self._on_batch, batch, rank)

    async def _resync(self, reason: str) -> None:
        await self._flush()
        self.stats.resyncs += 1
        self._delivered_windowed = False
        await self._call(self._on_resync, reason, resync=False)

    async def _call(self, fn: Callable[..., object], *args: object, resync: bool = True) -> None:
        """Call back; a failure is counted and, unless it was the resync itself, resyncs
        (whatever the batch callback did not finish is lost to the consumer)."""
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self.stats.callback_errors += 1
            if not self._callback_error_logged:
                self._callback_error_logged = True
                logger.exception(
                    "trtllm source %s: callback failed; further failures are only counted",
                    self._name,
                )
            if resync:
                await self._resync("callback_error")
