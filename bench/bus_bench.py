"""Event bus benchmark: engine KV events into the router's index, push (event bus) vs SSE pull.

A stack is real processes end to end: ``python -m harness.publisher --salted`` (the engine
simulator's vLLM encoder and ZMQ PUB, a router-issued cache salt on every chain's first
block, so every chain is attributed) -> the real ``continuum-kv-listener`` -> the real
router's KV index, either over the event bus (**push**: the listener dials the router's
EventBus with an mTLS client certificate made per run with ``certs``) or over SSE
(**pull**: the router reads ``GET /events/{backend}``). The listener announces a chain's
growth once per drained backlog of ZMQ batches, so its ingestion bounds the rate.

**Throughput, interleaved pairs.** This machine's speed drifts by +-20 % within seconds,
more than anything that separates push from pull, so runs of fresh processes minutes
apart cannot order them. A push stack and a pull stack stay alive side by side and take
turns (ABBA...), so the two bursts of a pair are seconds apart and see the machine alike;
the pairs are spread over ``--restarts`` fresh pairs of stacks (started A first, then B
first, in turn), because two identical stacks started once can differ by 3-10 % for their
whole life (hash seeds, memory layout, cores). Per burst: engine events / (time from the
trigger to the first 20 ms poll of the router's ``/admin/kv-index/backends`` showing every
resulting record applied), and the stack's CPU per event (utime + stime of the listener
and the router, all threads; on two cores both are busy, so the work per event sets the
pace). Per pair: push/pull; reported as the median with its distribution-free 95 %
confidence interval (``_table.median_interval``). ``--control`` runs the same with two
*pull* stacks: how far apart two identical stacks measure.

**Lag**: the publisher sends ``--rate`` events/s (batches of 8, each a whole salted chain)
for ``--seconds``; the bench polls the router's applied count every 5 ms, and per batch
takes (first poll at which the router applied its record) - (its send time), on the
shared monotonic clock. Reported p50/p99/max, push and pull.

Targets: push >= pull (PASS when the 95 % interval of the median push/pull ratio reaches
1, i.e. push is not shown slower), push >= 50,000 events/s end to end with mTLS, push lag
p99 < 50 ms at 10,000 events/s.

Run: ``.venv/bin/python -m bench.bus_bench [--batches 5000] [--pairs 24] [--restarts 6]
[--json F]``
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from ._kvstack import (
    BACKEND,
    Child,
    Listener,
    Publisher,
    cpu_seconds,
    free_port,
    listener_config,
    py,
    warm_up,
    workdir,
)
from ._table import median, median_interval, render_table, verdict

__all__ = ["main"]

CLIENT_ID = "bench-listener"
EVENTS_PER_BATCH = 8
TARGET_RATE = 50_000
TARGET_LAG_P99_MS = 50.0


# ---------------------------------------------------------------------------------------------
# configs and the router


def router_yaml(pki: dict[str, Any], bus_port: int, *, push: bool, sse_url: str) -> str:
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
        tls = {
            "cert": str(pki["server"].cert),
            "key": str(pki["server"].key),
            "client_ca": str(pki["ca"].cert),
        }
        broker = {"id": CLIENT_ID, "role": "kv_listener", "backends": [BACKEND]}
        cfg["dynamo"] = {
            "event_bus": {
                "enabled": True,
                "listen": f"127.0.0.1:{bus_port}",
                "tls": tls,
                "brokers": [broker],
            }
        }
    return yaml.safe_dump(cfg)


def bus_section(pki: dict[str, Any], bus_port: int) -> dict[str, Any]:
    """The listener's ``event_bus`` section: dial the router with the client certificate."""
    return {
        "url": f"https://localhost:{bus_port}",
        "ca_file": str(pki["ca"].cert),
        "client_id": CLIENT_ID,
        "client_cert_file": str(pki[CLIENT_ID].cert),
        "client_key_file": str(pki[CLIENT_ID].key),
        "reconnect_backoff": "50ms",
    }


