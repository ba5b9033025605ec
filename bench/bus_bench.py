"""Event bus benchmark: KV events per second into the router's index, push vs pull.

Real processes on this machine, TLS with mTLS on every event bus connection:

* **e2e** (engine -> listener -> transport -> router index): ``bench.ingest_bench``'s
  salted publisher (the simulator's vLLM encoder and ZMQ PUB, a router-issued cache salt on
  every chain's first block, so every block event becomes one ``cache_created``) -> the
  real ``continuum-kv-listener`` -> the real router, either over the event bus
  (``push``: the listener dials the router's EventBus, mTLS client certificate) or over
  SSE pull (``pull``: the router reads ``GET /events/{backend}``).
* **transport** (listener output stage -> router index): this module's ``feeder`` role
  runs the listener's own output components (``EventHub``, ``SseServer``,
  ``EventBusClient``) and publishes synthetic ``cache_created`` events into the hub as
  fast as it can; the router consumes them by push or pull. This isolates what the bus
  adds from the listener's engine ingestion, which caps the e2e figure (see
  ``ingest_bench``).
* **ceiling**: a bare grpc.aio TLS (mTLS) client-streaming loop, 64 SSE records per
  message (the bus's batching at full load), into a server that only counts records.

Events/s = events / (time from the trigger to the first poll of the router's
``/admin/kv-index/backends`` (every 20 ms) showing them all processed). Rounds interleave the
variants (fresh processes per run); the table shows medians and paired ratios, and the CPU
per event of the bottleneck process, all threads and its main thread (the event loop).

**Interleaved** (``--pairs``): this machine's speed drifts by +-20 % within seconds (a
bare CPU loop shows it), more than anything that separates push from pull, so the rounds
above, minutes apart, cannot order them. Here a push stack and a pull stack stay alive
side by side and take turns (ABBA...), so the two runs of a pair are seconds apart, over
``--restarts`` fresh pairs of stacks; the push/pull ratio per pair (events/s, and CPU per
event of the stack's processes) is reported as a median with its 95 % confidence
interval. ``--control`` runs the same with two pull stacks: the spread two identical
stacks show is the floor below which a push/pull difference means nothing.

**Lag**: the engine side publishes at a paced 10,000 events/s (batches of 8 every
0.8 ms, each batch a whole salted 8-block chain) for a few seconds; the bench polls the
router's applied-event count every 5 ms and takes, per event, (first poll at which the
router has applied its record) - (its batch's send time), on the shared monotonic clock.
Reported p50/p99/max, push and pull.

Run: ``.venv/bin/python -m bench.bus_bench [--events 100000] [--repeats 3] [--pairs 24]
[--restarts 6] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import http.client
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml

from bench._callgrind import self_cost_by_object
from bench._table import median, median_interval, paired_ratio, render_table, verdict
from bench.ingest_bench import (
    SALT_ENV,
    SALT_SECRET,
    Child,
    Listener,
    Publisher,
    _py,
    cpu_seconds,
    free_port,
    warm_up,
)

__all__ = ["main"]

BACKEND = "sim"  # ingest_bench's publisher salts for this backend
CLIENT_ID = "bench-listener"
RECORDS_PER_MESSAGE = 64
CALLGRIND_SLOWDOWN = 50
"""About how much slower a process runs under callgrind here; a counted feeder's linger (a
wall-clock wait) is stretched by it, or it would send that many more messages per event
than natively."""


# ---------------------------------------------------------------------------------------------
# router and polling


def main_thread_cpu_seconds(pid: int) -> float:
    """utime + stime of the main thread of ``pid``: the event loop, which bounds a
    single-loop process's throughput (gRPC's own threads do TLS and HTTP/2 beside it)."""
    try:
        raw = Path(f"/proc/{pid}/task/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    f = raw[raw.rindex(")") + 2 :].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def router_yaml(pki: dict[str, Any], bus_port: int, *, push: bool, sse_url: str = "") -> str:
    source: dict[str, Any] = {"backend_name": BACKEND, "reconnect_interval_ms": 50}
    if push:
        source["transport"] = "event_bus"
    else:
        source["endpoint"] = sse_url
    cfg: dict[str, Any] = {
        "server": {"listen": "127.0.0.1:0", "grpc_listen": "127.0.0.1:0"},
        "backends": [{"name": BACKEND, "url": "http://127.0.0.1:9", "type": "vllm"}],
        "health_check": {"enabled": False},
        "prefix_routing": {"enabled": True},
        "kv_cache_index": {
            "enabled": True,
            "max_entries": 2_000_000,
            "entry_ttl_seconds": 3600,
            "event_sources": [source],
        },
    }
    if push:
        cfg["dynamo"] = {
            "event_bus": {
                "enabled": True,
                "listen": f"127.0.0.1:{bus_port}",
                "tls": {
                    "cert": str(pki["server"].cert),
                    "key": str(pki["server"].key),
                    "client_ca": str(pki["ca"].cert),
                },
                "brokers": [{"id": CLIENT_ID, "role": "kv_listener", "backends": [BACKEND]}],
            }
        }
    return yaml.safe_dump(cfg)


def bus_section(pki: dict[str, Any], bus_port: int, linger_ms: int | None = None) -> dict[str, Any]:
    section: dict[str, Any] = {
        "url": f"https://localhost:{bus_port}",
        "ca_file": str(pki["ca"].cert),
        "client_id": CLIENT_ID,
        "client_cert_file": str(pki[CLIENT_ID].cert),
        "client_key_file": str(pki[CLIENT_ID].key),
        "reconnect_backoff": "50ms",
    }
    if linger_ms is not None:
        section["batch_linger_ms"] = linger_ms
    return section


class Router:
    def __init__(
        self, config: str, workdir: Path, tag: str, wrap: Sequence[str] = (), timeout: float = 30
    ) -> None:
        path = workdir / f"{tag}-router.yaml"
        path.write_text(config)
        cmd = [
            *wrap,
            *_py("-m", "router", "--log-level", "WARNING", "serve", "--config", str(path)),
        ]
        self.child = Child(f"{tag}-router", cmd, log_dir=workdir)
        host_port = self.child.expect(r"READY http=(\S+)", timeout).group(1)
        host, _, port = host_port.rpartition(":")
        # The consumer counters come from /admin/kv-index/backends: cheap to read (the
        # gRPC Backends call counts the index's entries, which would perturb the run).
        self.http = http.client.HTTPConnection(host, int(port), timeout=10 + 4 * timeout)

    def processed(self) -> int:
        """Events the consumer of BACKEND has applied (0 until it connected)."""
        self.http.request("GET", "/admin/kv-index/backends")
        body = json.loads(self.http.getresponse().read())
        for b in body["backends"]:
            if b["backend_name"] == BACKEND and b["connection"]["connected"]:
                return int(b["events"]["processed"])
        return 0

    def wait_connected(self, limit: float = 120.0) -> int:
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            n = self.processed()
            if n >= 1:
                return n
            time.sleep(0.02)
        raise TimeoutError(f"router never connected; log:\n{self.child.tail()}")

    def stop(self) -> None:
        self.http.close()
        self.child.stop()


def wait_processed(router: Router, target: int, limit: float = 120.0, poll: float = 0.02) -> float:
    """Monotonic time of the first poll showing ``processed >= target``."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if router.processed() >= target:
            return time.monotonic()
        time.sleep(poll)
    return float("nan")


