"""Ingestion benchmark: KV block events per second through the real listener process.

Real processes on this machine, 8 block events per batch (one block per event, chains of 64
blocks, ``POST /sim/burst``'s defaults), every burst as fast as the publisher can send it:

* **publisher**: ``python -m bench.sim --kv-events tcp://*:P`` (``/sim/burst``), or for the
  ``salted`` variants this module's publisher role, which runs the *same* burst code
  (``bench.sim.kv_events.KvEventHub.burst``, the sim's encoder, tokenizer and ZMQ PUB) with
  one change: the first block of every chain carries a router-issued cache salt
  (``bus.salt.encode_salt``) as vLLM shows it, ``extra_keys[0] == [salt]``;
* **baseline** (the ceiling): a bare pyzmq SUB + ``msgpack.unpackb`` loop in its own
  process, receiving the same burst;
* **listener**: ``continuum-kv-listener`` (config in a temp file; source ``engine: vllm``,
  ``zmq_mode: connect`` to the publisher's bound PUB), with one SSE subscriber process
  reading ``GET /events/{backend}`` through ``bus.sse.SseParser``.

What "real ingestion" is here. The sim's own burst carries no salt, so a listener with only
a salt secret *discards* every chain (``discarded_chains``) and tracks nothing, and one with
``/detokenize`` finds no chat-template anchor in the burst's synthetic text, so its chains
end up pending or unattributed: neither publishes a single prefix event. The judged
variants therefore use salted chains, the path a continuum-routed request takes in
production: decode, salt MAC check once per chain, every block tracked (keyed), pruning to
``max_tracked_blocks`` (default 100,000) once the burst passes it, hub and SSE. With one
prefix per chain (``M-salted``, ``A-salted``) every event grows its chain and is announced
(one ``cache_created`` per block event: the output path at its busiest); ``M-salted-64``
spreads the chains over 64 prefixes, so few events are announced. The informative variants
feed the sim's own burst to a listener with a salt secret only (``M-sim``: decode and
discard) or with ``detokenize_endpoint`` at the sim (``M-sim-detok``: chains kept pending
with their tokens, background /detokenize calls).

Measured per run, over the burst (``t0`` = just before the burst is triggered):

* baseline events/s = events the bare loop decoded / (its last frame - t0);
* listener events/s = ``/stats`` ``events`` delta / (first ``/stats`` poll that shows all of
  them - t0); polled every 20 ms;
* SSE records/s = hub ``seq`` delta / (the subscriber's last record - t0);
* CPU s per 1k events = (utime + stime of the process, all threads, ``/proc/<pid>/stat``,
  from t0 to the end of the run) / (events / 1000), for the listener and the bare loop;
* losses: the bare loop checks sequence numbers, the listener reports ``gaps``; a run with
  either is invalid (reported, left out of the medians). SSE losses (the hub's
  ``overflows``, the subscriber's ``buffer_overflow`` record) invalidate the run's SSE
  figures only.

The listener runs with ``subscriber_queue_size: 1000000`` (``--subscriber-queue``): its
ZMQ receive loop drains a queued burst without ever yielding to the event loop, so the SSE
writer only runs once the burst is ingested and the whole burst's records wait in the
subscriber's queue; with the default 4096 the subscriber is closed with
``buffer_overflow`` in every run with one prefix per chain.

Before each timed burst, one-batch bursts are sent until the receiver (bare loop or the
listener's ``/stats`` ``frames``) has seen one, so ZMQ's slow-joiner loss cannot hit the
timed burst; the PUB's SNDHWM and the SUB's RCVHWM (100,000 batches in both the engines and
the listener) exceed the burst, which is therefore queued, not dropped, while the receiver
lags. Every run starts fresh processes; rounds interleave baseline and listener runs of
every variant (alternating which goes first), and the table shows medians and the paired
per-round ratio. Target: listener/baseline >= 40 % for the judged variants.

Run: ``.venv/bin/python -m bench.ingest_bench [--batches 25000] [--repeats 3] [--json F]``
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import queue
import re
import select
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.procs import free_port

from ._table import fmt_float, median, paired_ratio, render_table, verdict
from .procs import BlockingChild

TARGET_RATIO = 0.40
BACKEND = "sim"
MODEL = "demo-model"
SALT_ENV = "CONTINUUM_BENCH_SALT_SECRET"
SALT_SECRET = b"ingest-bench-salt-secret-0123456789"
_ROOT = Path(__file__).resolve().parents[1]
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
_NIL = b"\xc0"  # msgpack nil: a burst event whose parent is nil starts a chain


# ---------------------------------------------------------------------------------------------
# /proc


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # comm may hold spaces: split after the last ')'


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads)."""
    f = _stat_fields(pid)
    return float("nan") if f is None else (int(f[11]) + int(f[12])) / _CLK_TCK


