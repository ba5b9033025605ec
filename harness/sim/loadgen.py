"""Closed-loop HTTP/1.1 load generator: ``python -m harness.sim.loadgen URL -c 32 -d 5``.

Why not aiohttp: an aiohttp client tops out around the throughput we want to measure, so the
numbers would describe the client. This one keeps N keep-alive connections, each sending the
next request from inside the parser callback of the previous response (no tasks, no awaits
per request), which on uvloop costs a few microseconds per request. ``wrk`` is better when
installed; this exists so ``make bench`` works on a bare machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import cast
from urllib.parse import urlsplit

import httptools

__all__ = ["LoadResult", "run_load"]


@dataclass
class LoadResult:
    """Totals for one run; latencies in seconds, kept whole so percentiles are exact."""

    requests: int = 0
    errors: int = 0
    non_2xx: int = 0
    duration: float = 0.0
    latencies: list[float] = field(default_factory=list, repr=False)

    @property
    def rps(self) -> float:
        return self.requests / self.duration if self.duration else 0.0

    def percentile(self, p: float) -> float:
        if not self.latencies:
            return 0.0
        data = sorted(self.latencies)
        return data[min(len(data) - 1, int(p / 100 * len(data)))]

    def merge(self, other: LoadResult) -> None:
        self.requests += other.requests
        self.errors += other.errors
        self.non_2xx += other.non_2xx
        self.duration = max(self.duration, other.duration)
        self.latencies += other.latencies

    def summary(self) -> dict[str, float | int]:
        return {
            "requests": self.requests,
            "errors": self.errors,
            "non_2xx": self.non_2xx,
            "duration_s": round(self.duration, 3),
            "rps": round(self.rps, 1),
            "p50_ms": round(self.percentile(50) * 1e3, 3),
            "p99_ms": round(self.percentile(99) * 1e3, 3),
        }


def build_request(
    url: str, method: str = "GET", body: bytes = b"", headers: Sequence[str] = ()
) -> tuple[str, int, bytes]:
    """Pre-render the request bytes once; every send is then a single write of a constant."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    port = parts.port or 80
    target = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    lines = [f"{method} {target} HTTP/1.1", f"Host: {host}:{port}"]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
        if not any(h.lower().startswith("content-type:") for h in headers):
            lines.append("Content-Type: application/json")
    lines += list(headers)
    return host, port, ("\r\n".join(lines) + "\r\n\r\n").encode() + body


class _Client(asyncio.Protocol):
    def __init__(self, request: bytes, result: LoadResult, deadline: float) -> None:
        self._request = request
        self._result = result
        self._deadline = deadline
        self._loop = asyncio.get_running_loop()
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._sent = 0.0
        self.done: asyncio.Future[None] = self._loop.create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        self._send()

    def _send(self) -> None:
        assert self._transport is not None
        self._sent = time.perf_counter()
        self._transport.write(self._request)

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError:
            self._result.errors += 1
            self._finish()

    def on_message_complete(self) -> None:
        now = time.perf_counter()
        res = self._result
        res.requests += 1
        res.latencies.append(now - self._sent)
        if not 200 <= self._parser.get_status_code() < 300:
            res.non_2xx += 1
        if self._loop.time() < self._deadline and self._parser.should_keep_alive():
            self._send()
        else:
            self._finish()

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self._result.errors += 1
            self.done.set_result(None)

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)
        if self._transport is not None:
            self._transport.close()


async def run_load(
    host: str, port: int, request: bytes, concurrency: int, duration: float
) -> LoadResult:
    """Keep ``concurrency`` requests outstanding for ``duration`` seconds."""
    loop = asyncio.get_running_loop()
    result = LoadResult()
    deadline = loop.time() + duration
    start = time.perf_counter()
    clients: list[_Client] = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(
            lambda: _Client(request, result, deadline), host, port
        )
        clients.append(proto)
    await asyncio.gather(*(c.done for c in clients))
    result.duration = time.perf_counter() - start
    return result


def _run_in_process(
    host: str, port: int, request: bytes, concurrency: int, duration: float, uvloop_: bool
) -> LoadResult:
    factory = None
    if uvloop_:
        import uvloop

        factory = uvloop.new_event_loop
    with asyncio.Runner(loop_factory=factory) as runner:
        return runner.run(run_load(host, port, request, concurrency, duration))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m harness.sim.loadgen", description=__doc__)
    p.add_argument("url")
    p.add_argument("-c", "--concurrency", type=int, default=32)
    p.add_argument("-d", "--duration", type=float, default=5.0)
    p.add_argument("-m", "--method", default=None, help="default: POST if --body else GET")
    p.add_argument("-b", "--body", default="", help="request body (or @file)")
    p.add_argument("-H", "--header", action="append", default=[], help="'Name: value'")
    p.add_argument("-p", "--procs", type=int, default=1, help="client processes")
    p.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    body = args.body
    if body.startswith("@"):
        with open(body[1:], "rb") as f:
            raw = f.read()
    else:
        raw = body.encode()
    method = args.method or ("POST" if raw else "GET")
    host, port, request = build_request(args.url, method, raw, args.header)
    per_proc = [args.concurrency // args.procs] * args.procs
    for i in range(args.concurrency % args.procs):
        per_proc[i] += 1
    total = LoadResult()
    if args.procs == 1:
        total = _run_in_process(
            host, port, request, args.concurrency, args.duration, not args.no_uvloop
        )
    else:
        with ProcessPoolExecutor(args.procs) as pool:
            futures = [
                pool.submit(
                    _run_in_process, host, port, request, c, args.duration, not args.no_uvloop
                )
                for c in per_proc
            ]
            for fut in futures:
                total.merge(fut.result())
    print(json.dumps(total.summary()))
    return 0 if total.errors == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