class Instructions:
    """Instructions a process executes around a burst, per thread, under callgrind.

    The process runs under ``valgrind --tool=callgrind --instr-atstart=no
    --separate-threads=yes`` (:meth:`wrap`): uninstrumented until :meth:`start` switches
    instrumentation on; :meth:`stop` dumps and switches it off. Unlike time, the count does
    not move with other load on the machine, so it can tell apart two paths that differ
    by a percent.
    """

    def __init__(self, out: Path) -> None:
        self.out = out
        self.pid = 0

    def wrap(self) -> list[str]:
        return [
            "valgrind", "--tool=callgrind", "--instr-atstart=no", "--separate-threads=yes",
            f"--callgrind-out-file={self.out}.%p",
        ]  # fmt: skip

    def _control(self, *flags: str) -> None:
        subprocess.run(
            ["callgrind_control", *flags, str(self.pid)], check=True, capture_output=True
        )

    def start(self, pid: int) -> None:
        self.pid = pid
        self._control("-i", "on")

    def stop(self) -> tuple[dict[int, int], dict[str, int]]:
        """Instructions per thread (1 = the main thread) since :meth:`start`, and the main
        thread's split by shared object (``bench._callgrind``)."""
        self._control("-d")
        self._control("-i", "off")
        counts: dict[int, int] = {}
        objects: dict[str, int] = {}
        for f in self.out.parent.glob(f"{self.out.name}.{self.pid}.1-*"):
            thread = int(f.name.rsplit("-", 1)[1])
            text = f.read_text()
            for line in text.splitlines():
                if line.startswith(("summary:", "totals:")):
                    counts[thread] = int(line.split()[1])
                    break
            if thread == 1:
                objects = self_cost_by_object(text)
        return counts, objects


# ---------------------------------------------------------------------------------------------
# hidden roles


def feeder_role(args: argparse.Namespace) -> int:
    """The listener's output stage: hub + SSE server + event bus client; stdin ``burst N``."""
    from bus.events import KvEvent
    from listener.push.client import EventBusClient
    from listener.push.config import EventBusClientConfig
    from listener.sse_server import SseServer
    from listener.stream import EventHub

    async def main() -> None:
        hub = EventHub(history_size=args.history, queue_size=args.queue)
        hub.add_backend(BACKEND)
        sse = SseServer(hub)
        port = await sse.start("127.0.0.1", 0)
        client = None
        task = None
        if args.bus:
            client = EventBusClient(EventBusClientConfig(**json.loads(args.bus)), hub, [BACKEND])
            task = asyncio.ensure_future(client.run())
        print(f"READY http=127.0.0.1:{port}", flush=True)
        loop = asyncio.get_running_loop()
        n = 0
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    return
                parts = line.split()
                if parts[:1] == ["burst"]:
                    count = int(parts[1])
                    for i in range(count):
                        n += 1
                        ev = KvEvent(
                            "cache_created", BACKEND, f"{n:064x}", 16 * (1 + i % 64), "gpu"
                        )
                        hub.publish(BACKEND, ev)
                        if i % 256 == 255:
                            await asyncio.sleep(0)  # as the listener's ingestion yields
                    print(
                        json.dumps(
                            {"published": count, "seq": hub.stats()["backends"][BACKEND]["seq"]}
                        ),
                        flush=True,
                    )
        finally:
            if client is not None:
                await client.drain(task)
            await sse.stop()

    asyncio.run(main())
    return 0


