"""Typed configuration of ``continuum-kv-listener``: YAML to ``ListenerConfig``.

One model per YAML section, one docstring per field (unit, default, meaning). Unknown
keys are errors, so a typo such as ``histroy_size`` never falls back to a default.
Every error and warning names its YAML path (``sources[1].zmq_endpoint``), including the
cross-field rules that field types cannot express (``check_listener_config``):

* ``engine: vllm|sglang`` requires ``zmq_endpoint``; ``engine: trtllm`` requires
  ``trtllm_endpoint`` and forbids every ``zmq_*`` option (and ``topic``,
  ``replay_endpoint``, ``dp_ranks``); ``poll_interval_ms`` belongs to trtllm only.
* ``detokenize_endpoint`` requires ``model`` (the model name is part of the prefix key).
* A chain is attributed to a prefix key through ``detokenize_endpoint`` or through a
  router-issued cache salt (``salt_secret_file`` / ``salt_secret_env``). A ZMQ source with
  neither gets a warning (its events can never be published); ``engine: trtllm``
  *requires* a salt secret, because trtllm-serve has no public ``/detokenize``.
* The host of ``trtllm_endpoint`` must be listed in ``allowed_publishers``.
* ``backend_name`` is unique; ZMQ endpoints the listener binds are unique after the
  ``dp_ranks`` expansion (``tcp://h:5557`` -> ``tcp://h:5557+rank``).
* ``event_bus`` (push mode, ``listener.push.config``): https URL, a credential from a file
  or an environment variable (never inline) or an mTLS client certificate, existing files.

``load_listener_config`` is what ``continuum-kv-listener --check`` and the process itself
use, so the two always agree on what a file means.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from bus.config import (
    ConfigError,
    ConfigIssue,
    clean_message,
    duplicate_names,
    parse_hostport,
    parse_validated,
    read_yaml,
    yaml_path,
)
from bus.config import log_warnings as _log_warnings
from listener.endpoints import offset_endpoint
from listener.push.config import EventBusClientConfig

__all__ = [
    "BACKEND_NAME_RE",
    "ENGINES",
    "ChatTemplateMarkers",
    "ConfigError",
    "ConfigIssue",
    "GrpcTlsConfig",
    "ListenerConfig",
    "SourceConfig",
    "ZmqEndpoint",
    "check_listener_config",
    "load_listener_config",
    "log_warnings",
    "parse_hostport",
    "parse_listener_config",
]

log = logging.getLogger("continuum.listener.config")

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

    allowed_publishers: list[str] = Field(default_factory=list)
    """IPs, CIDRs or hostnames allowed to publish to this source (ZMQ peers, the trtllm URL
    host). Empty = any peer, only sensible with ``zmq_mode: connect`` on a trusted net."""

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


def _validation_issues(exc: ValidationError) -> list[ConfigIssue]:
    issues: list[ConfigIssue] = []
    seen: set[str] = set()
    for e in exc.errors(include_url=False):
        loc = tuple(e["loc"])
        path = yaml_path(loc)
        literal_branch = any(isinstance(p, str) and p.startswith("literal[") for p in loc)
        markers_branch = "ChatTemplateMarkers" in loc
        if literal_branch and isinstance(e.get("input"), dict):
            continue  # the marker mapping's own errors say more
        if literal_branch or (markers_branch and e["type"] == "model_type"):
            message = 'must be "chatml", "llama3" or a mapping {system_start, user_start, end}'
        elif e["type"] == "extra_forbidden":
            message = "unknown field"
        else:
            message = clean_message(e["msg"])
        key = f"{path}\0{message}"
        if key not in seen:
            seen.add(key)
            issues.append(ConfigIssue("error", path, message))
    return issues


def _check_source(cfg: ListenerConfig, i: int, s: SourceConfig) -> list[ConfigIssue]:
    p = f"sources[{i}]"
    issues: list[ConfigIssue] = []
    given = s.model_fields_set

    def err(field: str, message: str) -> None:
        issues.append(ConfigIssue("error", f"{p}.{field}", message))

    if s.engine == "trtllm":
        if s.trtllm_endpoint is None:
            err("trtllm_endpoint", f"engine trtllm requires {p}.trtllm_endpoint")
        for field in _ZMQ_ONLY:
            if field in given:
                err(field, f"engine trtllm does not use ZMQ: remove {p}.{field}")
        if not cfg.has_salt_secret:
            err(
                "engine",
                "engine trtllm requires salt_secret_file or salt_secret_env: trtllm-serve has "
                "no public /detokenize, so prefix keys come only from router-issued cache salts",
            )
        if s.trtllm_endpoint is not None:
            host = urlsplit(s.trtllm_endpoint).hostname or ""
            if not s.allowed_publishers or not s.publisher_allowed(host):
                err(
                    "allowed_publishers",
                    f"trtllm_endpoint host {host!r} must be listed in {p}.allowed_publishers",
                )
    else:
        if s.zmq_endpoint is None:
            err("zmq_endpoint", f"engine {s.engine} requires {p}.zmq_endpoint")
        for field in _TRTLLM_ONLY:
            if field in given:
                err(field, f"{p}.{field} is for engine trtllm only (this source is {s.engine})")
        if s.zmq_endpoint is not None and s.dp_ranks and s.dp_ranks > 1:
            for field, value in (
                ("zmq_endpoint", s.zmq_endpoint),
                ("replay_endpoint", s.replay_endpoint),
            ):
                if value is None:
                    continue
                try:
                    offset_endpoint(value, s.dp_ranks - 1)
                except ValueError as exc:
                    err(field, f"{p}.dp_ranks requires a tcp:// or inproc:// endpoint: {exc}")
                    continue
                m = _ZMQ_TCP_RE.match(value)
                if m and int(m.group("port")) + s.dp_ranks - 1 > 65535:
                    err(field, f"port + dp_ranks - 1 exceeds 65535 ({value!r}, {s.dp_ranks})")
        if s.zmq_endpoint is not None and s.replay_endpoint is not None and not issues:
            eps = s.zmq_endpoints()
            live = {ep.endpoint: ep.rank for ep in eps}
            for ep in eps:
                if ep.replay_endpoint in live:
                    err(
                        "replay_endpoint",
                        f"replay endpoint {ep.replay_endpoint} of dp rank {ep.rank} is also "
                        f"the zmq_endpoint of dp rank {live[ep.replay_endpoint]}",
                    )
                    break
        if s.zmq_mode == "bind" and not s.allowed_publishers:
            issues.append(
                ConfigIssue(
                    "warning",
                    f"{p}.allowed_publishers",
                    "zmq_mode bind with no allowed_publishers accepts events from any peer "
                    "that can reach the port; list the engines' addresses",
                )
            )
        if s.detokenize_endpoint is None and not cfg.has_salt_secret:
            issues.append(
                ConfigIssue(
                    "warning",
                    p,
                    "no way to attribute chains to prefix keys: set "
                    f"{p}.detokenize_endpoint or salt_secret_file/salt_secret_env; "
                    "until then this backend publishes no cache events",
                )
            )
    if s.detokenize_endpoint is not None and s.model is None:
        err("model", f"{p}.detokenize_endpoint requires {p}.model (it is part of the prefix key)")
    if s.max_chain_tokens > s.max_retained_tokens:
        issues.append(
            ConfigIssue(
                "warning",
                f"{p}.max_chain_tokens",
                f"larger than {p}.max_retained_tokens: no full chain can be retained",
            )
        )
    return issues


def check_listener_config(cfg: ListenerConfig) -> list[ConfigIssue]:
    """Cross-field rules: errors the field types cannot express, and warnings."""
    issues: list[ConfigIssue] = []
    if cfg.event_bus is not None:
        for path, message in cfg.event_bus.issues("event_bus"):
            issues.append(ConfigIssue("error", path, message))
    if cfg.grpc_tls is not None and cfg.grpc_listen is None:
        issues.append(ConfigIssue("error", "grpc_tls", "grpc_tls requires grpc_listen"))
    if cfg.grpc_tls is not None:
        for field in ("cert", "key", "client_ca"):
            value = getattr(cfg.grpc_tls, field)
            if value is not None and not Path(value).is_file():
                issues.append(
                    ConfigIssue("error", f"grpc_tls.{field}", f"file {value!r} does not exist")
                )
    if cfg.session_predictor is not None:
        if not cfg.eviction_advisor or cfg.grpc_listen is None:
            issues.append(
                ConfigIssue(
                    "error",
                    "session_predictor",
                    "session_predictor requires eviction_advisor and grpc_listen",
                )
            )
        if not Path(cfg.session_predictor).is_file():
            issues.append(
                ConfigIssue(
                    "error",
                    "session_predictor",
                    f"file {cfg.session_predictor!r} does not exist",
                )
            )
    if cfg.salt_secret_file is not None and not Path(cfg.salt_secret_file).is_file():
        issues.append(
            ConfigIssue(
                "error", "salt_secret_file", f"file {cfg.salt_secret_file!r} does not exist"
            )
        )
    if cfg.grpc_listen is not None:
        h1, p1 = parse_hostport(cfg.listen)
        h2, p2 = parse_hostport(cfg.grpc_listen)
        if p1 and p1 == p2 and (h1 == h2 or "0.0.0.0" in (h1, h2) or "::" in (h1, h2)):
            issues.append(
                ConfigIssue("error", "grpc_listen", f"port {p2} is already used by listen")
            )
    if not cfg.sources:
        issues.append(
            ConfigIssue("warning", "sources", "no sources: every /events/{backend} is a 404")
        )
    names = [s.backend_name for s in cfg.sources]
    issues += duplicate_names(names, "sources", "backend_name", "backend_name")
    bound: dict[str, str] = {}
    for i, s in enumerate(cfg.sources):
        source_issues = _check_source(cfg, i, s)
        issues.extend(source_issues)
        if (
            s.zmq_mode == "bind"
            and s.zmq_endpoint is not None
            and not any(x.severity == "error" for x in source_issues)
        ):
            for ep in s.zmq_endpoints():
                if ep.endpoint in bound:
                    issues.append(
                        ConfigIssue(
                            "error",
                            f"sources[{i}].zmq_endpoint",
                            f"{ep.endpoint} is already bound by {bound[ep.endpoint]}",
                        )
                    )
                else:
                    bound[ep.endpoint] = f"sources[{i}].zmq_endpoint"
    return issues


def parse_listener_config(
    data: Any, source: str = "<config>"
) -> tuple[ListenerConfig, list[ConfigIssue]]:
    """Validate already-parsed YAML. Raises ConfigError; returns the config and warnings."""
    return parse_validated(ListenerConfig, data, source, check_listener_config, _validation_issues)


def load_listener_config(path: str | Path) -> tuple[ListenerConfig, list[ConfigIssue]]:
    """Read and validate a YAML file.

    Returns:
        The config and the warnings (each naming its YAML path).

    Raises:
        ConfigError: the file is unreadable, not YAML, or invalid; ``issues`` names the
            YAML path of every error.
    """
    data = read_yaml(path)
    return parse_listener_config(data, str(path))


def log_warnings(issues: Iterable[ConfigIssue]) -> None:
    _log_warnings(issues, log)