class Router:
    """``python -m router serve``; reads the consumer's applied count over HTTP (cheap:
    the gRPC Backends call counts the index's entries, which would perturb the run)."""

    def __init__(self, config: str, workdir: Path, tag: str) -> None:
        path = workdir / f"{tag}-router.yaml"
        path.write_text(config)
        cmd = py("-m", "router", "--log-level", "WARNING", "serve", "--config", str(path))
        self.child = Child(f"{tag}-router", cmd, log_dir=workdir)
        host, _, port = self.child.expect(r"READY http=(\S+)").group(1).rpartition(":")
        self.http = http.client.HTTPConnection(host, int(port), timeout=130)

    def processed(self) -> int:
        """Events the consumer of BACKEND has applied (0 until it connected)."""
        self.http.request("GET", "/admin/kv-index/backends")
        body = json.loads(self.http.getresponse().read())
        for b in body["backends"]:
            if b["backend_name"] == BACKEND and b["connection"]["connected"]:
                return int(b["events"]["processed"])
        return 0

    def wait_processed(self, target: int, limit: float = 120.0, poll: float = 0.02) -> float:
        """Monotonic time of the first poll showing ``processed >= target`` (NaN: never)."""
        deadline = time.monotonic() + limit
        while time.monotonic() < deadline:
            if self.processed() >= target:
                return time.monotonic()
            time.sleep(poll)
        return float("nan")

    def stop(self) -> None:
        self.http.close()
        self.child.stop()


# ---------------------------------------------------------------------------------------------
# a stack and its bursts


class Stack:
    """Publisher -> listener -> router, push or pull, connected and warmed up."""

    def __init__(self, pki: dict[str, Any], wd: Path, push: bool, tag: str) -> None:
        bus_port = free_port()
        self.pub = Publisher(wd, tag)
        self.lst: Listener | None = None
        self.router: Router | None = None
        try:
            top: dict[str, Any] = {"subscriber_queue_size": 1_000_000, "history_size": 1_000_000}
            if push:
                top["event_bus"] = bus_section(pki, bus_port)
            self.lst = lst = Listener(listener_config(self.pub.connect_endpoint, top=top), wd, tag)
            warm_up(lambda: self.pub.burst(1, 1), lambda: lst.source()["frames"] > 0)
            sse_url = f"{lst.url}/events/{BACKEND}"
            self.router = Router(router_yaml(pki, bus_port, push=push, sse_url=sse_url), wd, tag)
            connected = self.router.wait_processed(1)  # the warm-up's records
            if connected != connected:  # NaN: never
                raise TimeoutError(f"router never connected; log:\n{self.router.child.tail()}")
        except BaseException:
            self.stop()
            raise

    @property
    def pids(self) -> list[int]:
        """The stack's own processes (the publisher stands for the engine, alike in both)."""
        assert self.lst is not None and self.router is not None
        return [self.lst.pid, self.router.child.pid]

    def caught_up(self) -> tuple[int, int]:
        """(router processed, listener seq) once the router applied every record so far:
        from here on, each new listener record is one more processed event at the router."""
        assert self.lst is not None and self.router is not None
        deadline = time.monotonic() + 30
        state = (self.lst.hub_seq(), self.router.processed())
        while time.monotonic() < deadline:
            time.sleep(0.1)
            now = (self.lst.hub_seq(), self.router.processed())
            if now == state:
                return state[1], state[0]
            state = now
        raise TimeoutError("the router did not settle")

    def burst(self, batches: int) -> float:
        """Engine events/s of one burst, until the router applied its last record."""
        assert self.lst is not None and self.router is not None
        n0, seq0 = self.caught_up()
        ev0 = self.lst.source()["events"]
        n = batches * EVENTS_PER_BATCH
        t0 = time.monotonic()
        self.pub.burst(batches, EVENTS_PER_BATCH)
        deadline = time.monotonic() + 120
        while self.lst.source()["events"] - ev0 < n and time.monotonic() < deadline:
            time.sleep(0.02)
        seq = self.lst.hub_seq()
        return n / (self.router.wait_processed(n0 + seq - seq0) - t0)

    def stop(self) -> None:
        for part in (self.router, self.lst, self.pub):
            if part is not None:
                part.stop()