def rss_bytes(pid: int) -> int:
    """VmRSS of ``pid`` in bytes (0 if it is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


# ---------------------------------------------------------------------------------------------
# child processes


class Child(BlockingChild):
    """A benchmark child logging to ``<log_dir>/<name>.log``."""

    def __init__(
        self,
        name: str,
        cmd: Sequence[str],
        *,
        env: dict[str, str] | None = None,
        log_dir: Path,
        stdin: bool = False,
    ) -> None:
        super().__init__(name, cmd, log=log_dir / f"{name}.log", env=env, stdin=stdin)


def _py(*args: str) -> list[str]:
    return [sys.executable, *args]


def _http(method: str, url: str, body: bytes | None = None, timeout: float = 60.0) -> Any:
    host, port = url.removeprefix("http://").split("/", 1)[0].rsplit(":", 1)
    path = "/" + url.removeprefix("http://").split("/", 1)[1]
    conn = http.client.HTTPConnection(host, int(port), timeout=timeout)
    try:
        headers = {"content-type": "application/json"} if body is not None else {}
        conn.request(method, path, body, headers)
        resp = conn.getresponse()
        raw = resp.read()
        if resp.status != 200:
            raise RuntimeError(f"{method} {url}: HTTP {resp.status}: {raw[:200]!r}")
        return json.loads(raw)
    finally:
        conn.close()


# ---------------------------------------------------------------------------------------------
# publishers: the sim (its own burst) and the salted burst (this module's publisher role)


class Publisher:
    """Starts a burst publisher and triggers its bursts; ``next_seq`` follows its PUB."""

    def __init__(
        self, kind: str, fmt: str, log_dir: Path, hwm: int, tag: str, prefixes: int = 0
    ) -> None:
        self.kind, self.fmt = kind, fmt
        self.zmq_port = free_port()
        self.next_seq = 0
        self.http_url = ""
        endpoint = f"tcp://*:{self.zmq_port}"
        if kind == "sim":
            cmd = _py(
                "-m", "bench.sim", "--port", "0", "--die-with-parent",
                "--kv-events", endpoint, "--kv-events-format", fmt,
                "--kv-events-hwm", str(hwm), "--model", MODEL,
            )  # fmt: skip
            self.child = Child(f"{tag}-sim", cmd, log_dir=log_dir)
            self.http_url = f"http://127.0.0.1:{self.child.wait_ready().port}"
        else:
            cmd = _py(
                "-m", "bench.ingest_bench", "--role", "publisher", "--endpoint", endpoint,
                "--format", fmt, "--hwm", str(hwm), "--salted", "--prefixes", str(prefixes),
            )  # fmt: skip
            self.child = Child(f"{tag}-pub", cmd, log_dir=log_dir, stdin=True)
            self.child.wait_ready()

    @property
    def connect_endpoint(self) -> str:
        return f"tcp://127.0.0.1:{self.zmq_port}"

    def burst(self, batches: int, events_per_batch: int) -> dict[str, Any]:
        """Publish a burst and wait for the publisher's own report (rate, seqs)."""
        if self.kind == "sim":
            body = {"batches": batches, "events_per_batch": events_per_batch}
            res = _http("POST", self.http_url + "/sim/burst", json.dumps(body).encode())
        else:
            self.child.send(f"burst {batches} {events_per_batch}")
            res = json.loads(self.child.expect(r"^\{", timeout=300).string)
        self.next_seq = int(res["last_seq"]) + 1
        return res

    def stop(self) -> None:
        self.child.stop()


class _SaltingEncoder:
    """The sim's encoder, plus a router-issued cache salt on every chain's first block.

    ``KvEventHub.burst`` packs a chain's first event with parent nil; this wrapper puts
    ``[salt]`` into that event's ``extra_keys[0]`` (vLLM >= 0.17, both encodings), or into
    ``cache_salt`` for SGLang formats. ``prefixes == 0``: a new prefix key per chain.
    """

    def __init__(self, enc: Any, secret: bytes, backend: str, prefixes: int, bpe: int) -> None:
        from bus.salt import encode_salt

        self._enc, self.fmt = enc, enc.fmt
        self._secret, self._backend, self._prefixes, self._bpe = secret, backend, prefixes, bpe
        self._encode_salt = encode_salt
        self._chains = 0
        self._memo: dict[int, str] = {}
        import msgpack

        self._packb = msgpack.Packer(use_bin_type=True, autoreset=True).pack

    def _salt(self) -> str:
        i = self._chains if self._prefixes <= 0 else self._chains % self._prefixes
        self._chains += 1
        salt = self._memo.get(i)
        if salt is None:
            key = hashlib.sha256(b"ingest-bench-prefix-%d" % i).digest()
            salt = self._encode_salt(self._secret, self._backend, key)
            if self._prefixes > 0:
                self._memo[i] = salt
        return salt

    def stored_packed(
        self,
        hashes: bytes,
        parent: bytes,
        tokens: bytes,
        block_size: bytes,
        extra_keys: bytes,
        cache_salt: str | None = None,
    ) -> bytes:
        if parent == _NIL:
            salt = self._salt()
            if self.fmt.salt == "extra_keys":
                keys = [[salt]] + [None] * (self._bpe - 1)
                return self._enc.stored_packed(
                    hashes, parent, tokens, block_size, self._packb(keys)
                )
            return self._enc.stored_packed(hashes, parent, tokens, block_size, extra_keys, salt)
        return self._enc.stored_packed(hashes, parent, tokens, block_size, extra_keys)

    def batch(self, ts: float, events: Sequence[bytes], dp_rank: int | None = 0) -> bytes:
        return self._enc.batch(ts, events, dp_rank)


