"""ZMQ SUB source for vLLM / SGLang KV events (one per backend and data-parallel rank).

Wire format (``listener/ENGINE_FORMATS.md`` §1, §6): every live message is three frames,
``[topic, seq, payload]``, where ``seq`` is an 8-byte big-endian counter that starts at 0 when
the engine's publisher starts and rises by 1 per batch. Anything else is counted as a
malformed frame and dropped (its sequence number is unknown, so the next batch shows the
gap). An undecodable payload is counted as a decode error and resyncs (``decode_error``):
its sequence number is taken, since a replay would bring back the same bytes. A batch
with a block event that does not decode (``EventBatch.malformed``) resyncs before it is
delivered (``malformed_event``). A batch callback that raises is counted and resyncs too
(``callback_error``). None of these ever
ends the receive loop.

Ordering (the algorithm)
------------------------
``last_seq`` is the sequence number of the last batch handed to ``on_batch``. It survives
reconnects, so a reconnect is just another chance to see a gap. For each live batch ``s``:

* no ``last_seq`` yet: ``s`` is the baseline and is delivered; with a ``replay_endpoint``
  and ``s > 0`` (the engine ran before us) its buffered batches ``0..s-1`` are fetched
  first, so a listener started or restarted beside a running engine learns the blocks the
  engine already holds;
* ``s == last_seq + 1``: delivered;
* ``s > last_seq + 1`` (a gap: slow-joiner loss, HWM overflow, a reconnect): with a
  ``replay_endpoint`` a DEALER asks the engine's ROUTER for every buffered batch from
  ``last_seq`` itself, which must come back with the payload delivered (or the buffer must
  start right after it): another payload under that number, or none at all, is another
  engine instance (restarted behind a partition, already past ``last_seq``) and handled as
  a restart below. The newer replayed batches are delivered in order (the live ``s`` among
  them) and the live copies still queued on the SUB socket are dropped as duplicates. A
  replay that answers in full without reaching ``s - 1`` shows the engine never published
  ``s``: the message is dropped (``forged_frames``) and the position stays. If replay
  fails, times out or starts past ``last_seq + 1`` (the engine's buffer no longer holds the
  missing batches), ``on_resync("gap")`` is called and the buffer is learned again from
  wherever it starts; with no replay endpoint, ``on_resync("gap")`` and delivery resumes
  at ``s``;
* ``s <= last_seq`` outside that duplicate window: a PUB never repeats a sequence number,
  so the engine restarted, unless (with a replay endpoint) the engine still holds batch
  ``last_seq`` as delivered: then ``s`` is not its own and is dropped (``forged_frames``).
  On a restart ``on_resync("restart")`` is called and ``s`` becomes the new baseline; with
  a replay endpoint the restarted engine's batches ``0..s-1`` (lost to the slow-joiner
  rule) are fetched first.

Every resync that forgets the position re-arms learning: the next live batch fetches the
engine's buffer first, or the idle replay (``idle_replay_after_s``) does for an engine
that publishes nothing, and the consumer catches up on it at once (``on_drained``). So a
message under a forged number never leaves the position there.

A resync for a batch that arrived unusable (``decode_error``, ``malformed_event``,
``callback_error``, or :meth:`ZmqSource.relearn` after the batch callback's own fault)
forgets the backend's whole state, blocks of good earlier batches too. With a replay
endpoint the source then learns it again: ``last_seq`` is forgotten, so the next live
batch fetches the engine's whole buffer first, as after a listener start. The engine's
copy of the batch is replayed too: an unusable message that a hostile or broken peer
slipped in under a real sequence number is replaced by the real one. Faults during a
replay resync without learning again, so an engine whose own buffer holds a bad batch
costs one replay, not one per batch.

Resuming from a checkpoint (``resume``: the last batch ``S`` a previous process applied,
and a digest of its payload) replaces the baseline rule for the first live batch ``s``:

* ``s <= S``: the engine restarted meanwhile (its seq starts at 0 again):
  ``on_resync("restart")`` drops the checkpoint's view, then as above;
* with a ``replay_endpoint``, replay is asked from ``S`` itself: if the engine still
  buffers ``S`` and its payload's digest differs, it is another engine instance (a
  restart that already ran past ``S``): ``on_resync("restart")`` as above; if it matches,
  the resume is verified and ``S+1..`` are delivered. If the buffer starts after ``S+1``
  (it is bounded), what it holds is delivered and the batches before it are lost:
  ``on_gap(n)`` with their number, and the view is kept (it may be incomplete, never
  invented); the same when replay fails or there is no replay endpoint and ``s > S+1``.
  A checkpoint's view is all there is of the engine's cache (cache hits store nothing),
  so a gap after a resume keeps it rather than resyncing to empty.

A restarted engine that publishes nothing shows no sequence at all, so in connect mode
with a replay endpoint a disconnect is followed by a check (``_probe``): the replay ROUTER
is asked, until it answers, for batches from ``last_seq`` itself. The engine that published it still
buffers its newest batch and sends it back; an engine that answers without it (only the
end marker) never published that sequence number: it restarted, and is treated as above
(``on_resync("restart")``, then a fresh baseline). The probe acts only if no batch was
delivered meanwhile; a probe that fails or times out leaves things as they are. With no
replay endpoint nothing can tell such an engine from one still holding its blocks, so in
connect mode the end of the engine's connection forgets the view
(``on_resync("disconnect")``), as a gap would, rather than keep it possibly stale.

Access control: ``allowed_publishers`` (IPs, CIDRs, hostnames). In bind mode a ZAP handler
on ``inproc://zeromq.zap.01`` of the source's private context accepts only listed peer
addresses (the SUB socket sets a ZAP domain and enforces it, so the check fails closed);
in connect mode the endpoint's host, resolved, must be listed, or :meth:`ZmqSource.run`
raises :class:`PublisherNotAllowedError` before any socket exists. The replay endpoint is
always connected to, so its host is checked the same way. ``ipc://`` and ``inproc://``
endpoints are local and are not checked.

Structure: :meth:`ZmqSource.run` runs a :class:`bus.supervisor.Supervisor` (reconnects with
an injected :class:`bus.backoff.Backoff`); :meth:`ZmqSource._run_once` owns one socket's
lifetime, and the first good frame after failures reports it healthy.

Size: one module (about 1200 lines): live delivery, replay and restart handling are one
ordering algorithm over ``last_seq`` (above); the frame parsing and the ZAP handler it
needs stay beside it.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass
from typing import Literal, TypeAlias

import zmq
import zmq.asyncio

from bus.backoff import Backoff, ExponentialBackoff
from bus.supervisor import Attempt, Supervisor, Verdict
from listener.checkpoint import payload_digest
from listener.decode import DEFAULT_MAX_FRAME_BYTES
from listener.endpoints import (
    SCHEMES as _SCHEMES,
)
from listener.endpoints import (
    PublisherAllowlist,
    PublisherNotAllowedError,
    expand_dp_endpoints,
    is_ipv6_endpoint,
    offset_endpoint,
    tcp_host_port,
)
from listener.engine_events import EventBatch

__all__ = [
    "END_SEQ",
    "BatchCallback",
    "Decoder",
    "PublisherAllowlist",
    "PublisherNotAllowedError",
    "ResyncCallback",
    "ZmqSource",
    "ZmqSourceConfig",
    "ZmqSourceStats",
    "expand_dp_endpoints",
    "offset_endpoint",
]

logger = logging.getLogger(__name__)

ZmqEngine: TypeAlias = Literal["vllm", "sglang"]
Decoder: TypeAlias = Callable[[bytes, ZmqEngine], EventBatch]
"""``decode_batch(payload, engine) -> EventBatch``; raises (``ValueError``) on bad input."""
BatchCallback: TypeAlias = Callable[[EventBatch, "int | None"], "Awaitable[None] | None"]
"""``on_batch(batch, dp_rank)``; may be a plain function or a coroutine function."""
ResyncCallback: TypeAlias = Callable[[str], "Awaitable[None] | None"]
"""``on_resync(reason)``: forget this source's blocks; ``reason`` is ``gap``, ``restart``,
``decode_error``, ``malformed_event``, ``callback_error`` or ``disconnect`` (trtllm adds
``window``)."""

SEQ_LEN = 8
END_SEQ = b"\xff" * SEQ_LEN
"""The replay end marker (-1 as 8 bytes); never a live sequence number."""
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_ZAP_DOMAIN = b"continuum"
_DRAIN_BATCH = 64
_MAX_LOGGED_DENIED = 64
_RELEARN = frozenset(("decode_error", "malformed_event", "callback_error"))
"""Resyncs after which the engine's buffer is fetched again (see the module docstring)."""


