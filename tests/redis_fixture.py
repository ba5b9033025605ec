"""Redis for tests: ``REDIS_URL``, else a private ``redis-server``, else skip (or fail).

Use from a test module with ``pytest_plugins = ("tests.redis_fixture",)``.

* ``redis_url`` (session): ``$REDIS_URL`` if set; otherwise a private ``redis-server`` on a
  free loopback port (``--save "" --appendonly no``), stopped at the end of the session.
* ``redis_server`` (function): always a private server, for tests that kill, pause or
  restart it (never the shared one).

Without Redis the tests skip, unless ``CONTINUUM_REQUIRE_REDIS=1`` (CI): then they fail.
Readiness is awaited by PINGing, never by sleeping a fixed time.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from harness.procs import free_port as _free_port

__all__ = ["RedisServer", "redis_server", "redis_url", "require_redis", "unavailable"]

REQUIRE_ENV = "CONTINUUM_REQUIRE_REDIS"


def require_redis() -> bool:
    """True when missing Redis must fail the test instead of skipping it (CI)."""
    return os.environ.get(REQUIRE_ENV, "") not in ("", "0", "false", "no")


def unavailable(reason: str) -> None:
    """Skip, or fail when ``CONTINUUM_REQUIRE_REDIS`` is set. Never returns."""
    if require_redis():
        pytest.fail(f"{reason} ({REQUIRE_ENV}=1)", pytrace=False)
    pytest.skip(reason)


def _ping(port: int, timeout: float = 0.2) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """A private ``redis-server`` process on a loopback port that stays the same across
    ``kill``/``start`` (so clients can reconnect to the same URL)."""

    def __init__(self, executable: str) -> None:
        self.executable = executable
        self.port = 0
        self._dir = tempfile.TemporaryDirectory(prefix="continuum-redis-")
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout: float = 10.0) -> None:
        """Start (again) on ``self.port``; pick a free port on first start. Waits for PONG."""
        attempts = 1 if self.port else 5
        for _ in range(attempts):
            if not self.port or attempts > 1:
                self.port = _free_port()
            self._proc = subprocess.Popen(
                [
                    self.executable,
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--dir",
                    self._dir.name,
                    "--daemonize",
                    "no",
                    "--loglevel",
                    "warning",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    break  # exited: the port was taken meanwhile, try another
                if _ping(self.port):
                    return
                time.sleep(0.02)
            self.kill()
        raise RuntimeError(f"redis-server did not start on 127.0.0.1:{self.port}")

    def kill(self) -> None:
        """SIGKILL and reap: connections drop at once, nothing is saved."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)

    def close(self) -> None:
        self.kill()
        self._dir.cleanup()


def _executable() -> str | None:
    return shutil.which("redis-server")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A Redis to run against: ``$REDIS_URL``, or a private server for the session."""
    env = os.environ.get("REDIS_URL")
    if env:
        yield env
        return
    exe = _executable()
    if exe is None:
        unavailable("no REDIS_URL and no redis-server on PATH")
    server = RedisServer(exe)  # type: ignore[arg-type]
    server.start()
    try:
        yield server.url
    finally:
        server.close()


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A private server this test may kill and restart (needs redis-server on PATH)."""
    exe = _executable()
    if exe is None:
        unavailable("redis-server not on PATH (needed to kill and restart a private Redis)")
    server = RedisServer(exe)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.close()