def salted_hub(
    endpoint: str, fmt: str, hwm: int, salt: tuple[bytes, str, int] | None
) -> tuple[Any, Any]:
    """The simulator's KV event hub publishing on a ZMQ PUB at ``endpoint``: (hub, pub).
    ``salt`` = (secret, backend, prefixes) puts a router-issued salt on every chain's
    first block (``_SaltingEncoder``); None publishes unsalted."""
    from bench.sim.kv_events import KvEventHub, ZmqPublisher
    from bench.sim.kv_wire import get_format
    from bench.sim.tokenizer import SimpleTokenizer

    pub = ZmqPublisher(endpoint, hwm=hwm)
    hub = KvEventHub(
        block_size=16, fmt=get_format(fmt), publisher=pub, sample_ids=SimpleTokenizer().sample_ids
    )
    if salt is not None:
        secret, backend, prefixes = salt
        hub.encoder = _SaltingEncoder(hub.encoder, secret, backend, prefixes, 1)
    return hub, pub


def publisher_role(args: argparse.Namespace) -> int:
    """Hidden role: a sim-equivalent burst publisher controlled by stdin lines.

    ``burst BATCHES EVENTS_PER_BATCH`` publishes and prints the burst's JSON report.
    """
    import asyncio

    async def main() -> None:
        secret = os.environ.get(SALT_ENV, "").encode() or SALT_SECRET
        salt = (secret, args.backend, args.prefixes) if args.salted else None
        hub, _ = salted_hub(args.endpoint, args.format, args.hwm, salt)
        hub.start()
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    return
                parts = line.split()
                if parts[:1] == ["burst"]:
                    res = await hub.burst(int(parts[1]), int(parts[2]))
                    print(json.dumps(res), flush=True)
        finally:
            hub.close()

    asyncio.run(main())
    return 0


# ---------------------------------------------------------------------------------------------
# the bare receive-and-decode loop (baseline) and the SSE subscriber


