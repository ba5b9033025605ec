"""The KV event stack the listener benchmarks start: engine-side publisher, listener, /proc.

``ingest_bench``, ``bus_bench`` and ``listener_memory_bench`` all run the same engine side
(``python -m harness.publisher``: the engine simulator's burst code on a ZMQ PUB, salted
or not) into a real ``continuum-kv-listener``, as blocking child processes of a
synchronous benchmark, each logging to ``<workdir>/<tag>-<role>.log``. The listener and
the publisher share one salt secret (:data:`SALT_SECRET`), so salted chains verify.

Costs are read from ``/proc``: utime + stime over all of a process's threads (which does
not advance while it waits, so it moves far less with other load than a rate does) and
its resident set.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml

from harness.procs import BlockingChild, free_port
from harness.publisher import DEFAULT_SALT_SECRET, SALT_ENV

__all__ = [
    "BACKEND",
    "SALT_ENV",
    "SALT_SECRET",
    "Child",
    "Listener",
    "Publisher",
    "cpu_seconds",
    "free_port",
    "http_json",
    "listener_config",
    "py",
    "rss_bytes",
    "warm_up",
    "workdir",
]

BACKEND = "sim"
SALT_SECRET = DEFAULT_SALT_SECRET
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads); NaN once it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    f = raw[raw.rindex(")") + 2 :].split()  # comm may hold spaces: split after the last ')'
    return (int(f[11]) + int(f[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def py(*args: str) -> list[str]:
    return [sys.executable, *args]


class Child(BlockingChild):
    """A benchmark child logging to ``<log_dir>/<name>.log``, with the bench salt secret."""

    def __init__(
        self, name: str, cmd: Sequence[str], *, log_dir: Path, stdin: bool = False
    ) -> None:
        env = {SALT_ENV: SALT_SECRET.decode()}
        super().__init__(name, cmd, log=log_dir / f"{name}.log", env=env, stdin=stdin)


def http_json(method: str, url: str, timeout: float = 60.0) -> Any:
    """One request without a body; the JSON answer (anything but a 200 raises)."""
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.rpartition(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        conn.request(method, "/" + path)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {raw[:200]!r}")
        return json.loads(raw)
    finally:
        conn.close()


class Publisher:
    """``python -m harness.publisher`` on a free port; ``next_seq`` follows its PUB."""

    def __init__(
        self, workdir: Path, tag: str, *, fmt: str = "vllm-0.33", salted: bool = True,
        prefixes: int = 0, hwm: int = 100_000, token_ids: str = "simple",
    ) -> None:  # fmt: skip
        self.zmq_port = free_port()
        self.next_seq = 0
        cmd = py(
            "-m", "harness.publisher", "--endpoint", f"tcp://*:{self.zmq_port}",
            "--format", fmt, "--hwm", str(hwm), "--backend", BACKEND,
            "--prefixes", str(prefixes), *(["--salted"] if salted else []),
            "--token-ids", token_ids,
        )  # fmt: skip
        self.child = Child(f"{tag}-pub", cmd, log_dir=workdir, stdin=True)
        self.child.wait_ready()

    @property
    def connect_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def burst(self, batches: int, events_per_batch: int) -> dict[str, Any]:
        """Publish a burst; the publisher's own report (its rate, first and last seq)."""
        self.child.send(f"burst {batches} {events_per_batch}")
        res = json.loads(self.child.expect(r"^\{", timeout=300).string)
        self.next_seq = int(res["last_seq"]) + 1
        return res

    def start_paced(self, rate: float, seconds: float, events_per_batch: int) -> None:
        """Start a paced run (a chain per batch at ``rate`` events/s); :meth:`paced_result`
        waits for its end."""
        self.child.send(f"paced {rate} {seconds} {events_per_batch}")

    def paced_result(self, timeout: float = 120.0) -> dict[str, Any]:
        """The send time of every batch of the paced run (monotonic clock)."""
        res = json.loads(self.child.expect(r"^\{", timeout=timeout).string)
        self.next_seq += len(res["times"])
        return res

    def stop(self) -> None:
        self.child.stop()


def listener_config(
    zmq_endpoint: str,
    *,
    detokenize_url: str | None = None,
    top: dict[str, Any] | None = None,
    source: dict[str, Any] | None = None,
) -> str:
    """A listener config: one vLLM source connecting to ``zmq_endpoint``, verifying salts
    with the bench secret; ``top`` and ``source`` add top-level and source keys."""
    src: dict[str, Any] = {
        "backend_name": BACKEND,
        "engine": "vllm",
        "zmq_endpoint": zmq_endpoint,
        "zmq_mode": "connect",
    }
    if detokenize_url:
        src.update(detokenize_endpoint=detokenize_url, model="demo-model")
    cfg = {"listen": "127.0.0.1:0", "salt_secret_env": SALT_ENV, **(top or {})}
    cfg["sources"] = [{**src, **(source or {})}]
    return yaml.safe_dump(cfg)


class Listener:
    """``continuum-kv-listener`` with a config written to ``workdir``."""

    def __init__(self, config_text: str, workdir: Path, tag: str) -> None:
        cfg = workdir / f"{tag}-listener.yaml"
        cfg.write_text(config_text)
        exe = Path(sys.executable).with_name("continuum-kv-listener")
        cmd = [str(exe)] if exe.exists() else py("-m", "listener")
        cmd += ["--config", str(cfg), "--log-level", "WARNING"]
        self.child = Child(f"{tag}-listener", cmd, log_dir=workdir)
        self.url = self.child.wait_ready().url()
        self.pid = self.child.pid

    def stats(self) -> dict[str, Any]:
        return http_json("GET", self.url + "/stats")

    def source(self) -> dict[str, Any]:
        return self.stats()["sources"][BACKEND]

    def hub_seq(self) -> int:
        """The hub's last record number for BACKEND: one per announced record."""
        return int(self.stats()["hub"]["backends"][BACKEND]["seq"])

    def stop(self) -> None:
        self.child.stop()


def warm_up(trigger: Callable[[], object], seen: Callable[[], bool], limit: float = 20.0) -> int:
    """One-batch bursts until the receiver has seen a frame (ZMQ's slow joiner), so that
    the timed burst after it loses nothing to a subscription still travelling."""
    deadline = time.monotonic() + limit
    n = 0
    while time.monotonic() < deadline:
        trigger()
        n += 1
        t_end = time.monotonic() + 0.25
        while time.monotonic() < t_end:
            if seen():
                return n
            time.sleep(0.02)
    raise TimeoutError("the receiver never saw a warm-up frame")


@contextlib.contextmanager
def workdir(prefix: str, keep: bool = False) -> Iterator[Path]:
    """A fresh directory for the run's configs and process logs; removed at the end
    unless ``keep`` (``--keep-logs``), when its path is printed."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        yield path
    finally:
        if keep:
            print(f"logs and configs kept in {path}")
        else:
            shutil.rmtree(path, ignore_errors=True)
