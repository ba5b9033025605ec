"""Fleet benchmark: conversation-depth routing against the selection strategies.

One run, real processes: ``--engines`` simulated engines (Qwen2 tokenizer and chat
template, a bounded prefix cache that also keeps each answer's blocks, modelled prefill
and decode time, vLLM KV events over ZMQ), the real ``continuum-kv-listener`` subscribed
to all of them (in conversation mode when it supports it), and for every workload and
row a fresh router process on a generated config:

* ``RoundRobin``;
* ``PrefixAwareHash`` (Tier 1, the prefix key on a bounded-load hash ring);
* ``PrefixAwareHash+KV`` (plus Tier 4, the prefix-key index fed by the listener);
* ``Conversation`` (plus the conversation-depth index: how many tokens of each request's
  rendered prompt every engine holds, from the engines' events and predict-on-route);
* ``ConsistentHash(session)`` (the session id in ``user``: stickiness without any cache
  knowledge, the baseline to beat).

Workloads (:mod:`harness.workloads`): (a) multi-turn chat, >= 8 sessions per shared
system prompt, enough concurrent sessions that no engine can take all of a prompt's;
(b) agent tool loops on a few shared tool suites, prompts growing to several thousand
tokens; (c) every session with its own system prompt. Engines are reset between runs and
the listener is waited on until it tracks nothing, so every run starts cold.

Figures per row and workload, each the median over ``--repeat`` rounds of every row
(default 3; one run of a row moves by several points with the engines' timing): the
engines' own token hit rate (cached / prompt tokens from ``/sim/stats``), modelled
prefill seconds (and against RoundRobin), load spread
(time-averaged in-flight requests per engine, sampled every ``--sample-ms``: max/mean),
turn-to-turn stickiness (share of turns on the engine of the session's previous turn)
and the router's predicted-vs-delivered cached-token error (from its
``/admin/kv-index/stats``; "-" when it reports none). Targets, judged on the same run:
Conversation >= PrefixAwareHash+KV + 10 pp hit rate on (a) and (b), >= the session-hash
row's hit rate there, max/mean load <= 1.25, and >= PrefixAwareHash+KV - 1 pp on (c).

Rows whose listener or router support is missing are printed as "not available" (see
:mod:`bench._fleet`), the others run. A plot (SVG) of the hit rates is written to
``bench/out/fleet_hit_rate.svg``.

    .venv/bin/python -m bench.fleet_bench            # ~5-10 min
    .venv/bin/python -m bench.fleet_bench --quick    # smaller workloads, ~2 min
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from bench._fleet import (
    MODEL,
    ListenerProcess,
    RouterProcess,
    admin_stats,
    kv_consumers_connected,
    listener_cleared,
    listener_config,
    listener_connected,
    listener_conversation,
    predicted_vs_delivered,
    router_config,
    router_conversation,
    routes_conversation,
    scoring_arg,
)
from bench._plot import bar_chart_svg
from bench._table import render_table, verdict
from harness.procs import ROOT, ChildExited, ChildTimeout, free_port
from harness.sim.fleet import SimFleet
from harness.workloads import (
    Progress,
    Workload,
    agent_tool_loops,
    run_workload,
    shared_prompt_chat,
    stickiness,
    unique_prompt_chat,
)

BASE_CONFIG = ROOT / "deploy" / "demo.yaml"
OUT = ROOT / "bench" / "out"


@dataclass(frozen=True)
class Row:
    label: str
    strategy: str
    #: "": the strategy alone; "kv": Tier 4 prefix-key index; "conv": conversation index too.
    index: str = ""


ROWS = (
    Row("RoundRobin", "RoundRobin"),
    Row("PrefixAwareHash", "PrefixAwareHash"),
    Row("PrefixAwareHash+KV", "PrefixAwareHash", "kv"),
    Row("Conversation", "PrefixAwareHash", "conv"),
    Row("ConsistentHash(session)", "ConsistentHash"),
)
PREFIX_KV, CONV, SESSION = "PrefixAwareHash+KV", "Conversation", "ConsistentHash(session)"


@dataclass
class Result:
    workload: str
    row: str
    available: str | None = None  # None: ran; else why not
    requests: int = 0
    errors: int = 0
    hit_rate: float = float("nan")
    prefill_s: float = float("nan")
    load_spread: float = float("nan")
    stickiness: float = float("nan")
    pred_error: float | None = None
    seconds: float = 0.0
    runs: list[float] = field(default_factory=list)
    """Each run's hit rate when the row ran more than once (``--repeat``): the figures
    above are the medians."""


@dataclass(frozen=True)
class Setup:
    """One workload with the fleet it runs on: its engines' cache size and the sessions
    in flight. Each cache holds about a quarter to a half of what a workload's live
    sessions need fleet-wide, so where a conversation is prefilled matters."""

    workload: Workload
    capacity_blocks: int
    concurrency: int


def setups(args: argparse.Namespace) -> dict[str, Setup]:
    q, seed = args.quick, args.seed
    all_ = {
        # 8 prompts, the two most popular carrying more sessions than one engine takes;
        # every session in flight at once.
        "a": Setup(
            shared_prompt_chat(
                prompts=8,
                sessions_per_prompt=8,
                popularity=(4, 2),
                turns=5 if q else 8,
                system_words=500,
                user_words=30,
                seed=seed,
            ),
            1200,
            96,
        ),
        # 2 tool suites over 4 engines: each suite's sessions need more than one engine.
        "b": Setup(
            agent_tool_loops(
                suites=2,
                sessions_per_suite=12,
                steps=6 if q else 10,
                result_words=300,
                seed=seed + 1,
            ),
            1300,
            24,
        ),
        "c": Setup(unique_prompt_chat(sessions=32 if q else 48, turns=4, seed=seed + 2), 1000, 32),
    }
    return {
        k: replace(
            all_[k],
            capacity_blocks=args.capacity_blocks or all_[k].capacity_blocks,
            concurrency=args.concurrency or all_[k].concurrency,
        )
        for k in args.workloads
    }


async def ideal_hit_rate(wl: Workload, block_size: int) -> float:
    """The hit rate of one engine with an unbounded cache serving every session in turn:
    the most any routing can reach (each turn's new tokens always miss)."""
    from harness.sim.engine import SimConfig, SimEngine
    from harness.sim.httpserver import Request, dumps
    from harness.workloads import replay_session

    engine = SimEngine(
        SimConfig(
            name="engine-1", tokenizer="qwen2", block_size=block_size, capacity_blocks=1 << 40
        )
    )

    async def send(_: int, body: dict[str, Any]) -> dict[str, Any] | None:
        resp = await engine(Request("POST", "/v1/chat/completions", "", {}, dumps(body)))
        data = json.loads(getattr(resp, "body", b"{}"))
        message: dict[str, Any] | None = data.get("choices", [{}])[0].get("message")
        return message

    for session in wl.sessions:
        await replay_session(session, MODEL, send)
    return float(engine.stats()["hit_rate"])


async def sample_load(urls: list[str], every: float, stop: asyncio.Event) -> list[list[int]]:
    """In-flight requests of every engine, one sample per ``every`` seconds until ``stop``."""
    samples: list[list[int]] = []
    async with aiohttp.ClientSession() as http:

        async def one(url: str) -> int:
            async with http.get(url + "/sim/stats") as resp:
                return int((await resp.json())["in_flight"])

        while not stop.is_set():
            samples.append(list(await asyncio.gather(*(one(u) for u in urls))))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every)
    return samples