def receiver_role(args: argparse.Namespace) -> int:
    """Hidden role: bare SUB + ``msgpack.unpackb``.

    Idle: prints ``SEEN <seq>`` per frame (warm-up). ``arm FIRST N`` on stdin: prints
    ``ARMED``, then receives and decodes until batch ``FIRST+N-1`` (or 10 s of silence) and
    prints ``{"events", "batches", "lost", "t_last"}``.
    """
    import msgpack
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, args.hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(args.endpoint)
    print("READY", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    buf = b""
    while True:
        ready = dict(poller.poll(1000))
        if sock in ready:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                print(f"SEEN {int.from_bytes(frames[1], 'big')}", flush=True)
        if sys.stdin.fileno() in ready:
            chunk = os.read(sys.stdin.fileno(), 4096)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                parts = line.decode().split()
                if parts[:1] != ["arm"]:
                    continue
                first, n = int(parts[1]), int(parts[2])
                sock.setsockopt(zmq.RCVTIMEO, 10_000)
                print("ARMED", flush=True)
                # -- the measured loop ----------------------------------------------------
                recv, unpackb = sock.recv_multipart, msgpack.unpackb
                last = first + n - 1
                expect = first
                events = batches = 0
                try:
                    while expect <= last:
                        _topic, seq8, payload = recv()
                        seq = int.from_bytes(seq8, "big")
                        if seq < first:
                            continue
                        expect = seq + 1
                        events += len(unpackb(payload)[1])
                        batches += 1
                except zmq.Again:
                    pass
                t_last = time.monotonic()
                sock.setsockopt(zmq.RCVTIMEO, -1)
                out = {"events": events, "batches": batches, "lost": n - batches}
                print(json.dumps({**out, "t_last": t_last}), flush=True)


def sse_role(args: argparse.Namespace) -> int:
    """Hidden role: one SSE subscriber (``bus.sse.SseParser``) of ``GET /events/{backend}``.

    Prints ``OPEN`` once the response headers are in. ``until SEQ`` on stdin: once a live
    record with that seq (or a later one) arrived, prints ``{"records", "last_seq",
    "t_last", "errors", "closed", "cpu"}`` and exits; also after 10 s without any record.
    """
    from bus.sse import SseParser

    host, port = args.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    # HTTP/1.0: the server streams without chunked encoding until it closes.
    sock.sendall(
        f"GET /events/{args.backend} HTTP/1.0\r\nHost: {host}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            print("CLOSED", flush=True)
            return 1
        head += chunk
    status_line, _, rest = head.partition(b"\r\n")
    if b" 200 " not in status_line + b" ":
        print(f"HTTP {status_line!r}", flush=True)
        return 1
    body = rest.split(b"\r\n\r\n", 1)[1]
    print("OPEN", flush=True)
    parser = SseParser()
    records = errors = 0
    last_seq = -1
    t_last = 0.0
    target: int | None = None
    closed = False
    stdin = sys.stdin.fileno()
    idle_since = time.monotonic()

    def feed(data: bytes) -> None:
        nonlocal records, errors, last_seq, t_last
        recs = parser.feed(data)
        if not recs:
            return
        now = time.monotonic()
        for r in recs:
            records += 1
            if r.event == "error":
                errors += 1
            rid = r.id or ""
            epoch, sep, seq = rid.rpartition("-")
            if sep and "." not in epoch and seq.isdigit():
                last_seq = int(seq)
        t_last = now

    feed(body)
    sock.setblocking(False)
    while True:
        readable, _, _ = select.select([sock, stdin], [], [], 0.5)
        if sock in readable:
            try:
                chunk = sock.recv(1 << 20)
            except BlockingIOError:
                chunk = None
            if chunk == b"":
                closed = True
            elif chunk:
                feed(chunk)
                idle_since = time.monotonic()
        if stdin in readable:
            line = os.read(stdin, 4096).decode()
            m = re.search(r"until (\d+)", line)
            if m:
                target = int(m.group(1))
                idle_since = time.monotonic()
        done = target is not None and (last_seq >= target or closed)
        if done or (target is not None and time.monotonic() - idle_since > 10):
            out = {
                "records": records,
                "last_seq": last_seq,
                "t_last": t_last,
                "errors": errors,
                "closed": closed,
                "cpu": time.process_time(),
            }
            print(json.dumps(out), flush=True)
            return 0
        if closed and target is None:
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# the listener


def listener_yaml(
    zmq_endpoint: str,
    *,
    detokenize_url: str | None = None,
    salt: bool = True,
    subscriber_queue_size: int | None = None,
    extra_source: dict[str, Any] | None = None,
) -> str:
    lines = ['listen: "127.0.0.1:0"']
    if subscriber_queue_size is not None:
        lines.append(f"subscriber_queue_size: {subscriber_queue_size}")
    if salt:
        lines.append(f"salt_secret_env: {SALT_ENV}")
    lines += [
        "sources:",
        f"  - backend_name: {BACKEND}",
        "    engine: vllm",
        f'    zmq_endpoint: "{zmq_endpoint}"',
        "    zmq_mode: connect",
    ]
    if detokenize_url:
        lines += [f'    detokenize_endpoint: "{detokenize_url}"', f"    model: {MODEL}"]
    for k, v in (extra_source or {}).items():
        lines.append(f"    {k}: {v}")
    return "\n".join(lines) + "\n"


class Listener:
    """``continuum-kv-listener`` with a config written to ``workdir``."""

    def __init__(
        self, config_text: str, workdir: Path, tag: str, command: str | None = None
    ) -> None:
        cfg = workdir / f"{tag}-listener.yaml"
        cfg.write_text(config_text)
        if command:
            cmd = shlex.split(command)
        else:
            exe = Path(sys.executable).with_name("continuum-kv-listener")
            cmd = [str(exe)] if exe.exists() else _py("-m", "listener")
        cmd += ["--config", str(cfg), "--log-level", "WARNING"]
        env = {SALT_ENV: SALT_SECRET.decode()}
        self.child = Child(f"{tag}-listener", cmd, env=env, log_dir=workdir)
        self.url = self.child.wait_ready().url()
        self.pid = self.child.pid

    def stats(self) -> dict[str, Any]:
        return _http("GET", self.url + "/stats")  # type: ignore[no-any-return]

    def source(self, st: dict[str, Any] | None = None) -> dict[str, Any]:
        st = st if st is not None else self.stats()
        return st["sources"][BACKEND]  # type: ignore[no-any-return]

    def stop(self) -> None:
        self.child.stop()


def warm_up(trigger: Callable[[], None], seen: Callable[[], bool], limit: float = 20.0) -> int:
    """One-batch bursts until the receiver has seen a frame (ZMQ's slow joiner)."""
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


# ---------------------------------------------------------------------------------------------
# profiling (py-spy, optional)


def py_spy_path() -> str | None:
    exe = Path(sys.executable).with_name("py-spy")
    return str(exe) if exe.exists() else shutil.which("py-spy")


def start_py_spy(pid: int, out: Path) -> subprocess.Popen[bytes]:
    """``py-spy record`` of ``pid`` (collapsed stacks per function, busy samples only)."""
    exe = py_spy_path()
    if exe is None:
        raise RuntimeError("py-spy not found (.venv/bin/pip install py-spy)")
    cmd = [exe, "record", "-p", str(pid), "-r", "250", "-F", "--nonblocking"]
    cmd += ["-f", "raw", "-o", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    time.sleep(0.5)  # attach before the burst starts
    return proc


def stop_py_spy(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


_FRAME_RE = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?):\d+\)$")


def _frame_name(frame: str) -> str:
    """``file.py:function`` of a py-spy frame ``function (path/file.py:line)``."""
    m = _FRAME_RE.match(frame.strip())
    if not m:
        return frame.strip()
    path = m.group("file")
    for marker in ("/site-packages/", "/lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    else:
        with contextlib.suppress(ValueError):
            path = str(Path(path).relative_to(_ROOT))
    return f"{path}:{m.group('fn')}"


_STAGES = (
    # (stage, any of these frames in the stack); the first match wins, innermost stages first
    ("pruning (BlockStore.enforce)", ("listener/chains/blocks.py:BlockStore.enforce",)),
    ("emit: KvEvent, hub publish, SSE encode", ("listener/chains/prefixes.py:PrefixLedger.flush",)),
    ("track (ChainTracker.apply, rest)", ("listener/chains/tracker.py:ChainTracker.apply",)),
    ("decode (decode_batch)", ("listener/decode.py:decode_batch",)),
    ("SSE write (SseServer._events)", ("listener/sse_server.py:SseServer._events",)),
    (
        "attribution workers, /detokenize",
        ("listener/chains/attribution.py:AttributionJobs._worker",),
    ),
    ("receive (pyzmq asyncio)", ("zmq/",)),
    ("source loop (ZmqSource)", ("listener/zmq_source.py:",)),
)


def summarize_profile(path: Path, top: int = 15) -> str:
    """Stage shares and the busiest functions of a py-spy raw (collapsed) profile."""
    self_n: dict[str, int] = {}
    incl_n: dict[str, int] = {}
    stage_n: dict[str, int] = {}
    total = 0
    for line in path.read_text(errors="replace").splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_frame_name(f) for f in stack.split(";")]
        if not frames:
            continue
        n = int(count)
        total += n
        self_n[frames[-1]] = self_n.get(frames[-1], 0) + n
        for f in set(frames):
            incl_n[f] = incl_n.get(f, 0) + n
        stage = "other (event loop, aiohttp, /stats)"
        for name, marks in _STAGES:
            if any(f.startswith(m) or f == m for f in frames for m in marks):
                stage = name
                break
        stage_n[stage] = stage_n.get(stage, 0) + n
    if not total:
        return "(no samples)"
    out = [f"{total} busy samples (py-spy, per function); time by pipeline stage:"]
    rows = [[k, f"{v / total:.1%}"] for k, v in sorted(stage_n.items(), key=lambda kv: -kv[1])]
    out.append(render_table(["stage", "share"], rows))
    out += ["", f"top {top} functions by self time:"]
    rows = [
        [name, f"{n / total:.1%}", f"{incl_n.get(name, 0) / total:.1%}"]
        for name, n in sorted(self_n.items(), key=lambda kv: -kv[1])[:top]
    ]
    out.append(render_table(["function", "self", "inclusive"], rows))
    return "\n".join(out)


# ---------------------------------------------------------------------------------------------
# variants and runs


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    fmt: str
    publisher: str  # "sim" | "salted"
    detokenize: bool = False
    judged: bool = True
    prefixes: int = 0  # salted: distinct prefix keys (0: one per chain)


VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("M-salted", "M (vllm-0.33), salted chains", "vllm-0.33", "salted"),
        Variant("A-salted", "A (vllm-0.23.0), salted chains", "vllm-0.23.0", "salted"),
        Variant("M-salted-64", "M, salted, 64 shared prefixes", "vllm-0.33", "salted", prefixes=64),
        Variant("M-sim", "M, sim burst, salt secret only", "vllm-0.33", "sim", judged=False),
        Variant(
            "M-sim-detok",
            "M, sim burst, /detokenize",
            "vllm-0.33",
            "sim",
            detokenize=True,
            judged=False,
        ),
    )
}