def paced_role(args: argparse.Namespace) -> int:
    """Salted engine events at a fixed rate; ``warm`` = one event, ``go`` = the paced run,
    which prints the monotonic send time of each batch."""
    from bench.ingest_bench import salted_hub
    from harness.sim.kv_events import CapturePublisher

    async def main() -> None:
        hub, pub = salted_hub(args.endpoint, "vllm-0.33", 100_000, (SALT_SECRET, BACKEND, 0))
        hub.start()
        print("READY", flush=True)
        loop = asyncio.get_running_loop()
        try:
            while True:
                line = await loop.run_in_executor(None, sys.stdin.readline)
                if not line:
                    return
                if line.startswith("warm"):
                    await hub.burst(1, 1, chain_blocks=64)
                    print("{}", flush=True)
                elif line.startswith("go"):
                    per = args.events_per_batch
                    interval = per / args.rate
                    batches = int(args.rate * args.seconds / per)
                    # Encode every batch first (the burst code, into a list), then send
                    # them on a fixed schedule through the real PUB socket.
                    capture = CapturePublisher()
                    hub.publisher = capture  # type: ignore[assignment]
                    await hub.burst(batches, per, chain_blocks=per)  # a chain per batch
                    hub.publisher = pub
                    times: list[float] = []
                    t0 = time.monotonic()
                    for b, payload in enumerate(capture.payloads):
                        delay = t0 + b * interval - time.monotonic()
                        if delay > 0:
                            await asyncio.sleep(delay)
                        times.append(time.monotonic())
                        pub.publish(payload)
                    print(json.dumps({"times": times, "events_per_batch": per}), flush=True)
        finally:
            hub.close()

    asyncio.run(main())
    return 0


def bare_server_role(args: argparse.Namespace) -> int:
    """The ceiling's receiver: EventBus.Stream that only counts records (mTLS)."""
    from bus._gen.continuum.bus.v1 import bus_pb2 as pb
    from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc

    class Counter(pb_grpc.EventBusServicer):
        async def Stream(self, request_iterator: Any, context: Any) -> Any:
            records = 0
            received = 0
            async for req in request_iterator:
                if req.WhichOneof("kind") == "data":
                    data = req.data.data
                    received += len(data)
                    records += data.count(b"\n\n")
            return pb.StreamResponse(bytes_received=received, records_parsed=records)

    creds = grpc.ssl_server_credentials(
        [(Path(args.key).read_bytes(), Path(args.cert).read_bytes())],
        root_certificates=Path(args.ca).read_bytes(),
        require_client_auth=True,
    )

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.max_receive_message_length", 4 << 20)])
        pb_grpc.add_EventBusServicer_to_server(Counter(), server)
        port = server.add_secure_port("127.0.0.1:0", creds)
        await server.start()
        print(f"READY {port}", flush=True)
        await server.wait_for_termination()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())
    return 0


