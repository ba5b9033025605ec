"""Typed router configuration: one model per YAML section, one docstring per field.

Defaults and ranges are the reference documentation's. Unknown keys are errors (a typo
such as ``virtual_node`` must not silently fall back to a default).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from bus.config import parse_duration, parse_hostport

__all__ = [
    "BACKEND_TYPES",
    "STRATEGIES",
    "BackendConfig",
    "BrokerConfig",
    "ClusterConfig",
    "ControlPlaneConfig",
    "DynamoConfig",
    "EventBusConfig",
    "EventBusTlsConfig",
    "EventSourceConfig",
    "GeminiContextCacheConfig",
    "HealthCheckConfig",
    "KvCacheIndexConfig",
    "OptimizationPolicyConfig",
    "PrefixRoutingConfig",
    "RedisConfig",
    "ResponseCacheConfig",
    "RouterConfig",
    "ScoringConfig",
    "SemanticCacheConfig",
    "ServerConfig",
    "StorageOffloadingConfig",
    "parse_hostport",
]

BackendType = Literal["openai", "vllm", "sglang", "trtllm", "anthropic", "gemini"]
BACKEND_TYPES: tuple[str, ...] = ("openai", "vllm", "sglang", "trtllm", "anthropic", "gemini")

Strategy = Literal[
    "RoundRobin",
    "WeightedRoundRobin",
    "LeastLatency",
    "Random",
    "ConsistentHash",
    "PrefixAwareHash",
]
STRATEGIES: tuple[str, ...] = (
    "RoundRobin",
    "WeightedRoundRobin",
    "LeastLatency",
    "Random",
    "ConsistentHash",
    "PrefixAwareHash",
)

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}\Z")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ServerConfig(_Section):
    """The router's listeners and request limits. Restart-only: a reload never rebinds."""

    listen: str = "127.0.0.1:8080"
    """HTTP API, admin and /metrics, as ``host:port`` (port 0 picks a free port). Loopback
    by default: a non-loopback address needs an admin token (or ``allow_unauthenticated``)."""
    grpc_listen: str | None = None
    """gRPC services (KvIndex, health, reflection) as ``host:port``; unset = not started. A
    non-loopback address needs an admin token, mTLS (``grpc_tls_client_ca``) or
    ``allow_unauthenticated``."""
    grpc_tls_cert: str | None = None
    """PEM certificate chain for the gRPC services; with ``grpc_tls_key`` turns on TLS
    (TLS 1.2 at least)."""
    grpc_tls_key: str | None = None
    grpc_tls_client_ca: str | None = None
    """PEM CA bundle: with it every gRPC client must present a certificate it signed
    (mTLS), which authenticates KvIndex calls without the token. Needs the cert and key."""
    admin_token_file: str | None = None
    """File holding the bearer token required under /admin and by every KvIndex call
    (whitespace stripped); an empty or unreadable file is a config error."""
    admin_token_env: str | None = None
    """Environment variable holding that token (unset or empty is a config error); the
    file wins when both are set."""
    allow_unauthenticated: bool = False
    """Serve /admin and KvIndex without a token on non-loopback addresses: only for a
    trusted network (validation warns)."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 10 * 1024 * 1024
    """Largest request body accepted (bytes); larger gets 413 before it is read whole."""
    body_read_timeout_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 30_000
    """Whole-body deadline from the request's headers to its last body byte; a client
    slower than this gets 408 and its connection closed, so trickling clients cannot hold
    request slots. (Headers have granian's own 30 s deadline.)"""
    max_concurrent_requests: Annotated[int, Field(ge=1, le=1_000_000)] = 1_000
    """Requests handled at once, streams included; one more gets 503 with ``Retry-After``
    at once instead of waiting behind the others."""
    connect_timeout_ms: Annotated[int, Field(ge=10, le=600_000)] = 5_000
    """TCP/TLS connect timeout to a backend; a connect failure retries the next candidate."""
    request_timeout_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 300_000
    """Upstream time to the response headers (and between stream chunks); over it: 504."""
    shutdown_grace_ms: Annotated[int, Field(ge=0, le=600_000)] = 5_000
    """On SIGTERM/SIGINT: new requests get 503 at once, requests in flight (streams too)
    get this long to finish; then the rest are cut and the process exits."""

    @field_validator("listen", "grpc_listen")
    @classmethod
    def _hostport(cls, v: str | None) -> str | None:
        if v is not None:
            parse_hostport(v)
        return v


class BackendConfig(_Section):
    """One inference engine or API the router may send requests to."""

    name: str
    """Unique name; used as metric label, in logs and in KV events (``[A-Za-z0-9_.-]{1,64}``)."""
    url: str
    """Base URL without the API path, e.g. ``http://vllm-1:8000``."""
    type: BackendType = "openai"
    """Wire dialect: decides paths, auth headers and which endpoints may use it."""
    models: list[str] = Field(default_factory=list)
    """Models served; empty = discovered from the backend's ``GET /v1/models``."""
    weight: Annotated[int, Field(ge=1, le=1000)] = 1
    """Relative share for WeightedRoundRobin."""
    enabled: bool = True
    """A disabled backend is never selected nor health-checked."""
    internal: bool = False
    """Reserved for the router's own calls (embeddings for the semantic cache, ...);
    never a candidate for client traffic."""
    api_key_env: str | None = None
    """Environment variable holding the backend's API key (never inline in YAML)."""
    health_path: str | None = None
    """Health probe path; default by type (``/health`` for engines, ``/v1/models`` for
    openai, none for anthropic and gemini, which are then assumed healthy)."""
    anthropic_auto_cache_control: bool = True
    """Inject ``cache_control`` into native Anthropic requests for this backend."""
    cache_salt: bool = False
    """Issue a ``cache_salt`` binding (backend, prefix key) so the KV listener learns the
    prefix key without detokenizing (opt-in for vllm and sglang; always on for trtllm
    when ``kv_cache_index`` has a salt secret; never for other types)."""

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        if not _NAME_RE.match(v):
            raise ValueError("must match [A-Za-z0-9_.-]{1,64}")
        return v

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^https?://[^/\s]+", v):
            raise ValueError(f"must be an http:// or https:// URL, got {v!r}")
        return v.rstrip("/")

    @field_validator("models")
    @classmethod
    def _models(cls, v: list[str]) -> list[str]:
        if any(not m for m in v):
            raise ValueError("model names must be non-empty")
        return v


class HealthCheckConfig(_Section):
    """Active health probing of every enabled backend."""

    enabled: bool = True
    interval_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 10_000
    """Time between probes of one backend."""
    timeout_ms: Annotated[int, Field(ge=10, le=600_000)] = 2_000
    """A probe slower than this counts as a failure."""
    unhealthy_threshold: Annotated[int, Field(ge=1, le=100)] = 3
    """Consecutive failures (probes or connect errors) that mark a backend unhealthy."""
    healthy_threshold: Annotated[int, Field(ge=1, le=100)] = 1
    """Consecutive successful probes that bring it back."""
    ejection_cooldown_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 30_000
    """How long a backend ejected by connect failures and without an active probe
    (``anthropic``, ``gemini``, or any backend while probes are off) stays out before a
    half-open retry: it gets traffic again, a connect success brings it back, one more
    failure ejects it for another cool-down."""


class PrefixRoutingConfig(_Section):
    """Tier 1: prefix keys and the CHWBL ring used by PrefixAwareHash."""

    enabled: bool = False
    """Compute prefix keys; without them PrefixAwareHash hashes the model name only."""
    max_prefix_length: Annotated[int, Field(ge=1, le=1 << 20)] = 1024
    """Bytes of anchor text hashed, cut back to a UTF-8 boundary."""
    load_factor_epsilon: Annotated[float, Field(ge=0.01, le=10.0)] = 0.25
    """A backend may carry up to (1 + epsilon) x the average in-flight load."""
    virtual_nodes: Annotated[int, Field(ge=1, le=10_000)] = 150
    """Ring points per backend; hot-reloadable (the ring is rebuilt)."""
    anthropic_cache_control_injection: bool = False
    """Force cache_control injection even for backends with auto injection off."""


def _dialable(v: list[str]) -> list[str]:
    """``host:port`` addresses a client can dial (``parse_hostport`` checks the form)."""
    for a in v:
        _, port = parse_hostport(a)
        if port == 0:
            raise ValueError(f"{a!r}: port 0 cannot be dialled")
    return v


class SentinelConfig(_Section):
    """Where Redis Sentinel says the primary is (``response_cache.redis.mode: sentinel``)."""

    master_name: Annotated[str, Field(min_length=1)]
    """The name the sentinels monitor the primary under (``sentinel monitor <name> ...``)."""
    addresses: Annotated[list[str], Field(min_length=1)]
    """The sentinels, ``host:port`` each; any one that answers is enough."""
    username: str | None = None
    """ACL user for the sentinels (``sentinel sentinel-user``), if they need one."""
    password: str | None = None
    """Password of the sentinels themselves (their ``requirepass``/``sentinel-pass``), not
    the data nodes' (``response_cache.redis.password``)."""
    tls: bool = False
    """TLS to the sentinels too (the data nodes follow ``response_cache.redis.tls``)."""
    db: Annotated[int, Field(ge=0, le=15)] = 0

    _addrs = field_validator("addresses")(_dialable)


class ClusterConfig(_Section):
    """Where a Redis Cluster is (``response_cache.redis.mode: cluster``)."""

    startup_nodes: Annotated[list[str], Field(min_length=1)]
    """Some of the cluster's nodes, ``host:port`` each; the client asks any one that
    answers for the slot map and then talks to every primary directly."""

    _addrs = field_validator("startup_nodes")(_dialable)


class RedisConfig(_Section):
    """One Redis/Valkey connection pool, shared by the response cache and the KV index."""

    mode: Literal["standalone", "sentinel", "cluster"] = "standalone"
    """``standalone``: one server at ``url``; ``sentinel``: the primary Sentinel names
    (``sentinel``), followed across failovers; ``cluster``: a Redis Cluster
    (``cluster``), for the response cache and the KV index alike (the index then keeps
    each backend's keys under a hash tag of its own, one slot per backend)."""
    url: str = "redis://127.0.0.1:6379"
    """``redis://`` or ``rediss://`` (TLS); ``tls: true`` upgrades a ``redis://`` URL.
    Standalone only."""
    tls: bool = False
    username: str | None = None
    """ACL user of the data nodes (sentinel and cluster modes; standalone: in ``url``, or
    here)."""
    password: str | None = None
    """Password of the data nodes (sentinel and cluster modes; standalone: in ``url``, or
    here)."""
    tls_ca_file: str | None = None
    """PEM CA bundle that verifies the servers' certificates over TLS (default: the
    system's)."""
    sentinel: SentinelConfig | None = None
    cluster: ClusterConfig | None = None
    pool_size: Annotated[int, Field(ge=1, le=1024)] = 8
    key_prefix: str = "cr:resp:"
    """Response cache key namespace; glob characters (``*?[]``) are rejected."""
    connect_timeout_ms: Annotated[int, Field(ge=10, le=600_000)] = 3_000
    command_timeout_ms: Annotated[int, Field(ge=10, le=600_000)] = 1_000
    fallback_capacity: Annotated[int, Field(ge=1, le=10_000_000)] = 1_000
    fallback_ttl_seconds: Annotated[int, Field(ge=1, le=86_400)] = 300
    fallback_to_memory: bool = True
    health_check_interval_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 30_000
    """How often a Redis that failed is retried before switching back from memory."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        if not re.match(r"^rediss?://", v):
            raise ValueError(f"must be a redis:// or rediss:// URL, got {v!r}")
        return v

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if any(c in v for c in "*?[]"):
            raise ValueError("must not contain glob characters (* ? [ ])")
        return v

    @model_validator(mode="after")
    def _mode(self) -> RedisConfig:
        if self.mode == "sentinel" and self.sentinel is None:
            raise ValueError("mode: sentinel needs a sentinel section (master_name, addresses)")
        if self.sentinel is not None and self.mode != "sentinel":
            raise ValueError(f"a sentinel section needs mode: sentinel (mode is {self.mode})")
        if self.mode == "cluster" and self.cluster is None:
            raise ValueError("mode: cluster needs a cluster section (startup_nodes)")
        if self.cluster is not None and self.mode != "cluster":
            raise ValueError(f"a cluster section needs mode: cluster (mode is {self.mode})")
        return self


class SemanticCacheConfig(_Section):
    """Tier 2's semantic path: answer a paraphrase of an earlier question from the cache.

    Serves only when ``control_plane.optimization`` allows it too. Every field
    hot-reloads (the vector index is per router and in memory).
    """

    enabled: bool = False
    backend: str | None = None
    """Name of the configured backend serving ``embedding_model`` (``internal: true``
    allowed, ``enabled: false`` refused); required when enabled."""
    embedding_model: str | None = None
    """Model asked for on ``POST /v1/embeddings``; required when enabled."""
    threshold: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    """Cosine similarity at or above which a stored answer is served; unset =
    ``control_plane.optimization.semantic_similarity_bps`` / 10000."""
    max_entries: Annotated[int, Field(ge=1, le=1_000_000)] = 1000
    """Vectors kept in the router's index (all partitions); the oldest go first."""
    ttl: str | None = None
    """Entry lifetime (``"5m"``...); unset = ``response_cache.ttl``. A policy's
    ``cache_ttl_secs`` wins over both."""
    embedding_timeout_ms: Annotated[int, Field(ge=100, le=60_000)] = 2000
    """Deadline of the embeddings call; past it the request is a plain miss."""
    max_input_bytes: Annotated[int, Field(ge=1, le=1 << 20)] = 8192
    """A last user message longer than this (UTF-8 bytes) skips the semantic path."""

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, v: str | None) -> str | None:
        if v is not None and not 1 <= parse_duration(v) <= 30 * 86400:
            raise ValueError("must be between 1s and 30d")
        return v


