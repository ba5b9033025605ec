"""Who may reach the admin surface: /admin/* and gRPC KvIndex are never open to a network
by accident. A non-loopback listener without a token (or, for gRPC, mTLS) is a config
error naming its YAML path unless ``server.allow_unauthenticated`` says the network is
trusted; a token source that yields nothing is an error, never "no auth"."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from router.admin_auth import AdminToken
from router.config import ConfigError, parse_config

ENV = "CONTINUUM_TEST_ADMIN_TOKEN"


def errors(server: dict[str, Any]) -> dict[str, str]:
    with pytest.raises(ConfigError) as info:
        parse_config({"server": server})
    return {i.path: i.message for i in info.value.issues}


def warnings(server: dict[str, Any]) -> dict[str, str]:
    _, issues = parse_config({"server": server})
    return {i.path: i.message for i in issues if i.severity == "warning"}


def test_the_default_listener_is_loopback_and_needs_no_token() -> None:
    cfg, _ = parse_config({})
    assert cfg.server.listen == "127.0.0.1:8080"
    assert not cfg.server.allow_unauthenticated


@pytest.mark.parametrize(
    "listen", ["127.0.0.1:0", "127.3.2.1:8080", "localhost:8080", "[::1]:8080", "LOCALHOST:1"]
)
def test_loopback_listeners_need_no_token(listen: str) -> None:
    parse_config({"server": {"listen": listen, "grpc_listen": listen}})


@pytest.mark.parametrize("listen", ["0.0.0.0:8080", "[::]:8080", "10.1.2.3:8080", "router:80"])
def test_a_network_http_listener_without_a_token_is_refused(listen: str) -> None:
    errs = errors({"listen": listen})
    assert set(errs) == {"server.listen"}
    assert "admin_token" in errs["server.listen"]
    assert "allow_unauthenticated" in errs["server.listen"]


def test_a_network_grpc_listener_without_a_token_is_refused() -> None:
    errs = errors({"listen": "127.0.0.1:8080", "grpc_listen": "0.0.0.0:50051"})
    assert set(errs) == {"server.grpc_listen"}
    assert "KvIndex" in errs["server.grpc_listen"]


def test_allow_unauthenticated_opts_out_with_a_warning() -> None:
    warns = warnings(
        {"listen": "0.0.0.0:8080", "grpc_listen": "0.0.0.0:50051", "allow_unauthenticated": True}
    )
    assert "server.allow_unauthenticated" in warns


def test_grpc_mtls_authenticates_the_grpc_port_without_a_token(tmp_path: Path) -> None:
    for name in ("crt", "key", "ca"):
        (tmp_path / name).write_text("x")
    parse_config(
        {
            "server": {
                "grpc_listen": "0.0.0.0:50051",
                "grpc_tls_cert": str(tmp_path / "crt"),
                "grpc_tls_key": str(tmp_path / "key"),
                "grpc_tls_client_ca": str(tmp_path / "ca"),
            }
        }
    )


def test_a_client_ca_without_a_server_certificate_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "ca").write_text("x")
    errs = errors({"grpc_tls_client_ca": str(tmp_path / "ca")})
    assert "server.grpc_tls_client_ca" in errs


def test_a_token_over_plaintext_grpc_on_the_network_is_warned_about(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(ENV, "s3cret")
    warns = warnings(
        {"listen": "0.0.0.0:8080", "grpc_listen": "0.0.0.0:50051", "admin_token_env": ENV}
    )
    assert "server.grpc_listen" in warns
    assert "plaintext" in warns["server.grpc_listen"]


@pytest.mark.parametrize("value", [None, "", "   \n"])
def test_an_admin_token_env_that_yields_nothing_is_an_error(
    monkeypatch: pytest.MonkeyPatch, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    errs = errors({"admin_token_env": ENV})  # even on loopback: it was asked for
    assert ENV in errs["server.admin_token_env"]


@pytest.mark.parametrize("content", [b"", b" \n\t\n", b"\xff\xfe"])
def test_an_admin_token_file_that_yields_nothing_is_an_error(
    tmp_path: Path, content: bytes
) -> None:
    path = tmp_path / "token"
    path.write_bytes(content)
    errs = errors({"admin_token_file": str(path)})
    assert str(path) in errs["server.admin_token_file"]


def test_a_token_permits_a_network_listener(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "token"
    path.write_text(" s3cret \n")
    cfg, _ = parse_config({"server": {"listen": "0.0.0.0:8080", "admin_token_file": str(path)}})
    token = AdminToken.from_config(cfg.server)
    assert token.required
    assert token.allows("Bearer s3cret")
    assert not token.allows("Bearer other")
    assert not token.allows(None)


def test_the_token_reader_refuses_an_empty_token_itself(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up reads the token again after validation: an emptied variable still fails."""
    cfg, _ = parse_config({})
    monkeypatch.setenv(ENV, "")
    server = cfg.server.model_copy(update={"admin_token_env": ENV})
    with pytest.raises(ConfigError) as info:
        AdminToken.from_config(server)
    assert info.value.issues[0].path == "server.admin_token_env"
