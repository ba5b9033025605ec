"""The admin surface of a real router process: it refuses to start exposed, every KvIndex
method needs the token, and the gRPC port speaks TLS, with client certificates (mTLS) as
an alternative to the token. Certificates come from the development PKI (``certs``)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bus._gen.continuum.kvindex.v1 import kvindex_pb2 as pb
from bus._gen.continuum.kvindex.v1 import kvindex_pb2_grpc as pb_grpc
from bus.grpc_tls import channel_credentials
from certs import CertPair, dev_bundle, make_client_cert

from .conftest import ROOT, StartRouter, http

TOKEN_ENV = "CONTINUUM_TEST_ADMIN_TOKEN"
TOKEN = "admin-auth-test-token"
SERVICE = pb.DESCRIPTOR.services_by_name["KvIndex"]

Call = Callable[..., Awaitable[Any]]


def calls(stub: pb_grpc.KvIndexStub) -> dict[str, Call]:
    """Every KvIndex method, each with a valid request (a method added to the proto and
    missing here fails the test)."""
    requests = {
        "Query": pb.QueryRequest(prefix_hash="0" * 64),
        "Score": pb.ScoreRequest(prefix_hash="0" * 64),
        "Backends": pb.BackendsRequest(),
        "Stats": pb.StatsRequest(),
        "Clear": pb.ClearRequest(),
    }
    assert set(requests) == {m.name for m in SERVICE.methods}
    return {
        name: (lambda req=req, name=name, **kw: getattr(stub, name)(req, timeout=5, **kw))
        for name, req in requests.items()
    }


async def code_of(call: Awaitable[Any]) -> grpc.StatusCode:
    try:
        await call
    except grpc.aio.AioRpcError as err:
        return err.code()
    return grpc.StatusCode.OK


async def config_error(tmp_path: Path, config: dict[str, Any]) -> str:
    """Run ``router serve`` on ``config``; it must exit 1 before serving. Returns stderr."""
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(config), encoding="utf-8")
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "router",
        "serve",
        "--config",
        str(path),
        cwd=ROOT,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        env={"PATH": "/usr/bin:/bin"},
    )
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 1, (out, err)
    assert b"READY" not in out
    return err.decode()


async def test_a_router_open_to_the_network_without_a_token_refuses_to_start(
    tmp_path: Path,
) -> None:
    err = await config_error(tmp_path, {"server": {"listen": "0.0.0.0:0"}})
    assert "server.listen" in err and "admin_token" in err, err
    err = await config_error(tmp_path, {"server": {"grpc_listen": "0.0.0.0:0"}})
    assert "server.grpc_listen" in err, err
    err = await config_error(tmp_path, {"server": {"admin_token_env": TOKEN_ENV}})
    assert "server.admin_token_env" in err and TOKEN_ENV in err, err


async def test_allow_unauthenticated_lets_a_trusted_network_router_start(
    start_router: StartRouter,
) -> None:
    router = await start_router(
        {"server": {"listen": "0.0.0.0:0", "allow_unauthenticated": True}, "backends": []}
    )
    assert "server.allow_unauthenticated" in router.log()
    r = await http("GET", router.url + "/admin/backends")
    assert r.status == 200, r


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, CertPair]:
    out = tmp_path_factory.mktemp("pki")
    bundle = dev_bundle(out, clients=["operator"])
    other_ca = dev_bundle(out / "other")["ca"]
    bundle["stranger"] = make_client_cert(other_ca, out / "other", "stranger")
    return bundle


def tls(pki: dict[str, CertPair], client: str | None = None) -> grpc.ChannelCredentials:
    pair = pki[client] if client else None
    return channel_credentials(
        str(pki["ca"].cert),
        str(pair.cert) if pair else None,
        str(pair.key) if pair else None,
    )


async def test_every_kvindex_method_needs_the_token_over_tls(
    start_router: StartRouter, pki: dict[str, CertPair]
) -> None:
    router = await start_router(
        {
            "server": {
                "grpc_listen": "127.0.0.1:0",
                "grpc_tls_cert": str(pki["server"].cert),
                "grpc_tls_key": str(pki["server"].key),
                "admin_token_env": TOKEN_ENV,
            },
            "backends": [],
        },
        env={TOKEN_ENV: TOKEN},
    )
    target = router.grpc_address.replace("127.0.0.1", "localhost")
    async with grpc.aio.secure_channel(target, tls(pki)) as channel:
        methods = calls(pb_grpc.KvIndexStub(channel))
        wrong = [None, (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]
        for name, call in methods.items():
            for metadata in wrong:
                code = await code_of(call(metadata=metadata))
                assert code == grpc.StatusCode.UNAUTHENTICATED, (name, metadata)
            # With the token the call gets through to the service (Tier 4 is off here).
            authed = await code_of(call(metadata=(("authorization", f"Bearer {TOKEN}"),)))
            assert authed == grpc.StatusCode.FAILED_PRECONDITION, name
        # Health stays open for probes.
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    # Plaintext to the TLS port gets nowhere.
    async with grpc.aio.insecure_channel(target) as channel:
        stats = calls(pb_grpc.KvIndexStub(channel))["Stats"]
        assert await code_of(stats()) == grpc.StatusCode.UNAVAILABLE
    # /admin is behind the same token.
    assert (await http("GET", router.url + "/admin/backends")).status == 401
    headers = {"authorization": f"Bearer {TOKEN}"}
    assert (await http("GET", router.url + "/admin/backends", headers=headers)).status == 200


async def test_mtls_client_certificates_authenticate_kvindex_without_a_token(
    start_router: StartRouter, pki: dict[str, CertPair]
) -> None:
    router = await start_router(
        {
            "server": {
                "grpc_listen": "127.0.0.1:0",
                "grpc_tls_cert": str(pki["server"].cert),
                "grpc_tls_key": str(pki["server"].key),
                "grpc_tls_client_ca": str(pki["ca"].cert),
            },
            "backends": [],
        }
    )
    target = router.grpc_address.replace("127.0.0.1", "localhost")
    async with grpc.aio.secure_channel(target, tls(pki, "operator")) as channel:
        for name, call in calls(pb_grpc.KvIndexStub(channel)).items():
            assert await code_of(call()) == grpc.StatusCode.FAILED_PRECONDITION, name
    for client in (None, "stranger"):  # no certificate, or one another CA signed
        async with grpc.aio.secure_channel(target, tls(pki, client)) as channel:
            stats = calls(pb_grpc.KvIndexStub(channel))["Stats"]
            assert await code_of(stats()) == grpc.StatusCode.UNAVAILABLE, client