class ResponseCacheConfig(_Section):
    """Tiers 2 and 3: whole responses of deterministic requests, in memory or Redis."""

    enabled: bool = False
    backend: Literal["memory", "redis"] = "memory"
    """``redis`` shares ``response_cache.redis``'s pool with the KV index; restart-only."""
    capacity: Annotated[int, Field(ge=1, le=100_000_000)] = 1000
    """Entries kept in memory before LRU eviction."""
    ttl: str = "5m"
    """Lifetime of an entry: ``"30s"``, ``"5m"``, ``"1h"``... (1 s to 30 days)."""
    max_response_size: Annotated[int, Field(ge=1, le=1 << 30)] = 1 << 20
    """Largest non-streaming body stored (bytes)."""
    max_stream_buffer_size: Annotated[int, Field(ge=1, le=1 << 30)] = 10 << 20
    """Largest stream buffered for storing (bytes); a longer stream is passed through only."""
    redis: RedisConfig | None = None
    semantic: SemanticCacheConfig = Field(default_factory=SemanticCacheConfig)

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, v: str) -> str:
        seconds = parse_duration(v)
        if not 1 <= seconds <= 30 * 86400:
            raise ValueError("must be between 1s and 30d")
        return v

    @property
    def ttl_seconds(self) -> int:
        return int(parse_duration(self.ttl))


