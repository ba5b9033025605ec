"""The listener process: sources -> decode -> chain tracker -> event hub -> SSE and gRPC.

One ``SourceRuntime`` per configured backend owns its tracker and its transports (one
ZMQ source per DP rank, or one trtllm poller). With ``conversation.enabled`` each tracker
also gets its source's token byte table (``listener.token_bytes``, one per tokenizer file,
shared by the sources that name it) and announces conversation keys.

Everything runs on one asyncio loop; the ingestion path (``_on_batch``) is synchronous
from the decoded batch to the hub, so an event is published in the same step its engine
event is applied and a snapshot taken by a new subscriber is always consistent with the
live stream that follows.

Stop order (SIGTERM/SIGINT): sources, gRPC, SSE, then the hub, so subscribers see the
end of their stream rather than a reset connection.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import signal
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bus.config import parse_hostport
from bus.events import KvEvent
from bus.salt import load_secret
from bus.tasks import cancel_and_wait

from .chains import ChainTracker
from .chains.conversation import ConversationSettings
from .checkpointer import Checkpointer
from .config import ListenerConfig, SourceConfig
from .decode import decode_batch
from .engine_events import EventBatch
from .grpc_service import GrpcServer, ListenerServicer
from .push.client import EventBusClient
from .recovery import Attributor, Detokenizer
from .saecache.advisor import EvictionAdvisor
from .saecache.advisor import add_to_server as advisor_to_server
from .saecache.guard import GuardConfig
from .saecache.pruning import SaePruningPolicy
from .sse_server import SseServer
from .stream import EventHub
from .templates import CHATML, LLAMA3, ChatTemplate, get_template, marker_template
from .token_bytes import load_token_bytes
from .trtllm_source import TrtllmPoller, TrtllmPollerConfig
from .zmq_source import ZmqSource, ZmqSourceConfig

__all__ = ["ListenerApp", "SourceRuntime", "run"]

log = logging.getLogger("continuum.listener")


def _templates(src: SourceConfig) -> Sequence[ChatTemplate]:
    tpl = src.chat_template
    if tpl is None:
        chosen: Sequence[ChatTemplate] = (CHATML, LLAMA3)
    elif isinstance(tpl, str):
        chosen = (get_template(tpl),)
    else:
        chosen = (marker_template(tpl.system_start, tpl.user_start, tpl.end),)
    if src.default_system_prompt:
        chosen = tuple(t.with_default_system_prompt(src.default_system_prompt) for t in chosen)
    return chosen


def _identity(cfg: ListenerConfig, src: SourceConfig) -> dict[str, Any]:
    """What a checkpoint's state depends on: one written under other values is refused."""
    conv = cfg.conversation
    return {
        "backend": src.backend_name,
        "engine": src.engine,
        "model": src.model,
        "max_chain_tokens": src.max_chain_tokens,
        "max_tracked_blocks": src.max_tracked_blocks,
        "max_retained_tokens": src.max_retained_tokens,
        "pruning_policy": src.pruning_policy,
        "max_prefix_length": cfg.max_prefix_length,
        "conversation": [conv.chunk_bytes, conv.max_retained_bytes] if conv.enabled else None,
    }