def run_interleaved(
    args: argparse.Namespace, pki: dict[str, Any], wd: Path, modes: Sequence[tuple[str, bool]]
) -> dict[str, dict[str, list[float]]]:
    """``args.pairs`` bursts on each of two live stacks, alternating ABBA, over
    ``args.restarts`` fresh pairs of stacks; ``modes`` names the two and says which one
    pushes. By name and in pair order: events/s per burst (``rate``) and the stack's CPU
    per event (``cpu_us``)."""
    out: dict[str, dict[str, list[float]]] = {name: {"rate": [], "cpu_us": []} for name, _ in modes}
    names = [name for name, _ in modes]
    events = args.batches * EVENTS_PER_BATCH
    restarts = max(1, min(args.restarts, args.pairs))
    k = 0
    for restart in range(restarts):
        with contextlib.ExitStack() as live:
            stacks: dict[str, Stack] = {}
            # Started A first, then B first, in turn: over a whole run of pull-against-pull
            # pairs, the stack started first measured a few percent slower.
            for name, push in modes if restart % 2 == 0 else modes[::-1]:
                stacks[name] = Stack(pki, wd, push, f"{name}-{restart}")
                live.callback(stacks[name].stop)
            for _ in range((args.pairs - k) // (restarts - restart)):
                for name in names if k % 2 == 0 else names[::-1]:
                    cpu0 = sum(cpu_seconds(p) for p in stacks[name].pids)
                    out[name]["rate"].append(stacks[name].burst(args.batches))
                    cpu = sum(cpu_seconds(p) for p in stacks[name].pids) - cpu0
                    out[name]["cpu_us"].append(cpu / events * 1e6)
                if args.verbose:
                    print(k, {n: round(v["rate"][-1]) for n, v in out.items()}, flush=True)
                k += 1
    return out


def run_lag(args: argparse.Namespace, pki: dict[str, Any], wd: Path, push: bool) -> dict[str, Any]:
    """Per paced batch: (first 5 ms poll where the router applied its record) - (send time).
    Each batch is a whole chain with its own salted prefix, announced as one
    ``cache_created``, so batch ``b`` is the router's ``b + 1``-th applied event after the
    start; the run is only valid when the listener's seq moved by exactly the batch count."""
    stack = Stack(pki, wd, push, f"lag-{'push' if push else 'pull'}")
    try:
        assert stack.lst is not None and stack.router is not None
        n0, seq0 = stack.caught_up()
        batches = int(args.rate * args.seconds / EVENTS_PER_BATCH)
        polls: list[tuple[float, int]] = []
        stack.pub.start_paced(args.rate, args.seconds, EVENTS_PER_BATCH)
        deadline = time.monotonic() + args.seconds + 60
        while time.monotonic() < deadline:
            polls.append((time.monotonic(), stack.router.processed() - n0))
            if polls[-1][1] >= batches:
                break
            time.sleep(0.005)
        times = stack.pub.paced_result()["times"]
        lags: list[float] = []
        j = 0
        for b, t_send in enumerate(times):
            while j < len(polls) and polls[j][1] < b + 1:
                j += 1
            lags.append(polls[j][0] - t_send if j < len(polls) else float("inf"))
        lags.sort()

        def q(p: float) -> float:
            return lags[min(len(lags) - 1, int(p * len(lags)))] * 1000

        return {
            "events": len(lags) * EVENTS_PER_BATCH,
            "valid": stack.lst.hub_seq() - seq0 == len(times),
            "p50_ms": q(0.50),
            "p99_ms": q(0.99),
            "max_ms": lags[-1] * 1000,
        }
    finally:
        stack.stop()


# ---------------------------------------------------------------------------------------------
# report


PUSH_ROW = "e2e: push (A) vs pull (B)"
CONTROL_ROW = "e2e control: pull (A) vs pull (B)"


def ab_ratio(
    runs: dict[str, dict[str, list[float]]], key: str = "rate"
) -> tuple[list[float], float, float, float]:
    """A/B of ``key`` (``rate``: events/s, ``cpu_us``: stack CPU per event) per
    interleaved pair: the ratios, their median and the median's 95 % interval."""
    ratios = [x / y for x, y in zip(runs["A"][key], runs["B"][key], strict=True) if y > 0]
    lo, hi = median_interval(ratios)
    return ratios, median(ratios), lo, hi


def _interval(lo: float, hi: float) -> str:
    return f"{lo:.3f} .. {hi:.3f}" if lo == lo else "- (needs 6 pairs)"


def report(args: argparse.Namespace, res: dict[str, Any]) -> None:
    print(
        f"\nEvent bus end to end (engine -> listener -> event bus (mTLS) or SSE pull -> router "
        f"index): {args.pairs} pairs of {args.batches * EVENTS_PER_BATCH}-event bursts on two "
        f"live stacks, alternating ABBA, over {args.restarts} restarts; A/B per pair: median "
        "and its distribution-free 95 % confidence interval. Stack CPU/ev: listener + router, "
        "all threads, per engine event\n"
    )
    rows = []
    for label, runs in res["interleaved"].items():
        ratios, mid, lo, hi = ab_ratio(runs)
        _, work, wlo, whi = ab_ratio(runs, "cpu_us")
        a, b = runs["A"], runs["B"]
        rows.append(
            [
                label,
                f"{median(a['rate']):,.0f}",
                f"{median(b['rate']):,.0f}",
                f"{mid:.3f}",
                _interval(lo, hi),
                f"{sum(r >= 1.0 for r in ratios)}/{len(ratios)}",
                f"{median(a['cpu_us']):.1f} / {median(b['cpu_us']):.1f}",
                f"{work:.3f}",
                _interval(wlo, whi),
            ]
        )
    headers = ["row", "A ev/s", "B ev/s", "A/B ev/s", "95% CI", "pairs A >= B"]
    headers += ["stack CPU us/ev A / B", "A/B CPU", "95% CI"]
    print(render_table(headers, rows))
    lag = res["lag"]
    if lag:
        print(
            f"\nLag engine event -> router index at {args.rate:,.0f} events/s for {args.seconds:g}s"
        )
        print()
        lrows = [
            [
                name + ("" if v["valid"] else " (invalid: seq != batches)"),
                v["events"],
                f"{v['p50_ms']:.1f}",
                f"{v['p99_ms']:.1f}",
                f"{v['max_ms']:.1f}",
            ]
            for name, v in lag.items()
        ]
        print(render_table(["transport", "events", "p50 ms", "p99 ms", "max ms"], lrows))
    push = res["interleaved"][PUSH_ROW]
    _, mid, lo, hi = ab_ratio(push)
    rate = median(push["A"]["rate"])
    ok = None if hi != hi else hi >= 1.0
    targets: list[tuple[str, str, bool | None]] = [
        ("push >= pull (95% CI of push/pull reaches 1)", f"{mid:.3f} ({_interval(lo, hi)})", ok),
        (f"push >= {TARGET_RATE:,} events/s end to end", f"{rate:,.0f}", rate >= TARGET_RATE),
    ]
    if "push" in lag:
        p99 = lag["push"]["p99_ms"]
        targets.append(
            (f"push lag p99 < {TARGET_LAG_P99_MS:g} ms", f"{p99:.1f} ms", p99 < TARGET_LAG_P99_MS)
        )
    print("\ntargets:\n")
    print(render_table(["target", "figure", ""], [(t, f, verdict(v)) for t, f, v in targets]))


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bus_bench", description=__doc__)
    p.add_argument(
        "--batches", type=int, default=5_000, help=f"batches of {EVENTS_PER_BATCH} per burst"
    )
    p.add_argument("--pairs", type=int, default=24, help="interleaved push/pull burst pairs")
    p.add_argument(
        "--restarts", type=int, default=6, help="fresh pairs of stacks the pairs are spread over"
    )
    p.add_argument(
        "--control",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also interleave pull against pull: the noise floor of the push/pull ratio",
    )
    p.add_argument("--rate", type=float, default=10_000, help="lag run: engine events per second")
    p.add_argument("--seconds", type=float, default=3.0, help="lag run length (0: skip)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep configs and process logs")
    p.add_argument("-v", "--verbose", action="store_true", help="print every pair")
    args = p.parse_args(argv)
    if args.pairs < 1:
        p.error("--pairs must be at least 1")
    from certs import dev_bundle

    res: dict[str, Any] = {"interleaved": {}, "lag": {}}
    with workdir("continuum-bus-bench-", args.keep_logs) as wd:
        pki = dev_bundle(wd / "pki", clients=[CLIENT_ID])
        res["interleaved"][PUSH_ROW] = run_interleaved(args, pki, wd, (("A", True), ("B", False)))
        if args.control:
            modes = (("A", False), ("B", False))
            res["interleaved"][CONTROL_ROW] = run_interleaved(args, pki, wd, modes)
        if args.seconds > 0:
            for name, push in (("push", True), ("pull", False)):
                res["lag"][name] = run_lag(args, pki, wd, push)
    report(args, res)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