def bare_client_role(args: argparse.Namespace) -> int:
    from bus._gen.continuum.bus.v1 import bus_pb2 as pb
    from bus._gen.continuum.bus.v1 import bus_pb2_grpc as pb_grpc
    from bus.events import KvEvent
    from bus.sse import encode_record

    creds = grpc.ssl_channel_credentials(
        Path(args.ca).read_bytes(),
        Path(args.client_key).read_bytes(),
        Path(args.client_cert).read_bytes(),
    )

    async def main() -> dict[str, Any]:
        n = args.events
        recs = [
            encode_record(
                KvEvent("cache_created", BACKEND, f"{i:064x}", 16 * (1 + i % 64), "gpu").to_json(),
                event="cache_created",
                id=f"bench-{i + 1}",
            )
            for i in range(n)
        ]
        msgs = [
            pb.StreamRequest(data=pb.StreamData(data=b"".join(recs[i : i + RECORDS_PER_MESSAGE])))
            for i in range(0, n, RECORDS_PER_MESSAGE)
        ]
        async with grpc.aio.secure_channel(f"localhost:{args.port}", creds) as ch:
            stub = pb_grpc.EventBusStub(ch)
            call = stub.Stream()
            t0 = time.monotonic()
            await call.write(pb.StreamRequest(open=pb.StreamOpen(stream_id="bare")))
            for m in msgs:
                await call.write(m)
            await call.done_writing()
            resp = await call
            seconds = time.monotonic() - t0
        return {"events": resp.records_parsed, "seconds": seconds}

    print(json.dumps(asyncio.run(main())), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# runs


@contextlib.contextmanager
def _transport_stack(
    args: argparse.Namespace,
    pki: dict[str, Any],
    workdir: Path,
    push: bool,
    tag: str,
    router_wrap: Sequence[str] = (),
    feeder_wrap: Sequence[str] = (),
) -> Iterator[tuple[Child, Router, int]]:
    """A feeder and a router consuming it (push or pull), connected: (feeder, router, n0).
    Either may run under a wrapper (callgrind; see ``CALLGRIND_SLOWDOWN``)."""
    feeder, router = _transport_pair(args, pki, workdir, push, tag, router_wrap, feeder_wrap)
    try:
        yield feeder, router, router.wait_connected(900 if router_wrap else 120)
    finally:
        router.stop()
        feeder.stop()


def _transport_pair(
    args: argparse.Namespace,
    pki: dict[str, Any],
    workdir: Path,
    push: bool,
    tag: str,
    router_wrap: Sequence[str],
    feeder_wrap: Sequence[str],
) -> tuple[Child, Router]:
    bus_port = free_port()
    cmd = [
        *feeder_wrap,
        *_py(
            "-m", "bench.bus_bench", "--role", "feeder",
            "--history", str(max(args.events, args.callgrind_events) + 1000),
            "--queue", "1000000",
        ),
    ]  # fmt: skip
    if push:
        linger = 10 * CALLGRIND_SLOWDOWN if feeder_wrap else None
        cmd += ["--bus", json.dumps(bus_section(pki, bus_port, linger))]
    feeder = Child(f"{tag}-feeder", cmd, log_dir=workdir, stdin=True)
    try:
        ready = feeder.expect(r"READY http=(\S+)", 900 if feeder_wrap else 30)
        url = "http://" + ready.group(1)
        cfg = router_yaml(pki, bus_port, push=push, sse_url=f"{url}/events/{BACKEND}")
        router = Router(cfg, workdir, tag, router_wrap, 900 if router_wrap else 30)
    except BaseException:
        feeder.stop()
        raise
    return feeder, router


def run_transport(
    args: argparse.Namespace, pki: dict[str, Any], workdir: Path, push: bool, tag: str
) -> dict[str, Any]:
    with _transport_stack(args, pki, workdir, push, tag) as (feeder, router, _):
        return _with_cpu(router.child.pid, args.events, _transport_burst, args, feeder, router)


def _with_cpu(pid: int, events: int, burst: Callable[..., float], *a: Any) -> dict[str, Any]:
    """One burst's events/s, and the CPU per event of ``pid`` (all threads; main only)."""
    cpu0, main0 = cpu_seconds(pid), main_thread_cpu_seconds(pid)
    rate = burst(*a)
    cpu, main = cpu_seconds(pid) - cpu0, main_thread_cpu_seconds(pid) - main0
    return {
        "events": events,
        "events_per_s": rate,
        "us_per_event": cpu / events * 1e6,
        "main_us_per_event": main / events * 1e6,
    }


def listener_yaml(pki: dict[str, Any], zmq_endpoint: str, bus_port: int | None) -> str:
    cfg: dict[str, Any] = {
        "listen": "127.0.0.1:0",
        "salt_secret_env": SALT_ENV,
        "subscriber_queue_size": 1_000_000,
        "history_size": 1_000_000,
        "sources": [
            {
                "backend_name": BACKEND,
                "engine": "vllm",
                "zmq_endpoint": zmq_endpoint,
                "zmq_mode": "connect",
            }
        ],
    }
    if bus_port is not None:
        cfg["event_bus"] = bus_section(pki, bus_port)
    return yaml.safe_dump(cfg)


def _e2e_stack(
    pki: dict[str, Any],
    workdir: Path,
    push: bool,
    tag: str,
    paced: argparse.Namespace | None = None,
) -> tuple[Any, Listener, Router]:
    bus_port = free_port()
    if paced is None:
        pub: Any = Publisher("salted", "vllm-0.33", workdir, 100_000, tag)
        endpoint = pub.connect_endpoint
        trigger = lambda: pub.burst(1, 1)  # noqa: E731
    else:
        port = free_port()
        cmd = _py(
            "-m", "bench.bus_bench", "--role", "paced", "--endpoint", f"tcp://*:{port}",
            "--rate", str(paced.rate), "--seconds", str(paced.seconds),
        )  # fmt: skip
        pub = Child(
            f"{tag}-paced", cmd, log_dir=workdir, stdin=True, env={SALT_ENV: SALT_SECRET.decode()}
        )
        pub.expect("^READY")
        endpoint = f"tcp://127.0.0.1:{port}"

        def trigger() -> None:
            pub.send("warm")
            pub.expect(r"^\{\}")

    lst: Listener | None = None
    try:
        lst = Listener(listener_yaml(pki, endpoint, bus_port if push else None), workdir, tag)
        warm_up(trigger, lambda: lst.source()["frames"] > 0)  # type: ignore[union-attr]
        cfg = router_yaml(pki, bus_port, push=push, sse_url=f"{lst.url}/events/{BACKEND}")
        router = Router(cfg, workdir, tag)
    except BaseException:
        if lst is not None:
            lst.stop()
        pub.stop()
        raise
    router.wait_connected()
    return pub, lst, router


def _caught_up(lst: Listener, router: Router) -> tuple[int, int]:
    """(router processed, listener seq) once the router applied every record so far: from
    here on, each new listener record is one more processed event at the router."""
    deadline = time.monotonic() + 30
    seq = lst.stats()["hub"]["backends"][BACKEND]["seq"]
    n = router.processed()
    while time.monotonic() < deadline:
        time.sleep(0.1)
        seq2, n2 = lst.stats()["hub"]["backends"][BACKEND]["seq"], router.processed()
        if (seq2, n2) == (seq, n):
            return n, seq
        seq, n = seq2, n2
    raise TimeoutError("the router did not settle")


def run_e2e(
    args: argparse.Namespace, pki: dict[str, Any], workdir: Path, push: bool, tag: str
) -> dict[str, Any]:
    """Engine block events/s until the router applied the last resulting record (the
    listener coalesces one ZMQ batch of a chain into one ``cache_created``)."""
    pub, lst, router = _e2e_stack(pki, workdir, push, tag)
    try:
        _caught_up(lst, router)
        return _with_cpu(lst.pid, args.e2e_batches * 8, _e2e_burst, args, pub, lst, router)
    finally:
        router.stop()
        lst.stop()
        pub.stop()


def run_interleaved(
    args: argparse.Namespace,
    pki: dict[str, Any],
    workdir: Path,
    row: str,
    modes: Sequence[tuple[str, bool]],
) -> dict[str, dict[str, list[float]]]:
    """Push and pull stacks both alive, bursts alternating between them (ABBA...), so each
    pair of runs is seconds apart: this machine's speed drifts by +-20 % over seconds
    (a bare CPU loop shows it), which swamps one-after-the-other runs of fresh processes.
    The pairs are spread over ``args.restarts`` fresh pairs of stacks: two identical
    stacks started once can differ by 10 % for their whole life (hash seeds, memory
    layout, which core each process lands on), which only new processes average out.

    ``row`` is ``transport`` (``args.events`` per burst) or ``e2e`` (``args.e2e_batches``
    batches of 8); ``modes`` names two stacks and says which one pushes. Returns, by name
    and in pair order, events/s per burst (``rate``) and the CPU time per event of the
    whole stack (``cpu_us``: every process of it, all threads): on two cores both
    processes of a stack are busy, so the work per event, not one process's, sets the
    pace (the e2e row leaves out the engine simulator, the same in both). Pull against
    pull (``--control``) shows how far apart two identical stacks measure: the noise
    floor of the push/pull ratios.
    """
    out: dict[str, dict[str, list[float]]] = {name: {"rate": [], "cpu_us": []} for name, _ in modes}
    events = args.events if row == "transport" else args.e2e_batches * 8
    names = [name for name, _ in modes]
    restarts = max(1, min(args.restarts, args.pairs))
    k = 0
    for restart in range(restarts):
        with contextlib.ExitStack() as stack:
            bursts: dict[str, Callable[[], float]] = {}
            pids: dict[str, list[int]] = {}
            # Started in turn A first, then B first: the stack started first measured a few
            # percent slower over a whole run of pull-against-pull pairs.
            for name, push in modes if restart % 2 == 0 else modes[::-1]:
                tag = f"il-{row}-{name}-{restart}"
                if row == "transport":
                    feeder, router, _ = stack.enter_context(
                        _transport_stack(args, pki, workdir, push, tag)
                    )
                    bursts[name] = functools.partial(_transport_burst, args, feeder, router)
                    pids[name] = [feeder.pid, router.child.pid]
                else:
                    pub, lst, router = _e2e_stack(pki, workdir, push, tag)
                    stack.callback(pub.stop)
                    stack.callback(lst.stop)
                    stack.callback(router.stop)
                    bursts[name] = functools.partial(_e2e_burst, args, pub, lst, router)
                    pids[name] = [lst.pid, router.child.pid]  # the engine simulator is not ours
            for _ in range((args.pairs - k) // (restarts - restart)):
                for name in names if k % 2 == 0 else names[::-1]:
                    cpu0 = sum(cpu_seconds(p) for p in pids[name])
                    out[name]["rate"].append(bursts[name]())
                    cpu = sum(cpu_seconds(p) for p in pids[name]) - cpu0
                    out[name]["cpu_us"].append(cpu / events * 1e6)
                if args.verbose:
                    print(row, k, {n: round(v["rate"][-1]) for n, v in out.items()}, flush=True)
                k += 1
    return out


def _transport_burst(args: argparse.Namespace, feeder: Child, router: Router) -> float:
    n0 = router.processed()
    t0 = time.monotonic()
    feeder.send(f"burst {args.events}")
    return args.events / (wait_processed(router, n0 + args.events) - t0)


def _e2e_burst(args: argparse.Namespace, pub: Any, lst: Listener, router: Router) -> float:
    n0, seq0 = _caught_up(lst, router)
    ev0 = lst.source()["events"]
    n = args.e2e_batches * 8
    t0 = time.monotonic()
    pub.burst(args.e2e_batches, 8)
    deadline = time.monotonic() + 120
    while lst.source()["events"] - ev0 < n and time.monotonic() < deadline:
        time.sleep(0.02)
    seq = lst.stats()["hub"]["backends"][BACKEND]["seq"]
    return n / (wait_processed(router, n0 + seq - seq0) - t0)


def _wait_idle(pid: int, quiet: float = 2.0, limit: float = 900.0) -> None:
    """Return once ``pid`` used under 5 % of a CPU for ``quiet`` seconds: the end of a
    burst under callgrind, told from ``/proc`` so that no request adds to the count."""
    deadline = time.monotonic() + limit
    last, since = cpu_seconds(pid), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now, cpu = time.monotonic(), cpu_seconds(pid)
        if cpu - last > 0.05 * (now - since):
            last, since = cpu, now
        elif now - since >= quiet:
            return
    raise TimeoutError(f"process {pid} never went idle")


def run_instructions(
    args: argparse.Namespace, pki: dict[str, Any], workdir: Path, push: bool, tag: str
) -> dict[str, dict[Any, float]]:
    """Instructions per event, per thread, of the two stages the transport touches, each
    under callgrind in its own run of ``--callgrind-events`` transport events: the router
    (SSE parse, JSON, index: the transport row's bottleneck) and the feeder (the listener's
    output stage: hub, SSE server or event bus client). The listener's ingestion in front
    of them is the same code on both paths. Nothing polls the counted process while it
    counts: the run ends when it goes idle, and its totals are checked afterwards.
    ``"<stage> objects"``: the main thread's instructions per event by shared object."""
    out: dict[str, dict[Any, float]] = {}
    n = args.callgrind_events
    for stage in ("router", "feeder"):
        counter = Instructions(workdir / f"{tag}-{stage}.cg")
        wraps = {f"{stage}_wrap": counter.wrap()}
        with _transport_stack(args, pki, workdir, push, f"{tag}-{stage}", **wraps) as (
            feeder,
            router,
            n0,
        ):
            pid = router.child.pid if stage == "router" else feeder.pid
            _wait_idle(pid)
            counter.start(pid)
            feeder.send(f"burst {n}")
            if stage == "router":
                _wait_idle(pid)
            else:  # the router is not counted: ask it
                wait_processed(router, n0 + n, limit=900, poll=0.5)
                _wait_idle(pid)
            counts, objects = counter.stop()
            if router.processed() != n0 + n:
                raise RuntimeError(f"the router applied {router.processed() - n0} of {n}")
            out[stage] = {t: v / n for t, v in counts.items()}
            out[f"{stage} objects"] = {o: v / n for o, v in objects.items()}
    return out


def run_ceiling(
    args: argparse.Namespace, pki: dict[str, Any], workdir: Path, tag: str
) -> dict[str, Any]:
    srv = Child(
        f"{tag}-bare-server",
        _py("-m", "bench.bus_bench", "--role", "bare-server", "--cert", str(pki["server"].cert),
            "--key", str(pki["server"].key), "--ca", str(pki["ca"].cert)),
        log_dir=workdir,
    )  # fmt: skip
    try:
        port = srv.expect(r"^READY (\d+)").group(1)
        cli = Child(
            f"{tag}-bare-client",
            _py("-m", "bench.bus_bench", "--role", "bare-client", "--port", port,
                "--events", str(args.events),
                "--ca", str(pki["ca"].cert), "--client-cert", str(pki[CLIENT_ID].cert),
                "--client-key", str(pki[CLIENT_ID].key)),
            log_dir=workdir,
        )  # fmt: skip
        res = json.loads(cli.expect(r"^\{", timeout=120).string)
        cli.stop()
        return {"events": res["events"], "events_per_s": res["events"] / res["seconds"]}
    finally:
        srv.stop()


def run_lag(
    args: argparse.Namespace, pki: dict[str, Any], workdir: Path, push: bool, tag: str
) -> dict[str, Any]:
    """Per engine batch: (first 5 ms poll where the router applied its record) - (send time).

    Each paced batch is a whole 8-block chain with its own salted prefix, which the
    listener announces as one ``cache_created``; so batch ``b`` of the run is the router's
    ``b + 1``-th applied event after the start. The run is only valid when the listener's
    seq moved by exactly the batch count.
    """
    pub, lst, router = _e2e_stack(pki, workdir, push, tag, paced=args)
    try:
        n0, seq0 = _caught_up(lst, router)
        batches = int(args.rate * args.seconds / 8)
        polls: list[tuple[float, int]] = []
        pub.send("go")
        deadline = time.monotonic() + args.seconds + 60
        while time.monotonic() < deadline:
            polls.append((time.monotonic(), router.processed() - n0 + seq0))
            if polls[-1][1] >= seq0 + batches:
                break
            time.sleep(0.005)
        done = json.loads(pub.expect(r"^\{", timeout=60).string)
        seq1 = lst.stats()["hub"]["backends"][BACKEND]["seq"]
        per = done["events_per_batch"]
        lags: list[float] = []
        j = 0
        for b, t_send in enumerate(done["times"]):
            while j < len(polls) and polls[j][1] < seq0 + b + 1:
                j += 1
            lags.append(polls[j][0] - t_send if j < len(polls) else float("inf"))
        lags.sort()

        def q(p: float) -> float:
            return lags[min(len(lags) - 1, int(p * len(lags)))] * 1000

        return {
            "events": len(lags) * per,
            "valid": seq1 - seq0 == len(done["times"]),
            "p50_ms": q(0.50),
            "p99_ms": q(0.99),
            "max_ms": lags[-1] * 1000,
        }
    finally:
        router.stop()
        lst.stop()
        pub.stop()


# ---------------------------------------------------------------------------------------------
# report


def make_pki(workdir: Path) -> dict[str, Any]:
    from certs import dev_bundle

    return dev_bundle(workdir / "pki", clients=[CLIENT_ID])


def bench(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="bus-bench-"))
    pki = make_pki(workdir)
    cpu: dict[str, list[float]] = {k: [] for k in ("t-push", "t-pull", "e-push", "e-pull")}
    main_cpu: dict[str, list[float]] = {k: [] for k in cpu}
    cells: dict[str, list[float]] = {
        k: [] for k in ("t-push", "t-pull", "e-push", "e-pull", "ceiling")
    }
    for r in range(args.repeats):
        order = [("t-push", True), ("t-pull", False)]
        e_order = [("e-push", True), ("e-pull", False)]
        if r % 2:
            order.reverse()
            e_order.reverse()
        for name, push in order:
            res = run_transport(args, pki, workdir, push, f"r{r}-{name}")
            cells[name].append(res["events_per_s"])
            cpu[name].append(res["us_per_event"])
            main_cpu[name].append(res["main_us_per_event"])
            if args.verbose:
                print(name, res, flush=True)
        cells["ceiling"].append(run_ceiling(args, pki, workdir, f"r{r}-ceil")["events_per_s"])
        if args.e2e_batches:
            for name, push in e_order:
                res = run_e2e(args, pki, workdir, push, f"r{r}-{name}")
                cells[name].append(res["events_per_s"])
                cpu[name].append(res["us_per_event"])
                main_cpu[name].append(res["main_us_per_event"])
                if args.verbose:
                    print(name, res, flush=True)
    interleaved: dict[str, dict[str, list[float]]] = {}
    rows = ["transport", "e2e"] if args.e2e_batches else ["transport"]
    for row in rows if args.pairs else []:
        interleaved[f"{row}: push (A) vs pull (B)"] = run_interleaved(
            args, pki, workdir, row, (("A", True), ("B", False))
        )
        if args.control:
            interleaved[f"{row} control: pull (A) vs pull (B)"] = run_interleaved(
                args, pki, workdir, row, (("A", False), ("B", False))
            )
    instructions: dict[str, Any] = {}
    if args.callgrind:
        if shutil.which("valgrind") is None:
            print("valgrind not found: --callgrind skipped", flush=True)
        else:
            for name, push in (("push", True), ("pull", False)):
                instructions[name] = run_instructions(args, pki, workdir, push, f"cg-{name}")
                if args.verbose:
                    print("instructions", name, instructions[name], flush=True)
    lag: dict[str, dict[str, Any]] = {}
    if args.seconds > 0:
        for name, push in (("push", True), ("pull", False)):
            lag[name] = run_lag(args, pki, workdir, push, f"lag-{name}")
    return {
        "cells": cells,
        "cpu": cpu,
        "main_cpu": main_cpu,
        "interleaved": interleaved,
        "instructions": instructions,
        "lag": lag,
    }


def sum_values(d: dict[int, float]) -> float:
    return sum(d.values())


def object_rows(
    push: dict[str, float], pull: dict[str, float], share: float = 0.002
) -> list[list[str]]:
    """Objects holding at least ``share`` of either side's instructions, the largest
    difference first, then the rest folded into one row, then the totals."""
    total_a, total_b = sum(push.values()), sum(pull.values())
    big = [
        o
        for o in set(push) | set(pull)
        if max(push.get(o, 0.0) / total_a, pull.get(o, 0.0) / total_b) >= share
    ]
    big.sort(key=lambda o: -abs(push.get(o, 0.0) - pull.get(o, 0.0)))
    rows = []
    for o in big:
        a, b = push.get(o, 0.0), pull.get(o, 0.0)
        rows.append([o, f"{a:,.0f}", f"{b:,.0f}", f"{a - b:+,.0f}"])
    rest_a = total_a - sum(push.get(o, 0.0) for o in big)
    rest_b = total_b - sum(pull.get(o, 0.0) for o in big)
    rows.append(["(others)", f"{rest_a:,.0f}", f"{rest_b:,.0f}", f"{rest_a - rest_b:+,.0f}"])
    rows.append(["total", f"{total_a:,.0f}", f"{total_b:,.0f}", f"{total_a - total_b:+,.0f}"])
    return rows


def ab_ratio(
    runs: dict[str, dict[str, list[float]]], key: str = "rate"
) -> tuple[list[float], float, float, float]:
    """A/B of ``key`` (``rate``: events/s, ``cpu_us``: stack CPU per event) per
    interleaved pair: the ratios, their median and the median's 95 % interval."""
    ratios = [x / y for x, y in zip(runs["A"][key], runs["B"][key], strict=True) if y > 0]
    lo, hi = median_interval(ratios)
    return ratios, median(ratios), lo, hi


def report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    c = res["cells"]
    # push >= pull is judged on the interleaved pairs when there are any: fresh-process
    # rounds minutes apart cannot order two paths this close (see the module docstring).
    # PASS: the 95 % interval of the median push/pull ratio reaches 1, i.e. push is not
    # shown slower than pull.
    judged = {
        row: ab_ratio(runs)[1:]
        for row in ("transport", "e2e")
        if (runs := res.get("interleaved", {}).get(f"{row}: push (A) vs pull (B)"))
    }
    ceiling = median(c["ceiling"])
    rows = []
    for label, key, base in (
        ("transport: hub -> event bus (mTLS) -> router index", "t-push", "t-pull"),
        ("transport: hub -> SSE pull -> router index", "t-pull", None),
        ("e2e: engine -> listener -> event bus (mTLS) -> index", "e-push", "e-pull"),
        ("e2e: engine -> listener -> SSE pull -> index", "e-pull", None),
        (f"ceiling: bare grpc.aio mTLS stream, {RECORDS_PER_MESSAGE} ev/msg", "ceiling", None),
    ):
        vals = c[key]
        if not vals:
            continue
        m = median(vals)
        vs_pull = paired_ratio(vals, c[base]) if base and c[base] else float("nan")
        ok = None
        if key in ("t-push", "e-push"):
            row = "transport" if key == "t-push" else "e2e"
            ok = judged[row][2] >= 1.0 if row in judged else vs_pull >= 1.0
        rows.append(
            [
                label,
                f"{m:,.0f}",
                f"{vs_pull:.2f}" if vs_pull == vs_pull else "-",
                f"{m / ceiling:.0%}" if ceiling == ceiling else "-",
                verdict(ok) + (" (pairs)" if ok is not None and judged else ""),
                verdict(m >= 50_000) if key in ("t-push", "e-push") else "-",
                f"{median(res['cpu'][key]):.1f}" if res["cpu"].get(key) else "-",
                f"{median(res['main_cpu'][key]):.1f}" if res["main_cpu"].get(key) else "-",
            ]
        )
    print(
        f"Event bus: {args.events} events per transport run, {args.e2e_batches * 8} per e2e run; "
        f"medians of {args.repeats} interleaved rounds (fresh processes per run); "
        "targets: push >= pull (judged on the interleaved pairs below when they ran: "
        "PASS when the 95 % interval of the median push/pull ratio reaches 1, i.e. push is "
        "not shown slower; else on these rounds), push >= 50k events/s. CPU us/ev: the router "
        "process's CPU per event (transport rows) or the listener's (e2e rows), which noise "
        "from other jobs on the machine affects far less than events/s; loop us/ev: the same "
        "for the process's main thread only (its event loop, the bottleneck)"
    )
    print()
    print(
        render_table(
            [
                "path",
                "events/s",
                "push/pull",
                "of ceiling",
                ">= pull",
                ">= 50k/s",
                "CPU us/ev",
                "loop us/ev",
            ],
            rows,
        )
    )
    if res.get("interleaved"):
        print()
        print(
            f"Interleaved: two stacks alive at once, {args.pairs} pairs of bursts alternating "
            "ABBA (a pair's runs are seconds apart and see the machine alike); A/B per pair, "
            "median and its distribution-free 95 % confidence interval. Stack CPU/ev: CPU "
            "time of the stack's processes (transport: feeder + router; e2e: listener + "
            "router), all threads, per event"
        )
        print()
        rows = []
        for label, runs in res["interleaved"].items():
            a, b = runs["A"], runs["B"]
            ratios, mid, lo, hi = ab_ratio(runs)
            _, work, wlo, whi = ab_ratio(runs, "cpu_us")
            rows.append(
                [
                    label,
                    f"{median(a['rate']):,.0f}",
                    f"{median(b['rate']):,.0f}",
                    f"{mid:.3f}",
                    f"{lo:.3f} .. {hi:.3f}",
                    f"{sum(r >= 1.0 for r in ratios)}/{len(ratios)}",
                    f"{median(a['cpu_us']):.1f} / {median(b['cpu_us']):.1f}",
                    f"{work:.3f}",
                    f"{wlo:.3f} .. {whi:.3f}",
                ]
            )
        print(
            render_table(
                [
                    "row",
                    "A ev/s",
                    "B ev/s",
                    "A/B ev/s",
                    "95% CI",
                    "pairs A >= B",
                    "stack CPU us/ev A / B",
                    "A/B CPU",
                    "95% CI",
                ],
                rows,
            )
        )
    ins = res.get("instructions")
    if ins:
        print()
        print(
            f"Instructions per event under callgrind ({args.callgrind_events:,} transport "
            "events): the two stages the transport touches, main thread (the event loop) "
            "and all threads"
        )
        print()
        irows = []
        for proc, row in (("router", "consumer"), ("feeder", "listener output stage")):
            push, pull = ins["push"][proc], ins["pull"][proc]
            for scope, pick in (("main thread", lambda d: d.get(1, 0.0)), ("all", sum_values)):
                a, b = pick(push), pick(pull)
                irows.append([f"{row}: {proc}, {scope}", f"{a:,.0f}", f"{b:,.0f}", f"{a / b:.3f}"])
        print(render_table(["stage", "push", "pull", "push/pull"], irows))
        for proc in ("feeder", "router"):
            key = f"{proc} objects"
            if key in ins["push"] and key in ins["pull"]:
                print()
                print(f"{proc}, main thread, by shared object (instructions per event)")
                print()
                print(
                    render_table(
                        ["object", "push", "pull", "push - pull"],
                        object_rows(ins["push"][key], ins["pull"][key]),
                    )
                )
    if res["lag"]:
        print()
        print(
            f"Lag engine event -> router index at {args.rate:,.0f} events/s for "
            f"{args.seconds:g}s (target p99 < 50 ms)"
        )
        print()
        lrows = [
            [
                name + ("" if v["valid"] else " (invalid: seq != batches)"),
                v["events"],
                f"{v['p50_ms']:.1f}",
                f"{v['p99_ms']:.1f}",
                f"{v['max_ms']:.1f}",
                verdict(v["p99_ms"] < 50),
            ]
            for name, v in res["lag"].items()
        ]
        print(
            render_table(["transport", "events", "p50 ms", "p99 ms", "max ms", "p99 < 50"], lrows)
        )


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--events", type=int, default=100_000, help="events per transport run")
    p.add_argument(
        "--e2e-batches", type=int, default=5_000, help="batches of 8 per e2e run (0: skip)"
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rate", type=float, default=10_000, help="lag run: engine events per second")
    p.add_argument("--seconds", type=float, default=3.0, help="lag run length (0: skip)")
    p.add_argument(
        "--pairs",
        type=int,
        default=24,
        help="interleaved push/pull burst pairs on live stacks, per row (0: skip)",
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also interleave pull against pull: the noise floor of the push/pull ratio",
    )
    p.add_argument(
        "--callgrind",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="count instructions per event of each row's bottleneck under callgrind (~4 min)",
    )
    p.add_argument(
        "--restarts",
        type=int,
        default=6,
        help="fresh pairs of stacks the interleaved pairs are spread over",
    )
    p.add_argument("--callgrind-events", type=int, default=20_000, help=argparse.SUPPRESS)
    p.add_argument("--json", metavar="FILE")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument(
        "--role", choices=("feeder", "paced", "bare-server", "bare-client"), help=argparse.SUPPRESS
    )
    p.add_argument("--bus", default="", help=argparse.SUPPRESS)
    p.add_argument("--history", type=int, default=200_000, help=argparse.SUPPRESS)
    p.add_argument("--queue", type=int, default=1_000_000, help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--events-per-batch", type=int, default=8, help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    p.add_argument("--cert", help=argparse.SUPPRESS)
    p.add_argument("--key", help=argparse.SUPPRESS)
    p.add_argument("--ca", help=argparse.SUPPRESS)
    p.add_argument("--client-cert", help=argparse.SUPPRESS)
    p.add_argument("--client-key", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    roles = {
        "feeder": feeder_role,
        "paced": paced_role,
        "bare-server": bare_server_role,
        "bare-client": bare_client_role,
    }
    if args.role:
        return roles[args.role](args)
    os.environ.setdefault(SALT_ENV, SALT_SECRET.decode())
    res = bench(args)
    report(args, res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
