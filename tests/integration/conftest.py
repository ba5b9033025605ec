"""Integration fixtures: simulated engines and the real router, each as a subprocess.

* ``sims``: a module-scoped :class:`SimFleet` of three engines with different model sets
  (``sim-1``: demo-model + alpha, ``sim-2``: demo-model + beta, ``sim-3``: demo-model).
* ``start_router(config) -> RouterProc``: writes the YAML, runs ``python -m router serve``,
  waits for its ``READY`` line and always stops it at teardown, asserting exit status 0.
  ``module_router_launcher`` does the same for routers shared by a whole module.
* ``FaultProxy``: an in-test HTTP hop in front of a sim that adds the sim's fault headers
  (``x-sim-delay-ms``, ``x-sim-status``, ...) to every POST, so a backend can be made slow,
  broken or garbage-spewing without relying on the router forwarding client headers.

Every async test of this directory runs on one session-wide event loop, so module-scoped
subprocesses and servers can be shared by the tests of a module.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import orjson
import pytest
import pytest_asyncio
import yaml
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from harness.procs import Service
from harness.sim.fleet import SimFleet
from tests import waiting

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent

READY_TIMEOUT_S = 60.0
"""A bound, not a speed check: a router in conversation mode loads its templates and
tokenizers before READY, which took over 20 s on a loaded two-core machine."""
STOP_TIMEOUT_S = 10.0
ERROR_KEYS = {"message", "type", "param", "code"}

# The reload log lines of router/reload.py, one per SIGHUP.
_SIGHUP_APPLIED = "config reloaded (SIGHUP)"
_SIGHUP_REJECTED = "reload (SIGHUP) rejected: keeping the running config"


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run every async test of this directory on the session event loop."""
    marker = pytest.mark.asyncio(loop_scope="session")
    for item in items:
        if pytest_asyncio.is_async_test(item) and HERE in Path(str(item.path)).parents:
            item.add_marker(marker, append=False)


# -- polling -------------------------------------------------------------------------------


async def wait_until(
    predicate: Callable[[], Awaitable[Any]],
    within: float = 5.0,
    interval: float = 0.05,
    what: str = "condition",
) -> Any:
    """Await ``predicate()`` until it returns a truthy value; fail after ``within`` s."""
    return await waiting.eventually(predicate, within, interval, what)


# -- small HTTP helpers --------------------------------------------------------------------