class SourceRuntime:
    """One backend: its tracker, its transports and their counters."""

    def __init__(self, cfg: ListenerConfig, src: SourceConfig, hub: EventHub) -> None:
        self.src = src
        self.name = src.backend_name
        self.hub = hub
        secret = None
        if cfg.has_salt_secret:
            secret = load_secret(cfg.salt_secret_file, cfg.salt_secret_env)
        self.detokenizer: Detokenizer | None = None
        if src.detokenize_endpoint:
            self.detokenizer = Detokenizer(
                src.detokenize_endpoint,
                model=src.model,
                flavor="sglang" if src.engine == "sglang" else "vllm",
            )
        attributor = Attributor(
            model=src.model or "",
            template=_templates(src),
            backend=self.name,
            detokenizer=self.detokenizer,
            max_prefix_length=cfg.max_prefix_length,
            salt_secret=secret,
        )
        conversation = None
        if cfg.conversation.enabled:
            assert src.tokenizer is not None  # the loader requires it
            conversation = ConversationSettings(
                load_token_bytes(src.tokenizer),
                src.model,
                cfg.conversation.chunk_bytes,
                cfg.conversation.max_retained_bytes,
            )
        self.tracker = ChainTracker(
            self.name,
            self._emit,
            attributor,
            engine=src.engine,
            max_chain_tokens=src.max_chain_tokens,
            max_tracked_blocks=src.max_tracked_blocks,
            max_retained_tokens=src.max_retained_tokens,
            policy=SaePruningPolicy() if src.pruning_policy == "saecache" else None,
            conversation=conversation,
            on_fault=self._on_fault,
        )
        hub.add_backend(self.name, self.tracker.snapshot)
        self.transports: list[ZmqSource | TrtllmPoller] = []
        if src.engine == "trtllm":
            assert src.trtllm_endpoint is not None
            self.transports.append(
                TrtllmPoller(
                    TrtllmPollerConfig(
                        url=src.trtllm_endpoint,
                        allowed_publishers=tuple(src.allowed_publishers),
                        backend=self.name,
                        poll_interval_ms=src.poll_interval_ms,
                    ),
                    on_batch=self._on_batch,
                    on_resync=self._on_resync,
                )
            )
        else:
            for i, ep in enumerate(src.zmq_endpoints()):
                rank = i if src.dp_ranks else None
                self.transports.append(
                    ZmqSource(
                        ZmqSourceConfig(
                            endpoint=ep.endpoint,
                            mode=src.zmq_mode,
                            engine=src.engine,
                            topic=src.topic,
                            replay_endpoint=ep.replay_endpoint,
                            allowed_publishers=tuple(src.allowed_publishers),
                            dp_rank=rank,
                            backend=self.name,
                            max_frame_bytes=src.max_frame_bytes,
                        ),
                        decode=functools.partial(decode_batch, max_frame_bytes=src.max_frame_bytes),
                        on_batch=functools.partial(self._on_batch, flush=False),
                        on_resync=self._on_resync,
                        on_drained=self.tracker.flush,
                    )
                )
        self.incomplete = False
        """The view was resumed from a checkpoint and misses batches no replay gave back."""
        self.checkpointer: Checkpointer | None = None
        zmq_transports = [t for t in self.transports if isinstance(t, ZmqSource)]
        if cfg.checkpoint_dir is not None and zmq_transports:
            self.checkpointer = Checkpointer(
                Path(cfg.checkpoint_dir) / f"{self.name}.ckpt",
                _identity(cfg, src),
                self.tracker,
                zmq_transports,
                self._changes,
                cfg.checkpoint_max_age_s,
            )
            self.checkpointer.load(self._on_gap)

    def _changes(self) -> tuple[int, ...]:
        """Moves whenever the state may have changed: what the hub published for the
        backend and the batches the transports took."""
        seq = self.hub.stats()["backends"][self.name]["seq"]
        return (seq, *(t.stats.batches + t.stats.resyncs for t in self.transports))

    def _on_gap(self, lost: int) -> None:
        """Batches after a checkpoint are lost for good: the view is kept (it is all there
        is of what the engine holds) and subscribers are told it may be incomplete."""
        self.incomplete = True
        self.hub.set_incomplete(self.name, True)
        self.tracker.flush()
        self.hub.resync(self.name, "checkpoint_gap", self.tracker.snapshot())

    def _emit(self, ev: KvEvent) -> None:
        self.hub.publish(self.name, ev)

    def _on_batch(self, batch: EventBatch, dp_rank: int | None, flush: bool = True) -> None:
        """``flush=False`` for ZMQ sources: they flush once per drained backlog."""
        if batch.dp_rank is None and dp_rank is not None:
            batch.dp_rank = dp_rank
        self.tracker.apply(batch, flush=flush)

    def _on_resync(self, reason: str) -> None:
        """The engine restarted or events were lost (a gap, an undecodable batch, an event
        the tracker failed on): forget, then tell subscribers."""
        self.tracker.reset()
        if self.incomplete:  # empty now: nothing is missing any more
            self.incomplete = False
            self.hub.set_incomplete(self.name, False)
        self.hub.resync(self.name, reason, self.tracker.snapshot())

    def _on_fault(self, reason: str) -> None:
        """An event the tracker failed on: resync, and learn the state again from the
        engine's replay buffer where there is one."""
        self._on_resync(reason)
        for t in self.transports:
            if isinstance(t, ZmqSource):
                t.relearn()

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"engine": self.src.engine}
        transport: dict[str, int] = {}
        for t in self.transports:
            for f in dataclasses.fields(t.stats):
                v = getattr(t.stats, f.name)
                k = f.name
                if isinstance(v, int) and not isinstance(v, bool):
                    transport[k] = transport.get(k, 0) + v
        out.update(transport)
        out.update(self.tracker.stats())
        if self.checkpointer is not None:
            out.update(self.checkpointer.stats)
        out["view_incomplete"] = int(self.incomplete)
        return out

    async def aclose(self) -> None:
        await self.tracker.aclose()
        if self.detokenizer is not None:
            await self.detokenizer.aclose()