class ScoringConfig(_Section):
    """KvOverlapScorer weights; read once at start (kv_cache_index is restart-only)."""

    overlap_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.6
    load_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.3
    health_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.1
    min_overlap_threshold: Annotated[float, Field(ge=0.0, le=1.0)] = 0.3
    """A backend whose tier-weighted overlap is below this scores 0 (treated as uncached)."""
    gpu_tier_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    storage_tier_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.6


class StorageOffloadingConfig(_Section):
    enabled: bool = False
    """Track GpuHot vs StorageWarm per (prefix, backend)."""
    treat_eviction_as_offload: bool = True
    """With offloading on, ``cache_evicted`` demotes to StorageWarm instead of removing."""


class EventSourceConfig(_Section):
    """One listener stream the router consumes."""

    backend_name: str
    """The configured backend the events describe."""
    endpoint: str | None = None
    """``http(s)://listener:7817/events/<backend>`` or ``ws(s)://...``; none for event_bus."""
    transport: Literal["sse", "event_bus"] = "sse"
    reconnect_interval_ms: Annotated[int, Field(ge=10, le=600_000)] = 1_000
    """First reconnect delay; doubles up to max(this, 60 s)."""
    read_timeout_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 60_000
    """``transport: sse``: an open stream that brings no byte for this long counts as dead
    (a partition, a NAT that lost its state: no FIN, no RST ever comes) and is dropped and
    reopened from the last event ID; the same bound applies to the answer to a GET. Keep
    it a few of the listener's ``heartbeat_interval_ms`` (15 s: 60 s is four): an idle
    stream carries only heartbeats. ``event_bus`` sources rely on HTTP/2 keepalive
    (``dynamo.event_bus.keepalive_time_ms``) instead."""

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(https?|wss?)://[^/\s]+", v):
            raise ValueError(f"must be an http, https, ws or wss URL, got {v!r}")
        return v