# --------------------------------------------------------------------------------------------
# Config and counters


@dataclass(frozen=True, slots=True)
class ZmqSourceConfig:
    endpoint: str
    """Where the engine publishes: ``tcp://host:port`` (``tcp://127.0.0.1:*`` binds an
    ephemeral port, see :attr:`ZmqSource.bound_endpoint`), ``ipc://...`` or ``inproc://...``."""
    mode: Literal["bind", "connect"] = "connect"
    """``connect`` when the engine binds (its endpoint has ``*``); ``bind`` when the engine is
    given this listener's address and connects."""
    engine: ZmqEngine = "vllm"
    """Passed to the decoder."""
    topic: str = ""
    """SUB prefix filter; the engine's ``topic`` (default empty: everything)."""
    replay_endpoint: str | None = None
    """The engine's replay ROUTER (always connected to). ``None``: gaps are not replayed."""
    allowed_publishers: tuple[str, ...] = ()
    """IPs, CIDRs or hostnames allowed to publish (tcp only). Empty: anyone may."""
    dp_rank: int | None = None
    """The data-parallel rank this source listens to; passed to ``on_batch``."""
    backend: str = ""
    """Backend name, for logs."""
    replay_timeout_s: float = 5.0
    """Longest wait for each replay reply message, in seconds."""
    idle_replay_after_s: float = 2.0
    """With a replay endpoint and nothing known of the engine yet (a listener started
    beside a running engine): ask the replay for the engine's whole buffer after this long
    without a live batch, instead of waiting for one. An engine that routers send nothing
    (they learn what it holds only from this listener) may otherwise never publish again."""
    rcvhwm: int = 100_000
    """SUB receive high-water mark (messages); the engines' PUB uses 100 000."""
    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES
    """Largest frame taken from a peer (``ZMQ_MAXMSGSIZE`` on the SUB and the replay
    DEALER; the decoder's bound). libzmq drops the connection of a peer that sends a larger
    one before buffering it; the batch is then lost like any other (a gap)."""

    def __post_init__(self) -> None:
        if self.mode not in ("bind", "connect"):
            raise ValueError(f"mode must be 'bind' or 'connect', got {self.mode!r}")
        if self.engine not in ("vllm", "sglang"):
            raise ValueError(f"engine must be 'vllm' or 'sglang', got {self.engine!r}")
        for name, ep in (("endpoint", self.endpoint), ("replay_endpoint", self.replay_endpoint)):
            if ep is not None and not ep.startswith(_SCHEMES):
                raise ValueError(f"{name} must start with tcp://, ipc:// or inproc://: {ep!r}")
            if ep is not None and ep.startswith("tcp://"):
                tcp_host_port(ep)
        if self.mode == "connect" and self.endpoint.startswith("tcp://"):
            host, port = tcp_host_port(self.endpoint)
            if host == "*" or not port.isdigit():
                raise ValueError(
                    f"mode 'connect' requires a concrete host:port endpoint, got {self.endpoint!r}"
                )
        if self.replay_timeout_s <= 0:
            raise ValueError("replay_timeout_s must be > 0")
        if self.idle_replay_after_s <= 0:
            raise ValueError("idle_replay_after_s must be > 0")
        if self.dp_rank is not None and self.dp_rank < 0:
            raise ValueError("dp_rank must be >= 0")
        if self.max_frame_bytes < 1:
            raise ValueError("max_frame_bytes must be >= 1")
        object.__setattr__(self, "allowed_publishers", tuple(self.allowed_publishers))
        PublisherAllowlist(self.allowed_publishers)  # validates the entries


