"""Start and stop a fleet of simulated engines as real subprocesses.

Real processes rather than in-process servers because the router under test must see real
sockets, real connection failures when a backend is killed, and backends that do not share the
test's event loop (an in-process sim would steal CPU from the router being benchmarked).

Each sim binds port 0 and reports its port on a ``READY <port>`` line, so there is no
pick-a-free-port race and no sleeping: start-up costs exactly as long as it takes.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from harness.procs import ChildProcess, launch, python_module

__all__ = ["SimFleet", "SimProcess", "sim_args"]


def sim_args(opts: Mapping[str, Any]) -> list[str]:
    """Keyword options -> CLI flags (``block_size=8`` -> ``--block-size 8``).

    Generic on purpose, so new ``harness.sim`` flags work through :class:`SimFleet` without
    touching this file: ``True`` is a bare flag, ``False``/``None`` are omitted, sequences
    repeat the flag.
    """
    out: list[str] = []
    for key, value in opts.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            out.append(flag)
        elif value is False or value is None:
            continue
        elif isinstance(value, list | tuple):
            for v in value:
                out += [flag, str(v)]
        else:
            out += [flag, str(value)]
    return out


@dataclass
class SimProcess:
    """One running sim; its log (stderr) is useful when a test fails."""

    name: str
    host: str
    port: int
    child: ChildProcess

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def proc(self) -> asyncio.subprocess.Process:
        return self.child.proc

    @property
    def log_path(self) -> Path | None:
        return self.child.log_path

    @property
    def running(self) -> bool:
        return self.child.running

    def log(self) -> str:
        return self.child.log()


class SimFleet:
    """``async with SimFleet(n=3, model="demo-model", latency=True) as fleet: ...``

    Extra keyword options become CLI flags of every sim (see :func:`sim_args`);
    ``overrides={1: {"unhealthy": True}}`` changes options for single sims by index.
    """

    def __init__(
        self,
        n: int = 1,
        model: str | Sequence[str] = "demo-model",
        *,
        names: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        overrides: Mapping[int, Mapping[str, Any]] | None = None,
        startup_timeout: float = 20.0,
        python: str = sys.executable,
        **opts: Any,
    ) -> None:
        if n < 1:
            raise ValueError("n must be >= 1")
        if names is not None and len(names) != n:
            raise ValueError("names must have n entries")
        self.n = n
        self.models = [model] if isinstance(model, str) else list(model)
        self.host = host
        self._names = list(names) if names is not None else [f"sim-{i + 1}" for i in range(n)]
        self._overrides = dict(overrides or {})
        self._opts = opts
        self._startup_timeout = startup_timeout
        self._python = python
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        self.sims: list[SimProcess] = []

    # -- lifecycle --------------------------------------------------------------------------

    async def __aenter__(self) -> SimFleet:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> SimFleet:
        """Spawn all sims concurrently and return once every one printed READY."""
        if self.sims:
            raise RuntimeError("fleet already started")
        self._tmp = tempfile.TemporaryDirectory(prefix="simfleet-")
        results = await asyncio.gather(
            *(self._spawn(i) for i in range(self.n)), return_exceptions=True
        )
        started = [r for r in results if isinstance(r, SimProcess)]
        self.sims = started
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            await self.stop()
            raise failures[0]
        return self

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM everything, SIGKILL what is still alive after ``grace`` seconds."""
        await asyncio.gather(*(s.child.stop(grace) for s in self.sims))
        self.sims = []
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def terminate(self, index: int, grace: float = 5.0) -> None:
        """Graceful stop of one sim (it finishes nothing: open connections are dropped)."""
        await self.sims[index].child.stop(grace)

    async def kill(self, index: int) -> None:
        """SIGKILL one sim, to test how the router copes with a backend that vanishes."""
        await self.sims[index].child.kill()

    async def restart(self, index: int) -> SimProcess:
        """Start sim ``index`` again after it stopped or was killed, on the same HTTP port
        and the same options (its KV-event ports too): an engine restart as the router and
        the listener see it, with an empty cache and a publisher counting from 0 again."""
        old = self.sims[index]
        if old.running:
            raise RuntimeError(f"{old.name} is still running")
        self.sims[index] = await self._spawn(index, port=old.port)
        return self.sims[index]

    # -- accessors --------------------------------------------------------------------------

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.sims]

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.sims]

    @property
    def ports(self) -> list[int]:
        return [s.port for s in self.sims]

    def __len__(self) -> int:
        return len(self.sims)

    def __getitem__(self, index: int) -> SimProcess:
        return self.sims[index]

    def __iter__(self) -> Iterator[SimProcess]:
        return iter(self.sims)

    async def stats(self) -> list[dict[str, Any]]:
        """``/sim/stats`` of every sim, in fleet order."""
        return await self._each("GET", "/sim/stats")

    async def reset(self) -> None:
        """Clear caches and counters everywhere, so tests do not depend on order."""
        await self._each("POST", "/sim/reset")

    async def _each(self, method: str, path: str) -> list[dict[str, Any]]:
        import aiohttp  # lazy: spawning sims should not require the client stack

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:

            async def one(url: str) -> dict[str, Any]:
                async with session.request(method, url + path) as resp:
                    resp.raise_for_status()
                    data: dict[str, Any] = await resp.json()
                    return data

            return list(await asyncio.gather(*(one(u) for u in self.urls)))

    # -- internals --------------------------------------------------------------------------

    async def _spawn(self, index: int, port: int = 0) -> SimProcess:
        assert self._tmp is not None
        name = self._names[index]
        opts: dict[str, Any] = {**self._opts, **self._overrides.get(index, {})}
        models = opts.pop("model", None) or self.models
        argv = python_module(
            "harness.sim",
            "--host",
            self.host,
            "--port",
            str(port),
            "--name",
            name,
            "--die-with-parent",
            *sim_args({"model": models}),
            *sim_args(opts),
            python=self._python,
        )
        child = await launch(
            name,
            argv,
            ready_timeout=self._startup_timeout,
            log=Path(self._tmp.name) / f"{name}.log",
        )
        return SimProcess(name, self.host, child.ready.port, child)