class ConversationScoringConfig(_Section):
    """The cost model of conversation-depth routing, in prompt tokens (lowest cost wins).

    ``cost(b) = prompt_tokens - credit(tier) * held_tokens(b)
               + prefill_load_weight * in_flight_prefill_tokens(b)
               + active_request_weight * in_flight_requests(b)``

    among the backends under the bounded-load cap (``load_factor_epsilon``). The defaults
    favour what a backend holds (the load terms break near-ties) and leave the balance to
    the cap: measured with ``bench/fleet_bench.py``, heavier load weights move
    conversations off the engine that holds them (lower hit rate), lighter ones without
    the cap pile a shared tool suite's sessions onto one engine (max/mean load over 2).
    """

    gpu_credit: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    """Share of the held tokens a backend need not prefill when they are in GPU memory."""
    storage_credit: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    """The same for tokens held only in a slower tier (they must be loaded back)."""
    prefill_load_weight: Annotated[float, Field(ge=0.0, le=100.0)] = 0.1
    """Cost of one prompt token the backend is still prefilling for requests in flight."""
    active_request_weight: Annotated[float, Field(ge=0.0, le=1_000_000.0)] = 32.0
    """Cost, in tokens, of each request the backend has in flight (decode contention)."""
    bytes_per_token: Annotated[float, Field(ge=0.5, le=64.0)] = 4.0
    """Estimate of a prompt's tokens from its rendered bytes before any event tells."""
    load_factor_epsilon: Annotated[float | None, Field(ge=0.0, le=10.0)] = 0.25
    """Bounded load, as PrefixAwareHash's ring: a backend already at
    ``ceil((1 + epsilon) * (in-flight requests + 1) / candidates)`` is not chosen while
    another is below it, however much it holds (None: no bound, the cost alone); over it
    means over it now and on average over ``load_window_seconds``."""
    new_prompts: Literal["least_loaded", "strategy"] = "least_loaded"
    """Who places a request none of the candidates holds any of: the backend under the
    cap with the fewest prompts placed over the last ``load_window_seconds`` (then the
    fewest requests and prefill tokens in flight, then the prompt's own hash), or the
    configured ``selection_strategy``. Measured with
    ``bench/affinity_bench.py`` (8 shared prompts, 2 backends): PrefixAwareHash's ring
    put 5 of the 8 on one backend in some runs (max share 0.63)."""
    load_window_seconds: Annotated[float, Field(ge=0.0, le=600.0)] = 2.0
    """Time constant, in seconds, of the in-flight averages the load term and the cap
    read (0: the counts now). A backend is at the cap only when over it both now and on
    average: against the counts now alone a shared prompt's engine hits the cap whenever
    a few of its sessions arrive together, and each request sent past it prefills the
    whole prompt elsewhere (``make run``'s demo: 61-65 % token hit rate, 83-87 % with
    the average); a lasting imbalance still moves work away."""
    resident_weight: Annotated[float, Field(ge=0.0, le=10.0)] = 0.1
    """Cost of each prompt token of the other live conversations this router sent to the
    backend (``resident_tokens``: what its cache is asked to keep; a first request
    weighed by how often its prompt's conversations go on; 0: off). Sessions stick, so
    an engine that took more of them evicts their histories first; with the term a
    shared prompt's new sessions go where there is room, copying the prompt once, while
    a conversation's own history (thousands of tokens) keeps it where it is. Measured
    (``bench/RESULTS.md``, fleet_bench): at 0.1 the fleet's load spread falls from
    1.31-1.33 to about 1.1 max/mean on (a) and (b) with +1 to +3 points of token hit
    rate; ``make run``'s demo and ``bench/affinity_bench.py`` are unchanged; 0.3 and more
    move conversations off their histories on the demo's small caches (72 % and 67 %
    against 80 %)."""
    resident_window_seconds: Annotated[float, Field(gt=0.0, le=86_400.0)] = 300.0
    """A conversation not routed for this long no longer counts as resident."""
    sticky_tokens: Annotated[int, Field(ge=0)] = 0
    """A conversation whose backend holds at least this many of its tokens more than any
    other candidate (its own history, not a prompt shared with other sessions) may stay
    there past ``load_factor_epsilon``, up to ``sticky_load_factor_epsilon``: moving it
    prefills all of that history again elsewhere, where placing a new session elsewhere
    costs only its shared prompt, so the cap moves new sessions first. 0 (the default):
    no exemption. Measured (``bench/RESULTS.md``): at 1024 ``make run``'s demo (24
    tenants, small caches) rises from 79 % to 84-85 % token hit rate, but
    ``bench/fleet_bench.py``'s load spread goes from 1.22-1.23 to 1.31-1.32 max/mean at
    the same hit rates, over the 1.25 the fleet is held to: worth it where conversations
    are long and engines' caches small."""
    sticky_load_factor_epsilon: Annotated[float, Field(ge=0.0, le=10.0)] = 0.5
    """The bound for such a conversation's backend, and for the home of a prompt worth only
    its shared prefix (one whose conversations rarely send a second request, or add less
    than a sixteenth of it per request: ``router.kvindex.cost``), as
    ``load_factor_epsilon`` (used only when larger than it). Unbounded, a tool suite's
    sessions pile onto one engine (``bench/fleet_bench.py`` (b): max/mean load 2.04)."""
    copy_load_factor_epsilon: Annotated[float, Field(ge=0.0, le=10.0)] = 2.0
    """The bound up to which that home keeps a request when no candidate under the cap
    holds any of the prompt (every other choice copies it), for a prompt worth only its
    prefix and one not judged yet (fewer than 3 requests after a conversation's first
    and 8 conversations seen), as ``load_factor_epsilon`` (used only when larger than
    it). A copy made for load prefills the whole prompt, and in a fleet whose caches
    are full it evicts as much of other prompts, which come back as misses and are
    placed again: a cascade (``make run``'s demo, 24 tenants whose prompts fill the
    fleet's caches once, medians of paired runs: ConsistentHash 88 % token hit rate,
    this row 83 % with copies made past 1.5x the mean load, 89 % past 2x, 91 % past 3x;
    ``bench/RESULTS.md``). On two backends no load reaches 3x the mean, so such a home
    is never copied for load there; what bounds it is that a prompt with more than one
    backend's share of the recent requests is never kept home."""