@dataclass(slots=True)
class ZmqSourceStats:
    frames: int = 0
    """Multipart messages received on the live socket."""
    batches: int = 0
    """Batches decoded and handed to ``on_batch`` (live and replayed)."""
    events: int = 0
    """Events in those batches."""
    skipped_events: int = 0
    """Events the decoder did not understand (unknown kinds included)."""
    malformed_events: int = 0
    """Of those, block events of a known kind: lost, so their batch resyncs first."""
    decode_errors: int = 0
    malformed_frames: int = 0
    """Live messages that are not ``[topic, 8-byte seq, payload]``."""
    gaps: int = 0
    """Forward jumps in ``seq``."""
    replays: int = 0
    """Gaps closed by replay."""
    replay_failures: int = 0
    replayed_batches: int = 0
    duplicates: int = 0
    """Live batches dropped because replay had already delivered them."""
    forged_frames: int = 0
    """Live messages under a sequence number the engine's replay shows it never published
    (from the future, or below a batch it still holds unchanged): dropped, the position
    kept. Only counted with a replay endpoint (without one they cannot be told apart)."""
    restarts: int = 0
    resyncs: int = 0
    relearns: int = 0
    """Resyncs after which the engine's whole buffer was fetched again (replay endpoint)."""
    idle_replays: int = 0
    """Replays of an engine's buffer asked because no live batch came after the start
    (``idle_replay_after_s``)."""
    resumes: int = 0
    """Starts from a checkpoint's sequence number (``resume``)."""
    resumes_verified: int = 0
    """Of those, ones whose last batch the engine's replay still had, identical."""
    gap_batches: int = 0
    """Batches lost between a checkpoint and the first live batch that no replay gave
    back (``on_gap``): what the resumed view may lack."""
    publishers_denied: int = 0
    """Connections refused by the ZAP handler (bind mode)."""
    callback_errors: int = 0
    connects: int = 0
    """Socket lifetimes started (the first, then one per reconnect)."""
    disconnects: int = 0
    """Peer connections that ended: the engine went away, or sent a frame over
    ``max_frame_bytes`` (libzmq drops the connection); connect mode connects again."""
    last_seq: int | None = None


# --------------------------------------------------------------------------------------------
# Frame parsing


def _parse_live(frames: list[bytes]) -> tuple[int, bytes] | None:
    if len(frames) != 3 or len(frames[1]) != SEQ_LEN or frames[1] == END_SEQ:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]


_END = object()


def _parse_replay(frames: list[bytes]) -> tuple[int, bytes] | object | None:
    """A replay reply as ``(seq, payload)``, ``_END``, or ``None`` when malformed.

    Layouts (§6): ``[b"", seq, payload]`` / ``[b"", END, b""]`` (vLLM < 0.26, SGLang < 0.5.22)
    and ``[b"", topic, seq, payload]`` / ``[b"", b"", END, b""]`` (newer).
    """
    if len(frames) == 3 and frames[0] == b"":
        seq, payload = frames[1], frames[2]
    elif len(frames) == 4 and frames[0] == b"":
        seq, payload = frames[2], frames[3]
    else:
        return None
    if len(seq) != SEQ_LEN:
        return None
    if seq == END_SEQ:
        return _END if payload == b"" else None
    return int.from_bytes(seq, "big"), payload


class _ReplayError(Exception):
    pass


class _OtherEngine(Exception):
    """The replayed batch at the resume point differs from the checkpoint's: the engine
    restarted (and ran past the checkpoint's sequence number)."""


def _classify(error: Exception | None) -> Verdict:
    """An endpoint outside ``allowed_publishers`` is a configuration error: not retried."""
    return Verdict.FATAL if isinstance(error, PublisherNotAllowedError) else Verdict.RETRY


# --------------------------------------------------------------------------------------------
# ZAP


