"""Push-mode configuration on both sides: every error names its YAML path.

Router: ``dynamo.event_bus`` (TLS required, token_hash form, unique ids, a way to
authenticate each entry), ``transport: event_bus`` sources, and which fields a reload
applies (brokers) or keeps (listen, tls). Listener: ``event_bus`` (https only, host[:port],
a credential from a file or the environment but never inline, cert and key together).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from bus.config import parse_duration
from listener.config import parse_listener_config
from listener.push.config import EventBusClientConfig
from router.config import ConfigError, keep_restart_only, parse_config, restart_only_changes

HASH = "sha256:" + "a" * 64


def router(
    bus: dict[str, Any] | None = None, sources: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    return {
        "backends": [{"name": "vllm-1", "url": "http://e:8000", "type": "vllm"}],
        "prefix_routing": {"enabled": True},
        **({"dynamo": {"event_bus": bus}} if bus is not None else {}),
        "kv_cache_index": {"enabled": True, "event_sources": sources or []},
    }


def router_errors(data: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    return {i.path: i.message for i in info.value.issues if i.severity == "error"}


@pytest.fixture
def tls(tmp_path: Path) -> dict[str, str]:
    for name in ("c.pem", "k.pem", "ca.pem"):
        (tmp_path / name).write_text("x")
    return {"cert": str(tmp_path / "c.pem"), "key": str(tmp_path / "k.pem")}


def test_a_complete_router_section_is_valid(tls: dict[str, str]) -> None:
    bus = {
        "enabled": True,
        "listen": "0.0.0.0:9443",
        "tls": tls,
        "brokers": [
            {"id": "kv-a", "role": "kv_listener", "token_hash": HASH, "backends": ["vllm-1"]}
        ],
    }
    src = [{"backend_name": "vllm-1", "transport": "event_bus", "reconnect_interval_ms": 5000}]
    cfg, warnings = parse_config(router(bus, src))
    assert cfg.dynamo.event_bus.brokers[0].backends == ["vllm-1"]
    assert warnings == []


def test_the_bus_is_tls_only_and_entries_need_a_credential(tmp_path: Path) -> None:
    bus = {"enabled": True, "brokers": [{"id": "kv-a", "role": "kv_listener"}]}
    errs = router_errors(router(bus))
    assert errs["dynamo.event_bus.tls.cert"].startswith("the event bus is TLS only")
    assert "dynamo.event_bus.tls.key" in errs
    assert "no way to authenticate" in errs["dynamo.event_bus.brokers[0].token_hash"]
    bus["tls"] = {"cert": str(tmp_path / "none"), "key": str(tmp_path / "none")}
    assert "does not exist" in router_errors(router(bus))["dynamo.event_bus.tls.cert"]


@pytest.mark.parametrize(
    ("broker", "path", "text"),
    [
        ({"token_hash": "a" * 64}, "token_hash", 'must be "sha256:"'),
        ({"token_hash": "sha256:" + "A" * 64}, "token_hash", "lowercase hex"),
        ({"token_hash": "sha256:" + "a" * 64 + "\n"}, "token_hash", "lowercase hex"),
        ({"id": "kv-a\n"}, "id", "DNS label-like"),
        ({"role": "admin"}, "role", "'kv_listener' or 'broker'"),
        ({"id": "has space"}, "id", "DNS label-like"),
        ({"backends": ["bad/name"]}, "backends", "not a source id"),
    ],
)
def test_broker_fields(tls: dict[str, str], broker: dict[str, Any], path: str, text: str) -> None:
    entry = {"id": "kv-a", "role": "kv_listener", "token_hash": HASH, **broker}
    errs = router_errors(router({"enabled": True, "tls": tls, "brokers": [entry]}))
    assert text in errs[f"dynamo.event_bus.brokers[0].{path}"]


def test_duplicate_ids_and_event_bus_sources(tls: dict[str, str]) -> None:
    entry = {"id": "kv-a", "role": "kv_listener", "token_hash": HASH}
    errs = router_errors(router({"enabled": True, "tls": tls, "brokers": [entry, entry]}))
    assert "duplicate broker id 'kv-a'" in errs["dynamo.event_bus.brokers[1].id"]
    src = [{"backend_name": "vllm-1", "transport": "event_bus", "endpoint": "http://l:7817/e"}]
    errs = router_errors(router(None, src))
    assert errs["kv_cache_index.event_sources[0].endpoint"].startswith("transport event_bus takes")
    assert errs["kv_cache_index.event_sources[0].transport"] == (
        "transport event_bus requires dynamo.event_bus.enabled: true"
    )


def test_an_unannounceable_source_is_a_warning(tls: dict[str, str]) -> None:
    bus = {"enabled": True, "tls": tls, "brokers": []}
    _, warnings = parse_config(router(bus, [{"backend_name": "vllm-1", "transport": "event_bus"}]))
    assert [w.path for w in warnings] == ["kv_cache_index.event_sources[0].backend_name"]


def test_reload_applies_brokers_and_keeps_listen_and_tls(tls: dict[str, str]) -> None:
    entry = {"id": "kv-a", "role": "kv_listener", "token_hash": HASH, "backends": ["vllm-1"]}
    old, _ = parse_config(router({"enabled": True, "tls": tls, "brokers": [entry]}))
    moved = {
        "enabled": True,
        "tls": tls,
        "listen": "0.0.0.0:9444",
        "brokers": [{**entry, "backends": []}],
    }
    new, _ = parse_config(router(moved))
    assert "dynamo.event_bus.listen" in restart_only_changes(old, new)
    kept = keep_restart_only(old, new)
    assert kept.dynamo.event_bus.listen == "0.0.0.0:9443"
    assert kept.dynamo.event_bus.brokers[0].backends == []


# -- listener ------------------------------------------------------------------------------


def listener(bus: dict[str, Any]) -> dict[str, Any]:
    return {
        "salt_secret_env": "S",
        "event_bus": bus,
        "sources": [{"backend_name": "vllm-1", "engine": "vllm", "zmq_endpoint": "tcp://e:5557"}],
    }


def listener_errors(bus: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_listener_config(listener(bus))
    return {i.path: i.message for i in info.value.issues if i.severity == "error"}


def test_listener_section(tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text("t\n")
    cfg, _ = parse_listener_config(
        listener(
            {
                "url": "https://router.example.com",
                "client_id": "kv-a",
                "credential_file": str(token),
            }
        )
    )
    bus = cfg.event_bus
    assert bus is not None and bus.target == "router.example.com:443"
    assert bus.reconnect_backoff_s == 1.0 and bus.drain_deadline_s == 5.0
    v6 = EventBusClientConfig(url="https://[::1]:9443", client_id="a", credential_env="X")
    assert v6.target == "[::1]:9443"


@pytest.mark.parametrize(
    ("bus", "path", "text"),
    [
        ({"url": "http://r:9443"}, "event_bus.url", "https://"),
        ({"url": "https://r:9443/bus"}, "event_bus.url", "no path"),
        ({"url": "https://r:99999"}, "event_bus.url", "bad port"),
        ({"credential": "s3cret"}, "event_bus.credential", "inline credentials are not allowed"),
        ({"credential_file": "/nonexistent"}, "event_bus.credential_file", "does not exist"),
        ({"client_cert_file": "/etc/hostname"}, "event_bus.client_key_file", "go together"),
        ({"credential_env": None}, "event_bus", "no credential"),
        ({"drain_deadline": "soon"}, "event_bus.drain_deadline", "duration"),
        ({"client_id": "a b"}, "event_bus.client_id", "DNS label-like"),
        ({"client_id": "kv-a\n"}, "event_bus.client_id", "DNS label-like"),
        ({"keepalive_time": "500ms"}, "event_bus.keepalive_time", "between 1s"),
        ({"keepalive_timeout": "never"}, "event_bus.keepalive_timeout", "duration"),
    ],
)
def test_listener_errors(bus: dict[str, Any], path: str, text: str) -> None:
    base = {"url": "https://r:9443", "client_id": "kv-a", "credential_env": "T"}
    errs = listener_errors({**base, **bus})
    assert text in errs[path], errs


def test_several_routers_get_one_single_url_section_each() -> None:
    cfg, _ = parse_listener_config(
        listener(
            {
                "urls": ["https://router-a:9443", "https://router-b"],
                "client_id": "kv-a",
                "credential_env": "T",
                "reconnect_backoff": "2s",
            }
        )
    )
    bus = cfg.event_bus
    assert bus is not None and bus.router_urls == ["https://router-a:9443", "https://router-b"]
    each = bus.per_router()
    assert [b.target for b in each] == ["router-a:9443", "router-b:443"]
    assert all(b.urls == [] and b.reconnect_backoff_s == 2.0 for b in each)
    assert all(b.client_id == "kv-a" and b.credential_env == "T" for b in each)
    # The single-URL form is one router, as before.
    one = EventBusClientConfig(url="https://r:9443", client_id="a", credential_env="X")
    assert [b.url for b in one.per_router()] == ["https://r:9443"]


@pytest.mark.parametrize(
    ("bus", "path", "text"),
    [
        ({"url": None}, "event_bus.url", "set url (one router) or urls"),
        ({"urls": ["https://r2:9443"]}, "event_bus.urls", "not both"),
        ({"url": None, "urls": ["https://a:1", "https://A:1/"]}, "event_bus.urls[1]", "twice"),
        ({"url": None, "urls": ["https://a:1", "http://b:1"]}, "event_bus.urls[1]", "https://"),
        ({"url": None, "urls": ["https://a:1/x"]}, "event_bus.urls[0]", "no path"),
        ({"url": None, "urls": "https://a:1"}, "event_bus.urls", "valid list"),
        ({"url": None, "urls": [f"https://r{i}:1" for i in range(65)]}, "event_bus.urls", "64"),
    ],
)
def test_several_router_urls_errors(bus: dict[str, Any], path: str, text: str) -> None:
    base = {"url": "https://r:9443", "client_id": "kv-a", "credential_env": "T"}
    errs = listener_errors({**base, **bus})
    assert text in errs.get(path, ""), errs


def test_durations() -> None:
    assert parse_duration("250ms") == 0.25
    assert parse_duration("2s") == 2.0 and parse_duration("1m") == 60.0
    assert parse_duration("1.5s") == 1.5 and parse_duration("1h") == 3600.0
    assert parse_duration(3) == 3.0
    for bad in ("1 week", "-1s", "s", "", "1e3s"):
        with pytest.raises(ValueError):
            parse_duration(bad)


def test_keepalive_bounds_the_ping_ack_wait_on_both_ends(tls: dict[str, str]) -> None:
    """gRPC core waits ``grpc.http2.ping_timeout_ms`` (a minute unless set) for a ping's
    ack, whatever ``keepalive_timeout_ms`` says: both ends set it to their timeout."""
    from listener.push.client import keepalive_options as client_options
    from router.eventbus.server import keepalive_options as server_options

    cfg, _ = parse_config(
        router(
            {"enabled": True, "tls": tls, "keepalive_time_ms": 4000, "keepalive_timeout_ms": 2000}
        )
    )
    server = dict(server_options(cfg.dynamo.event_bus))
    assert server["grpc.keepalive_time_ms"] == 4000
    assert server["grpc.keepalive_timeout_ms"] == server["grpc.http2.ping_timeout_ms"] == 2000
    assert server["grpc.http2.min_ping_interval_without_data_ms"] == 5000
    bus = EventBusClientConfig(
        url="https://r:9443",
        client_id="a",
        credential_env="X",
        keepalive_time="3s",
        keepalive_timeout="1500ms",
    )
    client = dict(client_options(bus))
    assert client["grpc.keepalive_time_ms"] == 3000
    assert client["grpc.keepalive_timeout_ms"] == client["grpc.http2.ping_timeout_ms"] == 1500
    defaults = dict(client_options(EventBusClientConfig(url="https://r", client_id="a")))
    assert defaults["grpc.keepalive_time_ms"] == 20_000
    assert defaults["grpc.http2.ping_timeout_ms"] == 10_000


@pytest.mark.parametrize(
    ("bus", "path"),
    [
        ({"keepalive_time_ms": 999}, "dynamo.event_bus.keepalive_time_ms"),
        ({"keepalive_timeout_ms": 0}, "dynamo.event_bus.keepalive_timeout_ms"),
        ({"min_client_ping_interval_ms": "often"}, "dynamo.event_bus.min_client_ping_interval_ms"),
    ],
)
def test_router_keepalive_errors(tls: dict[str, str], bus: dict[str, Any], path: str) -> None:
    assert path in router_errors(router({"enabled": True, "tls": tls, **bus}))


def test_an_sse_source_read_timeout() -> None:
    src: list[dict[str, Any]] = [
        {"backend_name": "vllm-1", "endpoint": "http://l:7817/events/vllm-1"}
    ]
    cfg, _ = parse_config(router(None, src))
    assert cfg.kv_cache_index.event_sources[0].read_timeout_ms == 60_000
    src[0]["read_timeout_ms"] = 3000
    cfg, _ = parse_config(router(None, src))
    assert cfg.kv_cache_index.event_sources[0].read_timeout_ms == 3000
    src[0]["read_timeout_ms"] = 50
    assert "kv_cache_index.event_sources[0].read_timeout_ms" in router_errors(router(None, src))


def test_the_push_client_redials_at_least_every_reconnect_backoff_max() -> None:
    """After a long outage every dial failed; the wait once the path heals is bounded by
    ``reconnect_backoff_max`` (10 s), not a minute."""
    from bus.backoff import ExponentialBackoff
    from listener.push.client import EventBusClient
    from listener.stream import EventHub

    def cap(**kw: str) -> float:
        cfg = EventBusClientConfig.model_validate(
            {"url": "https://r", "client_id": "a", "credential_env": "X", **kw}
        )
        client = EventBusClient(cfg, EventHub(backends=["b"]), ["b"])
        backoff = client._supervisor._backoff
        assert isinstance(backoff, ExponentialBackoff)
        return backoff.cap_s

    assert cap() == 10.0
    assert cap(reconnect_backoff="50ms", reconnect_backoff_max="2s") == 2.0
    assert cap(reconnect_backoff="30s", reconnect_backoff_max="2s") == 30.0  # never below
