"""Typed router configuration: one model per YAML section, one docstring per field.

Defaults and ranges are the reference documentation's. Unknown keys are errors (a typo
such as ``virtual_node`` must not silently fall back to a default).
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bus.config import parse_hostport

__all__ = [
    "BACKEND_TYPES",
    "STRATEGIES",
    "BackendConfig",
    "EventSourceConfig",
    "HealthCheckConfig",
    "KvCacheIndexConfig",
    "PrefixRoutingConfig",
    "RedisConfig",
    "ResponseCacheConfig",
    "RouterConfig",
    "ScoringConfig",
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

_NAME_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True)


class ServerConfig(_Section):
    """The router's listeners and request limits. Restart-only: a reload never rebinds."""

    listen: str = "0.0.0.0:8080"
    """HTTP API, admin and /metrics, as ``host:port`` (port 0 picks a free port)."""
    grpc_listen: str | None = None
    """gRPC services (KvIndex, health, reflection) as ``host:port``; unset = not started."""
    grpc_tls_cert: str | None = None
    """PEM certificate chain for the gRPC services; with ``grpc_tls_key`` turns on TLS."""
    grpc_tls_key: str | None = None
    admin_token_file: str | None = None
    """File holding the bearer token required under /admin (whitespace stripped)."""
    admin_token_env: str | None = None
    """Environment variable holding that token; the file wins when both are set."""
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 10 * 1024 * 1024
    """Largest request body accepted (bytes); larger gets 413 before it is read whole."""
    connect_timeout_ms: Annotated[int, Field(ge=10, le=600_000)] = 5_000
    """TCP/TLS connect timeout to a backend; a connect failure retries the next candidate."""
    request_timeout_ms: Annotated[int, Field(ge=100, le=3_600_000)] = 300_000
    """Upstream time to the response headers (and between stream chunks); over it: 504."""

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


class RedisConfig(_Section):
    """One Redis/Valkey connection pool, shared by the response cache and the KV index."""

    url: str = "redis://127.0.0.1:6379"
    """``redis://`` or ``rediss://`` (TLS); ``tls: true`` upgrades a ``redis://`` URL."""
    tls: bool = False
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


_DURATION_RE = re.compile(r"^\s*(\d+)\s*(ms|s|m|h|d)?\s*$")
_UNIT_S = {"ms": 0.001, "s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}


def parse_duration(value: str | int | float) -> float:
    """``"5m"``, ``"30s"``, ``"250ms"``, ``"1h"`` or a number of seconds, in seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = _DURATION_RE.match(str(value))
    if not m:
        raise ValueError(f'expected a duration like "5m", "30s" or "1h", got {value!r}')
    return int(m.group(1)) * _UNIT_S[m.group(2)]


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

    @field_validator("endpoint")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        if v is not None and not re.match(r"^(https?|wss?)://[^/\s]+", v):
            raise ValueError(f"must be an http, https, ws or wss URL, got {v!r}")
        return v


class KvCacheIndexConfig(_Section):
    """Tier 4: the index of which backend holds which prefix. Restart-only."""

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


class RouterConfig(_Section):
    """The whole router config file."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    backends: list[BackendConfig] = Field(default_factory=list)
    selection_strategy: Strategy = "RoundRobin"
    health_check: HealthCheckConfig = Field(default_factory=HealthCheckConfig)
    prefix_routing: PrefixRoutingConfig = Field(default_factory=PrefixRoutingConfig)
    response_cache: ResponseCacheConfig = Field(default_factory=ResponseCacheConfig)
    kv_cache_index: KvCacheIndexConfig = Field(default_factory=KvCacheIndexConfig)
