"""Tier 4 inside the router: index, event consumers and scorer, started as one.

Built when ``kv_cache_index.enabled`` (restart-only), so this object lives as long as
the process; it is consulted only while ``prefix_routing.enabled`` (the scorers need
prefix keys, and that switch hot-reloads). Of ``kv_cache_index`` only ``event_sources``
reloads (:meth:`KvRuntime.reconfigure`).

With ``kv_cache_index.conversation.enabled`` it also holds conversation-depth routing:
the chain index (a second index from the same factory: ``conversation.max_entries``,
the same TTL, Redis namespace ``cr:kvchain:``), fed by the same consumers (chain events
go to it, ``router.kvindex.apply``), and the :class:`ConversationScorer` over it. The
prefill ledger and the predicted-vs-delivered sums exist either way (the forwarder may
record prefix-routed requests too).

This is where the KV index (``router.kvindex``, which knows nothing of where its events
come from) meets ingestion (``router.ingest``, which knows nothing of the index but an
``apply`` callable) and push mode's session registry (built once by the process and handed
in: the opener of every ``transport: event_bus`` source).

With ``kv_cache_index.anti_entropy.interval_seconds`` > 0 it runs the anti-entropy check
(``router.kvindex.anti_entropy``) of every source: the listener's snapshot against the
indexes, at the consumer's position; fetched from ``GET /snapshot/<backend>``
(``router.ingest.snapshot``) for a pull-mode source, asked for on the listener's event
bus session (``SessionRegistry.snapshot``) for a push-mode one.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from bus.tasks import cancel_and_wait

from .config import RouterConfig
from .config.models import EventSourceConfig
from .eventbus.sessions import SessionRegistry
from .gemini.usage import cached_tokens_of
from .ingest import KvEventConsumerManager, StreamOpener
from .ingest.snapshot import fetch_snapshot, parse_snapshot, snapshot_session, snapshot_url
from .kvindex import (
    CHAIN_KEY_PREFIX,
    FallbackKvIndex,
    IndexStats,
    InstrumentedKvIndex,
    apply_event,
    apply_events,
    build_kv_index,
    end_resync,
)
from .kvindex.accuracy import PredictionAccuracy
from .kvindex.anti_entropy import AntiEntropy, Position
from .kvindex.cost import ConversationScorer
from .kvindex.prefill import PrefillLoad, PrefillTicket
from .kvindex.scorer import KvOverlapScorer
from .pool import Backend
from .selection import SelectionContext

__all__ = ["KvRuntime", "index_figures"]

log = logging.getLogger("continuum.kvindex")


class KvRuntime:
    def __init__(
        self,
        config: RouterConfig,
        on_decision: Callable[[str, str, float | None], None] | None = None,
        pools: Any = None,
        event_bus: SessionRegistry | None = None,
        *,
        on_conversation_decision: Callable[[str], None] | None = None,
        on_prediction: Callable[[str, int, int], None] | None = None,
    ) -> None:
        """
        Args:
            on_decision: ``(decision, tier, score)`` of every scorer decision (metrics);
                the conversation scorer's too (``kv_aware`` when it chose, else
                ``fallback``; score None).
            on_conversation_decision: the conversation scorer's ``outcome`` (``chosen``,
                ``tie``, ``none_held``) of every decision (metrics).
            on_prediction: ``(backend, predicted, reported)`` cached tokens of every
                answered request the forwarder records (metrics).
            pools: the router's one ``RedisPools``: the index shares the response cache's
                pool.
            event_bus: push mode's session registry (None without ``dynamo.event_bus``):
                it opens the streams of ``transport: event_bus`` sources. Built once for
                the process (the bus server registers sessions in the same one); never
                closed here.
        """
        kv = config.kv_cache_index
        self.config = kv
        self.index = build_kv_index(kv, config.response_cache.redis, pools=pools)
        self.kv_aware = 0
        self.fallback = 0
        self.overlap_scores = 0
        self.queries = 0
        self._on_decision = on_decision
        self._on_conversation_decision = on_conversation_decision
        self.scorer = KvOverlapScorer(self.index, kv.scoring, on_decision=self._decision)
        self.prefill_load = PrefillLoad()
        """In-flight prefill tokens per backend: the forwarder's ``started``/``finished``."""
        self.accuracy = PredictionAccuracy(on_record=on_prediction)
        """Predicted against reported cached tokens: the forwarder's ``record``."""
        conv = kv.conversation
        self.chain_index: InstrumentedKvIndex | None = None
        self.conversation: ConversationScorer | None = None
        if conv.enabled:
            self.chain_index = build_kv_index(
                kv,
                config.response_cache.redis,
                pools=pools,
                key_prefix=CHAIN_KEY_PREFIX,
                max_entries=conv.max_entries,
            )
            self.conversation = ConversationScorer(
                self.chain_index,
                conv,
                self.prefill_load,
                entry_ttl_seconds=kv.entry_ttl_seconds,
                on_decision=self._conversation_decision,
            )
        self.event_bus = event_bus
        # ``kv_cache_index`` is restart-only, so the offloading settings are bound once.
        offloading = kv.storage_offloading
        self.consumers = KvEventConsumerManager(
            kv.event_sources,
            functools.partial(
                apply_event, self.index, offloading=offloading, chain_index=self.chain_index
            ),
            stream_opener_factory=self._stream_opener,
            apply_many=functools.partial(
                apply_events, self.index, offloading=offloading, chain_index=self.chain_index
            ),
            end_resync=functools.partial(end_resync, self.index, self.chain_index),
        )
        self._cleanup: asyncio.Task[None] | None = None
        self._resync: asyncio.Task[None] | None = None
        self._restart: asyncio.Task[None] | None = None
        self.anti_entropy: AntiEntropy | None = None
        self._anti_entropy_task: asyncio.Task[None] | None = None
        self._snapshot_urls: dict[str, str] = {}
        ae = kv.anti_entropy
        self._snapshot_session: Any = None
        targets = self._snapshot_targets(kv.event_sources)
        if ae.interval_seconds > 0 and targets:
            self.anti_entropy = AntiEntropy(
                targets,
                self.index,
                self.chain_index,
                offloading,
                fetch=self._fetch_snapshot,
                position=self._position,
                repair=self._repair if ae.repair else None,
                interval=ae.interval_seconds,
            )
        self.index_resyncs = 0
        """Times every stream was started over because a Redis index came back."""
        for idx in (self.index, self.chain_index):
            inner = idx.inner if idx is not None else None
            if isinstance(inner, FallbackKvIndex):
                inner.on_recovered = self._index_recovered
        sc = kv.scoring
        log.info(
            "KV scorer: overlap_weight=%g load_weight=%g health_weight=%g "
            "min_overlap_threshold=%g gpu_tier_weight=%g storage_tier_weight=%g",
            sc.overlap_weight,
            sc.load_weight,
            sc.health_weight,
            sc.min_overlap_threshold,
            sc.gpu_tier_weight,
            sc.storage_tier_weight,
        )
        if self.conversation is not None:
            cs = conv.scoring
            log.info(
                "conversation scorer: chunk_bytes=%d max_entries=%d predict_ttl_seconds=%g "
                "gpu_credit=%g storage_credit=%g prefill_load_weight=%g "
                "active_request_weight=%g bytes_per_token=%g",
                conv.chunk_bytes,
                conv.max_entries,
                self.conversation.predict_ttl,
                cs.gpu_credit,
                cs.storage_credit,
                cs.prefill_load_weight,
                cs.active_request_weight,
                cs.bytes_per_token,
            )

    def _stream_opener(self, source: EventSourceConfig) -> StreamOpener | None:
        if source.transport == "event_bus" and self.event_bus is not None:
            return self.event_bus.opener(source.backend_name)
        return None

    # -- lifecycle -----------------------------------------------------------------

    async def start(self) -> None:
        await self.consumers.start()
        loop = asyncio.get_running_loop()
        self._cleanup = loop.create_task(self._cleanup_loop())
        if self.anti_entropy is not None:
            self._snapshot_session = snapshot_session(self.config.anti_entropy.timeout_seconds)
            self._anti_entropy_task = loop.create_task(self.anti_entropy.run())

    def reconfigure(self, sources: Sequence[EventSourceConfig]) -> None:
        """Hot reload of ``kv_cache_index.event_sources``: the consumers switch to
        ``sources`` (``KvEventConsumerManager.restart``: unchanged ones keep running),
        in the background, after any switch still in progress."""
        sources = list(sources)
        if sources == self.config.event_sources:
            return
        self.config = self.config.model_copy(update={"event_sources": sources})
        previous = self._restart

        async def switch() -> None:
            if previous is not None:
                await asyncio.wait([previous])
            try:
                await self.consumers.restart(sources)
            except Exception:  # a reload never raises; the running consumers stay as they are
                log.exception("KV event sources: reload failed")
                return
            targets = self._snapshot_targets(sources)
            if self.anti_entropy is not None:
                # The check follows the sources (a runtime started without a source with
                # a snapshot has none to follow: anti-entropy starts with a restart then).
                self.anti_entropy.follow(targets)
            log.info(
                "KV event sources reloaded: %s",
                ", ".join(f"{s.backend_name} ({s.transport})" for s in sources) or "none",
            )

        self._restart = asyncio.get_running_loop().create_task(switch())

    async def stop(self) -> None:
        await cancel_and_wait(self._restart, log=log)
        await cancel_and_wait(self._anti_entropy_task, log=log)
        if self._snapshot_session is not None:
            await self._snapshot_session.close()
        await cancel_and_wait(self._cleanup, log=log)
        await cancel_and_wait(self._resync, log=log)
        await self.consumers.stop()
        await self.index.close()
        if self.chain_index is not None:
            await self.chain_index.close()

    def _index_recovered(self) -> None:
        """Redis serves the index again after an outage. If it restarted empty, every entry
        written before the outage is gone, and resuming the streams would not bring them
        back (each listener only sends what follows the router's position): start every
        stream over, so each listener sends ``resync`` and its snapshot. Runs once at a
        time; a Redis that kept its data costs one snapshot per backend."""
        if self._resync is not None and not self._resync.done():
            return
        self.index_resyncs += 1
        self._resync = asyncio.get_running_loop().create_task(self._resync_streams())

    async def _resync_streams(self) -> None:
        backends = await self.consumers.resync()
        log.warning(
            "KV index: Redis serves again; resyncing %d event stream(s) from snapshots",
            len(backends),
        )

    # -- anti-entropy ----------------------------------------------------------------

    def _snapshot_targets(self, sources: Sequence[EventSourceConfig]) -> list[str]:
        """The backends of ``sources`` that have a snapshot to check against (a pull
        source whose endpoint has a ``/snapshot/`` beside it, every push source when the
        event bus is on); their snapshot URLs are kept for :meth:`_fetch_snapshot`."""
        self._snapshot_urls = {
            s.backend_name: url
            for s in sources
            if s.transport == "sse" and (url := snapshot_url(s.endpoint)) is not None
        }
        pushed = [
            s.backend_name
            for s in sources
            if s.transport == "event_bus" and self.event_bus is not None
        ]
        return [*self._snapshot_urls, *pushed]

    async def _fetch_snapshot(self, backend: str) -> Any:
        url = self._snapshot_urls.get(backend)
        if url is not None:
            return await fetch_snapshot(self._snapshot_session, url, backend)
        assert self.event_bus is not None
        raw = await self.event_bus.snapshot(backend, self.config.anti_entropy.timeout_seconds)
        return parse_snapshot(raw, backend)

    def _position(self, backend: str) -> Position | None:
        consumer = self.consumers.consumers.get(backend)
        if consumer is None or not consumer.stats.connected:
            return None
        return Position(consumer.last_event_id, consumer.applying)

    async def _repair(self, backend: str) -> None:
        await self.consumers.resync([backend])

    async def _cleanup_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.cleanup_interval_ms / 1000)
            await self.sweep()

    async def sweep(self) -> None:
        """One round of the periodic sweep: expired entries of both indexes, then their
        stats (``last_stats``, which metrics read). Never raises but CancelledError."""
        for name, index in (("KV", self.index), ("chain", self.chain_index)):
            if index is None:
                continue
            try:
                removed = await index.cleanup_expired()
                if removed:
                    log.debug("expired %d %s index entries", removed, name)
                await index.stats()
            except Exception:  # the sweep must never die
                log.exception("%s index cleanup failed", name)

    # -- events and decisions ------------------------------------------------------

    def _decision(self, decision: str, tier: str, score: float | None) -> None:
        self.queries += 1
        if decision == "kv_aware":
            self.kv_aware += 1
            self.overlap_scores += 1
        else:
            self.fallback += 1
        if self._on_decision is not None:
            self._on_decision(decision, tier, score)

    def _conversation_decision(self, outcome: str, tier: str) -> None:
        """The conversation scorer's decisions count in the KV decisions as well
        (``kv_aware``: a KV scorer chose), and by outcome of their own."""
        if outcome == "chosen":
            self.kv_aware += 1
        else:
            self.fallback += 1
        if self._on_decision is not None:
            self._on_decision("kv_aware" if outcome == "chosen" else "fallback", tier, None)
        if self._on_conversation_decision is not None:
            self._on_conversation_decision(outcome)

    # -- what the forwarder reports (RoutingFeedback) -----------------------------

    def sent(self, backend: Backend, ctx: SelectionContext) -> object | None:
        """The tokens ``backend`` must still prefill for the request count as its load
        until it answers (the cost model's ``in_flight_prefill_tokens``)."""
        conv, view = self.conversation, ctx.view
        if conv is None or view is None:
            return None
        return self.prefill_load.started(backend.name, conv.prefill_tokens(view, backend))

    def answered(self, ticket: object | None) -> None:
        if isinstance(ticket, PrefillTicket):
            self.prefill_load.finished(ticket)

    def delivered(self, backend: Backend, ctx: SelectionContext, usage: Mapping[str, Any]) -> None:
        """The engine's own ``cached_tokens`` against the prediction for ``backend``; an
        engine that does not report them (no ``prompt_tokens_details``) is not counted."""
        conv, view = self.conversation, ctx.view
        details = usage.get("prompt_tokens_details")
        if conv is None or view is None or not isinstance(details, Mapping):
            return
        if "cached_tokens" not in details:
            return
        self.accuracy.record(
            backend.name, conv.predicted_cached_tokens(view, backend), cached_tokens_of(usage)
        )

    # -- what admin, gRPC and metrics read ---------------------------------------

    def consumer_stats(self) -> dict[str, dict[str, Any]]:
        """Every event source's counters (``ConsumerStats`` fields), by backend name."""
        return {
            name: {f.name: getattr(c, f.name) for f in dataclasses.fields(c)}
            for name, c in self.consumers.stats().items()
        }

    def metrics_snapshot(self) -> dict[str, Any]:
        """Sync view for the Prometheus collector (index figures: the latest ``stats()``,
        refreshed by the sweep and by admin reads)."""
        snap: dict[str, Any] = {
            "consumers": self.consumer_stats(),
            "index": index_figures(self.index.last_stats),
            "prefill_tokens": self.prefill_load.snapshot(),
        }
        if self.chain_index is not None:
            snap["chain_index"] = index_figures(self.chain_index.last_stats)
        if self.conversation is not None:
            snap["conversation_capped"] = self.conversation.capped
        if self.event_bus is not None:
            snap["event_bus"] = self.event_bus.stats()
        if self.anti_entropy is not None:
            snap["anti_entropy"] = self.anti_entropy
        return snap


def index_figures(st: IndexStats | None) -> dict[str, Any]:
    """The index's counts as the admin JSON and the metrics name them."""
    if st is None:
        return {}
    return {
        "prefix_count": st.prefix_count,
        "entry_count": st.entry_count,
        "total_hits": st.total_hits,
        "total_evictions": st.total_evictions,
        "fallback_active": bool(st.fallback_active),
        "fallback_count": st.fallback_count,
    }
