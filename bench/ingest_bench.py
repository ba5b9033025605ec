"""Ingestion benchmark: KV block events per second, the listener against a bare receive loop.

Real processes, 8 block events per batch (one block of 16 tokens per event, chains of 64
blocks), every burst published as fast as one core allows by ``python -m
harness.publisher --salted`` (the engine simulator's burst code; the first block of every
chain carries a router-issued cache salt, as vLLM shows it):

* **baseline** (the ceiling, same run): a bare pyzmq SUB + ``msgpack.unpackb`` loop in its
  own process (this module's ``receiver`` role), receiving the same burst;
* **listener**: ``continuum-kv-listener`` (source ``engine: vllm``, ``zmq_mode: connect``,
  the same salt secret), with one SSE subscriber process (the ``sse`` role) reading ``GET
  /events/{backend}`` through ``bus.sse.SseParser``. Salted chains are the path a request
  routed by continuum takes: decode, one salt check per chain, every block tracked and
  keyed, pruning to ``max_tracked_blocks`` (100,000) once the burst passes it, hub, SSE.
  Variants: both vLLM encodings with a prefix per chain (every event grows its chain, so
  every drained backlog announces it), and 64 shared prefixes (few announcements).
* **conversation keys**: the same salted burst with Qwen2 vocabulary token ids (the
  publisher's ``--token-ids qwen2``), once to a listener with prefix keys only
  (``M-salted-qwen``) and once to one in conversation mode (``M-salted-conv``:
  ``conversation.enabled``, the source's ``tokenizer`` Qwen2's ``tokenizer.json`` and its
  ``model``): every block's token bytes also extend its chain's conversation key chain, and
  the chain keys are announced too. ``conv/prefix-only`` (printed under the table) is the
  listener CPU per event of the one over the other, paired per round: the real-process
  counterpart of ``ingest_pipeline_bench``'s ``conv/full`` (target <= 1.5x).

Timing (``t0`` = just before the burst is triggered): bare events/s = events decoded /
(its last frame - t0); listener events/s = ``/stats`` ``events`` delta / (first 20 ms poll
showing all of them - t0); SSE records/s = hub ``seq`` delta / (the subscriber's last
record - t0); CPU per 1k events = utime + stime of the process (all threads) from t0 on.
Before each timed burst, one-batch bursts are sent until the receiver has seen one (ZMQ's
slow joiner); the PUB's SNDHWM and the SUB's RCVHWM (100,000 batches) exceed the burst,
so a lagging receiver queues, it does not drop. Losses are counted (bare loop: sequence
numbers; listener: ``gaps``; SSE: hub overflows and ``buffer_overflow``) and such runs are
left out of the medians. Every run starts fresh processes; rounds interleave the variants
and alternate bare/listener order; ratios are paired per round.

Target: listener/bare >= 40 % (events/s, same run). The bare loop keeps up with the
publisher, so that ratio also depends on the publisher's speed on the day; ``CPU
bare/lst`` (bare CPU per event over the listener's) is the load-independent one.

Run: ``.venv/bin/python -m bench.ingest_bench [--batches 25000] [--repeats 3] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import select
import socket
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.sim.tokenizer import bundled_qwen2_json

from ._kvstack import (
    BACKEND,
    Child,
    Listener,
    Publisher,
    cpu_seconds,
    listener_config,
    py,
    rss_bytes,
    warm_up,
    workdir,
)
from ._table import fmt_float, median, paired_ratio, render_table, verdict

TARGET_RATIO = 0.40
TARGET_CONV = 1.5


# ---------------------------------------------------------------------------------------------
# hidden roles: the bare receive-and-decode loop (baseline) and the SSE subscriber


def receiver_role(args: argparse.Namespace) -> int:
    """Bare SUB + ``msgpack.unpackb``. Idle: prints ``SEEN <seq>`` per frame (warm-up).
    ``arm FIRST N`` on stdin: prints ``ARMED``, receives and decodes until batch
    ``FIRST+N-1`` (or 10 s of silence), prints ``{"events", "batches", "lost", "t_last"}``."""
    import msgpack
    import zmq

    sock = zmq.Context().socket(zmq.SUB)
    sock.setsockopt(zmq.RCVHWM, args.hwm)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.connect(args.endpoint)
    print("READY", flush=True)
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(sys.stdin.fileno(), zmq.POLLIN)
    while True:
        ready = dict(poller.poll(1000))
        if sock in ready:
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                print(f"SEEN {int.from_bytes(frames[1], 'big')}", flush=True)
        if sys.stdin.fileno() not in ready:
            continue
        parts = sys.stdin.readline().split()  # one command per process: no buffering issue
        if parts[:1] != ["arm"]:
            return 0
        first, n = int(parts[1]), int(parts[2])
        sock.setsockopt(zmq.RCVTIMEO, 10_000)
        print("ARMED", flush=True)
        # -- the measured loop ------------------------------------------------------------
        recv, unpackb = sock.recv_multipart, msgpack.unpackb
        last, expect = first + n - 1, first
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
        out = {"events": events, "batches": batches, "lost": n - batches, "t_last": t_last}
        print(json.dumps(out), flush=True)


def sse_role(args: argparse.Namespace) -> int:
    """One SSE subscriber (``bus.sse.SseParser``) of ``GET /events/{backend}`` over HTTP/1.0
    (no chunked encoding). Prints ``OPEN`` once the headers are in. ``until SEQ`` on stdin:
    once a record with that seq or a later one arrived (or after 10 s without any), prints
    ``{"records", "last_seq", "t_last", "errors", "cpu"}`` and exits."""
    from bus.sse import SseParser

    host, port = args.url.removeprefix("http://").rsplit(":", 1)
    sock = socket.create_connection((host, int(port)))
    sock.sendall(
        f"GET /events/{BACKEND} HTTP/1.0\r\nHost: {host}\r\n"
        "Accept: text/event-stream\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(65536)
        if not chunk:
            print("CLOSED", flush=True)
            return 1
        head += chunk
    status_line = head.partition(b"\r\n")[0]
    if b" 200 " not in status_line + b" ":
        print(f"HTTP {status_line!r}", flush=True)
        return 1
    print("OPEN", flush=True)
    parser = SseParser()
    records = errors = 0
    last_seq, t_last = -1, 0.0
    target: int | None = None
    closed = False
    stdin = sys.stdin.fileno()
    idle_since = time.monotonic()
    data = head.split(b"\r\n\r\n", 1)[1]
    sock.setblocking(False)
    while True:
        if data:
            recs = parser.feed(data)
            for r in recs:
                records += 1
                errors += r.event == "error"
                epoch, sep, seq = (r.id or "").rpartition("-")
                if sep and "." not in epoch and seq.isdigit():
                    last_seq = int(seq)
            if recs:
                t_last = time.monotonic()
            idle_since = time.monotonic()
        data = b""
        readable, _, _ = select.select([sock, stdin], [], [], 0.5)
        if sock in readable:
            try:
                data = sock.recv(1 << 20)
                closed = closed or data == b""
            except BlockingIOError:
                pass
        if stdin in readable and (line := os.read(stdin, 4096).decode()).startswith("until"):
            target = int(line.split()[1])
            idle_since = time.monotonic()
        if target is not None and (
            last_seq >= target or closed or time.monotonic() - idle_since > 10
        ):
            out = {"records": records, "last_seq": last_seq, "t_last": t_last}
            print(json.dumps({**out, "errors": errors, "cpu": time.process_time()}), flush=True)
            return 0
        if closed and target is None:
            time.sleep(0.05)


# ---------------------------------------------------------------------------------------------
# variants and runs


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    fmt: str
    prefixes: int = 0  # distinct prefix keys (0: one per chain)
    token_ids: str = "simple"  # the publisher's --token-ids
    conversation: bool = False  # the listener computes conversation keys


VARIANTS: dict[str, Variant] = {
    v.key: v
    for v in (
        Variant("M-salted", "M (vllm-0.33), salted chains", "vllm-0.33"),
        Variant("A-salted", "A (vllm-0.23.0), salted chains", "vllm-0.23.0"),
        Variant("M-salted-64", "M, salted, 64 shared prefixes", "vllm-0.33", prefixes=64),
        Variant("M-salted-qwen", "M, salted, Qwen2 ids, prefix keys", "vllm-0.33",
                token_ids="qwen2"),
        Variant("M-salted-conv", "M, salted, Qwen2 ids, conversation keys", "vllm-0.33",
                token_ids="qwen2", conversation=True),
    )
}  # fmt: skip
CONV_PAIR = ("M-salted-conv", "M-salted-qwen")
"""The conversation variant and the prefix-only one it is compared with."""


@dataclass
class Cell:
    variant: Variant
    base: list[dict[str, Any]] = field(default_factory=list)
    listener: list[dict[str, Any]] = field(default_factory=list)


def _publisher(v: Variant, args: argparse.Namespace, workdir: Path, tag: str) -> Publisher:
    return Publisher(
        workdir, tag, fmt=v.fmt, prefixes=v.prefixes, hwm=args.hwm, token_ids=v.token_ids
    )


def run_baseline(v: Variant, args: argparse.Namespace, workdir: Path, tag: str) -> dict[str, Any]:
    pub = _publisher(v, args, workdir, tag)
    rx: Child | None = None
    try:
        cmd = py(
            "-m", "bench.ingest_bench", "--role", "receiver",
            "--endpoint", pub.connect_endpoint, "--hwm", str(args.hwm),
        )  # fmt: skip
        rx = Child(f"{tag}-bare", cmd, log_dir=workdir, stdin=True)
        rx.wait_ready()
        lines = rx.lines

        def seen() -> bool:
            try:
                while (line := lines.get_nowait()) is not None:
                    if line.startswith("SEEN"):
                        return True
            except queue.Empty:
                pass
            return False

        warm_up(lambda: pub.burst(1, args.events_per_batch), seen)
        time.sleep(0.1)  # the rest of the warm-up's SEEN lines
        rx.send(f"arm {pub.next_seq} {args.batches}")
        rx.expect(r"^ARMED")
        cpu0 = cpu_seconds(rx.pid)
        t0 = time.monotonic()
        pub_res = pub.burst(args.batches, args.events_per_batch)
        res = json.loads(rx.expect(r"^\{", timeout=600).string)
        cpu = cpu_seconds(rx.pid) - cpu0
        seconds, events = res["t_last"] - t0, res["events"]
        return {
            "events": events,
            "events_per_s": events / seconds if seconds > 0 else float("nan"),
            "cpu_s_per_1k": cpu / (events / 1000) if events else float("nan"),
            "lost": res["lost"],
            "pub_events_per_s": pub_res.get("events_per_s") or float("nan"),
            "valid": res["lost"] == 0,
        }
    finally:
        if rx is not None:
            rx.stop()
        pub.stop()


def run_listener(v: Variant, args: argparse.Namespace, workdir: Path, tag: str) -> dict[str, Any]:
    pub = _publisher(v, args, workdir, tag)
    lst: Listener | None = None
    sse: Child | None = None
    try:
        top: dict[str, Any] = {"subscriber_queue_size": args.subscriber_queue}
        source: dict[str, Any] = {}
        if v.conversation:
            top["conversation"] = {"enabled": True}
            source = {"tokenizer": str(bundled_qwen2_json()), "model": "sim"}
        cfg = listener_config(pub.connect_endpoint, top=top, source=source)
        lst = listener = Listener(cfg, workdir, tag)
        warm_up(
            lambda: pub.burst(1, args.events_per_batch), lambda: listener.source()["frames"] > 0
        )
        cmd = py("-m", "bench.ingest_bench", "--role", "sse", "--url", lst.url)
        sse = Child(f"{tag}-sse", cmd, log_dir=workdir, stdin=True)
        sse.expect(r"^OPEN")
        deadline = time.monotonic() + 10
        while lst.stats()["hub"]["backends"][BACKEND]["subscribers"] < 1:
            if time.monotonic() > deadline:
                raise TimeoutError("the SSE subscriber did not register")
            time.sleep(0.02)
        time.sleep(0.2)  # warm-up stragglers
        st0 = lst.stats()
        src0, hub0 = st0["sources"][BACKEND], st0["hub"]["backends"][BACKEND]
        expected = args.batches * args.events_per_batch
        cpu0 = cpu_seconds(lst.pid)
        t0 = time.monotonic()
        box: dict[str, Any] = {}
        trig = threading.Thread(
            target=lambda: box.update(pub.burst(args.batches, args.events_per_batch))
        )
        trig.start()
        t_done = float("nan")
        last_events, last_change = src0["events"], time.monotonic()
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
        hub = st["hub"]["backends"][BACKEND]
        sse.send(f"until {hub['seq']}")
        sres = json.loads(sse.expect(r"^\{", timeout=120).string)
        cpu = cpu_seconds(lst.pid) - cpu0
        events = src["events"] - src0["events"]
        records = hub["seq"] - hub0["seq"]
        sse_ok = sres["last_seq"] >= hub["seq"] and not sres["errors"]
        gaps = src["gaps"] - src0["gaps"]
        overflows = hub["overflows"] - hub0["overflows"]
        seconds = t_done - t0
        return {
            "events": events,
            "events_per_s": events / seconds if seconds > 0 else float("nan"),
            "sse_per_s": records / (sres["t_last"] - t0) if records and sse_ok else float("nan"),
            "sse_per_event": records / events if events else float("nan"),
            "cpu_s_per_1k": cpu / (events / 1000) if events else float("nan"),
            "lost": gaps,
            "sse_lost": overflows + sres["errors"],
            "tracked_blocks": src["tracked_blocks"],
            "chain_keys": src.get("chain_keys", 0),
            "rss_mib": rss_bytes(lst.pid) / 2**20,
            "pub_events_per_s": box.get("events_per_s") or float("nan"),
            "valid": events >= expected and gaps == 0,
            "sse_valid": sse_ok and overflows == 0,
        }
    finally:
        if sse is not None:
            sse.stop()
        if lst is not None:
            lst.stop()
        pub.stop()


# ---------------------------------------------------------------------------------------------
# report


HEADERS = [
    "variant", "bare ev/s", "listener ev/s", "listener/bare", ">=40%", "CPU bare/lst",
    "SSE rec/s", "SSE rec/ev", "CPU s/1k ev", "bare CPU s/1k ev", "pub ev/s", "tracked",
    "RSS end", "lost", "SSE lost",
]  # fmt: skip

LEGEND = (
    "bare / listener ev/s: block events per second from the trigger to the bare loop's last "
    "decoded frame / to the /stats poll that showed all of them; listener/bare: paired per "
    "round; CPU bare/lst: bare CPU per event over the listener's (paired): the listener's "
    "per-core capacity relative to the bare loop, independent of machine load; SSE rec/s: hub "
    "records out to the subscriber (rec/ev: per block event); CPU s/1k ev: the process's "
    "utime+stime per 1,000 events, all threads; pub ev/s: the publisher's own send rate (an "
    "upper bound for both receivers); tracked: tracked_blocks at the end; RSS end: listener "
    "VmRSS at the end; lost: batches the bare loop missed + the listener's gaps (must be 0; "
    "such runs are left out); SSE lost: hub overflows + buffer_overflow records (SSE figures "
    "of such runs are left out)."
)


def _lost(runs: list[dict[str, Any]], key: str, valid: str) -> str:
    invalid = sum(not r[valid] for r in runs)
    return f"{sum(r[key] for r in runs)}" + (f" ({invalid} inv.)" if invalid else "")


def report(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    print(
        f"\nKV event ingestion: {args.batches} batches x {args.events_per_batch} events = "
        f"{args.batches * args.events_per_batch} block events per burst, 1 block per event, "
        f"chains of 64 blocks; subscriber_queue_size {args.subscriber_queue}; medians of "
        f"{args.repeats} interleaved rounds (fresh processes per run); target listener/bare "
        f">= {TARGET_RATIO:.0%}\n"
    )
    rows = []
    out: dict[str, Any] = {"params": vars(args), "variants": {}}
    for c in cells:
        lst = [r for r in c.listener if r["valid"]]
        pairs = [(lr, br) for lr, br in zip(c.listener, c.base, strict=False) if lr["valid"]]
        pairs = [(lr, br) for lr, br in pairs if br["valid"]]
        ratio = paired_ratio(
            [lr["events_per_s"] for lr, _ in pairs], [br["events_per_s"] for _, br in pairs]
        )
        cpu_ratio = paired_ratio(
            [br["cpu_s_per_1k"] for _, br in pairs], [lr["cpu_s_per_1k"] for lr, _ in pairs]
        )
        base = [r for r in c.base if r["valid"]]
        ok = None if ratio != ratio else ratio >= TARGET_RATIO
        rows.append(
            [
                c.variant.label,
                fmt_float(median(r["events_per_s"] for r in base), 0),
                fmt_float(median(r["events_per_s"] for r in lst), 0),
                f"{ratio:.0%}" if ratio == ratio else "-",
                verdict(ok),
                f"{cpu_ratio:.0%}" if cpu_ratio == cpu_ratio else "-",
                fmt_float(median(r["sse_per_s"] for r in lst if r["sse_valid"]), 0),
                fmt_float(median(r["sse_per_event"] for r in c.listener), 2),
                fmt_float(median(r["cpu_s_per_1k"] for r in lst), 4),
                fmt_float(median(r["cpu_s_per_1k"] for r in base), 4),
                fmt_float(median(r["pub_events_per_s"] for r in c.base + c.listener), 0),
                fmt_float(median(r["tracked_blocks"] for r in c.listener), 0),
                f"{fmt_float(median(r['rss_mib'] for r in c.listener), 0)} MiB",
                _lost(c.base + c.listener, "lost", "valid"),
                _lost(c.listener, "sse_lost", "sse_valid"),
            ]
        )
        out["variants"][c.variant.key] = {
            "label": c.variant.label,
            "baseline_runs": c.base,
            "listener_runs": c.listener,
            "paired_ratio": ratio,
            "paired_cpu_ratio": cpu_ratio,
            "pass": ok,
        }
    print(render_table(HEADERS, rows))
    print("\n" + LEGEND)
    conv = conversation_cost(cells)
    if conv is not None:
        out["conv_vs_prefix_only"] = conv
        print(
            f"\nconversation keys ({CONV_PAIR[0]} over {CONV_PAIR[1]}, paired per round): "
            f"listener CPU per event conv/prefix-only {conv['cpu_ratio']:.2f}x (target <= "
            f"{TARGET_CONV}x: {verdict(conv['pass'])}), events/s {conv['rate_ratio']:.0%}, "
            f"chain keys held at the end {conv['chain_keys']:.0f}"
        )
    return out


def conversation_cost(cells: list[Cell]) -> dict[str, Any] | None:
    """The conversation variant against the prefix-only one of the same burst, round by
    round (None unless both ran)."""
    by_key = {c.variant.key: c for c in cells}
    if not all(k in by_key for k in CONV_PAIR):
        return None
    conv, plain = (by_key[k].listener for k in CONV_PAIR)
    pairs = [(c, p) for c, p in zip(conv, plain, strict=False) if c["valid"] and p["valid"]]
    cpu = paired_ratio([c["cpu_s_per_1k"] for c, _ in pairs], [p["cpu_s_per_1k"] for _, p in pairs])
    rate = paired_ratio(
        [c["events_per_s"] for c, _ in pairs], [p["events_per_s"] for _, p in pairs]
    )
    ok = None if cpu != cpu else cpu <= TARGET_CONV
    keys = median(c["chain_keys"] for c, _ in pairs) if pairs else float("nan")
    return {"cpu_ratio": cpu, "rate_ratio": rate, "pass": ok, "chain_keys": keys}


def bench(args: argparse.Namespace) -> list[Cell]:
    cells = [Cell(VARIANTS[k]) for k in args.variants]
    with workdir("continuum-ingest-bench-", args.keep_logs) as wd:
        for r in range(args.repeats):
            for c in cells:
                for which in ("base", "listener") if r % 2 == 0 else ("listener", "base"):
                    tag = f"r{r}-{c.variant.key}-{which}"
                    run = run_baseline if which == "base" else run_listener
                    res = run(c.variant, args, wd, tag)
                    (c.base if which == "base" else c.listener).append(res)
                    if args.verbose:
                        shown = {
                            k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()
                        }
                        print(f"round {r + 1} {c.variant.key:12} {which:8} {shown}", flush=True)
            if not args.verbose:
                print(f"round {r + 1}/{args.repeats} done", flush=True)
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ingest_bench", description=__doc__)
    p.add_argument("--batches", type=int, default=25_000, help="batches per timed burst")
    p.add_argument("--events-per-batch", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3, help="interleaved rounds (medians)")
    p.add_argument(
        "--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
        help="which publisher/listener set-ups to run (default: all)",
    )  # fmt: skip
    p.add_argument(
        "--subscriber-queue", type=int, default=1_000_000, metavar="N",
        help="the listener's subscriber_queue_size (default 1000000, the config maximum, so "
        "that the SSE queue holds a whole burst; the listener's default is 4096)",
    )  # fmt: skip
    p.add_argument("--hwm", type=int, default=100_000, help="PUB SNDHWM, bare SUB RCVHWM")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep configs and process logs")
    p.add_argument("-v", "--verbose", action="store_true", help="print every run")
    p.add_argument("--role", choices=("receiver", "sse"), help=argparse.SUPPRESS)
    p.add_argument("--endpoint", help=argparse.SUPPRESS)
    p.add_argument("--url", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.role == "receiver":
        return receiver_role(args)
    if args.role == "sse":
        return sse_role(args)
    if args.batches > args.hwm:
        print("note: --batches exceeds --hwm; a lagging receiver may lose batches")
    out = report(args, bench(args))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
