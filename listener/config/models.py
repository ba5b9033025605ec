"""Typed models of ``continuum-kv-listener``'s YAML, one per section.

One docstring per field (unit, default, meaning). Unknown keys are errors, so a typo such
as ``histroy_size`` never falls back to a default. The rules between fields are in
``loader``.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bus.config import parse_hostport
from listener.decode import DEFAULT_MAX_FRAME_BYTES
from listener.endpoints import offset_endpoint
from listener.push.config import EventBusClientConfig

__all__ = [
    "BACKEND_NAME_RE",
    "ENGINES",
    "ChatTemplateMarkers",
    "ConversationConfig",
    "GrpcTlsConfig",
    "ListenerConfig",
    "SourceConfig",
    "ZmqEndpoint",
]

Engine = Literal["vllm", "sglang", "trtllm"]
ENGINES: tuple[str, ...] = ("vllm", "sglang", "trtllm")

BACKEND_NAME_RE = re.compile(r"[A-Za-z0-9_-]{1,64}\Z")
"""A source id: the router's backend name, a metric label and a URL path segment."""

_ZMQ_TCP_RE = re.compile(r"^tcp://(?P<host>\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):(?P<port>\d{1,5})\Z")
_ZMQ_NAMED_RE = re.compile(r"^(?:ipc|inproc)://\S+\Z")
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)*"
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.?$"
)
_ZMQ_ONLY = ("zmq_endpoint", "zmq_mode", "topic", "replay_endpoint", "dp_ranks")
_TRTLLM_ONLY = ("trtllm_endpoint", "poll_interval_ms")


def _http_url(value: str) -> str:
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"must be an http:// or https:// URL, got {value!r}")
    return value


def _check_zmq_endpoint(value: str) -> str:
    m = _ZMQ_TCP_RE.match(value)
    if m:
        if int(m.group("port")) > 65535:
            raise ValueError(f"port {m.group('port')} is out of range 0-65535")
        return value
    if _ZMQ_NAMED_RE.match(value):
        return value
    raise ValueError(
        "expected tcp://host:port, ipc://path or inproc://name "
        f"(tcp://*:port to bind every interface), got {value!r}"
    )


class _Section(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True
    )


class GrpcTlsConfig(_Section):
    """Server certificate of the gRPC Listener service; without it gRPC is plaintext."""

    cert: str
    """PEM file: the server certificate chain."""
    key: str
    """PEM file: its private key."""
    client_ca: str | None = None
    """PEM file of CAs; when set, clients must present a certificate signed by one (mTLS)."""


class ChatTemplateMarkers(_Section):
    """A chat template given by its literal markers, for engines that are neither
    ``chatml`` nor ``llama3``. Prefix recovery finds the system prompt between
    ``system_start`` and ``end``, and the first user message between ``user_start``
    and ``end``, in the detokenized chain."""

    system_start: str
    """Text that opens the system turn, e.g. ``<|im_start|>system\\n``."""
    user_start: str
    """Text that opens a user turn, e.g. ``<|im_start|>user\\n``."""
    end: str
    """Text that closes a turn, e.g. ``<|im_end|>``."""

    @field_validator("system_start", "user_start", "end")
    @classmethod
    def _non_empty(cls, v: str) -> str:
        if not v:
            raise ValueError("must be a non-empty marker")
        return v


class ConversationConfig(_Section):
    """Conversation keys: besides the prefix keys, announce for every stored chain the keys of
    its whole prompt text, one per ``chunk_bytes`` (``chain_created`` / ``chain_offloaded`` /
    ``chain_evicted``), so the router knows how much of each conversation a backend holds.
    Each source needs its model's ``tokenizer`` (token ids back to the prompt's bytes)."""

    enabled: bool = False
    """Compute and announce conversation keys (default off: prefix keys only)."""
    chunk_bytes: Annotated[int, Field(ge=64, le=65_536)] = 1024
    """Bytes of prompt text per key: must equal the router's
    ``kv_cache_index.conversation.chunk_bytes`` or the two sides compute different keys."""
    max_retained_bytes: Annotated[int, Field(ge=1024, le=1 << 34)] = 64 << 20
    """Prompt bytes kept per source to extend chains (each block keeps the text after its
    last full chunk, fewer than ``chunk_bytes``); past it the least recently extended block
    loses them, and nothing stored under it gets keys. Default 64 MiB."""