class ChatTemplateConfig(_Section):
    """How one served model renders chat requests: the engine's own chat template."""

    model: str
    """The served model name (a request's ``model``)."""
    tokenizer_config: str | None = None
    """Path to the model's ``tokenizer_config.json``: its ``chat_template`` and the special
    tokens the template names (``bos_token``, ``eos_token``, ...)."""
    chat_template: str | None = None
    """Path to a ``.jinja`` template, used instead of the one in ``tokenizer_config``."""
    tokenizer: str | None = None
    """Path to the model's ``tokenizer.json``: its normalizer (NFC for Qwen) is applied to
    the rendered text, as the engine's tokenizer does before it tokenizes."""
    lora_adapters: list[str] = Field(default_factory=list)
    """Served names that are LoRA adapters of this model (their chains get the adapter's
    root, as the engine's block hashes do)."""


class ConversationConfig(_Section):
    """Conversation-depth routing: the index knows how much of each rendered prompt every
    backend holds (``bus.prompt_chain`` keys from the listener's ``chain_*`` events)."""

    enabled: bool = False
    chunk_bytes: Annotated[int, Field(ge=64, le=65_536)] = 1024
    """Bytes of rendered prompt per key; must equal the listener's ``conversation.chunk_bytes``."""
    templates: list[ChatTemplateConfig] = Field(default_factory=list)
    """One per served model; a model without one is routed on its prefix key."""
    max_entries: Annotated[int, Field(ge=100, le=100_000_000)] = 1_000_000
    """Chain keys kept in memory (its own bound, apart from the prefix entries')."""
    predict_ttl_seconds: Annotated[float, Field(ge=0.0, le=3600.0)] = 10.0
    """How long a routed request's keys count as held by its backend before the engine's
    events confirm them (0: never predict)."""
    scoring: ConversationScoringConfig = Field(default_factory=ConversationScoringConfig)
    render_cache_bytes: Annotated[int, Field(ge=0, le=1 << 40)] = 0
    """Memory bound of the render cache (bytes; 0: off, the default): each conversation's
    chain state after its messages so far, so its next turn renders and hashes only the
    messages it adds. Least recently used entries go first. Pays off for long
    conversations and agent loops (``bench/RESULTS.md``: a hit costs 0.64x rendering whole
    for a 32k-token chat, more than that for chats of 2k-8k tokens)."""


