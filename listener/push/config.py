"""The listener's ``event_bus`` section: where and how it dials the router (push mode).

``url`` names one router; ``urls`` names several (the replicas of a fleet that runs more
than one router behind a load balancer): the listener keeps one session per router, each
with its own reconnects and streams, so every replica gets every event and resumes by
its own last event id. :meth:`EventBusClientConfig.per_router` splits the section into
one single-URL config per router.

The credential is read from a file or an environment variable, never from the YAML
itself (configs get pasted into tickets; secrets must not be).
"""

from __future__ import annotations

import re
from typing import Annotated, Any
from urllib.parse import urlsplit

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

from bus.config import parse_duration

__all__ = ["EventBusClientConfig"]

_CLIENT_ID_RE = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9.-]{0,62}[A-Za-z0-9])?\Z")


def _check_url(v: str) -> str:
    parts = urlsplit(v)
    if parts.scheme != "https":
        raise ValueError(f"must be an https:// URL (the event bus is TLS only), got {v!r}")
    if not parts.hostname or parts.path not in ("", "/") or parts.query or parts.username:
        raise ValueError(f"must be https://host[:port] with no path, got {v!r}")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError as exc:
        raise ValueError(f"bad port in {v!r}") from exc
    return v


_RouterUrl = Annotated[str, AfterValidator(_check_url)]


def _duration(lo: float, hi: float) -> Any:
    def check(v: str | int | float) -> str | int | float:
        s = parse_duration(v)
        if not lo <= s <= hi:
            raise ValueError(f"must be between {lo:g}s and {hi:g}s, got {v!r}")
        return v

    return check