class ZmqEndpoint(BaseModel):
    """One ZMQ publisher of a source after the ``dp_ranks`` expansion (not a YAML section)."""

    model_config = ConfigDict(frozen=True)

    rank: int
    endpoint: str
    replay_endpoint: str | None


class SourceConfig(_Section):
    """One engine whose KV events the listener turns into one backend's prefix events."""

    backend_name: str
    """Source id (``[A-Za-z0-9_-]{1,64}``), unique; the router's backend name, the path of
    ``GET /events/{backend_name}`` and the ``backend`` of every event."""
    engine: Engine
    """``vllm`` or ``sglang`` (ZMQ msgpack), or ``trtllm`` (trtllm-serve HTTP poll)."""

    zmq_endpoint: str | None = None
    """ZMQ PUB endpoint of the engine (vllm/sglang, required): ``tcp://host:port``, or
    ``tcp://*:port`` with ``zmq_mode: bind``; ``ipc://path``; ``inproc://name``."""
    zmq_mode: Literal["bind", "connect"] = "connect"
    """``connect`` (default) when the engine binds (its endpoint has ``*``); ``bind`` when
    the engine is given the listener's concrete address and connects to it."""
    topic: str = ""
    """ZMQ topic to subscribe to (prefix match); default ``""`` = every message."""
    replay_endpoint: str | None = None
    """The engine's ZMQ ROUTER replay endpoint; unset = a sequence gap resets the backend
    (``resync``) instead of replaying the missed batches."""
    dp_ranks: Annotated[int, Field(ge=1, le=1024)] | None = None
    """Data-parallel ranks publishing separately; rank r uses the TCP port + r (and the
    replay port + r; ``inproc://x`` becomes ``inproc://x_dp<r>``). Unset = one publisher."""

    trtllm_endpoint: str | None = None
    """trtllm-serve's ``/kv_cache_events`` URL (trtllm, required); POSTed every
    ``poll_interval_ms``. Its host must be in ``allowed_publishers``; redirects are refused."""
    poll_interval_ms: Annotated[int, Field(ge=10, le=60_000)] = 100
    """trtllm only: time between polls when the previous one returned nothing (ms)."""

    detokenize_endpoint: str | None = None
    """The engine's ``/detokenize`` URL, to turn a chain's tokens back into the prompt text
    for the prefix key. Unset = only salt-echo chains are attributed."""
    model: str | None = None
    """Served model name: sent to ``/detokenize`` and hashed into the prefix key, so it must
    be the name clients put in ``model`` (required with ``detokenize_endpoint``)."""
    chat_template: Literal["chatml", "llama3"] | ChatTemplateMarkers | None = None
    """How the prompt text is laid out: ``chatml``, ``llama3`` or a marker mapping
    ``{system_start, user_start, end}``. Unset = try the built-ins in that order."""
    default_system_prompt: str | None = None
    """The system prompt the engine's template inserts when a request has none; a recovered
    system prompt equal to it is treated as absent (the key uses the first message)."""
    tokenizer: str | None = None
    """The model's ``tokenizer.json`` (Hugging Face format): the bytes of every token id, for
    conversation keys (required with ``conversation.enabled``). Byte-level BPE (Qwen, Llama
    3, GPT-2) and SentencePiece-style BPE (Llama 2, Mistral, Gemma) files are accepted;
    sources naming one file share one table."""

    allowed_publishers: list[str] = Field(default_factory=list)
    """IPs, CIDRs or hostnames allowed to publish to this source (ZMQ peers, the trtllm URL
    host). Empty = any peer, only sensible with ``zmq_mode: connect`` on a trusted net."""

    max_frame_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = DEFAULT_MAX_FRAME_BYTES
    """Largest ZMQ frame taken from the engine (64 MiB; a real batch is a few kB):
    ``ZMQ_MAXMSGSIZE`` on the sockets and the decoder's bound. libzmq drops a peer that
    sends a larger one (counted in ``disconnects``; the lost batch is a gap)."""
    max_chain_tokens: Annotated[int, Field(ge=1, le=1 << 22)] = 16384
    """Longest token chain rebuilt for ``/detokenize``; longer chains are tracked by length
    only and stay unattributed."""
    max_tracked_blocks: Annotated[int, Field(ge=1, le=100_000_000)] = 100_000
    """Block metadata entries kept; past it the oldest entries are pruned one by one."""
    max_retained_tokens: Annotated[int, Field(ge=1, le=1 << 32)] = 16_777_216
    """Token ids kept across all blocks (4 bytes each: 64 MiB by default); pruned like
    ``max_tracked_blocks``, never a whole backend at once."""
    pruning_policy: Literal["lru", "saecache"] = "lru"
    """Which entries go first when a bound above is reached: ``lru`` (oldest first) or
    ``saecache`` (lowest SAECache priority first: blocks nobody reused go before shared
    system-prompt chains; see ``listener/saecache/pruning.py``)."""

    @field_validator("backend_name")
    @classmethod
    def _backend_name(cls, v: str) -> str:
        if not BACKEND_NAME_RE.match(v):
            raise ValueError(f"must match [A-Za-z0-9_-]{{1,64}}, got {v!r}")
        return v

    @field_validator("zmq_endpoint", "replay_endpoint")
    @classmethod
    def _zmq(cls, v: str | None) -> str | None:
        return None if v is None else _check_zmq_endpoint(v)

    @field_validator("trtllm_endpoint", "detokenize_endpoint")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _http_url(v)

    @field_validator("model")
    @classmethod
    def _model(cls, v: str | None) -> str | None:
        if v is not None and not v:
            raise ValueError("must be a non-empty model name")
        return v

    @field_validator("allowed_publishers")
    @classmethod
    def _publishers(cls, v: list[str]) -> list[str]:
        for i, entry in enumerate(v):
            try:
                ipaddress.ip_network(entry, strict=False)
            except ValueError:
                if not _HOSTNAME_RE.match(entry):
                    raise ValueError(
                        f"entry {i} ({entry!r}) is not an IP address, a CIDR or a hostname"
                    ) from None
        return v

    def zmq_endpoints(self) -> list[ZmqEndpoint]:
        """The publishers to subscribe to: one per DP rank (just rank 0 without ``dp_ranks``).

        Raises:
            ValueError: the source has no ZMQ endpoint, or it cannot be offset per rank.
        """
        if self.zmq_endpoint is None:
            raise ValueError(f"source {self.backend_name!r} has no zmq_endpoint")
        return [
            ZmqEndpoint(
                rank=r,
                endpoint=offset_endpoint(self.zmq_endpoint, r),
                replay_endpoint=(
                    None
                    if self.replay_endpoint is None
                    else offset_endpoint(self.replay_endpoint, r)
                ),
            )
            for r in range(self.dp_ranks or 1)
        ]

    def publisher_allowed(self, host: str) -> bool:
        """Whether ``host`` (an IP or hostname) matches ``allowed_publishers``.

        Empty list = everything is allowed. A hostname entry matches the same name
        (case-insensitive); an IP matches an IP or CIDR entry containing it. No DNS lookups.
        """
        if not self.allowed_publishers:
            return True
        host = host.strip("[]")
        try:
            addr = ipaddress.ip_address(host)
        except ValueError:
            addr = None
        for entry in self.allowed_publishers:
            if addr is not None:
                try:
                    if addr in ipaddress.ip_network(entry, strict=False):
                        return True
                except ValueError:
                    pass
            if entry.rstrip(".").lower() == host.rstrip(".").lower():
                return True
        return False