def load_spread(samples: list[list[int]]) -> float:
    """max/mean over engines of the time-averaged in-flight requests (1.0 = even)."""
    busy = [s for s in samples if sum(s)]
    if not busy:
        return float("nan")
    n = len(busy[0])
    avg = [sum(s[i] for s in busy) / len(busy) for i in range(n)]
    mean = sum(avg) / n
    return max(avg) / mean if mean else float("nan")


async def run_row(
    row: Row,
    setup: Setup,
    *,
    fleet: SimFleet,
    listener: Any,
    base: dict[str, Any],
    tmp: Path,
    why_not: str | None,
    sample_every: float,
    scoring: dict[str, float] | None = None,
) -> Result:
    wl = setup.workload
    res = Result(wl.name, row.label)
    if row.index == "conv" and why_not is not None:
        res.available = why_not
        print(f"    {row.label:<24} not available ({why_not})")
        return res
    await fleet.reset()
    await listener_cleared(listener, fleet.names)
    cfg = router_config(
        base, fleet, row.strategy, 0, listener.url if row.index else None, None, row.index == "conv"
    )
    if row.index == "conv" and scoring:
        cfg["kv_cache_index"]["conversation"]["scoring"] = scoring
    log = tmp / f"router-{row.label}.log"
    t0 = time.perf_counter()
    try:
        async with RouterProcess(cfg, tmp, log=log) as router:
            if row.index:
                await kv_consumers_connected(router, fleet.names)
            if row.index == "conv" and (reason := await routes_conversation(router)) is not None:
                res.available = reason
                print(f"    {row.label:<24} not available ({reason})")
                return res
            progress = Progress(wl.requests, f"{row.label:<24} ")
            stop = asyncio.Event()
            sampler = asyncio.create_task(sample_load(fleet.urls, sample_every, stop))
            try:
                records = await run_workload(
                    router.url, wl, model=MODEL, concurrency=setup.concurrency, on_record=progress
                )
            finally:
                stop.set()
                samples = await sampler
            if row.index:
                res.pred_error = predicted_vs_delivered(await admin_stats(router))
    except (ChildExited, ChildTimeout) as exc:
        res.available = f"router failed: {exc}".splitlines()[0]
        print(f"    {row.label:<24} {res.available} (log: {log})")
        return res
    res.seconds = time.perf_counter() - t0
    stats = await fleet.stats()
    prompt = sum(s["prompt_tokens"] for s in stats)
    res.requests = len(records)
    res.errors = sum(r.status != 200 for r in records)
    res.hit_rate = sum(s["cached_tokens"] for s in stats) / prompt if prompt else float("nan")
    res.prefill_s = sum(s["prefill_seconds_modelled"] for s in stats)
    res.load_spread = load_spread(samples)
    res.stickiness = stickiness(records)
    print(f"    {row.label:<24} hit {100 * res.hit_rate:.1f}% in {res.seconds:.1f}s")
    return res