class EventBusClientConfig(BaseModel):
    """Push mode: dial the router's event bus over TLS and stream the announced sources."""

    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, use_attribute_docstrings=True
    )

    url: str | None = None
    """``https://host[:port]`` of the router's ``dynamo.event_bus.listen`` (default port
    443). https only: the bus is never plaintext. Set this or ``urls``."""
    urls: Annotated[list[_RouterUrl], Field(max_length=64)] = []
    """Several routers (replicas sharing one Redis index), each dialled on its own
    session with its own reconnects and streams: every router gets every event. Set
    this or ``url``; the other fields apply to every router."""
    client_id: str
    """This listener's broker entry id on the router (``dynamo.event_bus.brokers[].id``);
    also the DNS SAN of its client certificate when it uses one."""
    ca_file: str | None = None
    """PEM CA bundle that signed the router's certificate; unset = the system roots."""
    tls_server_name: str | None = None
    """Name to verify the router's certificate against, when it differs from the URL host."""
    credential_file: str | None = None
    """File holding the bearer token (whitespace stripped)."""
    credential_env: str | None = None
    """Environment variable holding the bearer token."""
    client_cert_file: str | None = None
    """PEM client certificate for mTLS (with ``client_key_file``)."""
    client_key_file: str | None = None
    """Its private key."""
    reconnect_backoff: str | int | float = "1s"
    """First reconnect delay after the session fails; doubles up to
    max(this, ``reconnect_backoff_max``)."""
    reconnect_backoff_max: str | int | float = "10s"
    """Longest wait between two dials. While no session is up the router hears nothing of
    this listener's sources, and after a long outage (a partition of minutes) every dial
    through the dead path failed: the wait after the path heals is up to this long, so
    the bound of a push recovery is ``connect_timeout`` + this (a dial is one TLS
    handshake: cheap to repeat)."""
    drain_deadline: str | int | float = "5s"
    """On SIGTERM: time to send Draining and close open streams before exiting."""
    connect_timeout: str | int | float = "10s"
    """Time to connect, handshake and receive the Welcome."""
    keepalive_time: str | int | float = "20s"
    """An HTTP/2 ping to the router after this long without one; with
    ``keepalive_timeout``, how soon a router gone silent (a partition, a NAT that lost its
    state: no FIN, no RST ever comes) is noticed and the session dialled again. Not under
    the router's ``min_client_ping_interval_ms`` (5 s), or it answers GOAWAY."""
    keepalive_timeout: str | int | float = "10s"
    """How long a ping may go unanswered before the connection counts as dead."""
    batch_max_bytes: Annotated[int, Field(ge=1024, le=1 << 20)] = 256 * 1024
    """A StreamData message is sent once it holds this many bytes of SSE records..."""
    batch_linger_ms: Annotated[int, Field(ge=0, le=1000)] = 10
    """...or after this long (ms) since the previous message: batches of records, not one
    gRPC message per event, at a bounded extra latency. 10 ms rather than less: each gRPC
    message costs the listener tens of microseconds (grpc.aio, HTTP/2, TLS), and at 2 ms
    the bus used ~9 % more listener CPU per engine event than SSE pull; at 10 ms the two
    are equal (bench/RESULTS.md, bus_bench) and the lag p99 stays under 20 ms."""
    credential: Any = None
    """Not allowed: an inline credential is rejected with a pointer to the two ways."""

    @field_validator("url")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        return None if v is None else _check_url(v)

    @field_validator("client_id")
    @classmethod
    def _client_id(cls, v: str) -> str:
        if not _CLIENT_ID_RE.match(v):
            raise ValueError("must be a DNS label-like id ([A-Za-z0-9.-], 1-64 characters)")
        return v

    _backoff = field_validator("reconnect_backoff")(_duration(0.01, 600))
    _backoff_max = field_validator("reconnect_backoff_max")(_duration(0.01, 600))
    _drain = field_validator("drain_deadline")(_duration(0, 600))
    _connect = field_validator("connect_timeout")(_duration(0.1, 600))
    _keepalive = field_validator("keepalive_time")(_duration(1, 3600))
    _keepalive_timeout = field_validator("keepalive_timeout")(_duration(0.1, 600))

    @property
    def router_urls(self) -> list[str]:
        """Every router this listener dials, in the configured order."""
        return list(self.urls) if self.urls else [self.url] if self.url else []

    def per_router(self) -> list[EventBusClientConfig]:
        """One single-URL section per router (what each session runs on)."""
        return [self.model_copy(update={"url": u, "urls": []}) for u in self.router_urls]

    @property
    def target(self) -> str:
        """``host:port`` for grpc (port 443 when the URL has none) of a single-URL section."""
        parts = urlsplit(self.url or "")
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        return f"{host}:{parts.port or 443}"

    @property
    def reconnect_backoff_s(self) -> float:
        return parse_duration(self.reconnect_backoff)

    @property
    def reconnect_backoff_max_s(self) -> float:
        return parse_duration(self.reconnect_backoff_max)

    @property
    def drain_deadline_s(self) -> float:
        return parse_duration(self.drain_deadline)

    @property
    def connect_timeout_s(self) -> float:
        return parse_duration(self.connect_timeout)

    @property
    def keepalive_time_s(self) -> float:
        return parse_duration(self.keepalive_time)

    @property
    def keepalive_timeout_s(self) -> float:
        return parse_duration(self.keepalive_timeout)

    def issues(self, path: str = "event_bus") -> list[tuple[str, str]]:
        """Cross-field errors as ``(yaml path, message)``; files are checked to exist."""
        from pathlib import Path

        out: list[tuple[str, str]] = []
        if self.url is None and not self.urls:
            out.append((f"{path}.url", "set url (one router) or urls (several routers)"))
        if self.url is not None and self.urls:
            out.append((f"{path}.urls", "set url or urls, not both"))
        seen: set[str] = set()
        for i, u in enumerate(self.urls):
            key = u.rstrip("/").lower()
            if key in seen:
                out.append((f"{path}.urls[{i}]", f"{u!r} is listed twice"))
            seen.add(key)
        if self.credential is not None:
            out.append(
                (
                    f"{path}.credential",
                    "inline credentials are not allowed: use credential_file or credential_env",
                )
            )
        if self.credential_file and self.credential_env:
            out.append(
                (f"{path}.credential_env", "set credential_file or credential_env, not both")
            )
        if bool(self.client_cert_file) != bool(self.client_key_file):
            out.append(
                (f"{path}.client_key_file", "client_cert_file and client_key_file go together")
            )
        if not (self.credential_file or self.credential_env or self.client_cert_file):
            out.append(
                (
                    path,
                    "no credential: set credential_file or credential_env (bearer token), or "
                    "client_cert_file and client_key_file (mTLS)",
                )
            )
        for field in ("ca_file", "credential_file", "client_cert_file", "client_key_file"):
            value = getattr(self, field)
            if value and not Path(value).is_file():
                out.append((f"{path}.{field}", f"file {value!r} does not exist"))
        return out
