"""KV-event publishing of the simulated engine: ZMQ (vLLM / SGLang) and trtllm-serve's poll.

Layers: :mod:`harness.sim.kv_wire` encodes one engine release's msgpack bytes, this module
turns prefix-cache changes into events and moves them (``KvEventPublisher``), publishes batches
over ZMQ with replay (``ZmqPublisher``) and queues trtllm JSON events (``TrtllmQueue``).

Transport, exactly as the engines do it (listener/ENGINE_FORMATS.md §1, §6):

* PUB socket; it **binds** when the endpoint contains ``*`` or ``::`` or is ``ipc://`` /
  ``inproc://``, otherwise it **connects** (to a listener that bound its SUB). SNDHWM is
  ``hwm``; a slow or absent subscriber loses messages silently (and so does everything
  published before a subscription reached the PUB: ZMQ's slow joiner).
* Frames ``[topic, seq, payload]``: ``seq`` is 8 bytes big endian, 0 for the first batch
  after start-up, +1 per batch (one batch per cache change of one request, that is one
  scheduler step of the real engine; removals first, then stores).
* ``--dp-rank r`` adds ``r`` to the TCP port of both endpoints (``inproc://x`` becomes
  ``inproc://x_dp<r>``) and is the batch's ``dp_rank``.
* Replay: a ROUTER that always binds. A DEALER sends ``[b"", start_seq (8 bytes BE)]`` and
  gets every buffered batch with ``seq >= start`` and then an end marker, laid out per
  release: ``[b"", seq, payload]`` / ``[b"", ff*8, b""]`` before vLLM 0.26 and SGLang
  0.5.22, ``[b"", topic, seq, payload]`` / ``[b"", b"", ff*8, b""]`` from them on. The
  buffer keeps the last ``buffer_steps`` batches.

Events per cache change (``KvEventPublisher.changed``):

* vLLM: one ``BlockRemoved`` per evicted hash, then one ``BlockStored`` per run of newly
  stored blocks that chain onto each other (normally the whole uncached tail of the prompt).
* SGLang: one ``BlockRemoved`` per evicted radix node (a run of evicted blocks that chain,
  hashes root first), then one ``BlockStored`` per page (block), parents chained.
* The request's ``cache_salt`` is shown as the format allows (vLLM: first block only).
* A prefix-cache reset sends ``AllBlocksCleared`` (vLLM's ``reset_prefix_cache``, SGLang's
  ``flush_cache``); trtllm has no such event, so its queue gets one ``removed`` instead.

trtllm (listener/ENGINE_FORMATS.md §7): ``POST /kv_cache_events`` drains a JSON array of events with
a per-rank ``event_id`` (+1 each, ``created`` first with id 0), ``window_size``,
``attention_dp_rank`` (only with ``--dp-rank``) and ``data`` of type ``created``,
``stored`` (blocks listing their tokens, ``cache_salt`` on a request's first block) or
``removed``. Hashes are uint64 JSON numbers, often above 2**63.

Burst mode (``KvEventPublisher.burst``): synthetic ``BlockStored`` batches (valid chains, token
ids the sim's ``/detokenize`` can decode) published as fast as one core allows, for the
listener's ingestion benchmark. Burst blocks are not in the simulated cache.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import msgpack

from .block_hash import SglangHasher, VllmHasher
from .httpserver import dumps
from .kv_wire import EventEncoder, WireFormat
from .prefix_cache import BlockHasher, StoredBlock

__all__ = [
    "END_SEQ",
    "CapturePublisher",
    "KvEventPublisher",
    "TrtllmQueue",
    "ZmqPublisher",
    "offset_endpoint",
    "should_bind",
]

log = logging.getLogger("harness.sim.kv_events")

END_SEQ = b"\xff" * 8
_U64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # odd: c -> c * _GOLDEN mod 2**64 is a bijection
_YIELD_EVERY = 256  # burst batches between event-loop yields
_VARIANTS = 64  # distinct pre-packed token blocks a burst cycles through
_packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack


def should_bind(endpoint: str) -> bool:
    """The engines' rule: bind for wildcard hosts and ipc/inproc, else connect."""
    return (
        "*" in endpoint
        or "::" in endpoint
        or endpoint.startswith("ipc://")
        or endpoint.startswith("inproc://")
    )