def _pct(v: float) -> str:
    return "-" if v != v else f"{100 * v:.1f}%"


def _by(results: Sequence[Result], wl: str, row: str) -> Result | None:
    for r in results:
        if r.workload == wl and r.row == row and r.available is None:
            return r
    return None


def judge(
    results: Sequence[Result], names: dict[str, str]
) -> list[tuple[str, str, str, bool | None]]:
    """(target, measured, workload, pass) for the issue's targets; pass None = not judged."""
    out: list[tuple[str, str, str, bool | None]] = []
    for key in ("a", "b"):
        if key not in names:
            continue
        wl = names[key]
        conv, kv, sess = (
            _by(results, wl, CONV),
            _by(results, wl, PREFIX_KV),
            _by(results, wl, SESSION),
        )
        if conv is not None and kv is not None:
            d = conv.hit_rate - kv.hit_rate
            out.append((f"({key}) hit >= {PREFIX_KV} + 10 pp", f"{100 * d:+.1f} pp", wl, d >= 0.10))
        else:
            out.append((f"({key}) hit >= {PREFIX_KV} + 10 pp", "-", wl, None))
        if conv is not None and sess is not None:
            d = conv.hit_rate - sess.hit_rate
            out.append((f"({key}) hit >= {SESSION}", f"{100 * d:+.1f} pp", wl, d >= 0))
        else:
            out.append((f"({key}) hit >= {SESSION}", "-", wl, None))
        if conv is not None:
            ok = conv.load_spread <= 1.25 if conv.load_spread == conv.load_spread else None
            out.append((f"({key}) max/mean load <= 1.25", f"{conv.load_spread:.2f}", wl, ok))
        else:
            out.append((f"({key}) max/mean load <= 1.25", "-", wl, None))
    if "c" in names:
        wl = names["c"]
        conv, kv = _by(results, wl, CONV), _by(results, wl, PREFIX_KV)
        if conv is not None and kv is not None:
            d = conv.hit_rate - kv.hit_rate
            out.append((f"(c) hit >= {PREFIX_KV} - 1 pp", f"{100 * d:+.1f} pp", wl, d >= -0.01))
        else:
            out.append((f"(c) hit >= {PREFIX_KV} - 1 pp", "-", wl, None))
    return out


def _spread(runs: Sequence[float]) -> str:
    """The range of a row's hit rates over its runs: how far one run can be trusted."""
    if len(runs) < 2:
        return "-"
    return f"{100 * min(runs):.1f}-{100 * max(runs):.1f}"