class AntiEntropyConfig(_Section):
    """The periodic check of the index against each backend's listener snapshot (pull:
    ``GET /snapshot/<backend>``; push: asked on the event bus session;
    ``router.kvindex.anti_entropy``): ``continuum_kv_index_divergence``."""

    interval_seconds: Annotated[float, Field(ge=0.0, le=86_400.0)] = 60.0
    """Seconds between checks of every backend (0: off)."""
    repair: bool = False
    """Resync a backend found divergent by two checks in a row."""
    timeout_seconds: Annotated[float, Field(gt=0.0, le=600.0)] = 10.0
    """How long one snapshot fetch (or event bus snapshot answer) may take."""


class KvCacheIndexConfig(_Section):
    """Tier 4: the index of which backend holds which prefix. Restart-only but for
    ``event_sources`` (``router.config.reloading``)."""

    enabled: bool = False
    backend: Literal["memory", "redis"] = "memory"
    """``redis`` reuses ``response_cache.redis``'s connection pool."""
    max_entries: Annotated[int, Field(ge=100, le=10_000_000)] = 100_000
    """Prefix entries kept in memory; when full the oldest 10% go in one step."""
    entry_ttl_seconds: Annotated[int, Field(ge=1, le=86_400)] = 600
    cleanup_interval_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 30_000
    """Period of the proactive sweep of expired entries (TTL is also checked on query)."""
    scoring: ScoringConfig = Field(default_factory=ScoringConfig)
    storage_offloading: StorageOffloadingConfig = Field(default_factory=StorageOffloadingConfig)
    event_sources: list[EventSourceConfig] = Field(default_factory=list)
    salt_secret_file: str | None = None
    """HMAC secret shared with the listener for router-issued cache salts (file wins)."""
    salt_secret_env: str | None = None
    """Environment variable holding that secret."""
    conversation: ConversationConfig = Field(default_factory=ConversationConfig)
    anti_entropy: AntiEntropyConfig = Field(default_factory=AntiEntropyConfig)