def offset_endpoint(endpoint: str, rank: int | None) -> str:
    """vLLM's per-DP-rank endpoint: TCP port + rank, ``inproc://x`` -> ``inproc://x_dp<r>``."""
    if not rank:
        return endpoint
    if "inproc" in endpoint:
        return f"{endpoint}_dp{rank}"
    if "tcp" in endpoint:
        base, sep, port = endpoint.rpartition(":")
        if sep and port.isdigit():
            return f"{base}:{int(port) + rank}"
    return endpoint


class CapturePublisher:
    """Stands in for :class:`ZmqPublisher` where batches are wanted as bytes: the burst
    code encodes into ``payloads`` (benchmarks that replay them later or in-process)."""

    is_open = True

    def __init__(self) -> None:
        self.seq = 0
        self.payloads: list[bytes] = []

    def publish(self, payload: bytes) -> int:
        self.payloads.append(payload)
        self.seq += 1
        return self.seq - 1


class ZmqPublisher:
    """PUB socket with the engines' framing and an optional ROUTER replay server.

    :meth:`start` needs a running event loop when a replay endpoint or the subscriber
    monitor is used; :meth:`publish` is synchronous and never blocks.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        topic: str = "",
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        replay_topic: bool = True,
    ) -> None:
        if buffer_steps < 1:
            raise ValueError("buffer_steps must be >= 1")
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic.encode()
        self.hwm = hwm
        self.replay_topic = replay_topic
        self.seq = 0
        self.batches = 0
        self.replay_requests = 0
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self._ctx: Any = None
        self._pub: Any = None
        self._more = 2
        self._router: Any = None
        self._mon: Any = None
        self._actx: Any = None
        self._tasks: list[asyncio.Task[None]] = []

    def start(self, monitor: bool = False) -> None:
        """Open the sockets. ``monitor`` enables :meth:`wait_subscriber` (set up before the
        PUB binds or connects, so no handshake can be missed)."""
        import zmq
        import zmq.asyncio

        self._ctx = zmq.Context()
        self._actx = zmq.asyncio.Context.shadow(self._ctx.underlying)
        pub = self._ctx.socket(zmq.PUB)
        pub.setsockopt(zmq.SNDHWM, self.hwm)
        pub.setsockopt(zmq.LINGER, 200)
        self._pub = pub
        self._more = int(zmq.SNDMORE)
        if monitor:
            addr = f"inproc://sim-pub-monitor-{id(self)}"
            pub.monitor(addr, zmq.EVENT_HANDSHAKE_SUCCEEDED)
            self._mon = self._actx.socket(zmq.PAIR)
            self._mon.setsockopt(zmq.LINGER, 0)
            self._mon.connect(addr)
        if should_bind(self.endpoint):
            pub.bind(self.endpoint)
        else:
            pub.connect(self.endpoint)
        if self.replay_endpoint is not None:
            router = self._actx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            self._router = router
            router.bind(self.replay_endpoint)  # the replay socket always binds
            self._tasks.append(asyncio.get_running_loop().create_task(self._serve_replay()))

    @property
    def is_open(self) -> bool:
        return self._pub is not None

    def publish(self, payload: bytes) -> int:
        """Send one batch; returns its seq."""
        seq = self.seq
        seq8 = seq.to_bytes(8, "big")
        self.seq = seq + 1
        self.batches += 1
        send = self._pub.send
        more = self._more  # plain int flags: send_multipart's enum arithmetic costs more
        send(self.topic, more)
        send(seq8, more)
        send(payload, 0)
        self._buffer.append((seq8, payload))
        return seq

    async def wait_subscriber(self) -> None:
        """Return once a peer completed the ZMQ handshake (needs ``start(monitor=True)``)."""
        import zmq
        from zmq.utils.monitor import parse_monitor_message

        if self._mon is None:
            raise RuntimeError("wait_subscriber needs start(monitor=True)")
        while True:
            msg = parse_monitor_message(await self._mon.recv_multipart())
            if msg["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return

    async def _serve_replay(self) -> None:
        import zmq

        router = self._router
        while True:
            try:
                frames = await router.recv_multipart()
            except zmq.ZMQError:
                return
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                log.warning("ignoring malformed replay request (%d frames)", len(frames))
                continue
            self.replay_requests += 1
            ident = frames[0]
            start = int.from_bytes(frames[2], "big")
            first = self.seq - len(self._buffer)
            skip = min(max(0, start - first), len(self._buffer))
            # Snapshot: publishing may append while the sends below yield.
            items = list(itertools.islice(self._buffer, skip, None))
            for seq8, payload in items:
                if self.replay_topic:
                    await router.send_multipart((ident, b"", self.topic, seq8, payload))
                else:
                    await router.send_multipart((ident, b"", seq8, payload))
            if self.replay_topic:
                await router.send_multipart((ident, b"", b"", END_SEQ, b""))
            else:
                await router.send_multipart((ident, b"", END_SEQ, b""))

    def close(self) -> None:
        """Close every socket, then the context (which waits for the PUB's short linger)."""
        for task in self._tasks:
            task.cancel()
        self._tasks.clear()
        for sock in (self._router, self._mon):
            if sock is not None:
                sock.close(linger=0)
        self._router = self._mon = None
        if self._pub is not None:
            self._pub.close()
            self._pub = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None


class TrtllmQueue:
    """trtllm-serve's event buffer: ``drain`` returns and removes everything queued."""

    def __init__(
        self,
        num_blocks: int,
        *,
        window_size: int = 4096,
        dp_rank: int | None = None,
        max_events: int = 10_000,
        poll_block_s: float = 0.0,
    ) -> None:
        self.window_size = window_size
        self.dp_rank = dp_rank
        self.poll_block_s = poll_block_s
        self.next_id = 0
        self.dropped = 0
        self._q: deque[dict[str, Any]] = deque(maxlen=max_events)
        self._wake: asyncio.Event | None = None
        self.add({"type": "created", "num_blocks_per_cache_level": [num_blocks, 0]})

    def add(self, data: dict[str, Any]) -> None:
        ev: dict[str, Any] = {"event_id": self.next_id, "window_size": self.window_size}
        if self.dp_rank is not None:
            ev["attention_dp_rank"] = self.dp_rank
        ev["data"] = data
        self.next_id += 1
        if len(self._q) == self._q.maxlen:
            self.dropped += 1
        self._q.append(ev)
        if self._wake is not None:
            self._wake.set()

    def stored(
        self, parent: int | None, blocks: Sequence[tuple[int, Sequence[int]]], salt: str | None
    ) -> None:
        """One ``stored`` event; ``salt`` is put on the first block (None: not a first block)."""
        out = []
        for i, (h, tokens) in enumerate(blocks):
            out.append(
                {
                    "type": "stored_block",
                    "block_hash": h,
                    "tokens": [
                        {"type": "unique_token", "token_id": t, "token_extra_id": 0} for t in tokens
                    ],
                    "cache_level": 0,
                    "priority": 35,
                    "mm_keys": [],
                    "cache_salt": salt if i == 0 else None,
                    "lora_id": None,
                }
            )
        self.add({"type": "stored", "parent_hash": parent, "blocks": out})

    def removed(self, hashes: Sequence[int]) -> None:
        self.add({"type": "removed", "block_hashes": list(hashes)})

    def __len__(self) -> int:
        return len(self._q)

    async def drain(self) -> bytes:
        """The JSON array of all queued events (removed from the queue); waits up to
        ``poll_block_s`` for a first event when the queue is empty."""
        if not self._q and self.poll_block_s > 0:
            if self._wake is None:
                self._wake = asyncio.Event()
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_block_s)
        events = list(self._q)
        self._q.clear()
        return dumps(events)