def report(
    results: Sequence[Result], names: dict[str, str], ideals: dict[str, float]
) -> list[tuple[str, str, str, bool | None]]:
    for key, wl in names.items():
        rows = [r for r in results if r.workload == wl]
        rr = _by(results, wl, "RoundRobin")
        base = rr.prefill_s if rr is not None and rr.prefill_s > 0 else float("nan")
        table = []
        for r in rows:
            if r.available is not None:
                table.append([r.row, "not available", "", "", "", "", "", "", ""])
                continue
            table.append(
                [
                    r.row,
                    _pct(r.hit_rate),
                    _spread(r.runs),
                    f"{r.prefill_s:.2f}s",
                    "-" if base != base else f"{r.prefill_s / base:.2f}x",
                    "-" if r.load_spread != r.load_spread else f"{r.load_spread:.2f}",
                    _pct(r.stickiness),
                    "-" if r.pred_error is None else _pct(r.pred_error),
                    f"{r.requests}" + (f" ({r.errors} err)" if r.errors else ""),
                ]
            )
        print(f"\n({key}) {wl}; one unbounded cache: {_pct(ideals.get(wl, float('nan')))}")
        headers = ["row", "token hit", "runs", "prefill", "vs RR", "load max/mean", "sticky",
                   "pred err", "requests"]  # fmt: skip
        print(render_table(headers, table))
    verdicts = judge(results, names)
    print("\ntargets (same run):")
    print(
        render_table(
            ["target", "measured", "workload", ""],
            [[t, m, w, verdict(ok)] for t, m, w, ok in verdicts],
        )
    )
    print(
        "\n  token hit = the engines' cached / prompt tokens; prefill = their modelled prefill "
        "time; load = time-averaged\n  in-flight requests per engine, max/mean; sticky = turns "
        "on the engine of the session's previous turn;\n  pred err = |predicted - delivered| / "
        "delivered cached tokens as the router reports them ('-': not reported);\n  "
        "each figure is the median of the row's runs (--repeat), runs = their hit rates' range."
    )
    return verdicts


def plot(results: Sequence[Result], names: dict[str, str]) -> Path:
    labels = [row.label for row in ROWS]
    series = []
    for key, wl in names.items():
        vals = []
        for row in ROWS:
            r = _by(results, wl, row.label)
            vals.append(r.hit_rate if r is not None and r.hit_rate == r.hit_rate else 0.0)
        series.append((f"({key}) {wl}", vals))
    shown = [
        f"{lbl} (n/a)" if all(_by(results, wl, lbl) is None for wl in names.values()) else lbl
        for lbl in labels
    ]
    return bar_chart_svg(
        OUT / "fleet_hit_rate.svg", "Simulated fleet: the engines' token hit rate", series, shown
    )


async def measure(
    args: argparse.Namespace,
) -> tuple[list[Result], dict[str, str], dict[str, float]]:
    base = yaml.safe_load(BASE_CONFIG.read_text())
    plan = setups(args)
    names = {k: s.workload.name for k, s in plan.items()}
    print(f"fleet_bench: {args.engines} simulated engines, blocks of {args.block_size} tokens")
    for k, s in plan.items():
        print(
            f"  ({k}) {s.workload.name}: {s.workload.description} = {s.workload.requests} "
            f"requests, {s.concurrency} sessions in flight, {s.capacity_blocks} blocks per engine"
        )
    results: list[Result] = []
    ideals: dict[str, float] = {}
    for key, setup in plan.items():
        wl = setup.workload
        print(f"\n  ({key}) {wl.name}")
        ideals[wl.name] = await ideal_hit_rate(wl, args.block_size)
        print(f"    one unbounded cache would hit {100 * ideals[wl.name]:.1f}% of the tokens")
        results += await measure_workload(key, setup, base, args)
    return results, names, ideals


