"""Every error a client can meet, each with its status and the OpenAI error body shape.

Most cases share one router (``router``) whose backends are chosen per model name:

========================  ==========================================================
model                     backend
========================  ==========================================================
demo-model                sim-1, sim-2 (healthy)
slow-model                ``slowpoke``: sim-1 behind a proxy adding x-sim-delay-ms
garbage-model             ``garbler``: sim-2 behind a proxy adding x-sim-garbage
error-model               ``broken``: sim-2 behind a proxy adding x-sim-status: 500
stream-model              ``streamer``: sim-3 behind a proxy adding x-sim-stream-delay-ms
ghost-model               ``ghost``: a closed port, marked down by the first health round
========================  ==========================================================

The proxies (conftest ``FaultProxy``) add the sim's fault headers themselves, so these
tests do not depend on the router forwarding client headers (it does not today: see
``test_client_headers_reach_the_engine``). After the error cases,
``test_router_survives_everything_above`` checks the same router process still serves.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator

import aiohttp
import orjson
import pytest_asyncio

from harness.sim.fleet import SimFleet

from .conftest import (
    FaultProxy,
    RouterLauncher,
    RouterProc,
    StartRouter,
    assert_openai_error,
    backend,
    chat_body,
    http,
    metric_value,
    sim_json,
    wait_until,
)

ADMIN_ENV = "CONTINUUM_IT_ADMIN_TOKEN"
ADMIN_TOKEN = "s3cret-admin-token"
MAX_BODY = 4096
REQUEST_TIMEOUT_MS = 1000
SLOW_DELAY_MS = 3000  # well past the request timeout
STREAM_CHUNK_DELAY_MS = 100  # 64 words: the stream would run ~6 s


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def proxies(sims: SimFleet) -> AsyncIterator[dict[str, FaultProxy]]:
    wanted = {
        "slowpoke": (sims[0].url, {"x-sim-delay-ms": str(SLOW_DELAY_MS)}),
        "garbler": (sims[1].url, {"x-sim-garbage": "1"}),
        "broken": (sims[1].url, {"x-sim-status": "500"}),
        "streamer": (sims[2].url, {"x-sim-stream-delay-ms": str(STREAM_CHUNK_DELAY_MS)}),
    }
    started: dict[str, FaultProxy] = {}
    try:
        for name, (target, headers) in wanted.items():
            started[name] = await FaultProxy(target, headers).start()
        yield started
    finally:
        for p in started.values():
            await p.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def router(
    sims: SimFleet,
    proxies: dict[str, FaultProxy],
    module_router_launcher: RouterLauncher,
    dead_url_module: str,
) -> RouterProc:
    cfg = {
        "server": {
            "admin_token_env": ADMIN_ENV,
            "max_body_bytes": MAX_BODY,
            "request_timeout_ms": REQUEST_TIMEOUT_MS,
        },
        "health_check": {"interval_ms": 60_000},
        "backends": [
            backend("sim-1", sims[0].url, models=["demo-model"]),
            backend("sim-2", sims[1].url, models=["demo-model"]),
            backend("slowpoke", proxies["slowpoke"].url, models=["slow-model"]),
            backend("garbler", proxies["garbler"].url, models=["garbage-model"]),
            backend("broken", proxies["broken"].url, models=["error-model"]),
            backend("streamer", proxies["streamer"].url, models=["stream-model"]),
            backend("ghost", dead_url_module, models=["ghost-model"]),
        ],
    }
    return await module_router_launcher.start(cfg, env={ADMIN_ENV: ADMIN_TOKEN})


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def dead_url_module() -> AsyncIterator[str]:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


def chat_url(router: RouterProc) -> str:
    return router.url + "/v1/chat/completions"


# -- request validation --------------------------------------------------------------------


async def test_malformed_json_is_400(router: RouterProc) -> None:
    r = await http("POST", chat_url(router), data=b'{"model": "demo-model", "messages": [')
    err = assert_openai_error(r, 400)
    assert err["type"] == "invalid_request_error"
    assert "JSON" in err["message"]


async def test_non_object_json_is_400(router: RouterProc) -> None:
    for payload in (b"[1, 2, 3]", b'"a string"', b"42", b"null"):
        r = await http("POST", chat_url(router), data=payload)
        err = assert_openai_error(r, 400)
        assert "object" in err["message"], (payload, err)


async def test_missing_model_is_400(router: RouterProc) -> None:
    r = await http("POST", chat_url(router), json={"messages": [{"role": "user", "content": "x"}]})
    err = assert_openai_error(r, 400)
    assert err["param"] == "model"
    r = await http("POST", router.url + "/v1/embeddings", json={"input": "x"})
    assert assert_openai_error(r, 400)["param"] == "model"


async def test_unknown_model_is_404(router: RouterProc) -> None:
    r = await router.chat(chat_body(model="no-such-model"))
    err = assert_openai_error(r, 404)
    assert "no-such-model" in err["message"]
    assert err["code"] == "model_not_found"


async def test_body_over_limit_is_413_with_content_length(router: RouterProc) -> None:
    body = orjson.dumps(chat_body("x" * (MAX_BODY + 100)))
    r = await http("POST", chat_url(router), data=body)
    err = assert_openai_error(r, 413)
    assert err["code"] == "request_too_large"


async def test_body_over_limit_is_413_when_chunked(router: RouterProc) -> None:
    body = orjson.dumps(chat_body("x" * (MAX_BODY + 100)))

    async def chunks() -> AsyncIterator[bytes]:
        for i in range(0, len(body), 1000):
            yield body[i : i + 1000]

    r = await http("POST", chat_url(router), data=chunks())
    err = assert_openai_error(r, 413)
    assert err["code"] == "request_too_large"


async def test_keep_alive_connection_survives_a_413(router: RouterProc) -> None:
    """SDKs pool connections: a rejected oversized body must not poison the next request."""
    host, _, port = router.url.removeprefix("http://").rpartition(":")
    reader, writer = await asyncio.open_connection(host, int(port))

    def request(body: bytes) -> bytes:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: router\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body

    async def response() -> tuple[int, bytes]:
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            name, _, value = line.decode().partition(":")
            if name.strip().lower() == "content-length":
                length = int(value)
        return status, await reader.readexactly(length)

    try:
        writer.write(request(orjson.dumps(chat_body("z" * (MAX_BODY + 10)))))
        status, _ = await asyncio.wait_for(response(), 5)
        assert status == 413
        writer.write(request(orjson.dumps(chat_body("same connection"))))
        status, body = await asyncio.wait_for(response(), 5)
        assert status == 200, body
        assert orjson.loads(body)["choices"][0]["message"]["content"].endswith("same connection")
    finally:
        writer.close()


async def test_body_at_the_limit_is_accepted(router: RouterProc) -> None:
    base = orjson.dumps(chat_body(""))
    body = orjson.dumps(chat_body("y" * (MAX_BODY - len(base))))
    assert len(body) == MAX_BODY
    r = await http("POST", chat_url(router), data=body)
    assert r.status == 200, r

    async def chunks() -> AsyncIterator[bytes]:
        yield body[:1000]
        yield body[1000:]

    r = await http("POST", chat_url(router), data=chunks())
    assert r.status == 200, r


async def test_unknown_path_is_404_and_wrong_method_405(router: RouterProc) -> None:
    r = await http("GET", router.url + "/v1/nothing-here")
    assert assert_openai_error(r, 404)["code"] == "not_found"
    r = await http("GET", chat_url(router))
    assert_openai_error(r, 405)


async def test_error_status_shapes_match_for_embeddings(router: RouterProc) -> None:
    r = await http("POST", router.url + "/v1/embeddings", json={"model": "x"})
    assert assert_openai_error(r, 400)["param"] == "input"
    r = await http(
        "POST", router.url + "/v1/embeddings", json={"model": "no-such-model", "input": "x"}
    )
    assert_openai_error(r, 404)


# -- backend failures ----------------------------------------------------------------------


async def test_no_healthy_backend_is_503_naming_the_model(router: RouterProc) -> None:
    health = (await http("GET", router.url + "/health")).json()
    assert health["backends"] == {"healthy": 6, "total": 7}, "ghost is down after one probe"
    r = await router.chat(chat_body(model="ghost-model"))
    err = assert_openai_error(r, 503)
    assert "ghost-model" in err["message"]
    assert err["type"] == "api_error"


async def test_upstream_timeout_is_504(router: RouterProc) -> None:
    loop = asyncio.get_running_loop()
    started = loop.time()
    r = await router.chat(chat_body(model="slow-model"))
    elapsed = loop.time() - started
    err = assert_openai_error(r, 504)
    assert "slowpoke" in err["message"]
    assert err["code"] == "upstream_timeout"
    assert REQUEST_TIMEOUT_MS / 1000 <= elapsed < SLOW_DELAY_MS / 1000, elapsed


async def test_garbage_from_backend_is_502_naming_it(router: RouterProc) -> None:
    r = await router.chat(chat_body(model="garbage-model"))
    err = assert_openai_error(r, 502)
    assert "garbler" in err["message"]
    assert err["code"] == "bad_gateway"


async def test_backend_500_is_passed_through(router: RouterProc) -> None:
    r = await router.chat(chat_body(model="error-model"))
    err = assert_openai_error(r, 500)
    assert "simulated failure" in err["message"], "the engine's own error body is relayed"
    assert r.headers.get("x-continuum-backend") == "broken"


async def disconnect_mid_stream(router: RouterProc, sim_url: str) -> None:
    """Open a slow stream on ``streamer``, read a few events, then drop the connection."""
    assert (await sim_json(sim_url, "/sim/stats"))["in_flight"] == 0
    body = chat_body("a long streamed answer", model="stream-model", max_tokens=64, stream=True)
    async with aiohttp.ClientSession() as session:
        resp = await session.post(chat_url(router), json=body)
        assert resp.status == 200
        assert resp.headers["x-continuum-backend"] == "streamer"
        data_lines = 0
        while data_lines < 3:
            line = await asyncio.wait_for(resp.content.readline(), 5)
            assert line, "stream ended early"
            data_lines += line.startswith(b"data: ")
        assert (await router.in_flight())["streamer"] == 1
        assert (await sim_json(sim_url, "/sim/stats"))["in_flight"] == 1
        resp.close()  # the client goes away mid-stream


async def test_client_disconnect_mid_stream_releases_the_backend(
    router: RouterProc, sims: SimFleet
) -> None:
    sim = sims[2]
    await disconnect_mid_stream(router, sim.url)

    async def router_released() -> bool:
        return (await router.in_flight())["streamer"] == 0

    async def sim_released() -> bool:
        return (await sim_json(sim.url, "/sim/stats"))["in_flight"] == 0

    # The stream had ~6 s left: releasing within 3 s proves the disconnect propagated.
    await wait_until(router_released, 3.0, what="router in-flight back to 0")
    await wait_until(sim_released, 3.0, what="engine generation aborted")
    text = await router.metrics()
    assert metric_value(text, "continuum_backend_in_flight_requests", backend="streamer") == 0


# -- admin auth ----------------------------------------------------------------------------


async def test_admin_requires_the_token(router: RouterProc) -> None:
    stats_url = router.url + "/admin/prefix-routing/stats"
    for headers in (
        {},
        {"authorization": "Bearer wrong-token"},
        {"authorization": ADMIN_TOKEN},
        {"authorization": f"Basic {ADMIN_TOKEN}"},
    ):
        r = await http("GET", stats_url, headers=headers)
        err = assert_openai_error(r, 401)
        assert err["type"] == "authentication_error", err
        assert r.headers.get("WWW-Authenticate") == "Bearer"
    r = await http("GET", stats_url, headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert r.status == 200
    assert r.json()["enabled"] is False
    # Unknown admin paths do not reveal themselves without the token.
    r = await http("GET", router.url + "/admin/unknown")
    assert_openai_error(r, 401)
    r = await http("GET", router.url + "/admin/unknown", headers=router.admin_headers)
    assert_openai_error(r, 404)
    # Client traffic and metrics need no admin token.
    assert (await http("GET", router.url + "/metrics")).status == 200


# -- after all that --------------------------------------------------------------------------


async def test_router_survives_everything_above(router: RouterProc) -> None:
    assert router.proc.returncode is None, "the router process died"
    r = await router.chat(chat_body("still there?", system="survival"))
    assert r.status == 200, r
    assert r.headers["x-continuum-backend"] in ("sim-1", "sim-2")
    assert r.json()["choices"][0]["message"]["content"].endswith("echo: still there?")
    assert all(v == 0 for v in (await router.in_flight()).values())


# -- connect failures: a separate router, health checks off --------------------------------


async def test_connect_failure_is_retried_on_the_next_backend(
    start_router: StartRouter, sims: SimFleet, dead_url: str
) -> None:
    router = await start_router(
        {
            "selection_strategy": "RoundRobin",
            # Off, and models given: nothing ever marks the dead backend down.
            "health_check": {"enabled": False, "unhealthy_threshold": 100},
            "backends": [
                backend("dead", dead_url, models=["demo-model"]),
                backend("live", sims[0].url, models=["demo-model"]),
                backend("dead-alone", dead_url, models=["lonely-model"]),
            ],
        }
    )
    results = [await router.chat(chat_body(f"attempt {i}")) for i in range(8)]
    assert [r.status for r in results] == [200] * 8, results
    assert {r.headers["x-continuum-backend"] for r in results} == {"live"}
    text = await router.metrics()
    retries = metric_value(text, "continuum_upstream_retries_total", backend="dead")
    assert retries >= 1, "RoundRobin must have picked the dead backend at least once"
    assert metric_value(text, "continuum_requests_total", backend="live", status="200") == 8
    assert metric_value(text, "continuum_requests_total", status="502") == 0

    # With no other candidate there is nothing to retry: 502 naming the backend.
    r = await router.chat(chat_body(model="lonely-model"))
    err = assert_openai_error(r, 502)
    assert "dead-alone" in err["message"]


# -- router bugs found while writing this suite: these two fail until router code is fixed --


async def test_client_disconnect_is_not_counted_as_a_backend_failure(
    router: RouterProc, sims: SimFleet
) -> None:
    """A user pressing "stop" must not make a healthy engine look like it is failing.

    proxy.py's ``_Relay.aclose`` says a client disconnect is "not the backend's failure",
    but the adapter cancels the relay task first, and ``_Relay.__anext__`` treats the
    CancelledError like an upstream error (``_finish(ok=False)`` with blame).
    """
    text = await router.metrics()
    before = metric_value(text, "continuum_backend_success_rate", backend="streamer")
    await disconnect_mid_stream(router, sims[2].url)

    async def released() -> bool:
        return (await router.in_flight())["streamer"] == 0

    await wait_until(released, 3.0, what="router in-flight back to 0")
    text = await router.metrics()
    after = metric_value(text, "continuum_backend_success_rate", backend="streamer")
    assert after == before == 1.0, f"success rate {before} -> {after} after a client disconnect"


async def test_client_headers_reach_the_engine(router: RouterProc, sims: SimFleet) -> None:
    """Per-request headers meant for the engine (tracing, the sim's fault knobs) arrive.

    The router builds upstream headers from scratch (app.py ``_upstream_headers``) and
    keeps only content-type, accept-encoding and x-request-id, so ``traceparent`` and
    ``x-sim-*`` are dropped.
    """
    r = await router.chat(
        chat_body("trace me", system="headers"),
        headers={
            "traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "x-request-id": "req-123",
        },
    )
    assert r.status == 200, r
    served = r.headers["x-continuum-backend"]
    sim = next(s for s in sims if s.name == served)
    seen = {k.lower(): v for k, v in (await sim_json(sim.url, "/sim/last-headers")).items()}
    assert seen.get("x-request-id") == "req-123"
    assert seen.get("traceparent", "").startswith("00-4bf92f3577b34da6"), seen

    # The sim's documented fault knob, sent by the client, must take effect.
    r = await router.chat(chat_body("fail please"), headers={"x-sim-status": "503"})
    assert_openai_error(r, 503)