class _ZapHandler:
    """Answers ZAP requests (RFC 27) by peer address; fails closed on anything odd."""

    def __init__(self, allowlist: PublisherAllowlist, stats: ZmqSourceStats, name: str) -> None:
        self._allowlist = allowlist
        self._stats = stats
        self._name = name
        self._logged: set[str] = set()

    def reply(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            request_id = msg[1] if len(msg) > 1 else b""
            return [b"1.0", request_id, b"500", b"Malformed ZAP request", b"", b""]
        version, request_id, _domain, address_b, _identity, _mechanism = msg[:6]
        address = address_b.decode("ascii", "replace")
        if version == b"1.0" and self._allowlist.allows_address(address):
            return [b"1.0", request_id, b"200", b"OK", b"", b""]
        self._stats.publishers_denied += 1
        if address not in self._logged and len(self._logged) < _MAX_LOGGED_DENIED:
            self._logged.add(address)
            logger.warning(
                "zmq source %s: refused publisher %s (not in allowed_publishers)",
                self._name,
                address,
            )
        return [b"1.0", request_id, b"400", b"Address not allowed", b"", b""]

    async def serve(self, sock: zmq.asyncio.Socket) -> None:
        """Answer requests until cancelled. Owns ``sock`` and closes it."""
        try:
            while True:
                msg = await sock.recv_multipart()
                await sock.send_multipart(self.reply(msg))
        except zmq.ZMQError as exc:
            # Without a handler the SUB socket enforces its ZAP domain: every peer is refused.
            logger.error("zmq source %s: ZAP handler stopped: %s", self._name, exc)
        finally:
            sock.close(0)


# --------------------------------------------------------------------------------------------
# The source


class ZmqSource:
    """Receives one engine publisher's batches, in order, and hands them on.

    Args:
        config: where and how to listen.
        decode: ``decode_batch(payload, engine) -> EventBatch`` (``listener.decode``); any
            exception it raises counts as a decode error.
        on_batch: called with each batch in sequence order, and this source's dp rank (the
            batch's own ``dp_rank`` when the config has none). Sync or async.
        on_resync: called with ``"gap"`` or ``"restart"`` before the first batch after a loss
            that could not be replayed, or after an engine restart; ``"decode_error"`` after
            an undecodable batch; ``"callback_error"`` after ``on_batch`` or ``on_drained``
            raised. Sync or async.
        on_drained: called after each run of batches that were already queued (at most
            ``_DRAIN_BATCH + 1``), before the loop yields: where a consumer that defers
            work per batch catches up. Sync or async.
        backoff: reconnect delay strategy (default ``ExponentialBackoff()``).

    Callback exceptions are logged (the first), counted and followed by a resync, never
    propagated.
    """

    def __init__(
        self,
        config: ZmqSourceConfig,
        *,
        decode: Decoder,
        on_batch: BatchCallback,
        on_resync: ResyncCallback,
        on_drained: Callable[[], object] | None = None,
        backoff: Backoff | None = None,
    ) -> None:
        self.config = config
        self.stats = ZmqSourceStats()
        self._decode = decode
        self._on_batch = on_batch
        self._sync_batch = None if inspect.iscoroutinefunction(on_batch) else on_batch
        """``on_batch`` when it is a plain function: the in-order path calls it directly."""
        self._on_resync = on_resync
        self._on_drained = on_drained
        self._allowlist = PublisherAllowlist(config.allowed_publishers)
        self._name = config.backend or config.endpoint
        if config.dp_rank is not None:
            self._name += f"[dp{config.dp_rank}]"
        self._uses_zap = (
            bool(self._allowlist) and config.mode == "bind" and config.endpoint.startswith("tcp://")
        )
        self._ctx: zmq.asyncio.Context | None = None
        self._last_seq: int | None = None
        self._last_payload: bytes | None = None
        self._resume: tuple[int, bytes | None] | None = None
        """(seq, digest) of a checkpoint, until the first live batch (``resume``)."""
        self._on_gap: Callable[[int], object] | None = None
        self._dup_floor: int | None = None
        """After a replay, live batches with ``dup_floor < seq <= last_seq`` are duplicates."""
        self._supervisor = Supervisor(
            self._run_once,
            _classify,
            backoff=backoff if backoff is not None else ExponentialBackoff(),
            on_retry=self._log_retry,
        )
        self._ready = asyncio.Event()
        self._bound_endpoint: str | None = None
        self._decode_error_logged = False
        self._malformed_logged = False
        self._forged_logged = False
        self._replaying = False
        self._idle_replay_asked = False
        self._callback_error_logged = False

    # -- public surface ----------------------------------------------------------------------

    @property
    def last_seq(self) -> int | None:
        return self._last_seq

    def relearn(self) -> None:
        """After a resync: with a replay endpoint, fetch the engine's whole buffer before
        the next live batch, or after ``idle_replay_after_s`` without one (no-op without a
        replay endpoint, or during a replay)."""
        if self.config.replay_endpoint is None or self._replaying:
            return
        self.stats.relearns += 1
        self._forget()

    def _forget(self) -> None:
        """Forget the position after a resync: the next live batch is a new baseline
        (with a replay endpoint, learned together with the engine's buffer), and the idle
        replay is armed again, so an engine that publishes nothing more is learned too."""
        self._last_seq = self.stats.last_seq = None
        self._last_payload = None
        self._dup_floor = None
        self._idle_replay_asked = False

    def resume(self, seq: int, digest: bytes | None, on_gap: Callable[[int], object]) -> None:
        """Continue after batch ``seq`` (with payload digest ``digest``,
        ``listener.checkpoint.payload_digest``) that a previous process applied; before
        ``run``. ``on_gap(n)``: ``n`` batches after it could not be fetched (module
        docstring)."""
        if seq < 0:
            raise ValueError("seq must be >= 0")
        self._resume = (seq, digest)
        self._on_gap = on_gap

    def position(self) -> tuple[int, bytes | None] | None:
        """The last batch applied and its payload digest (what a checkpoint keeps), or the
        resume point while no live batch came yet."""
        if self._last_seq is None:
            return self._resume
        payload = self._last_payload
        return self._last_seq, None if payload is None else payload_digest(payload)

    @property
    def bound_endpoint(self) -> str | None:
        """The live socket's actual endpoint (resolves ``*`` ports), once :meth:`wait_ready`."""
        return self._bound_endpoint

    async def wait_ready(self) -> str:
        """Wait until the live socket is bound or connected; returns :attr:`bound_endpoint`."""
        await self._ready.wait()
        assert self._bound_endpoint is not None
        return self._bound_endpoint

    async def run(self) -> None:
        """Receive until cancelled. May be called once at a time per source.

        Each connection lifetime (:meth:`_run_once`) that ends in an error (a bind that fails,
        a name that does not resolve, a socket error) is logged and retried after
        ``backoff.compute(failures)``; the first good frame resets the failure count. The
        source owns a private ZMQ context (ZAP handlers are per context), destroyed on exit.

        Raises:
            PublisherNotAllowedError: an endpoint's host is not in ``allowed_publishers``
                (a configuration error; not retried).
            asyncio.CancelledError: always propagated.
        """
        self._ctx = ctx = zmq.asyncio.Context()
        zap_task: asyncio.Task[None] | None = None
        try:
            if self._uses_zap:
                # The ZAP handler belongs to the context (one per source), not to a socket
                # lifetime: it is bound before any SUB socket exists and outlives reconnects.
                zap_sock = ctx.socket(zmq.REP)
                zap_sock.setsockopt(zmq.LINGER, 0)
                zap_sock.bind(ZAP_ENDPOINT)
                zap = _ZapHandler(self._allowlist, self.stats, self._name)
                zap_task = asyncio.create_task(zap.serve(zap_sock), name=f"zap:{self._name}")
            await self._supervisor.run()
        finally:
            self._ready.clear()
            if zap_task is not None:
                zap_task.cancel()
                await asyncio.wait([zap_task])
            self._ctx = None
            ctx.destroy(linger=0)

    def _log_retry(self, attempt: Attempt) -> None:
        logger.warning(
            "zmq source %s: %s: %s; reconnecting in %.2fs (failure %d)",
            self._name,
            type(attempt.error).__name__,
            attempt.error,
            attempt.delay,
            attempt.failures,
        )

    # -- one connection's lifetime -----------------------------------------------------------

    async def _run_once(self) -> None:
        """Check the allowlist, then own one SUB socket until an error (or cancellation)."""
        assert self._ctx is not None
        cfg = self.config
        self._ready.clear()
        if self._allowlist:
            await self._allowlist.refresh()
            if cfg.mode == "connect" and cfg.endpoint.startswith("tcp://"):
                await self._allowlist.check_host(tcp_host_port(cfg.endpoint)[0])
            if cfg.replay_endpoint and cfg.replay_endpoint.startswith("tcp://"):
                await self._allowlist.check_host(tcp_host_port(cfg.replay_endpoint)[0])
        with self._ctx.socket(zmq.SUB) as sock:
            sock.setsockopt(zmq.RCVHWM, cfg.rcvhwm)
            sock.setsockopt(zmq.MAXMSGSIZE, cfg.max_frame_bytes)
            sock.setsockopt(zmq.LINGER, 0)
            if is_ipv6_endpoint(cfg.endpoint):
                sock.setsockopt(zmq.IPV6, 1)
            if self._uses_zap:
                sock.setsockopt(zmq.ZAP_DOMAIN, _ZAP_DOMAIN)
                sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
            sock.setsockopt(zmq.SUBSCRIBE, cfg.topic.encode())
            if cfg.mode == "bind":
                sock.bind(cfg.endpoint)
            else:
                sock.connect(cfg.endpoint)
            self._bound_endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT) or cfg.endpoint
            monitor = asyncio.create_task(self._watch(sock), name=f"zmq-monitor:{self._name}")
            try:
                await self._receive(sock)
            finally:
                monitor.cancel()
                await asyncio.wait([monitor])

    async def _watch(self, sock: zmq.asyncio.Socket) -> None:
        """Count ended peer connections; in connect mode, connect again.

        libzmq reconnects by itself after a connection error, but not after a protocol
        error, and a frame over ``ZMQ_MAXMSGSIZE`` is one: without a new ``connect`` the
        SUB would stay silent for good. Connecting again after any disconnect is harmless.
        """
        mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        probing = self.config.mode == "connect" and self.config.replay_endpoint is not None
        probes: set[asyncio.Task[None]] = set()
        try:
            while True:
                await mon.recv_multipart()
                self.stats.disconnects += 1
                if probing and self._last_seq is not None and not probes:
                    task = asyncio.create_task(self._probe(self._last_seq))
                    probes.add(task)
                    task.add_done_callback(probes.discard)
                elif (
                    self.config.mode == "connect"
                    and self.config.replay_endpoint is None
                    and self._last_seq is not None
                ):
                    # Connect mode only: there the one peer is the engine's endpoint. A
                    # bound SUB also sees peers it refused (ZAP), which must not reset it.
                    await self._disconnected()
                if self.config.mode == "connect":
                    with contextlib.suppress(zmq.ZMQError):
                        sock.disconnect(self.config.endpoint)
                    sock.connect(self.config.endpoint)
        finally:
            for task in probes:
                task.cancel()
            if probes:  # none outlives the socket (nor the context it was made in)
                await asyncio.wait(probes)
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            mon.close(0)

    async def _receive(self, sock: zmq.asyncio.Socket) -> None:
        """Deliver what ``sock`` receives until an error (or cancellation)."""
        cfg = self.config
        self.stats.connects += 1
        self._ready.set()
        logger.info(
            "zmq source %s: %s %s (replay %s)",
            self._name,
            "bound" if cfg.mode == "bind" else "connected to",
            self._bound_endpoint,
            cfg.replay_endpoint or "off",
        )
        # pyzmq's awaitable recv completes at once while messages are queued, so a
        # busy engine would starve every other task on the loop (SSE writers, /stats,
        # detokenize jobs). Drain a bounded batch without awaiting, then yield.
        raw: zmq.Socket[bytes] = zmq.Socket.shadow(sock.underlying)
        again = zmq.Again
        noblock = zmq.NOBLOCK
        take = self._take
        on_drained = self._on_drained
        self._idle_replay_asked = False
        idle_ms = int(cfg.idle_replay_after_s * 1000) or 1
        while True:
            if self._idle_replay_due():
                try:
                    frames = await asyncio.wait_for(sock.recv_multipart(), cfg.idle_replay_after_s)
                except TimeoutError:
                    await self._replay_idle_engine()
                    # The replayed batches are a run like any other: the consumer catches
                    # up now, not at the next live batch (an idle engine may send none).
                    if on_drained is not None:
                        await self._call(on_drained)
                    continue
            else:
                # A resync outside this loop (the restart probe) may arm the idle replay:
                # with a replay endpoint, look again after each quiet spell.
                if cfg.replay_endpoint is not None and not await sock.poll(idle_ms):
                    continue
                frames = await sock.recv_multipart()
            pending = take(frames)
            if pending is not None:
                await pending
            for _ in range(_DRAIN_BATCH):
                try:
                    frames = raw.recv_multipart(noblock)
                except again:
                    break
                pending = take(frames)
                if pending is not None:
                    await pending
            if on_drained is not None:
                await self._call(on_drained)
            await asyncio.sleep(0)

    def _idle_replay_due(self) -> bool:
        return (
            not self._idle_replay_asked
            and self._last_seq is None
            and self._resume is None
            and self.config.replay_endpoint is not None
        )

    async def _replay_idle_engine(self) -> None:
        """No live batch since the start (or since a resync forgot the position) and
        nothing known: learn the engine's buffer now (in the receive loop, so no live batch
        is handled meanwhile; live copies of what it returns are dropped as duplicates),
        from wherever it starts. Asked once per connection and resync: a failure leaves
        the next live batch's replay to try again."""
        self._idle_replay_asked = True
        try:
            await self._replay(0, partial=True)
        except (_ReplayError, TimeoutError, zmq.ZMQError) as exc:
            logger.info(
                "zmq source %s: no replay of an idle engine: %s",
                self._name,
                str(exc) or type(exc).__name__,
            )
            return
        if self._last_seq is not None:
            self.stats.replays += 1
            self.stats.idle_replays += 1
            self._dup_floor = -1

    # -- ordering ----------------------------------------------------------------------------

    def _take(self, frames: list[bytes]) -> Awaitable[None] | None:
        """Handle one live message; returns what is left to await, if anything.

        The in-order case (the next seq, a plain callback, no failure to reset) runs here
        without a coroutine per batch; everything else is ``_on_live``'s.
        """
        last = self._last_seq
        if (
            last is None
            or self._sync_batch is None
            or self._supervisor.failures
            or len(frames) != 3
            or len(seq8 := frames[1]) != SEQ_LEN
            or int.from_bytes(seq8, "big") != last + 1
        ):
            return self._on_live(frames)
        self.stats.frames += 1
        self._dup_floor = None
        decoded = self._decoded(last + 1, frames[2])
        if decoded is None:
            return self._resync("decode_error")
        if decoded[0].malformed:
            return self._hand_over(decoded)
        try:
            result = self._sync_batch(*decoded)
        except Exception:
            self._callback_failed()
            return self._resync("callback_error")
        if result is not None and inspect.isawaitable(result):
            return self._call(lambda: result)
        return None

    async def _on_live(self, frames: list[bytes]) -> None:
        self.stats.frames += 1
        parsed = _parse_live(frames)
        if parsed is None:
            self.stats.malformed_frames += 1
            if not self._malformed_logged:
                self._malformed_logged = True
                logger.warning(
                    "zmq source %s: dropped a malformed message (%d frames, seq frame %d bytes);"
                    " further ones are only counted",
                    self._name,
                    len(frames),
                    len(frames[1]) if len(frames) > 1 else -1,
                )
            return
        if self._supervisor.failures:
            self._supervisor.healthy()
        seq, payload = parsed
        last = self._last_seq
        if last is None and self._resume is not None:
            resume, self._resume = self._resume, None
            await self._resume_at(resume, seq, payload)
        elif last is None and seq > 0 and self.config.replay_endpoint:
            # A listener (re)starting beside a running engine: fetch what the engine still
            # buffers from its start, so the blocks it already holds are known too.
            self._dup_floor = None
            await self._recover(0, seq, payload, after_restart=True)
        elif last is None or seq == last + 1:
            self._dup_floor = None
            await self._deliver(seq, payload)
        elif seq > last + 1:
            self.stats.gaps += 1
            if self.config.replay_endpoint:
                await self._gap(last, seq, payload)
            else:
                await self._recover(last + 1, seq, payload, after_restart=False)
        elif self._dup_floor is not None and seq > self._dup_floor:
            self.stats.duplicates += 1
        elif self.config.replay_endpoint and await self._verify(last) == "same":
            # The engine still holds the batch last delivered, unchanged: it did not
            # restart, so a lower number is not its own.
            self._forged(seq)
        else:
            logger.warning(
                "zmq source %s: seq fell from %d to %d: engine restarted", self._name, last, seq
            )
            await self._restarted(seq, payload)

    async def _gap(self, last: int, seq: int, payload: bytes) -> None:
        """Live batch ``seq`` after ``last`` with batches missing, replay endpoint on.

        The replay is asked from ``last`` itself, so the engine proves it is the one that
        published it (``_verify``). Then: what it returns closes the gap; if the engine
        never published ``seq - 1`` the live message is not its own (a forged sequence
        number) and is dropped, the position unmoved; another engine instance restarted;
        a replay that fails or no longer reaches ``last`` resyncs and learns the engine's
        whole buffer again.
        """
        verdict = await self._verify(last)
        if verdict == "other":
            logger.warning(
                "zmq source %s: the engine no longer holds batch %d (gap to %d): engine restarted",
                self._name,
                last,
                seq,
            )
            await self._restarted(seq, payload)
            return
        covered = self._last_seq
        assert covered is not None
        if covered >= seq - 1:
            self.stats.replays += 1
            if covered == seq - 1:
                await self._deliver(seq, payload)
            return
        if verdict == "same":
            self._forged(seq)
            return
        self.stats.replay_failures += 1
        logger.warning(
            "zmq source %s: lost batches %d..%d; resync", self._name, covered + 1, seq - 1
        )
        await self._resync("gap")
        self._forget()
        await self._recover(0, seq, payload, after_restart=True)

    async def _verify(self, last: int) -> Literal["same", "other", "failed"]:
        """Replay from ``last``, the batch last delivered: ``same`` when the engine holds
        it with the payload delivered (or its buffer starts right after it), delivering
        the newer batches it returns; ``other`` when it holds another payload under that
        number or never published it (its newest batch is older: a restarted engine);
        ``failed`` when the replay fails, times out or no longer reaches ``last + 1``."""
        payload = self._last_payload
        try:
            await self._replay(
                last, verify=True, digest=None if payload is None else payload_digest(payload)
            )
        except _OtherEngine:
            return "other"
        except (_ReplayError, TimeoutError, zmq.ZMQError) as exc:
            self._replay_failed(last, exc)
            return "failed"
        if self._last_seq != last:  # newer batches were delivered: their live copies follow
            floor = self._dup_floor
            self._dup_floor = last if floor is None else min(floor, last)
        return "same"

    def _replay_failed(self, start: int, exc: Exception) -> None:
        logger.warning(
            "zmq source %s: replay from %d failed: %s",
            self._name,
            start,
            str(exc) or type(exc).__name__,
        )

    def _forged(self, seq: int) -> None:
        """A live message numbered ``seq`` that the engine's replay shows it never
        published: dropped, the position unmoved (a hostile or broken peer on the PUB)."""
        self.stats.forged_frames += 1
        if not self._forged_logged:
            self._forged_logged = True
            logger.warning(
                "zmq source %s: dropped a message numbered %d that the engine never published"
                " (position %s); further ones are only counted",
                self._name,
                seq,
                self._last_seq,
            )

    async def _restarted(self, seq: int, payload: bytes) -> None:
        self.stats.restarts += 1
        await self._resync("restart")
        self._forget()
        if self.config.replay_endpoint and seq > 0:
            await self._recover(0, seq, payload, after_restart=True)
        else:
            await self._deliver(seq, payload)

    async def _resume_at(self, resume: tuple[int, bytes | None], seq: int, payload: bytes) -> None:
        """The first live batch ``seq`` after a checkpoint at ``resume`` (module docstring)."""
        start, digest = resume
        self.stats.resumes += 1
        if seq <= start:
            logger.warning(
                "zmq source %s: seq %d at or below the checkpoint's %d: engine restarted;"
                " the checkpoint's view is dropped",
                self._name,
                seq,
                start,
            )
            await self._restarted(seq, payload)
            return
        self._last_seq = self.stats.last_seq = start
        self._dup_floor = None
        if self.config.replay_endpoint:  # even for seq == start + 1: verify the engine
            try:
                await self._replay_resume(start, digest)
            except _OtherEngine:
                logger.warning(
                    "zmq source %s: the engine's batch %d is not the checkpoint's: engine"
                    " restarted; the checkpoint's view is dropped",
                    self._name,
                    start,
                )
                self._last_seq = self.stats.last_seq = None
                await self._restarted(seq, payload)
                return
            except (_ReplayError, TimeoutError, zmq.ZMQError) as exc:
                self.stats.replay_failures += 1
                logger.warning(
                    "zmq source %s: replay after the checkpoint (seq %d) failed: %s",
                    self._name,
                    start,
                    str(exc) or type(exc).__name__,
                )
        covered = self._last_seq
        assert covered is not None
        if covered >= seq:
            self._dup_floor = start
            return
        self._lost(seq - 1 - covered)
        await self._deliver(seq, payload)

    def _lost(self, n: int) -> None:
        """``n`` batches after a resume point are gone for good: counted, reported."""
        if n <= 0:
            return
        self.stats.gap_batches += n
        logger.warning(
            "zmq source %s: %d batch(es) after the checkpoint are not in the engine's replay"
            " buffer; the view may be incomplete",
            self._name,
            n,
        )
        if self._on_gap is not None:
            try:
                self._on_gap(n)
            except Exception:
                self._callback_failed()

    async def _recover(self, start: int, seq: int, payload: bytes, *, after_restart: bool) -> None:
        """Fill ``start..seq-1`` by replay, then make sure live batch ``seq`` is delivered.

        After a restart the state has just been reset, so a failed replay only means fewer
        known blocks and no second resync is sent. A replay that answered in full without
        reaching ``seq - 1`` shows the engine never published ``seq``: the live message is
        not its own and is dropped (``_forged``).
        """
        answered = False
        if self.config.replay_endpoint:
            try:
                await self._replay(start, partial=after_restart)
                answered = True
            except (_ReplayError, TimeoutError, zmq.ZMQError) as exc:
                self._replay_failed(start, exc)
        covered = self._last_seq if self._last_seq is not None else start - 1
        if covered >= seq - 1:
            if self.config.replay_endpoint:
                self.stats.replays += 1
            self._dup_floor = start - 1
            if covered == seq - 1:
                await self._deliver(seq, payload)
            return
        if answered:
            self._forged(seq)
            return
        if self.config.replay_endpoint:
            self.stats.replay_failures += 1
        if not after_restart:
            logger.warning(
                "zmq source %s: lost batches %d..%d; resync",
                self._name,
                covered + 1,
                seq - 1,
            )
            await self._resync("gap")
        self._dup_floor = None
        await self._deliver(seq, payload)

    async def _replay_request(self, start: int) -> zmq.asyncio.Socket:
        """A DEALER on the replay endpoint that has asked for the batches from ``start``
        (the caller reads the answer and closes it)."""
        assert self._ctx is not None and self.config.replay_endpoint is not None
        dealer = self._ctx.socket(zmq.DEALER)
        try:
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.MAXMSGSIZE, self.config.max_frame_bytes)
            if is_ipv6_endpoint(self.config.replay_endpoint):
                dealer.setsockopt(zmq.IPV6, 1)
            dealer.connect(self.config.replay_endpoint)
            await dealer.send_multipart([b"", start.to_bytes(SEQ_LEN, "big")])
        except BaseException:
            dealer.close(0)
            raise
        return dealer

    async def _probe(self, last: int) -> None:
        """After a disconnect: does the engine, once it answers, still hold batch ``last``?
        (module docstring). Asks again every ``replay_timeout_s`` until it answers or a
        batch is delivered."""
        item: object = None
        while self._last_seq == last and item is None:
            try:
                dealer = await self._replay_request(last)
            except zmq.ZMQError:
                return
            try:
                async with asyncio.timeout(self.config.replay_timeout_s):
                    item = _parse_replay(await dealer.recv_multipart())
            except TimeoutError:
                continue
            except zmq.ZMQError:
                return
            finally:
                dealer.close(0)
        if item is not _END or self._last_seq != last:
            return  # it still holds the batch (or something was delivered meanwhile)
        self.stats.restarts += 1
        logger.warning(
            "zmq source %s: the engine no longer holds batch %d after a reconnect: engine "
            "restarted",
            self._name,
            last,
        )
        self._forget()
        await self._resync("restart")

    async def _disconnected(self) -> None:
        """No replay endpoint, connect mode, and the engine's connection ended: nothing
        can tell an engine that restarted empty (and publishes nothing yet, so shows no
        sequence reset) from one still holding its blocks. A gap forgets the view too; so does
        this, rather than keep it possibly stale. The next batch is a new baseline."""
        logger.warning(
            "zmq source %s: the engine's connection ended and there is no replay endpoint to"
            " check whether it restarted; its blocks are forgotten",
            self._name,
        )
        self._forget()
        await self._resync("disconnect")

    async def _replay(
        self,
        start: int,
        *,
        verify: bool = False,
        digest: bytes | None = None,
        partial: bool = False,
    ) -> None:
        """Ask the replay ROUTER for batches from ``start`` and deliver them as they arrive.

        ``verify``: ``start`` is the batch last delivered, with payload digest ``digest``
        (None: not known): the engine must still hold it, with that digest, or its buffer must
        start at ``start + 1``; it is not delivered again. ``partial``: the state was just
        reset, so a buffer that starts past ``start`` is delivered from where it starts
        (fewer known blocks, never wrong ones) instead of failing.

        Raises:
            _OtherEngine: with ``verify``, the engine does not hold ``start`` as delivered.
            _ReplayError: malformed reply, or the first batch is past ``start`` (lost).
            TimeoutError: no reply within ``replay_timeout_s``.
        """
        expected = start
        checking = verify
        async with contextlib.aclosing(self._replies(start)) as replies:
            async for seq, payload in replies:
                if checking:
                    checking = False
                    if seq == start and digest is not None and payload_digest(payload) != digest:
                        raise _OtherEngine
                    expected = start + 1
                    if seq == start:
                        continue
                if seq < expected or (self._last_seq is not None and seq <= self._last_seq):
                    continue
                if seq > expected and not (partial and expected == start):
                    raise _ReplayError(f"replay buffer starts at {seq}, needed {expected}")
                self.stats.replayed_batches += 1
                await self._deliver(seq, payload)
                expected = seq + 1
        if checking:  # only the end marker: its newest batch is older than ``start``
            raise _OtherEngine

    async def _replay_resume(self, start: int, digest: bytes | None) -> None:
        """Replay after a checkpoint at batch ``start``: the batch itself, if buffered,
        must match ``digest`` (else ``_OtherEngine``); the batches after it are delivered
        as far as the buffer holds them, a hole before the first is ``_lost``.

        Raises:
            _OtherEngine: the engine's batch ``start`` is not the checkpoint's.
            _ReplayError, TimeoutError, zmq.ZMQError: as ``_replay``.
        """
        async with contextlib.aclosing(self._replies(start)) as replies:
            async for seq, payload in replies:
                if seq == start and digest is not None:
                    if payload_digest(payload) != digest:
                        raise _OtherEngine
                    self.stats.resumes_verified += 1
                last = self._last_seq
                assert last is not None
                if seq <= last:
                    continue
                self._lost(seq - 1 - last)
                self.stats.replayed_batches += 1
                await self._deliver(seq, payload)

    async def _replies(self, start: int) -> AsyncGenerator[tuple[int, bytes], None]:
        """The replay ROUTER's batches from ``start`` on, until its end marker.

        Raises:
            _ReplayError: malformed reply.
            TimeoutError: no reply within ``replay_timeout_s``.
        """
        self._replaying = True
        dealer: zmq.asyncio.Socket | None = None
        try:
            dealer = await self._replay_request(start)
            while True:
                async with asyncio.timeout(self.config.replay_timeout_s):
                    frames = await dealer.recv_multipart()
                item = _parse_replay(frames)
                if item is _END:
                    return
                if item is None:
                    raise _ReplayError(f"malformed replay reply ({len(frames)} frames)")
                assert isinstance(item, tuple)
                yield item
        finally:
            self._replaying = False
            if dealer is not None:
                dealer.close(0)

    # -- hand-off ----------------------------------------------------------------------------

    def _decoded(self, seq: int, payload: bytes) -> tuple[EventBatch, int | None] | None:
        self._last_seq = stats_seq = seq
        self._last_payload = payload
        stats = self.stats
        stats.last_seq = stats_seq
        try:
            batch = self._decode(payload, self.config.engine)
        except Exception as exc:
            stats.decode_errors += 1
            if not self._decode_error_logged:
                self._decode_error_logged = True
                logger.warning(
                    "zmq source %s: undecodable batch seq=%d (%d bytes): %s;"
                    " further decode errors are only counted",
                    self._name,
                    seq,
                    len(payload),
                    type(exc).__name__,
                )
            return None
        stats.batches += 1
        stats.events += len(batch.events)
        if batch.skipped:
            stats.skipped_events += batch.skipped
            stats.malformed_events += batch.malformed
        rank = self.config.dp_rank
        return batch, batch.dp_rank if rank is None else rank

    async def _deliver(self, seq: int, payload: bytes) -> None:
        decoded = self._decoded(seq, payload)
        if decoded is None:
            await self._resync("decode_error")
        else:
            await self._hand_over(decoded)

    async def _hand_over(self, decoded: tuple[EventBatch, int | None]) -> None:
        """``on_batch``, after a resync when the batch lost a block event (``malformed``):
        what it lost cannot be fetched again, and the batch's other events survive."""
        if decoded[0].malformed:
            await self._resync("malformed_event")
        await self._call(self._on_batch, *decoded)

    async def _resync(self, reason: str) -> None:
        self.stats.resyncs += 1
        await self._call(self._on_resync, reason, resync=False)
        if reason in _RELEARN:
            self.relearn()

    async def _call(self, fn: Callable[..., object], *args: object, resync: bool = True) -> None:
        """Call back; a failure is counted and, unless it was the resync itself, resyncs
        (whatever the callback did not finish is lost to the consumer)."""
        try:
            result = fn(*args)
            if inspect.isawaitable(result):
                await result
        except Exception:
            self._callback_failed()
            if resync:
                await self._resync("callback_error")

    def _callback_failed(self) -> None:
        self.stats.callback_errors += 1
        if not self._callback_error_logged:
            self._callback_error_logged = True
            logger.exception(
                "zmq source %s: callback failed; further failures are only counted",
                self._name,
            )