class GeminiContextCacheConfig(_Section):
    """Router-managed Gemini ``cachedContents`` for large, reused system prompts.

    Google bills cached tokens per token-hour of storage and enforces a per-model minimum
    token count, so this only pays for big prefixes reused often: off by default, short
    ttl. Restart-only (it owns a map and background tasks).
    """

    enabled: bool = False
    """Off: no map is allocated and no background task runs."""
    min_prefix_bytes: Annotated[int, Field(ge=1024)] = 16384
    """Smallest system prompt (UTF-8 bytes) worth a cache; the router does not tokenize,
    so this approximates Google's per-model minimum token count."""
    ttl: str = "10m"
    """Lifetime given to each created cachedContents resource (at least 60 s)."""
    extend_on_hit: bool = False
    """On a hit with at most 20% of the ttl left, PATCH the resource's ttl in the background."""
    max_entries: Annotated[int, Field(ge=10, le=1_000_000)] = 1000
    """Tracked entries (live and rejected) before the least recently used is evicted."""
    create_timeout_ms: Annotated[int, Field(ge=500, le=60_000)] = 5000
    """Deadline of one background ``POST /v1beta/cachedContents``."""
    negative_ttl_seconds: Annotated[int, Field(ge=1)] = 600
    """How long a prefix Google rejected (HTTP 400, or a failed create) is not retried."""
    prefer_native_api: bool = False
    """Send chat completions for gemini backends to ``generateContent`` /
    ``streamGenerateContent`` instead of ``/v1beta/openai/chat/completions``."""

    @field_validator("ttl")
    @classmethod
    def _ttl(cls, v: str) -> str:
        if parse_duration(v) < 60:
            raise ValueError("must be at least 60s")
        return v

    @property
    def ttl_seconds(self) -> int:
        return int(parse_duration(self.ttl))


class OptimizationPolicyConfig(_Section):
    """The caching policy a control plane would hand the router, kept locally.

    A stand-in for an organisation's hub policy: per-request switches, hot-reloaded.
    """

    semantic_cache_enabled: bool = False
    """The router's own switch for the semantic path (``response_cache.semantic``)."""
    cache_enabled: bool = True
    """Response caching at all: off, every chat completion is a BYPASS."""
    exact_cache: bool = True
    """Exact-match lookups and stores; the semantic path needs it on as well."""
    semantic_cache: bool = True
    """The policy's semantic switch (both this and ``semantic_cache_enabled``)."""
    semantic_similarity_bps: Annotated[int, Field(ge=0, le=10_000)] = 9200
    """Similarity threshold in basis points, used when ``semantic.threshold`` is unset."""
    cache_ttl_secs: Annotated[int, Field(ge=1, le=30 * 86400)] | None = None
    """Semantic entry lifetime; wins over ``semantic.ttl`` and ``response_cache.ttl``."""


class ControlPlaneConfig(_Section):
    optimization: OptimizationPolicyConfig = Field(default_factory=OptimizationPolicyConfig)


_SHA256_HASH_RE = re.compile(r"^sha256:[0-9a-f]{64}\Z")
_BROKER_ID_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,62}[A-Za-z0-9])?\Z")
_SOURCE_ID_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")


class EventBusTlsConfig(_Section):
    """TLS of the event bus. The bus never serves plaintext: cert and key are required."""

    cert: str | None = None
    """PEM file: the server certificate chain (SANs for every name listeners dial)."""
    key: str | None = None
    """PEM file: its private key."""
    client_ca: str | None = None
    """PEM file of CAs; when set, client certificates are requested and verified, and a
    certificate with a DNS SAN equal to a broker entry ``id`` authenticates as that entry."""