@dataclass
class Cell:
    variant: Variant
    base: list[dict[str, Any]] = field(default_factory=list)
    listener: list[dict[str, Any]] = field(default_factory=list)


def run_baseline(v: Variant, args: argparse.Namespace, workdir: Path, tag: str) -> dict[str, Any]:
    pub = Publisher(v.publisher, v.fmt, workdir, args.hwm, tag, v.prefixes)
    rx: Child | None = None
    try:
        cmd = _py(
            "-m", "bench.ingest_bench", "--role", "receiver",
            "--endpoint", pub.connect_endpoint, "--hwm", str(args.hwm),
        )  # fmt: skip
        rx = Child(f"{tag}-bare", cmd, log_dir=workdir, stdin=True)
        rx.wait_ready()
        receiver = rx

        def seen() -> bool:
            try:
                while True:
                    line = receiver.lines.get_nowait()
                    if line and line.startswith("SEEN"):
                        return True
            except queue.Empty:
                return False

        warm_up(lambda: pub.burst(1, args.events_per_batch), seen)
        time.sleep(0.1)
        rx.send(f"arm {pub.next_seq} {args.batches}")
        rx.expect(r"^ARMED")
        cpu0 = cpu_seconds(rx.pid)
        t0 = time.monotonic()
        pub_res = pub.burst(args.batches, args.events_per_batch)
        res = json.loads(rx.expect(r"^\{", timeout=600).string)
        cpu = cpu_seconds(rx.pid) - cpu0
        seconds = res["t_last"] - t0
        events = res["events"]
        return {
            "events": events,
            "seconds": seconds,
            "events_per_s": events / seconds if seconds > 0 else float("nan"),
            "cpu_s_per_1k": cpu / (events / 1000) if events else float("nan"),
            "lost_batches": res["lost"],
            "pub_events_per_s": pub_res.get("events_per_s") or float("nan"),
            "valid": res["lost"] == 0,
        }
    finally:
        if rx is not None:
            rx.stop()
        pub.stop()


