"""Event bus security against the real router process over real TLS.

Each refusal is asserted by its gRPC status code and detail, as an operator would see it:
no credential and wrong credentials are UNAUTHENTICATED; a right credential used for the
wrong role, another client id or an unlisted backend is PERMISSION_DENIED; a client that
does not trust the router's CA, or (with ``tls.client_ca``) a client without a certificate
from that CA, never completes the TLS handshake. A hot reload that shrinks an entry's
``backends`` ends the live session with Forbidden.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import pytest_asyncio

from bus._gen.continuum.bus.v1 import bus_pb2 as bpb
from harness.procs import free_port

from .conftest import RouterLauncher, RouterProc, StartRouter, metric_value, wait_until
from .push_stack import TOKENS, BusPeer, Pki, broker, make_pki, router_config

pytestmark = pytest.mark.slow

B, C = "vllm-1", "vllm-2"


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory)


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def token_router(
    module_router_launcher: RouterLauncher, pki: Pki
) -> AsyncIterator[tuple[RouterProc, int]]:
    port = free_port()
    brokers = [broker("kv-a", [B, C]), broker("kv-b", [B], role="broker")]
    yield await module_router_launcher.start(router_config(pki, port, [B, C], brokers)), port


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def mtls_router(
    module_router_launcher: RouterLauncher, pki: Pki
) -> AsyncIterator[tuple[RouterProc, int]]:
    port = free_port()
    brokers = [broker("kv-a", [B], token=False)]
    cfg = router_config(pki, port, [B], brokers, client_ca=True)
    yield await module_router_launcher.start(cfg), port


async def refused(
    peer: BusPeer, client_id: str, sources: list[str], role: bpb.Role = bpb.ROLE_KV_LISTENER
) -> Any:
    try:
        return await peer.refusal(client_id, sources, role)
    finally:
        await peer.close()


async def _subscribes(router: RouterProc) -> float:
    return metric_value(await router.metrics(), "continuum_event_bus_subscribes_total")


async def test_a_valid_token_is_welcomed(token_router: tuple[RouterProc, int], pki: Pki) -> None:
    router, port = token_router
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])
    try:
        before = await _subscribes(router)
        call, first = await peer.hello("kv-a", [B, C, B])
        assert first.WhichOneof("kind") == "welcome"
        assert list(first.welcome.accepted_sources) == [B, C]

        async def subscribed() -> bool:
            return await _subscribes(router) > before

        # The router's consumers ask for their streams at once; the listener half-closes
        # with those requests unread, and still gets its status (the call does not hang).
        await wait_until(subscribed, 15, interval=0.05, what="a Subscribe on the session")
        await call.done_writing()
        assert await peer.finish(call) == grpc.StatusCode.OK
    finally:
        await peer.close()


async def test_missing_and_wrong_tokens_are_unauthenticated(
    token_router: tuple[RouterProc, int], pki: Pki
) -> None:
    _, port = token_router
    code, detail = await refused(BusPeer(pki, port), "kv-a", [B])
    assert code == grpc.StatusCode.UNAUTHENTICATED and "no credential" in detail, detail
    code, detail = await refused(BusPeer(pki, port, token="not-the-token"), "kv-a", [B])
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "matches no dynamo.event_bus.brokers entry" in detail


async def test_a_client_that_does_not_trust_the_routers_ca_never_connects(
    token_router: tuple[RouterProc, int], pki: Pki
) -> None:
    _, port = token_router
    peer = BusPeer(pki, port, token=TOKENS["kv-a"], ca=pki.foreign_ca)
    code, _ = await refused(peer, "kv-a", [B])
    assert code == grpc.StatusCode.UNAVAILABLE  # the handshake failed; no call was made


async def test_roles_do_not_cross(token_router: tuple[RouterProc, int], pki: Pki) -> None:
    _, port = token_router
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])  # a kv_listener credential
    code, detail = await refused(peer, "kv-a", [B], bpb.ROLE_BROKER)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "has role kv_listener" in detail
    peer = BusPeer(pki, port, token=TOKENS["kv-b"])  # a broker credential
    code, detail = await refused(peer, "kv-b", [B], bpb.ROLE_KV_LISTENER)
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert "has role broker" in detail


async def test_another_client_id_and_unlisted_backends_are_denied(
    token_router: tuple[RouterProc, int], pki: Pki
) -> None:
    _, port = token_router
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])
    code, detail = await refused(peer, "kv-b", [B])
    assert code == grpc.StatusCode.PERMISSION_DENIED and "client_id 'kv-b'" in detail
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])
    code, detail = await refused(peer, "kv-a", [B, "vllm-9"])
    assert code == grpc.StatusCode.PERMISSION_DENIED
    assert detail == "source 'vllm-9' is not in backends of broker entry 'kv-a'"
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])
    code, detail = await refused(peer, "kv-a", ["bad source!"])
    assert code == grpc.StatusCode.INVALID_ARGUMENT


async def test_client_certificates(mtls_router: tuple[RouterProc, int], pki: Pki) -> None:
    _, port = mtls_router
    peer = BusPeer(pki, port, client=pki.clients["kv-a"])
    try:
        call, first = await peer.hello("kv-a", [B])
        assert first.WhichOneof("kind") == "welcome"
        call.cancel()
    finally:
        await peer.close()
    # Signed by the right CA, but its SAN is no entry id.
    code, detail = await refused(BusPeer(pki, port, client=pki.clients["intruder"]), "kv-a", [B])
    assert code == grpc.StatusCode.UNAUTHENTICATED
    assert "['intruder'] match no broker entry id" in detail
    # The right SAN from another CA, and no certificate at all: no handshake.
    code, _ = await refused(BusPeer(pki, port, client=pki.foreign_kv_a), "kv-a", [B])
    assert code == grpc.StatusCode.UNAVAILABLE
    code, _ = await refused(BusPeer(pki, port), "kv-a", [B])
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_hot_reload_shrinking_backends_ends_the_session_with_forbidden(
    start_router: StartRouter, pki: Pki, tmp_path: Path
) -> None:
    port = free_port()
    config = router_config(pki, port, [B, C], [broker("kv-a", [B, C])])
    router = await start_router(config)
    peer = BusPeer(pki, port, token=TOKENS["kv-a"])
    try:
        call, first = await peer.hello("kv-a", [B, C])
        assert first.WhichOneof("kind") == "welcome"
        shrunk = router_config(pki, port, [B, C], [broker("kv-a", [B])])
        assert await router.reload(shrunk)
        msg = await call.read()
        while msg.WhichOneof("kind") == "subscribe":  # the consumers' own requests
            msg = await call.read()
        assert msg.WhichOneof("kind") == "forbidden"
        assert list(msg.forbidden.sources) == [C]
        assert "no longer include 'vllm-2'" in msg.forbidden.reason
        assert await peer.finish(call) == grpc.StatusCode.PERMISSION_DENIED
        # The shrunk entry may still announce what it keeps; not what it lost.
        again, first = await peer.hello("kv-a", [B])
        assert first.WhichOneof("kind") == "welcome"
        again.cancel()
        code, _ = await peer.refusal("kv-a", [B, C])
        assert code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await peer.close()