class HttpResult:
    """A fully read response: ``status``, ``headers``, raw ``body`` and ``json()``."""

    __slots__ = ("body", "headers", "status")

    def __init__(self, status: int, headers: Mapping[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body

    def json(self) -> Any:
        return orjson.loads(self.body)

    def __repr__(self) -> str:
        return f"<HttpResult {self.status} {self.body[:300]!r}>"


async def http(
    method: str,
    url: str,
    *,
    json: Any = None,
    data: Any = None,
    headers: Mapping[str, str] | None = None,
    total_s: float = 15.0,
) -> HttpResult:
    """One request on a fresh connection (so no test inherits another's socket state)."""
    connector = aiohttp.TCPConnector(force_close=True)
    async with (
        aiohttp.ClientSession(
            connector=connector, timeout=aiohttp.ClientTimeout(total=total_s)
        ) as session,
        session.request(method, url, json=json, data=data, headers=headers) as resp,
    ):
        body = await resp.read()
        return HttpResult(resp.status, dict(resp.headers), body)


def assert_openai_error(result: HttpResult, status: int) -> dict[str, Any]:
    """Status and the OpenAI error body ``{"error": {message, type, param, code}}``."""
    assert result.status == status, result
    assert result.headers.get("Content-Type", "").startswith("application/json"), result.headers
    body = result.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == ERROR_KEYS, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    return err


def chat_body(user: str = "hello", *, system: str | None = None, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = []
    if system is not None:
        messages.append({"role": "system", "content": system})
    messages.append({"role": "user", "content": user})
    return {"model": "demo-model", "messages": messages, **extra}


def metric_samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """All samples called ``name`` (e.g. ``continuum_requests_total``) as (labels, value)."""
    out: list[tuple[dict[str, str], float]] = []
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                out.append((dict(sample.labels), float(sample.value)))
    return out


def metric_value(text: str, name: str, **labels: str) -> float:
    """Sum of the samples of ``name`` whose labels include ``labels`` (0 when none)."""
    return sum(
        v
        for lbl, v in metric_samples(text, name)
        if all(lbl.get(k) == want for k, want in labels.items())
    )


# -- gRPC ----------------------------------------------------------------------------------


class BearerToken(grpc.aio.UnaryUnaryClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every unary call that has none (the
    router's KvIndex needs it on every method when a token is configured)."""

    def __init__(self, token: str) -> None:
        self._entry = ("authorization", f"Bearer {token}")

    async def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        metadata = list(details.metadata or ())
        if not any(k == "authorization" for k, _ in metadata):
            details = details._replace(metadata=[*metadata, self._entry])
        return await continuation(details, request)


def authed_channel(target: str, token: str) -> grpc.aio.Channel:
    """A plaintext channel whose calls carry the admin token."""
    return grpc.aio.insecure_channel(target, interceptors=[BearerToken(token)])


# -- sockets -------------------------------------------------------------------------------


@pytest.fixture
def dead_url() -> Any:
    """URL of a port that refuses connections: bound (so nobody else gets it), not listening."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


# -- the router process --------------------------------------------------------------------


class RouterProc(Service):
    """A running ``python -m router serve``; stderr (the log) goes to ``log_path``."""

    def __init__(
        self,
        config: dict[str, Any],
        config_path: Path,
        admin_token: str | None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(
            "router",
            ["router", "serve"],
            config,
            config_path,
            env=env,
            ready_timeout=READY_TIMEOUT_S,
            stop_grace=STOP_TIMEOUT_S,
        )
        self.launch_listen: str = config["server"]["listen"]
        self.admin_token = admin_token
        self.grpc_target: str | None = None

    @property
    def config_path(self) -> Path:
        return self.path

    async def start(self) -> RouterProc:
        await super().start()
        self.grpc_target = self.ready.fields.get("grpc")
        return self

    @property
    def grpc_address(self) -> str:
        """``grpc_target`` of a router configured to serve gRPC (its READY line must say)."""
        assert self.grpc_target is not None, "READY must announce the gRPC port"
        return self.grpc_target

    # -- observation ------------------------------------------------------------------

    async def wait_for_log(self, text: str, within: float = 5.0) -> str:
        async def found() -> bool:
            return text in self.log()

        await wait_until(found, within, what=f"log line containing {text!r}")
        return self.log()

    @property
    def admin_headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.admin_token}"} if self.admin_token else {}

    async def stats(self) -> dict[str, Any]:
        r = await http("GET", self.url + "/admin/prefix-routing/stats", headers=self.admin_headers)
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data

    async def stats_of(self, path: str) -> dict[str, Any]:
        """Any admin GET endpoint's JSON."""
        r = await http("GET", self.url + path, headers=self.admin_headers)
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data

    async def post_raw(self, path: str, body: Any) -> HttpResult:
        return await http("POST", self.url + path, json=body, headers=self.admin_headers)

    async def post_json(self, path: str, body: Any) -> dict[str, Any]:
        r = await self.post_raw(path, body)
        assert r.status == 200, r
        data: dict[str, Any] = r.json()
        return data

    async def in_flight(self) -> dict[str, int]:
        dist = (await self.stats())["backend_distribution"]
        return {d["backend"]: d["in_flight_requests"] for d in dist}

    async def metrics(self) -> str:
        r = await http("GET", self.url + "/metrics")
        assert r.status == 200, r
        return r.body.decode()

    async def chat(self, body: Mapping[str, Any] | None = None, **kw: Any) -> HttpResult:
        return await http("POST", self.url + "/v1/chat/completions", json=body or chat_body(), **kw)

    # -- reconfiguration --------------------------------------------------------------

    def write_config(self, config: dict[str, Any] | str) -> None:
        """Replace the file atomically, as editors do (the router polls its contents).

        ``config`` is a dict dumped as YAML, or raw file text (to write broken YAML).
        """
        if isinstance(config, str):
            text = config
        else:
            text = yaml.safe_dump(self.complete(config), sort_keys=False)
        tmp = self.config_path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, self.config_path)

    async def reload(self, config: dict[str, Any] | str, within: float = 5.0) -> bool:
        """Rewrite the file, SIGHUP, and wait for the outcome; returns whether it applied.

        Waits for this SIGHUP's own log line (the file poller may also reload the same
        contents; those lines say "file changed" and are not counted), then, when the new
        config was applied, until /admin/prefix-routing/stats shows its prefix_routing.
        """
        applied_before, rejected_before = self._sighup_outcomes()
        self.write_config(config)
        self.proc.send_signal(signal.SIGHUP)

        async def outcome() -> bool:
            return sum(self._sighup_outcomes()) > applied_before + rejected_before

        await wait_until(outcome, within, what="the router to process SIGHUP")
        applied = self._sighup_outcomes()[0] > applied_before
        if applied and isinstance(config, dict):
            self.config = self.complete(config)
            await self.wait_prefix_config(config, within)
        return applied

    def complete(self, config: dict[str, Any]) -> dict[str, Any]:
        """``config`` with the launch-time ``server.listen`` unless it sets its own, so a
        reload does not change a restart-only field by accident."""
        server = {"listen": self.launch_listen, **(config.get("server") or {})}
        return {**config, "server": server}

    def _sighup_outcomes(self) -> tuple[int, int]:
        log = self.log()
        return log.count(_SIGHUP_APPLIED), log.count(_SIGHUP_REJECTED)

    async def wait_prefix_config(self, config: dict[str, Any], within: float = 5.0) -> None:
        """Poll the stats until their ``config`` section matches ``config``'s prefix_routing."""
        want = expected_prefix_config(config)

        async def visible() -> bool:
            return (await self.stats())["config"] == want

        await wait_until(visible, within, interval=0.1, what=f"stats config == {want}")


def expected_prefix_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The stats ``config`` section the router should report for ``config``."""
    pr = dict(config.get("prefix_routing") or {})
    return {
        "max_prefix_length": pr.get("max_prefix_length", 1024),
        "load_factor_epsilon": pr.get("load_factor_epsilon", 0.25),
        "virtual_nodes": pr.get("virtual_nodes", 150),
        "anthropic_cache_control_injection": pr.get("anthropic_cache_control_injection", False),
    }


class RouterLauncher:
    """Starts routers in ``directory`` and stops every one of them in ``close``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.started: list[RouterProc] = []

    async def start(
        self, config: dict[str, Any], *, env: Mapping[str, str] | None = None
    ) -> RouterProc:
        config = dict(config)
        config["server"] = {"listen": "127.0.0.1:0", **(config.get("server") or {})}
        token_env = config["server"].get("admin_token_env")
        admin_token = {**os.environ, **(env or {})}.get(token_env) if token_env else None
        n = len(self.started) + 1
        rp = RouterProc(config, self.directory / f"router-{n}.yaml", admin_token, env)
        self.started.append(rp)
        await rp.start()
        return rp

    async def close(self) -> None:
        """SIGTERM every router, SIGKILL after a grace period; assert each exited 0."""
        problems: list[str] = []
        for rp in self.started:
            if rp.child is None:
                continue  # its start failed, and said why
            rc = await rp.stop()
            if rp.child.ignored_signal:
                problems.append(f"{rp.config_path.name}: no exit within {STOP_TIMEOUT_S}s")
            if rc != 0:
                problems.append(f"{rp.config_path.name}: exit status {rc}; log:\n{rp.log()}")
        self.started.clear()
        assert not problems, "\n".join(problems)


StartRouter = Callable[..., Awaitable[RouterProc]]


@pytest_asyncio.fixture(loop_scope="session")
async def start_router(tmp_path: Path) -> AsyncIterator[StartRouter]:
    """``await start_router(config_dict, env=None) -> RouterProc``; stopped at teardown."""
    launcher = RouterLauncher(tmp_path)
    try:
        yield launcher.start
    finally:
        await launcher.close()


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def module_router_launcher(
    tmp_path_factory: pytest.TempPathFactory,
) -> AsyncIterator[RouterLauncher]:
    """For a router shared by the tests of one module; stopped after the module."""
    launcher = RouterLauncher(tmp_path_factory.mktemp("routers"))
    try:
        yield launcher
    finally:
        await launcher.close()


# -- simulated engines ---------------------------------------------------------------------

SIM_MODELS = {
    "sim-1": ["demo-model", "alpha"],
    "sim-2": ["demo-model", "beta"],
    "sim-3": ["demo-model"],
}


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def sims() -> AsyncIterator[SimFleet]:
    """Three engines: sim-1 serves demo-model + alpha, sim-2 demo-model + beta, sim-3
    demo-model only (the sim answers any model name unless strict)."""
    overrides = {i: {"model": models} for i, models in enumerate(SIM_MODELS.values())}
    async with SimFleet(n=3, names=list(SIM_MODELS), overrides=overrides) as fleet:
        yield fleet


SIM_ECHO = re.compile(r"^\[(sim-\d)\] echo: ")
"""The simulator's answer text: ``[<engine name>] echo: ...``."""


def served_by(text: str | None) -> str:
    """The name of the simulated engine that wrote ``text``."""
    m = SIM_ECHO.match(text or "")
    assert m, f"not a sim answer: {text!r}"
    return m.group(1)


def backend(name: str, url: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "url": url, "type": "vllm", **extra}


async def sim_json(url: str, path: str) -> Any:
    r = await http("GET", url + path)
    assert r.status == 200, r
    return r.json()


# -- fault injection in front of a sim -----------------------------------------------------

_HOP_BY_HOP = frozenset(
    ("connection", "keep-alive", "transfer-encoding", "content-length", "host", "upgrade")
)


class FaultProxy:
    """Relays every request to ``target`` (a sim), adding ``fault_headers`` to POSTs.

    Health probes (GET) pass unfaulted, so the router keeps the backend in rotation.
    Streams are relayed chunk by chunk; when the router drops its connection, the write
    fails and the upstream connection is closed, so the sim sees the disconnect.
    """

    def __init__(self, target: str, fault_headers: Mapping[str, str]) -> None:
        self.target = target.rstrip("/")
        self.fault_headers = dict(fault_headers)
        self._runner: web.AppRunner | None = None
        self._session: aiohttp.ClientSession | None = None
        self.url = ""

    async def start(self) -> FaultProxy:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=None), auto_decompress=False
        )
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(
            app, access_log=None, handler_cancellation=True, shutdown_timeout=0.5
        )
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = self._runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
        if self._session is not None:
            await self._session.close()

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        assert self._session is not None
        headers = {k: v for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP}
        if request.method == "POST":
            headers.update(self.fault_headers)
        body = await request.read()
        up = await self._session.request(
            request.method, self.target + request.rel_url.path_qs, headers=headers, data=body
        )
        try:
            ctype = up.headers.get("Content-Type", "application/octet-stream")
            if not ctype.startswith("text/event-stream"):
                data = await up.read()
                return web.Response(status=up.status, body=data, headers={"Content-Type": ctype})
            resp = web.StreamResponse(status=up.status, headers={"Content-Type": ctype})
            await resp.prepare(request)
            async for chunk in up.content.iter_any():
                await resp.write(chunk)
            await resp.write_eof()
            return resp
        finally:
            up.close()


MakeFaultProxy = Callable[[str, Mapping[str, str]], Awaitable[FaultProxy]]


@pytest_asyncio.fixture(loop_scope="session")
async def fault_proxy() -> AsyncIterator[MakeFaultProxy]:
    """``await fault_proxy(sim_url, {"x-sim-status": "500"}) -> FaultProxy`` (per test)."""
    proxies: list[FaultProxy] = []

    async def make(target: str, fault_headers: Mapping[str, str]) -> FaultProxy:
        proxy = await FaultProxy(target, fault_headers).start()
        proxies.append(proxy)
        return proxy

    try:
        yield make
    finally:
        for p in proxies:
            await p.close()
