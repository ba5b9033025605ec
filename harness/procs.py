"""Child processes of the project: spawn on a generated config, wait for READY, stop.

Contract of every service here (router, listener, engine simulator, embeddings server,
benchmark roles): it logs to stderr and, once it serves, prints one line on stdout,
``READY`` followed by bare words (``READY 8123``: a port) and/or ``key=value`` words
(``READY http=127.0.0.1:8080 grpc=127.0.0.1:50051``). A parent never sleeps and never
polls a port: it reads stdout until that line.

Waiting for a line (``expect``, and ``wait_ready`` on top of it): stdout lines are read
until one matches, within one deadline for the whole wait; lines before it are skipped.
End of stdout means the child exited: :class:`ChildExited` (a ``RuntimeError``) with its
exit status, the last stdout line and its log. The deadline passing: :class:`ChildTimeout`
(a ``TimeoutError``) with the same. The two variants share that logic (``_Wait``) and
differ only in how a line is read: :class:`ChildProcess` awaits the asyncio pipe,
:class:`BlockingChild` (the synchronous benchmarks) takes lines from a reader thread,
since a ``Popen`` pipe has no read with a timeout.

Logs: stderr goes to ``log`` (a file, truncated or appended to; :data:`DISCARD` drops
it), or with ``log=None`` to this process's own stderr (the terminal of ``make run``),
in which case no error can quote it. Children run in the repository root with it on
``PYTHONPATH``, so ``python -m router`` works from any working directory.

Stopping: a signal (SIGTERM unless told otherwise, or none after closing stdin), ``grace``
seconds, then SIGKILL. A child that failed to become ready is stopped before the error
reaches the caller, so no failed start leaves a process behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import random
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, Self

import yaml

__all__ = [
    "DISCARD",
    "READY_PATTERN",
    "ROOT",
    "BlockingChild",
    "ChildExited",
    "ChildProcess",
    "ChildTimeout",
    "Ready",
    "Service",
    "free_port",
    "launch",
    "parse_ready",
    "python_module",
]

ROOT = Path(__file__).resolve().parents[1]


def _ephemeral_range() -> tuple[int, int]:
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


_HANDED_OUT: dict[int, None] = {}
"""The ports :func:`free_port` gave lately, oldest first (at most ``_REMEMBERED``)."""
_REMEMBERED = 4096


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on, for a child to bind next.

    Picked at random below the kernel's ephemeral range and checked by binding it. The
    usual ``bind(0)`` hands out a port from that range, where any process's next outgoing
    connection may take it before the child binds it ("Address already in use"); below it,
    only another explicit bind can. Nor is a port this process handed out lately given
    again: two calls before either child binds (an engine's event and replay ports) would
    otherwise get the same port once in some 12,000 pairs, the second child failing to
    bind it.
    """
    low, _ = _ephemeral_range()
    top = max(low - 1, 2048)
    for _ in range(200):
        port = random.randint(max(1024, top - 12_000), top)
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT[port] = None
        if len(_HANDED_OUT) > _REMEMBERED:
            del _HANDED_OUT[next(iter(_HANDED_OUT))]
        return port
    with socket.socket() as s:  # everything tried was taken: fall back to the kernel's pick
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


DISCARD = Path(os.devnull)
"""``log=DISCARD``: the child's stderr is dropped."""
READY_PATTERN = r"^READY(?:\s|$)"
_ERROR_LOG_CHARS = 20_000  # an error quotes at most this much of the log (its end)


class ChildExited(RuntimeError):
    """The child's stdout ended (it exited) before the awaited line."""

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class ChildTimeout(TimeoutError):
    """The awaited line did not come within the deadline."""