class ListenerApp:
    def __init__(self, cfg: ListenerConfig) -> None:
        self.cfg = cfg
        self.hub = EventHub(cfg.history_size, cfg.subscriber_queue_size)
        self.sources = {s.backend_name: SourceRuntime(cfg, s, self.hub) for s in cfg.sources}
        self.sse = SseServer(
            self.hub,
            heartbeat_interval=cfg.heartbeat_interval_ms / 1000,
            stats_provider=self.stats,
            max_subscribers=cfg.max_subscribers,
            write_timeout=cfg.subscriber_write_timeout_ms / 1000,
        )
        self.grpc: GrpcServer | None = None
        self.advisor: EvictionAdvisor | None = None
        # Push mode: one client (session, reconnects, streams) per router, so each
        # replica of a fleet with several routers gets every event on its own terms.
        self.push: list[EventBusClient] = [
            EventBusClient(
                bus,
                self.hub,
                list(self.sources),
                heartbeat_interval=cfg.heartbeat_interval_ms / 1000,
            )
            for bus in (cfg.event_bus.per_router() if cfg.event_bus is not None else [])
        ]
        self._push_tasks: list[asyncio.Task[None]] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._checkpoint_tasks: list[asyncio.Task[None]] = []
        self.http_port: int | None = None
        self.grpc_port: int | None = None

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {name: rt.stats() for name, rt in self.sources.items()}
        if self.advisor is not None:
            for name, counters in self.advisor.stats().items():
                out[name].update(counters)
        return out

    async def start(self) -> None:
        host, port = parse_hostport(self.cfg.listen)
        self.http_port = await self.sse.start(host, port)
        if self.cfg.grpc_listen:
            servicer = ListenerServicer(self.hub, self.cfg.sources, self.stats)
            extra = []
            if self.cfg.eviction_advisor:
                predictor = None
                if self.cfg.session_predictor is not None:
                    from listener.saecache.predictor import load_predictor

                    # torch's import and the model load take a second or two: off the loop.
                    try:
                        predictor = await asyncio.to_thread(
                            load_predictor, self.cfg.session_predictor
                        )
                    except (ImportError, ValueError, RuntimeError) as exc:
                        # OSError (what the CLI reports as "cannot start") with the reason:
                        # torch missing, or not a model file.
                        raise OSError(
                            f"session_predictor {self.cfg.session_predictor!r}: {exc}"
                        ) from exc
                    log.info(
                        "session predictor %s: %d parameters",
                        self.cfg.session_predictor,
                        predictor.parameters,
                    )
                self.advisor = EvictionAdvisor(
                    self.sources,
                    max_blocks=self.cfg.eviction_advisor_max_blocks,
                    max_clock_skew=self.cfg.eviction_advisor_max_clock_skew_s,
                    predictor=predictor,
                    guard=GuardConfig() if self.cfg.eviction_advisor_safeguard else None,
                )
                extra.append(functools.partial(advisor_to_server, self.advisor))
            self.grpc = GrpcServer(servicer, self.cfg.grpc_tls, extra)
            self.grpc_port = await self.grpc.start(self.cfg.grpc_listen)
        loop = asyncio.get_running_loop()
        for rt in self.sources.values():
            for t in rt.transports:
                self._tasks.append(loop.create_task(t.run(), name=f"source-{rt.name}"))
            if rt.checkpointer is not None:
                self._checkpoint_tasks.append(
                    loop.create_task(
                        rt.checkpointer.run(self.cfg.checkpoint_interval_ms / 1000),
                        name=f"checkpoint-{rt.name}",
                    )
                )
        self._push_tasks = [
            loop.create_task(client.run(), name=f"event-bus:{client.cfg.url}")
            for client in self.push
        ]

    async def stop(self) -> None:
        if self.push:
            # Push mode first: Draining, close streams within drain_deadline (each router
            # moves the sources to another listener), while the sources still run; every
            # router's session drains at once, so the deadline holds for all of them.
            await asyncio.gather(
                *(c.drain(t) for c, t in zip(self.push, self._push_tasks, strict=False))
            )
        await cancel_and_wait(*self._tasks)
        await cancel_and_wait(*self._checkpoint_tasks)
        for rt in self.sources.values():  # the sources stopped: the last state is final
            if rt.checkpointer is not None:
                await rt.checkpointer.save(force=True)
        if self.grpc is not None:
            await self.grpc.stop()
        await self.sse.stop()
        self.hub.close()
        for rt in self.sources.values():
            await rt.aclose()

    def announce(self) -> str:
        host = parse_hostport(self.cfg.listen)[0]
        line = f"READY http={host}:{self.http_port}"
        if self.grpc_port is not None and self.cfg.grpc_listen:
            line += f" grpc={parse_hostport(self.cfg.grpc_listen)[0]}:{self.grpc_port}"
        return line


async def run(cfg: ListenerConfig) -> int:
    """Serve until SIGTERM or SIGINT; returns the exit status."""
    app = ListenerApp(cfg)
    await app.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    log.info("listening on %s with %d source(s)", cfg.listen, len(app.sources))
    print(app.announce(), flush=True)
    failed = asyncio.gather(*app._tasks)
    done, _ = await asyncio.wait(
        (asyncio.ensure_future(stop.wait()), failed), return_when=asyncio.FIRST_COMPLETED
    )
    status = 0
    if failed in done and failed.exception() is not None:
        log.error("a source stopped: %s", failed.exception())
        status = 1
    await app.stop()
    await cancel_and_wait(failed)
    return status