def run_listener(
    v: Variant,
    args: argparse.Namespace,
    workdir: Path,
    tag: str,
    profile_out: Path | None = None,
) -> dict[str, Any]:
    pub = Publisher(v.publisher, v.fmt, workdir, args.hwm, tag, v.prefixes)
    lst: Listener | None = None
    sse: Child | None = None
    spy: subprocess.Popen[bytes] | None = None
    try:
        detok = pub.http_url + "/detokenize" if v.detokenize else None
        lst = Listener(
            listener_yaml(
                pub.connect_endpoint,
                detokenize_url=detok,
                subscriber_queue_size=args.subscriber_queue,
            ),
            workdir,
            tag,
            args.listener_cmd,
        )
        listener = lst
        warm_up(
            lambda: pub.burst(1, args.events_per_batch),
            lambda: listener.source()["frames"] > 0,
        )
        cmd = _py(
            "-m", "bench.ingest_bench", "--role", "sse", "--url", lst.url, "--backend", BACKEND,
        )  # fmt: skip
        sse = Child(f"{tag}-sse", cmd, log_dir=workdir, stdin=True)
        sse.expect(r"^OPEN")
        deadline = time.monotonic() + 10
        while lst.stats()["hub"]["backends"][BACKEND]["subscribers"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the SSE subscriber did not register")
            time.sleep(0.02)
        time.sleep(0.2)  # warm-up stragglers, detokenize jobs of the warm-up chains
        st0 = lst.stats()
        src0, hub0 = st0["sources"][BACKEND], st0["hub"]["backends"][BACKEND]
        expected = args.batches * args.events_per_batch
        if profile_out is not None:
            spy = start_py_spy(lst.pid, profile_out)
        cpu0, sse_cpu0 = cpu_seconds(lst.pid), cpu_seconds(sse.pid)
        t0 = time.monotonic()
        box: dict[str, Any] = {}
        trig = threading.Thread(
            target=lambda: box.update(pub.burst(args.batches, args.events_per_batch))
        )
        trig.start()
        t_done = float("nan")
        last_events, last_change = src0["events"], time.monotonic()
        st = st0
        while True:
            time.sleep(0.02)
            st = lst.stats()
            now = time.monotonic()
            src = st["sources"][BACKEND]
            if src["events"] - src0["events"] >= expected:
                t_done = now
                break
            if src["events"] != last_events:
                last_events, last_change = src["events"], now
            elif now - last_change > 10 and not trig.is_alive():
                break  # lost batches: stop waiting
        trig.join()
        src, hub = st["sources"][BACKEND], st["hub"]["backends"][BACKEND]
        sse.send(f"until {hub['seq']}")
        sres = json.loads(sse.expect(r"^\{", timeout=120).string)
        sse_cpu = sres["cpu"] - sse_cpu0
        cpu = cpu_seconds(lst.pid) - cpu0
        if spy is not None:
            stop_py_spy(spy)
            spy = None
        events = src["events"] - src0["events"]
        records = hub["seq"] - hub0["seq"]
        sse_ok = sres["last_seq"] >= hub["seq"] and not sres["errors"]
        t_sse = sres["t_last"] if records else float("nan")
        gaps = src["gaps"] - src0["gaps"]
        overflows = hub["overflows"] - hub0["overflows"]
        seconds = t_done - t0
        return {
            "events": events,
            "seconds": seconds,
            "events_per_s": events / seconds if seconds > 0 else float("nan"),
            "sse_records": records,
            "sse_per_s": records / (t_sse - t0) if records and sse_ok else float("nan"),
            "sse_per_event": records / events if events else float("nan"),
            "cpu_s_per_1k": cpu / (events / 1000) if events else float("nan"),
            "sse_client_cpu_s": sse_cpu,
            "gaps": gaps,
            "sse_overflows": overflows + sres["errors"],
            "tracked_blocks": src["tracked_blocks"],
            "keyed_blocks": src["keyed_blocks"],
            "pending_blocks": src["pending_blocks"],
            "discarded_chains": src["discarded_chains"] - src0["discarded_chains"],
            "pruned_entries": src["pruned_entries"] - src0["pruned_entries"],
            "rss_mib": rss_bytes(lst.pid) / 2**20,
            "pub_events_per_s": box.get("events_per_s") or float("nan"),
            "valid": events >= expected and gaps == 0,
            "sse_valid": sse_ok and overflows == 0,
        }
    finally:
        if spy is not None:
            stop_py_spy(spy)
        if sse is not None:
            sse.stop()
        if lst is not None:
            lst.stop()
        pub.stop()


def _valid(runs: list[dict[str, Any]], key: str) -> list[float]:
    return [r[key] for r in runs if r["valid"]]


def report(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    ev = args.batches * args.events_per_batch
    print()
    print(
        f"KV event ingestion: {args.batches} batches x {args.events_per_batch} events "
        f"= {ev} block events per burst, 1 block per event, chains of 64 blocks; "
        f"subscriber_queue_size {args.subscriber_queue}; medians of {args.repeats} "
        "interleaved rounds (fresh processes per run); target listener/bare >= "
        f"{TARGET_RATIO:.0%} (judged variants)"
    )
    print()
    headers = [
        "variant",
        "bare ev/s",
        "listener ev/s",
        "listener/bare",
        ">=40%",
        "CPU bare/lst",
        "SSE rec/s",
        "SSE rec/ev",
        "CPU s/1k ev",
        "bare CPU s/1k ev",
        "pub ev/s",
        "tracked",
        "RSS end",
        "lost",
        "SSE lost",
    ]
    rows = []
    out: dict[str, Any] = {"params": vars(args), "variants": {}}
    for c in cells:
        v = c.variant
        b_rate = _valid(c.base, "events_per_s")
        l_rate = _valid(c.listener, "events_per_s")
        pairs = [
            (lr, br)
            for lr, br in zip(c.listener, c.base, strict=False)
            if lr["valid"] and br["valid"]
        ]
        ratio = paired_ratio(
            [lr["events_per_s"] for lr, _ in pairs], [br["events_per_s"] for _, br in pairs]
        )
        cpu_ratio = paired_ratio(
            [br["cpu_s_per_1k"] for _, br in pairs], [lr["cpu_s_per_1k"] for lr, _ in pairs]
        )
        lost = sum(r.get("lost_batches", 0) for r in c.base) + sum(r["gaps"] for r in c.listener)
        invalid = sum(not r["valid"] for r in c.base + c.listener)
        sse_lost = sum(r["sse_overflows"] for r in c.listener)
        sse_invalid = sum(not r["sse_valid"] for r in c.listener)
        ok = None if not v.judged or ratio != ratio else ratio >= TARGET_RATIO
        sse_runs = [r["sse_per_s"] for r in c.listener if r["valid"] and r["sse_valid"]]
        rows.append(
            [
                v.label,
                fmt_float(median(b_rate), 0),
                fmt_float(median(l_rate), 0),
                f"{ratio:.0%}" if ratio == ratio else "-",
                verdict(ok),
                f"{cpu_ratio:.0%}" if cpu_ratio == cpu_ratio else "-",
                fmt_float(median(sse_runs), 0),
                fmt_float(median(r["sse_per_event"] for r in c.listener), 2),
                fmt_float(median(_valid(c.listener, "cpu_s_per_1k")), 4),
                fmt_float(median(_valid(c.base, "cpu_s_per_1k")), 4),
                fmt_float(median(r["pub_events_per_s"] for r in c.base + c.listener), 0),
                fmt_float(median(r["tracked_blocks"] for r in c.listener), 0),
                f"{fmt_float(median(r['rss_mib'] for r in c.listener), 0)} MiB",
                f"{lost}" + (f" ({invalid} inv.)" if invalid else ""),
                f"{sse_lost}" + (f" ({sse_invalid} inv.)" if sse_invalid else ""),
            ]
        )
        out["variants"][v.key] = {
            "label": v.label,
            "judged": v.judged,
            "baseline_runs": c.base,
            "listener_runs": c.listener,
            "median_baseline_events_per_s": median(b_rate),
            "median_listener_events_per_s": median(l_rate),
            "paired_ratio": ratio,
            "paired_cpu_ratio": cpu_ratio,
            "pass": ok,
        }
    print(render_table(headers, rows))
    print()
    print(
        "bare / listener ev/s: block events per second from the trigger to the bare loop's "
        "last decoded frame / to the /stats poll that showed all of them; listener/bare: "
        "paired per round; CPU bare/lst: bare CPU per event over the listener's (paired): the "
        "listener's per-core capacity relative to the bare loop, independent of machine load; "
        "SSE rec/s: hub records out to the subscriber (rec/ev: per block event); CPU s/1k ev: "
        "the process's utime+stime per 1,000 events, all threads; pub ev/s: the publisher's "
        "own send rate (an upper bound for both receivers); tracked: tracked_blocks at the "
        "end; RSS end: listener VmRSS at the end; lost: batches the bare loop missed + the "
        "listener's gaps (must be 0; such runs are left out); SSE lost: hub overflows + "
        "buffer_overflow records (SSE figures of such runs are left out)."
    )
    return out


def bench(args: argparse.Namespace) -> list[Cell]:
    cells = [Cell(VARIANTS[k]) for k in args.variants]
    workdir = Path(tempfile.mkdtemp(prefix="continuum-ingest-bench-"))
    try:
        for r in range(args.repeats):
            for c in cells:
                order = ("base", "listener") if (r % 2 == 0) else ("listener", "base")
                for which in order:
                    tag = f"r{r}-{c.variant.key}-{which}"
                    if which == "base":
                        res = run_baseline(c.variant, args, workdir, tag)
                        c.base.append(res)
                    else:
                        res = run_listener(c.variant, args, workdir, tag)
                        c.listener.append(res)
                    if args.verbose:
                        shown = {
                            k: (round(v, 4) if isinstance(v, float) else v) for k, v in res.items()
                        }
                        print(f"round {r + 1} {c.variant.key:12} {which:8} {shown}", flush=True)
            if not args.verbose:
                print(f"round {r + 1}/{args.repeats} done", flush=True)
        if args.profile:
            prof_dir = Path(args.profile)
            prof_dir.mkdir(parents=True, exist_ok=True)
            for c in cells:
                out = prof_dir / f"{c.variant.key}.txt"
                res = run_listener(c.variant, args, workdir, f"prof-{c.variant.key}", out)
                print(
                    f"\nprofile of the listener, {c.variant.label} (py-spy, 250 Hz, not in the "
                    f"table; {res['events_per_s']:.0f} ev/s under the profiler): {out}"
                )
                print(summarize_profile(out))
    finally:
        if args.keep_logs:
            print(f"logs and configs kept in {workdir}")
        else:
            for p in workdir.iterdir():
                p.unlink()
            workdir.rmdir()
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest_bench", description=__doc__)
    p.add_argument("--batches", type=int, default=25_000, help="batches per timed burst")
    p.add_argument("--events-per-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=list(VARIANTS),
        help="which publisher/listener set-ups to run (default: all)",
    )
    p.add_argument(
        "--subscriber-queue",
        type=int,
        default=1_000_000,
        metavar="N",
        help="the listener's subscriber_queue_size (default 1000000, the config maximum: the "
        "listener drains a queued burst without yielding, so the SSE queue must hold the whole "
        "burst; the config default, 4096, overflows)",
    )
    p.add_argument(
        "--hwm", type=int, default=100_000, help="PUB SNDHWM and bare SUB RCVHWM (batches)"
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--profile",
        metavar="DIR",
        help="after the rounds, one extra listener run per variant under py-spy; collapsed "
        "stacks into DIR and a summary printed",
    )
    p.add_argument(
        "--listener-cmd",
        metavar="CMD",
        help="command that runs the listener instead of the venv's continuum-kv-listener "
        "(e.g. another checkout's); '--config FILE --log-level WARNING' is appended",
    )
    p.add_argument("--keep-logs", action="store_true", help="keep configs and process logs")
    p.add_argument("-v", "--verbose", action="store_true", help="print every run")
    # hidden roles of the child processes
    p.add_argument("--role", choices=("publisher", "receiver", "sse"), help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--format", default="vllm-0.33", help=argparse.SUPPRESS)
    p.add_argument("--salted", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--prefixes", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--backend", default=BACKEND, help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "publisher":
        return publisher_role(args)
    if args.role == "receiver":
        return receiver_role(args)
    if args.role == "sse":
        return sse_role(args)
    if args.batches * args.events_per_batch > 0 and args.batches > args.hwm:
        print("note: --batches exceeds --hwm; a lagging receiver may lose batches")
    cells = bench(args)
    out = report(args, cells)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