# -- READY lines ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Ready:
    """A parsed ``READY`` line: bare ``words`` and ``key=value`` ``fields``, in order."""

    line: str
    words: tuple[str, ...] = ()
    fields: Mapping[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        """The first bare word as a port (``READY 8123``, the simulators' form)."""
        if not self.words or not self.words[0].isdigit():
            raise ValueError(f"READY line without a port: {self.line!r}")
        return int(self.words[0])

    def url(self, key: str = "http") -> str:
        """``http://`` + the ``key=`` field (``READY http=host:port``, the services' form)."""
        try:
            return f"http://{self.fields[key]}"
        except KeyError:
            raise ValueError(f"READY line without {key}=: {self.line!r}") from None


def parse_ready(line: str) -> Ready:
    parts = line.split()
    if not parts or parts[0] != "READY":
        raise ValueError(f"not a READY line: {line!r}")
    words: list[str] = []
    fields: dict[str, str] = {}
    for part in parts[1:]:
        key, sep, value = part.partition("=")
        if sep:
            fields[key] = value
        else:
            words.append(part)
    return Ready(line.strip(), tuple(words), fields)


# -- what both variants share --------------------------------------------------------------


def python_module(module: str, *args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", module, *args]


@contextlib.contextmanager
def _spawn_options(
    *,
    log: Path | None,
    append_log: bool,
    stdin: bool,
    stdout_to_log: bool,
    env: Mapping[str, str] | None,
    cwd: Path,
) -> Iterator[dict[str, Any]]:
    """Keyword arguments for ``Popen`` and ``create_subprocess_exec`` alike (their PIPE and
    DEVNULL constants are the same); the log file is ours only until the spawn."""
    full_env = {**os.environ, **(env or {})}
    full_env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(ROOT), full_env.get("PYTHONPATH", "")) if p
    )
    with contextlib.ExitStack() as stack:
        log_file: IO[bytes] | None = None
        if log is not None:
            log_file = stack.enter_context(open(log, "ab" if append_log else "wb"))
        if stdout_to_log and log_file is None:
            raise ValueError("stdout_to_log needs a log file")
        yield {
            "stdin": subprocess.PIPE if stdin else subprocess.DEVNULL,
            "stdout": log_file if stdout_to_log else subprocess.PIPE,
            "stderr": log_file,
            "cwd": str(cwd),
            "env": full_env,
        }


def _line(raw: bytes) -> str:
    return raw.decode(errors="replace").rstrip("\r\n")


def _read_log(path: Path | None) -> str:
    """The whole log so far ("" when it is not captured or not readable)."""
    if path is None:
        return ""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


class _ChildBase:
    def __init__(self, name: str, log_path: Path | None) -> None:
        self.name = name
        self.log_path = log_path
        self._ready: Ready | None = None

    @property
    def ready(self) -> Ready:
        """The READY line :meth:`wait_ready` returned."""
        if self._ready is None:
            raise RuntimeError(f"{self.name} has not printed READY")
        return self._ready

    def log(self) -> str:
        return _read_log(self.log_path)

    def tail(self, n: int = 2000) -> str:
        return self.log()[-n:]

    def log_report(self) -> str:
        """The log as an error quotes it."""
        if self.log_path is None:
            return "its stderr is not captured (it went to ours)"
        if self.log_path == DISCARD:
            return "its stderr is discarded"
        text = self.log()
        if len(text) > _ERROR_LOG_CHARS:
            text = "[...]" + text[-_ERROR_LOG_CHARS:]
        return f"log ({self.log_path}):\n{text}"


class _Wait:
    """One wait for a stdout line: its deadline, the match, and the errors with the log."""

    def __init__(self, child: _ChildBase, pattern: str, within: float, what: str | None) -> None:
        self.child = child
        self.rx = re.compile(pattern)
        self.within = within
        self.what = what or f"a line matching {pattern!r}"
        self.deadline = time.monotonic() + within
        self.last: str | None = None

    def left(self) -> float:
        """Seconds the next read may take; raises once the deadline has passed."""
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise self.timed_out()
        return left

    def match(self, line: str) -> re.Match[str] | None:
        self.last = line
        return self.rx.search(line)

    def _seen(self) -> str:
        return "" if self.last is None else f" (last stdout line: {self.last!r})"

    def timed_out(self) -> ChildTimeout:
        return ChildTimeout(
            f"{self.child.name}: no {self.what} within {self.within:g}s{self._seen()}; "
            f"{self.child.log_report()}"
        )

    def exited(self, returncode: int) -> ChildExited:
        return ChildExited(
            f"{self.child.name} exited ({returncode}) before {self.what}{self._seen()}; "
            f"{self.child.log_report()}",
            returncode,
        )