class ListenerConfig(_Section):
    """The whole ``continuum-kv-listener`` config file."""

    listen: str = "127.0.0.1:7817"
    """SSE/HTTP server (``GET /events/{backend}``, ``/health``, ``/stats``, ``/metrics``) as
    ``host:port`` (port 0 = any free port). Keep it on an internal network."""
    grpc_listen: str | None = None
    """gRPC ``continuum.listener.v1.Listener`` (+ health, reflection) as ``host:port``;
    unset = not started."""
    grpc_tls: GrpcTlsConfig | None = None
    """TLS for ``grpc_listen``; unset = plaintext."""
    max_prefix_length: Annotated[int, Field(ge=1, le=1 << 20)] = 1024
    """Bytes of anchor text hashed into prefix keys: must equal the router's
    ``prefix_routing.max_prefix_length`` or the two sides compute different keys."""
    history_size: Annotated[int, Field(ge=16, le=1_000_000)] = 10_000
    """Events kept per backend for ``Last-Event-ID`` resumption; an older ID gets ``resync``
    and a snapshot instead."""
    heartbeat_interval_ms: Annotated[int, Field(ge=100, le=300_000)] = 15_000
    """An idle stream gets an SSE comment after this long (ms), so proxies keep it open."""
    subscriber_queue_size: Annotated[int, Field(ge=16, le=1_000_000)] = 4096
    """Live events queued per subscriber; a subscriber that falls this far behind is closed
    with an explicit ``buffer_overflow`` error and resumes from its last event ID."""
    max_subscribers: Annotated[int, Field(ge=1, le=100_000)] = 256
    """SSE event streams open at once (``GET /events/{backend}``); one more gets 503."""
    subscriber_write_timeout_ms: Annotated[int, Field(ge=100, le=600_000)] = 30_000
    """Longest a write to one SSE subscriber may wait for its socket; a client that stopped
    reading is disconnected then (``stalled_subscribers``), releasing its snapshot."""
    salt_secret_file: str | None = None
    """File holding the HMAC secret shared with the router for cache salts (>= 16 bytes,
    whitespace stripped)."""
    salt_secret_env: str | None = None
    """Environment variable holding that secret; the file wins when both are set."""
    sources: list[SourceConfig] = Field(default_factory=list)
    """The engines to listen to, one backend each."""
    event_bus: EventBusClientConfig | None = None
    """Push mode: dial the router's event bus over TLS and stream every source to it (the
    local SSE server keeps running). Unset = pull only."""
    eviction_advisor: bool = True
    """Serve ``continuum.listener.v1.EvictionAdvisor`` (SAECache advice for the engines) on
    ``grpc_listen``, for the backends of ``sources``."""
    eviction_advisor_max_blocks: Annotated[int, Field(ge=1, le=100_000_000)] = 1_000_000
    """Blocks the eviction advisor keeps per backend; past it the lowest-ranked are
    forgotten."""
    eviction_advisor_max_clock_skew_s: Annotated[float, Field(gt=0, le=86_400)] = 60.0
    """Seconds an engine's timestamp may be off where the listener's clock puts the
    engine's clock (seconds, any epoch); one further off is clamped there and counted
    (``advisor_clamped_timestamps``), so one bad event cannot poison the advisor's clock."""
    eviction_advisor_safeguard: bool = False
    """Rank by SAECache only while sampled shadow caches say it beats LRU and LFU on this
    backend's traffic, otherwise in the order of the one that does
    (``listener/saecache/guard.py``); off = SAECache's order always. Off by default: on
    the robustness grid (bench/RESULTS.md) it did not beat plain SAECache."""
    conversation: ConversationConfig = Field(default_factory=ConversationConfig)
    """Conversation keys for the router's conversation-depth index (off by default)."""
    checkpoint_dir: str | None = None
    """Directory of the per-source checkpoint files (``<backend_name>.ckpt``, mode 0600,
    the directory created 0700): each ZMQ source's chain state and last sequence number,
    written every ``checkpoint_interval_ms`` when changed and at shutdown, loaded at start
    so a restarted listener keeps what the engines hold (their replay buffers are
    bounded, and cache hits store nothing). Unset = off. Put it on storage that outlives
    the process (a volume), private to one listener."""
    checkpoint_interval_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 1000
    """How often a changed source is checkpointed (ms): the events of the last interval
    before a crash are what the engine's replay must give back."""
    checkpoint_max_age_s: Annotated[float, Field(gt=0, le=30 * 86_400)] = 3600.0
    """A checkpoint older than this (seconds) is ignored at start: after a long outage the
    engines have moved on too far for it to help."""
    session_predictor: str | None = None
    """Model file of the SAECache session predictor (``python -m listener.saecache.train``;
    needs torch). The eviction advisor then classifies a new session whose first
    REQUEST_STARTED carries ``features`` and no class guess. Unset: the engine's guess or
    the rule-based default."""

    @field_validator("listen", "grpc_listen")
    @classmethod
    def _hostport(cls, v: str | None) -> str | None:
        if v is not None:
            parse_hostport(v)
        return v

    @property
    def has_salt_secret(self) -> bool:
        return bool(self.salt_secret_file or self.salt_secret_env)

    def source(self, backend_name: str) -> SourceConfig:
        """The source of a backend; KeyError when there is none."""
        for s in self.sources:
            if s.backend_name == backend_name:
                return s
        raise KeyError(backend_name)


# -- loading -------------------------------------------------------------------------------