def _u64(h: Any) -> int:
    if isinstance(h, bytes):
        return int.from_bytes(h, "big") & _U64
    return int(h) & _U64


def _runs(stored: list[StoredBlock]) -> list[list[StoredBlock]]:
    """Split stored blocks into runs whose blocks chain onto each other."""
    runs: list[list[StoredBlock]] = []
    for b in stored:
        if runs and b.parent_hash is not None and b.parent_hash == runs[-1][-1].block_hash:
            runs[-1].append(b)
        else:
            runs.append([b])
    return runs


def _nodes(removed: list[Any], parents: list[Any]) -> list[list[Any]]:
    """Group evicted hashes into radix nodes: runs where each next hash is the parent of the
    previous one (the cache evicts a sequence tail first); hashes root first per node."""
    nodes: list[list[Any]] = []
    for i, h in enumerate(removed):
        if nodes and i > 0 and parents[i - 1] == h:
            nodes[-1].append(h)
        else:
            nodes.append([h])
    return [n[::-1] for n in nodes]


class KvEventPublisher:
    """Turns prefix-cache changes into engine events for the configured sinks."""

    def __init__(
        self,
        *,
        block_size: int,
        fmt: WireFormat | None = None,
        hash_format: str = "u64",
        publisher: ZmqPublisher | None = None,
        trtllm: TrtllmQueue | None = None,
        dp_rank: int | None = None,
        sample_ids: Callable[[int], list[int]] | None = None,
    ) -> None:
        if fmt is not None:
            # vLLM 0.9 and SGLang only have signed int64 hashes; --hash-format is for vLLM
            # >=0.10.2, whose default (u64) is therefore the accepted "no choice" value.
            kind = "i64" if "i64" in fmt.hash_kinds and hash_format == "u64" else hash_format
            if kind not in fmt.hash_kinds:
                raise ValueError(
                    f"--hash-format {hash_format} is not available with {fmt.name} "
                    f"(it publishes {'/'.join(fmt.hash_kinds)})"
                )
            self.hasher: BlockHasher = (
                SglangHasher() if fmt.engine == "sglang" else VllmHasher(kind)  # type: ignore[arg-type]
            )
            self.hash_kind = kind
        else:
            self.hasher = VllmHasher("u64")
            self.hash_kind = "u64"
        self.block_size = block_size
        self.fmt = fmt
        self.encoder = EventEncoder(fmt) if fmt is not None else None
        self.publisher = publisher
        self.trtllm = trtllm
        self.dp_rank = dp_rank or 0
        self.events = 0
        self.last_burst: dict[str, Any] | None = None
        self._sample_ids = sample_ids
        self._burst_counter = 0  # hashes stay unique across bursts
        self._tasks: list[asyncio.Task[None]] = []

    # -- lifecycle -------------------------------------------------------------------------

    def start(self, startup_burst: int = 0, burst_events: int = 8) -> None:
        """Open the sockets; with ``startup_burst``, burst once the first peer connected."""
        if self.publisher is not None:
            self.publisher.start(monitor=startup_burst > 0)
            if startup_burst > 0:
                task = asyncio.get_running_loop().create_task(
                    self._startup_burst(startup_burst, burst_events)
                )
                self._tasks.append(task)

    def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        if self.publisher is not None:
            self.publisher.close()

    async def _startup_burst(self, batches: int, events_per_batch: int) -> None:
        assert self.publisher is not None
        await self.publisher.wait_subscriber()
        await asyncio.sleep(0.2)  # the subscription travels right after the handshake
        result = await self.burst(batches, events_per_batch)
        log.warning("startup burst: %s", result)

    # -- cache changes ---------------------------------------------------------------------

    def changed(
        self,
        stored: list[StoredBlock],
        removed: list[Any],
        removed_parents: list[Any],
        salt: str | None,
    ) -> None:
        """One request's cache change (one scheduler step): removals, then stores."""
        runs = _runs(stored)
        enc = self.encoder
        if enc is not None and self.publisher is not None and self.publisher.is_open:
            bs = self.block_size
            events: list[bytes] = []
            assert self.fmt is not None
            if self.fmt.engine == "vllm":
                events += [enc.removed([h]) for h in removed]
                for run in runs:
                    first = run[0].parent_hash is None
                    tokens = [t for b in run for t in b.token_ids]
                    hashes = [b.block_hash for b in run]
                    events.append(enc.stored(hashes, run[0].parent_hash, tokens, bs, salt, first))
            else:
                events += [enc.removed(node) for node in _nodes(removed, removed_parents)]
                for b in stored:
                    first = b.parent_hash is None
                    events.append(
                        enc.stored([b.block_hash], b.parent_hash, b.token_ids, bs, salt, first)
                    )
            if events:
                self.events += len(events)
                self.publisher.publish(enc.batch(time.time(), events, self.dp_rank))
        if self.trtllm is not None:
            if removed:
                self.trtllm.removed([_u64(h) for h in removed])
            for run in runs:
                parent = run[0].parent_hash
                self.trtllm.stored(
                    None if parent is None else _u64(parent),
                    [(_u64(b.block_hash), b.token_ids) for b in run],
                    salt if parent is None else None,
                )

    def cleared(self, removed: list[Any]) -> None:
        """The whole prefix cache was reset (``removed``: every hash it held)."""
        enc = self.encoder
        if enc is not None and self.publisher is not None and self.publisher.is_open:
            self.events += 1
            self.publisher.publish(enc.batch(time.time(), [enc.cleared()], self.dp_rank))
        if self.trtllm is not None and removed:
            self.trtllm.removed([_u64(h) for h in removed])

    # -- burst -----------------------------------------------------------------------------

    def _burst_hash(self, c: int) -> Any:
        x = (c * _GOLDEN) & _U64
        if self.hash_kind == "bytes":
            return hashlib.sha256(x.to_bytes(8, "big")).digest()
        if self.hash_kind == "i64":
            return x - (1 << 64) if x >> 63 else x
        return x

    async def burst(
        self,
        batches: int,
        events_per_batch: int = 8,
        blocks_per_event: int = 1,
        chain_blocks: int = 64,
    ) -> dict[str, Any]:
        """Publish synthetic ``BlockStored`` batches as fast as possible.

        Chains are ``chain_blocks`` long (the first one starts with the burst, each with
        ``parent = nil``);
        every block has ``block_size`` decodable token ids, cycling through a few distinct
        blocks that are packed once. Returns the measured rate.
        """
        bs = self.block_size
        bpe = blocks_per_event
        per_event = bs * bpe
        pool: list[int] = list(self._sample_ids(per_event + _VARIANTS)) if self._sample_ids else []
        if len(pool) < per_event + _VARIANTS:
            pool = [1000 + i % 50_000 for i in range(per_event + _VARIANTS)]
        token_lists = [pool[v : v + per_event] for v in range(_VARIANTS)]
        enc = self.encoder
        pub = self.publisher if self.publisher is not None and self.publisher.is_open else None
        if pub is None:
            enc = None
        vllm = self.fmt is None or self.fmt.engine == "vllm"
        packed = [_packb(tl) for tl in token_lists]
        page_packed = [
            [_packb(tl[k * bs : (k + 1) * bs]) for k in range(bpe)] for tl in token_lists
        ]
        bs_b = _packb(bs)
        extra_b = _packb([None] * bpe) if enc is not None and enc.fmt.salt == "extra_keys" else b""
        page_extra = _packb([None]) if extra_b else b""
        chain_events = max(1, chain_blocks // bpe)
        trt = self.trtllm
        mk = self._burst_hash
        dp = self.dp_rank
        c = self._burst_counter
        parent: Any = None
        pos = 0  # every burst starts a new chain
        first_seq = pub.seq if pub is not None else None
        n_events = 0
        t0 = time.perf_counter()
        for b in range(batches):
            events: list[bytes] = []
            for _ in range(events_per_batch):
                if pos == 0:
                    parent = None
                hashes = [mk(c + k) for k in range(1, bpe + 1)]
                c += bpe
                v = c % _VARIANTS
                if enc is not None:
                    if vllm:
                        events.append(
                            enc.stored_packed(
                                _packb(hashes), _packb(parent), packed[v], bs_b, extra_b
                            )
                        )
                    else:  # SGLang: one event per page
                        p = parent
                        for k, h in enumerate(hashes):
                            events.append(
                                enc.stored_packed(
                                    _packb([h]), _packb(p), page_packed[v][k], bs_b, page_extra
                                )
                            )
                            p = h
                if trt is not None:
                    tl = token_lists[v]
                    blocks = [(_u64(h), tl[k * bs : (k + 1) * bs]) for k, h in enumerate(hashes)]
                    trt.stored(None if parent is None else _u64(parent), blocks, None)
                n_events += 1
                parent = hashes[-1]
                pos = (pos + 1) % chain_events
            if pub is not None and enc is not None:
                pub.publish(enc.batch(time.time(), events, dp))
            if b % _YIELD_EVERY == _YIELD_EVERY - 1:
                await asyncio.sleep(0)
        seconds = time.perf_counter() - t0
        self._burst_counter = c
        self.events += n_events
        result = {
            "batches": batches,
            "events": n_events,
            "blocks": n_events * bpe,
            "seconds": round(seconds, 6),
            "events_per_s": round(n_events / seconds) if seconds > 0 else None,
            "blocks_per_s": round(n_events * bpe / seconds) if seconds > 0 else None,
            "first_seq": first_seq,
            "last_seq": pub.seq - 1 if pub is not None and batches else None,
        }
        self.last_burst = result
        return result

    def stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": self.fmt.name if self.fmt is not None else None,
            "hash": self.hash_kind,
            "events": self.events,
            "dp_rank": self.dp_rank,
        }
        if self.publisher is not None:
            out.update(
                endpoint=self.publisher.endpoint,
                replay_endpoint=self.publisher.replay_endpoint,
                next_seq=self.publisher.seq,
                batches=self.publisher.batches,
                replay_requests=self.publisher.replay_requests,
            )
        if self.trtllm is not None:
            out["trtllm"] = {
                "queued": len(self.trtllm),
                "next_event_id": self.trtllm.next_id,
                "dropped": self.trtllm.dropped,
            }
        if self.last_burst is not None:
            out["last_burst"] = self.last_burst
        return out