# -- asyncio -------------------------------------------------------------------------------


class ChildProcess(_ChildBase):
    """A child on the running event loop; make one with :meth:`start` or :func:`launch`."""

    def __init__(self, name: str, proc: asyncio.subprocess.Process, log_path: Path | None) -> None:
        super().__init__(name, log_path)
        self.proc = proc
        self.ignored_signal = False
        """Whether the last :meth:`stop` had to SIGKILL after the grace period."""

    @classmethod
    async def start(
        cls,
        name: str,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        append_log: bool = False,
        stdin: bool = False,
        stdout_to_log: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> ChildProcess:
        """Spawn without waiting (``stdout_to_log``: for programs with no READY line)."""
        with _spawn_options(
            log=log,
            append_log=append_log,
            stdin=stdin,
            stdout_to_log=stdout_to_log,
            env=env,
            cwd=cwd,
        ) as options:
            proc = await asyncio.create_subprocess_exec(*argv, **options)
        return cls(name, proc, log)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def running(self) -> bool:
        return self.proc.returncode is None

    async def expect(
        self, pattern: str, within: float = 30.0, *, what: str | None = None
    ) -> re.Match[str]:
        """The first stdout line matching ``pattern`` within ``within`` s (see the module).

        The deadline is a parameter, not the caller's ``asyncio.timeout``, because its
        error must quote the child's log."""
        stdout = self.proc.stdout
        if stdout is None:
            raise RuntimeError(f"{self.name}: stdout is not a pipe")
        wait = _Wait(self, pattern, within, what)
        while True:
            try:
                raw = await asyncio.wait_for(stdout.readline(), wait.left())
            except TimeoutError:
                raise wait.timed_out() from None
            if not raw:
                raise wait.exited(await self.proc.wait())
            if m := wait.match(_line(raw)):
                return m

    async def wait_ready(self, within: float) -> Ready:
        """The READY line (kept as ``ready``); a child that does not get there is
        stopped before the error propagates, so a failed start leaves nothing behind."""
        try:
            m = await self.expect(READY_PATTERN, within, what="READY")
        except BaseException:
            await self.stop(grace=1.0)
            raise
        self._ready = parse_ready(m.string)
        return self._ready

    async def stop(
        self, grace: float = 10.0, *, sig: signal.Signals | None = signal.SIGTERM
    ) -> int:
        """``sig`` (``None``: the caller made it exit otherwise, e.g. closed its stdin),
        up to ``grace`` s for the exit, then SIGKILL; the exit status."""
        self.ignored_signal = False
        if self.proc.returncode is None:
            if sig is not None:
                with contextlib.suppress(ProcessLookupError):
                    self.proc.send_signal(sig)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                self.ignored_signal = True
                await self.kill()
        return await self.proc.wait()

    async def kill(self) -> int:
        """SIGKILL: no goodbye on any socket."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        return await self.proc.wait()


async def launch(
    name: str,
    argv: Sequence[str],
    *,
    ready_timeout: float,
    log: Path | None = None,
    append_log: bool = False,
    stdin: bool = False,
    env: Mapping[str, str] | None = None,
    cwd: Path = ROOT,
) -> ChildProcess:
    """Spawn and wait for READY (``child.ready``)."""
    child = await ChildProcess.start(
        name, argv, log=log, append_log=append_log, stdin=stdin, env=env, cwd=cwd
    )
    await child.wait_ready(ready_timeout)
    return child


class Service:
    """A project service, ``python -m <module> [args] --config <path>``, on a config this
    process writes; ready once it prints ``READY http=<host:port> ...`` (``url``).

    Its stderr goes to ``log``: by default a file beside the config (``<path>.log``), where
    a failing test finds it; ``None``: this process's own stderr.

    Restartable: every :meth:`start` rewrites ``config`` (a caller may change it in
    between, e.g. pin ``listen`` to keep the port) and appends to the same log.
    """

    def __init__(
        self,
        name: str,
        module_args: Sequence[str],
        config: dict[str, Any],
        path: Path,
        *,
        log: Path | Literal["beside-config"] | None = "beside-config",
        env: Mapping[str, str] | None = None,
        ready_timeout: float = 20.0,
        stop_grace: float = 10.0,
    ) -> None:
        self.name = name
        self.module_args = list(module_args)
        self.config = config
        self.path = path
        self.log_path = path.with_suffix(".log") if log == "beside-config" else log
        self.env = dict(env or {})
        self.ready_timeout = ready_timeout
        self.stop_grace = stop_grace
        self.child: ChildProcess | None = None
        self.url = ""

    @property
    def proc(self) -> asyncio.subprocess.Process:
        """The running (or last) process; raises if the service was never started."""
        return self._started().proc

    @property
    def running(self) -> bool:
        return self.child is not None and self.child.running

    @property
    def ready(self) -> Ready:
        return self._started().ready

    def log(self) -> str:
        return _read_log(self.log_path)

    async def start(self) -> Self:
        self.path.write_text(yaml.safe_dump(self.config, sort_keys=False), encoding="utf-8")
        module, *args = self.module_args
        self.child = None
        self.child = await launch(
            self.name,
            python_module(module, *args, "--config", str(self.path)),
            ready_timeout=self.ready_timeout,
            log=self.log_path,
            append_log=True,
            env=self.env,
        )
        self.url = self.ready.url()
        return self

    def _started(self) -> ChildProcess:
        if self.child is None:
            raise RuntimeError(f"{self.name} was never started")
        return self.child

    async def stop(self) -> int:
        """SIGTERM, SIGKILL after ``stop_grace`` s; the exit status."""
        return await self._started().stop(self.stop_grace)

    async def kill(self) -> int:
        return await self._started().kill()

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        if self.running:
            await self.stop()


# -- blocking ------------------------------------------------------------------------------


class BlockingChild(_ChildBase):
    """A ``Popen`` child for synchronous code; a thread queues its stdout lines
    (``lines``; ``None`` marks the end) for :meth:`expect`."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        *,
        log: Path | None = None,
        append_log: bool = False,
        stdin: bool = False,
        env: Mapping[str, str] | None = None,
        cwd: Path = ROOT,
    ) -> None:
        super().__init__(name, log)
        with _spawn_options(
            log=log, append_log=append_log, stdin=stdin, stdout_to_log=False, env=env, cwd=cwd
        ) as options:
            self.proc = subprocess.Popen(list(argv), **options)
        self.pid = self.proc.pid
        self.lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            self.lines.put(_line(raw))
        self.lines.put(None)

    def expect(
        self, pattern: str, timeout: float = 30.0, *, what: str | None = None
    ) -> re.Match[str]:
        """The first stdout line matching ``pattern`` within ``timeout`` s (see the module)."""
        wait = _Wait(self, pattern, timeout, what)
        while True:
            try:
                line = self.lines.get(timeout=wait.left())
            except queue.Empty:
                raise wait.timed_out() from None
            if line is None:
                self.lines.put(None)  # the end stays visible to a later expect
                raise wait.exited(self.proc.wait())
            if m := wait.match(line):
                return m

    def wait_ready(self, timeout: float = 30.0) -> Ready:
        """As :meth:`ChildProcess.wait_ready`: a child that does not get there is stopped."""
        try:
            m = self.expect(READY_PATTERN, timeout, what="READY")
        except BaseException:
            self.stop(grace=1.0)
            raise
        self._ready = parse_ready(m.string)
        return self._ready

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    def stop(self, grace: float = 10.0) -> int:
        """SIGTERM, up to ``grace`` s for the exit, then SIGKILL; the exit status."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()