class BrokerConfig(_Section):
    """One credential allowed on the event bus (``dynamo.event_bus.brokers[]``)."""

    id: str
    """Entry id: a listener's ``event_bus.client_id``, and the DNS SAN of its mTLS client
    certificate."""
    role: Literal["kv_listener", "broker"]
    """What the credential may open; roles never cross."""
    token_hash: str | None = None
    """``sha256:<64 lowercase hex>`` of the bearer token (``printf %s "$TOKEN" | sha256sum``);
    unset = mTLS client certificate only."""
    backends: list[str] = Field(default_factory=list)
    """The only sources (router backend names) this credential may announce."""

    @field_validator("id")
    @classmethod
    def _id(cls, v: str) -> str:
        if not _BROKER_ID_RE.match(v):
            raise ValueError("must be a DNS label-like id ([A-Za-z0-9.-], 1-64 characters)")
        return v

    @field_validator("token_hash")
    @classmethod
    def _token_hash(cls, v: str | None) -> str | None:
        if v is not None and not _SHA256_HASH_RE.match(v):
            raise ValueError('must be "sha256:" followed by 64 lowercase hex digits')
        return v

    @field_validator("backends")
    @classmethod
    def _backends(cls, v: list[str]) -> list[str]:
        for name in v:
            if not _SOURCE_ID_RE.match(name):
                raise ValueError(f"{name!r} is not a source id ([A-Za-z0-9_-], 1-64 characters)")
        return v


class EventBusConfig(_Section):
    """Push mode: listeners dial the router's gRPC ``continuum.bus.v1.EventBus`` over TLS.

    ``enabled``, ``listen`` and ``tls`` are restart-only; ``brokers`` reload at once (a
    session whose announced sources are no longer permitted ends with Forbidden).
    """

    enabled: bool = False
    listen: str = "0.0.0.0:9443"
    """``host:port`` of the TLS-only gRPC server (port 0 picks a free port)."""
    tls: EventBusTlsConfig = Field(default_factory=EventBusTlsConfig)
    brokers: list[BrokerConfig] = Field(default_factory=list)
    max_message_bytes: Annotated[int, Field(ge=64 * 1024, le=64 << 20)] = 4 << 20
    """Largest gRPC message accepted; a larger StreamData ends that call with
    RESOURCE_EXHAUSTED."""
    max_sessions: Annotated[int, Field(ge=1, le=100_000)] = 256
    """Session calls in progress at once (authenticated or not); one more is refused with
    RESOURCE_EXHAUSTED. A listener holds one."""
    max_streams: Annotated[int, Field(ge=1, le=1_000_000)] = 4096
    """Stream calls in progress at once (authenticated or not); one more is refused with
    RESOURCE_EXHAUSTED. A listener holds one per source the router consumes from it."""
    keepalive_time_ms: Annotated[int, Field(ge=1_000, le=3_600_000)] = 20_000
    """An HTTP/2 ping to each listener's connection after this long without one; with
    ``keepalive_timeout_ms``, how soon a listener gone silent (a partition, a host down, a
    NAT that lost its state) is noticed and its streams are ended (restart-only)."""
    keepalive_timeout_ms: Annotated[int, Field(ge=100, le=600_000)] = 10_000
    """How long a ping may go unanswered before the connection counts as dead."""
    min_client_ping_interval_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 5_000
    """Least interval between a listener's pings the router accepts; more often gets
    GOAWAY (too_many_pings). Keep it at or under the listeners' ``keepalive_time``."""

    @field_validator("listen")
    @classmethod
    def _listen(cls, v: str) -> str:
        parse_hostport(v)
        return v


class DynamoConfig(_Section):
    """Distributed-runtime integrations; today the event bus."""

    event_bus: EventBusConfig = Field(default_factory=EventBusConfig)


class RouterConfig(_Section):
    """The whole router config file."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    backends: list[BackendConfig] = Field(default_factory=list)
    selection_strategy: Strategy = "RoundRobin"
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    prefix_routing: PrefixRoutingConfig = Field(default_factory=PrefixRoutingConfig)
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)
    control_plane: ControlPlaneConfig = Field(default_factory=ControlPlaneConfig)
    kv_cache_index: KvCacheIndexConfig = Field(default_factory=KvCacheIndexConfig)
    dynamo: DynamoConfig = Field(default_factory=DynamoConfig)
    gemini_context_cache: GeminiContextCacheConfig = Field(default_factory=GeminiContextCacheConfig)