async def measure_workload(
    key: str, setup: Setup, base: dict[str, Any], args: argparse.Namespace
) -> list[Result]:
    """Every row on one workload, on a fleet (engines + listener) of its own."""
    results: list[Result] = []
    zmq_ports = [free_port() for _ in range(args.engines)]
    async with (
        SimFleet(
            n=args.engines,
            model=MODEL,
            names=[f"engine-{i + 1}" for i in range(args.engines)],
            capacity_blocks=setup.capacity_blocks,
            block_size=args.block_size,
            latency=True,
            prefill_us_per_token=args.prefill_us_per_token,
            decode_us_per_token=args.decode_us_per_token,
            tokenizer="qwen2",
            kv_events_format="vllm-0.33",
            overrides={i: {"kv_events": f"tcp://*:{p}"} for i, p in enumerate(zmq_ports)},
        ) as fleet,
        contextlib.AsyncExitStack() as stack,
    ):
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fleet-bench-")))
        conv_listener = listener_config(fleet, zmq_ports, conversation=True)
        why_not = await listener_conversation(conv_listener)
        if why_not is not None:
            why_not = f"listener: {why_not}"
        else:
            probe = router_config(
                base, fleet, "PrefixAwareHash", 0, "http://127.0.0.1:1", None, True
            )
            if (reason := await router_conversation(probe)) is not None:
                why_not = f"router: {reason}"
        plain = listener_config(fleet, zmq_ports)
        listener = await stack.enter_async_context(
            ListenerProcess(conv_listener if why_not is None else plain, tmp, log=tmp / "lst.log")
        )
        await listener_connected(listener, fleet)
        mode = "conversation mode" if why_not is None else "prefix keys only"
        print(f"    listener: {mode}")
        runs: dict[str, list[Result]] = {}
        # Rounds of every row, not each row N times in a row: whatever slows the shared
        # machine for a minute then costs every row alike.
        for rnd in range(args.repeat):
            if args.repeat > 1:
                print(f"    round {rnd + 1}/{args.repeat}")
            for row in ROWS:
                if args.rows and row.label not in args.rows:
                    continue
                runs.setdefault(row.label, []).append(
                    await run_row(
                        row,
                        setup,
                        fleet=fleet,
                        listener=listener,
                        base=base,
                        tmp=tmp,
                        why_not=why_not,
                        sample_every=args.sample_ms / 1000,
                        scoring=args.scoring,
                    )
                )
        results = [median_result(rs) for rs in runs.values()]
    return results


def median_result(runs: Sequence[Result]) -> Result:
    """The per-field median of a row's runs (the runs that did not start count for
    nothing; a row none of whose runs started keeps the first one's reason)."""
    ran = [r for r in runs if r.available is None]
    if not ran:
        return runs[0]
    if len(ran) == 1:
        return ran[0]

    def med(name: str) -> float:
        return float(statistics.median(getattr(r, name) for r in ran))

    preds = [r.pred_error for r in ran if r.pred_error is not None]
    return Result(
        workload=ran[0].workload,
        row=ran[0].row,
        requests=ran[0].requests,
        errors=sum(r.errors for r in ran),
        hit_rate=med("hit_rate"),
        prefill_s=med("prefill_s"),
        load_spread=med("load_spread"),
        stickiness=med("stickiness"),
        pred_error=float(statistics.median(preds)) if preds else None,
        seconds=sum(r.seconds for r in ran),
        runs=[r.hit_rate for r in ran],
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    results, names, ideals = asyncio.run(measure(args))
    verdicts = report(results, names, ideals)
    svg = plot(results, names)
    print(f"\n  plot: {svg.relative_to(ROOT)}")
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "ideal_hit_rate": ideals,
                    "results": [asdict(r) for r in results],
                    "targets": [
                        {"target": t, "measured": m, "workload": w, "pass": ok}
                        for t, m, w, ok in verdicts
                    ],
                },
                indent=2,
            )
        )
    return 0


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--engines", type=int, default=4)
    p.add_argument(
        "--capacity-blocks", type=int, default=0, help="per engine (default: per workload)"
    )
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument(
        "--concurrency", type=int, default=0, help="sessions in flight (default: per workload)"
    )
    p.add_argument("--prefill-us-per-token", type=float, default=50.0)
    p.add_argument("--decode-us-per-token", type=float, default=1000.0)
    p.add_argument("--sample-ms", type=float, default=50.0, help="load sampling period")
    p.add_argument(
        "--workloads",
        default="abc",
        help="which of a (shared-prompt chat), b (agent loops), c (own prompts)",
    )
    p.add_argument(
        "--scoring",
        type=scoring_arg,
        default={},
        help="the conversation row's kv_cache_index.conversation.scoring, as k=v,k=v "
        "(e.g. prefill_load_weight=0.1,active_request_weight=32)",
    )
    p.add_argument(
        "--rows",
        type=lambda v: [x.strip() for x in v.split(",") if x.strip()],
        default=[],
        help="comma-separated row labels to run (default: all): "
        + ", ".join(r.label for r in ROWS),
    )
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--repeat",
        type=int,
        default=3,
        help="rounds of every row; each figure is the median of its runs (default 3)",
    )
    p.add_argument("--quick", action="store_true", help="shorter sessions (~2 min)")
    p.add_argument("--json", metavar="FILE", help="write every figure and verdict as JSON")
    args = p.parse_args(argv)
    if not args.workloads or set(args.workloads) - set("abc"):
        p.error("--workloads takes letters out of a, b, c")
    return args


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
