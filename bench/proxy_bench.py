"""Proxy benchmark: throughput, latency and router CPU per request under ``wrk`` load.

Everything runs as real processes on this machine: ``harness.sim --trivial`` engines (a fixed
small answer, ~35k req/s direct), the router (``python -m router serve``) and ``wrk``.
For each concurrency and for non-streaming and streaming chat completions it measures:

* ``direct``: wrk straight at one engine (the floor; its CPU column is the engine's);
* ``bare``: the router with RoundRobin and prefix routing disabled, in front of the same
  engines: the "bare proxy on the same HTTP stack";
* ``full``: the router with PrefixAwareHash, prefix routing enabled (prefix key + CHWBL ring
  on every request) over the same engines;
* ``full-aiohttp``: ``full`` with the router's hand-written upstream client
  (``router.http.client``, asyncio + httptools) replaced by an aiohttp one
  (``bench.aiohttp_router``), so what the hand-written client saves is a ratio measured in
  the same run (``full/full-aiohttp``, req/s and CPU per request, paired per round);
* with ``--rust-routers``: ``vllm-router`` and ``sglang-router`` from PyPI (installed into a
  separate venv under /tmp, never into the project), round_robin and cache_aware, in front
  of the same engines.

* with ``--ref-tree DIR``: ``bare`` and ``full`` once more, the router's code taken from
  another checkout of the repository (say ``git worktree add /tmp/ref <commit>``), so a
  change's cost is a ratio measured in one run (``this tree / ref tree``) rather than two
  runs on two days.

Router CPU per request = (utime + stime of the router process and its descendants, from
``/proc/<pid>/stat``, delta over the measured run) / requests wrk completed. Every cell is
repeated (rounds interleave the targets, so machine noise hits them alike) and the table
shows medians. Targets: full/bare CPU per request <= 1.25, full pipeline >= 3000 req/s and
<= 400 us CPU per request.

Run: ``.venv/bin/python -m bench.proxy_bench [--quick] [--rust-routers] [--ref-tree DIR]
[--json out.json]``
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.procs import ChildProcess, free_port, launch, python_module
from harness.sim.fleet import SimFleet

from ._table import fmt_float, median, render_table, verdict
from .aiohttp_router import MARKER as AIOHTTP_MARKER

MODEL = "bench-model"
CHAT_PATH = "/v1/chat/completions"
TARGET_CPU_RATIO = 1.25
TARGET_RPS = 3000.0
TARGET_CPU_US = 400.0
DEFAULT_RUST_VENV = Path(tempfile.gettempdir()) / "continuum-rust-routers"
RUST_PACKAGES = ("vllm-router", "sglang-router")
AIOHTTP = "bench.aiohttp_router"
_CLK_TCK = os.sysconf("SC_CLK_TCK")


# -- process CPU ---------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may hold spaces and parentheses: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        f = _stat_fields(int(entry))
        if f is None:
            continue
        children.setdefault(int(f[1]), []).append(int(entry))  # f[1] = ppid
    out: list[int] = []
    todo = [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads) and of its live descendants."""
    total = 0
    for p in _descendants(pid):
        f = _stat_fields(p)
        if f is not None:
            total += int(f[11]) + int(f[12])  # fields 14 and 15: utime, stime
    return total / _CLK_TCK


# -- wrk -------------------------------------------------------------------------------------


def _lua_long_string(text: str) -> str:
    level = 0
    while f"]{'=' * level}]" in text:
        level += 1
    eq = "=" * level
    return f"[{eq}[{text}]{eq}]"


def request_bodies(n_tenants: int, stream: bool) -> list[bytes]:
    """``n_tenants`` distinct ~1 KB system prompts, each with a short user turn."""
    out = []
    for t in range(n_tenants):
        base = (
            f"You are the support assistant of tenant {t:03d}. Answer concisely, cite the "
            "knowledge base when you use it, never invent facts, follow the style guide. "
        )
        system = (base * (1024 // len(base) + 1))[:1024]
        body: dict[str, Any] = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": f"Question {t}: how do I reset my password?"},
            ],
            "max_tokens": 16,
        }
        if stream:
            body["stream"] = True
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


def write_lua(path: Path, bodies: list[bytes]) -> None:
    items = ",\n".join("  " + _lua_long_string(b.decode()) for b in bodies)
    path.write_text(
        "local bodies = {\n" + items + "\n}\n"
        "local reqs = {}\n"
        "local i = 0\n"
        "init = function(args)\n"
        "  local headers = {['Content-Type'] = 'application/json'}\n"
        "  for k, b in ipairs(bodies) do\n"
        f"    reqs[k] = wrk.format('POST', '{CHAT_PATH}', headers, b)\n"
        "  end\n"
        "  i = math.random(#reqs) - 1\n"
        "end\n"
        "request = function()\n"
        "  i = i % #reqs + 1\n"
        "  return reqs[i]\n"
        "end\n"
    )


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s|m)", text)
    if not m:
        raise ValueError(f"unparsable wrk latency {text!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


@dataclass
class WrkResult:
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    errors: int
    raw: str = ""


def parse_wrk(out: str) -> WrkResult:
    pct = dict(re.findall(r"^\s+(50|75|90|99)%\s+(\S+)", out, re.M))
    m = re.search(r"^\s*(\d+) requests in ([\d.]+)(us|ms|s|m)", out, re.M)
    rps = re.search(r"^Requests/sec:\s+([\d.]+)", out, re.M)
    if not (m and rps and "50" in pct and "99" in pct):
        raise RuntimeError(f"unexpected wrk output:\n{out}")
    errors = 0
    non2xx = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", out)
    if non2xx:
        errors += int(non2xx.group(1))
    sock = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", out)
    if sock:
        errors += sum(int(x) for x in sock.groups())
    return WrkResult(
        requests=int(m.group(1)),
        seconds=_ms(m.group(2) + m.group(3)) / 1e3,
        rps=float(rps.group(1)),
        p50_ms=_ms(pct["50"]),
        p99_ms=_ms(pct["99"]),
        errors=errors,
        raw=out,
    )


async def run_wrk(
    url: str, script: Path, connections: int, threads: int, seconds: float
) -> WrkResult:
    cmd = [
        "wrk",
        f"-t{max(1, min(threads, connections))}",
        f"-c{connections}",
        f"-d{max(1, round(seconds))}s",
        "--timeout",
        "10s",
        "--latency",
        "-s",
        str(script),
        url + CHAT_PATH,
    ]
    proc = await asyncio.create_subprocess_exec(
        *cmd, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    out, _ = await proc.communicate()
    text = out.decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(f"wrk failed ({proc.returncode}):\n{text}")
    return parse_wrk(text)


# -- targets ---------------------------------------------------------------------------------


def _probe(url: str, body: bytes) -> bool:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    try:
        conn = http.client.HTTPConnection(host, int(port), timeout=2)
        conn.request("POST", CHAT_PATH, body, {"content-type": "application/json"})
        ok = conn.getresponse().status == 200
        conn.close()
        return ok
    except OSError:
        return False


async def wait_serving(target: Target, limit: float = 60) -> None:
    """Until a chat completion through the target answers 200 (every backend registered);
    a target that does not get there is stopped, so no failed start outlives the run."""
    assert target.child is not None
    proc = target.child.proc
    body = request_bodies(1, False)[0]
    deadline = time.monotonic() + limit
    streak = 0
    try:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                raise RuntimeError(f"{target.url}: process exited with {proc.returncode}")
            if await asyncio.to_thread(_probe, target.url, body):
                streak += 1
                if streak >= 3:
                    return
            else:
                streak = 0
            await asyncio.sleep(0.2)
        raise TimeoutError(f"{target.url} did not serve chat completions within {limit}s")
    except BaseException:
        await target.stop()
        raise


@dataclass
class Target:
    key: str
    label: str
    url: str = ""
    pid: int = 0
    child: ChildProcess | None = None

    async def stop(self) -> None:
        if self.child is not None:
            await self.child.stop(10)


def router_yaml(strategy: str, prefix: bool, backend_urls: list[str], cache: bool = False) -> str:
    lines = [
        'server: {listen: "127.0.0.1:0"}',
        f"selection_strategy: {strategy}",
        f"prefix_routing: {{enabled: {str(prefix).lower()}, virtual_nodes: 150, "
        "load_factor_epsilon: 0.25}",
        "health_check: {interval_ms: 10000}",
        "backends:",
    ]
    if cache:
        lines.insert(0, "response_cache: {enabled: true, capacity: 10000, ttl: 1h}")
    for i, url in enumerate(backend_urls):
        lines.append(f'  - {{name: b{i + 1}, url: "{url}", type: vllm, models: [{MODEL}]}}')
    return "\n".join(lines) + "\n"


def _from_tree(tree: Path, module: str, *args: str) -> list[str]:
    """``python -m <module> args`` with ``tree`` first on ``sys.path``: that checkout's code,
    whatever this one's venv and ``PYTHONPATH`` say. A checkout with compiled modules
    (``setup.py``) gets them built in place first, as an editable install would."""
    if (tree / "setup.py").exists() and not list((tree / "bus").glob("_chaincore*.so")):
        subprocess.run(
            [sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
            cwd=tree,
            check=True,
            capture_output=True,
        )
    boot = (
        "import runpy, sys; "
        f"sys.path.insert(0, {str(tree)!r}); "
        f"sys.argv = [{module!r}, *{list(args)!r}]; "
        f"runpy.run_module({module!r}, run_name='__main__', alter_sys=True)"
    )
    return [sys.executable, "-c", boot]


async def start_continuum(
    target: Target,
    strategy: str,
    prefix: bool,
    urls: list[str],
    workdir: Path,
    cache: bool = False,
    module: str = "router",
    tree: Path | None = None,
) -> Target:
    """``python -m <module> serve``: the router, or ``bench.aiohttp_router`` (the router on
    an aiohttp upstream client, which says so in its log before it serves); with ``tree``,
    the router of that checkout."""
    cfg = workdir / f"{target.key}.yaml"
    cfg.write_text(router_yaml(strategy, prefix, urls, cache))
    log = workdir / f"{target.key}.log"
    argv = ["serve", "--config", str(cfg)]
    target.child = await launch(
        f"router {target.key}",
        _from_tree(tree, module, *argv) if tree is not None else python_module(module, *argv),
        ready_timeout=30,
        log=log,
    )
    target.pid = target.child.pid
    target.url = target.child.ready.url()
    await wait_serving(target)
    if module != "router" and AIOHTTP_MARKER not in log.read_text():
        await target.stop()
        raise RuntimeError(f"{target.label}: the aiohttp client is not in use (log: {log})")
    return target


def ensure_rust_venv(venv: Path) -> Path | None:
    """The venv holding the Rust routers, created and filled on first use (None: failed)."""
    bindir = venv / "bin"
    if all((bindir / p).exists() for p in RUST_PACKAGES):
        return bindir
    log_path = Path(tempfile.gettempdir()) / "continuum-rust-routers-install.log"
    print(f"installing {' '.join(RUST_PACKAGES)} into {venv} (log: {log_path}) ...", flush=True)
    try:
        with open(log_path, "wb") as log:
            if not (bindir / "pip").exists():
                base = getattr(sys, "_base_executable", sys.executable)
                subprocess.run([base, "-m", "venv", str(venv)], check=True, stdout=log, stderr=log)
            subprocess.run(
                [str(bindir / "pip"), "install", "--disable-pip-version-check", *RUST_PACKAGES],
                check=True,
                timeout=900,
                stdout=log,
                stderr=log,
            )
    except (subprocess.SubprocessError, OSError) as exc:
        print(f"warning: cannot install the Rust routers ({exc}, see {log_path}); skipping them")
        return None
    if all((bindir / p).exists() for p in RUST_PACKAGES):
        return bindir
    print("warning: Rust router console scripts missing after install; skipping them")
    return None


async def start_rust(
    target: Target, bindir: Path, kind: str, policy: str, urls: list[str], workdir: Path
) -> Target:
    port = free_port()
    common = [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--worker-urls",
        *urls,
        "--policy",
        policy,
        "--prometheus-host",
        "127.0.0.1",
        "--prometheus-port",
        str(free_port()),
    ]
    if kind == "vllm":
        cmd = [str(bindir / "vllm-router"), *common, "--log-level", "warning"]
    else:
        cmd = [str(bindir / "sglang-router"), "launch", *common, "--log-level", "warn"]
    target.child = await ChildProcess.start(
        target.label, cmd, log=workdir / f"{target.key}.log", stdout_to_log=True, cwd=workdir
    )
    target.pid = target.child.pid
    target.url = f"http://127.0.0.1:{port}"
    await wait_serving(target, limit=90)
    return target


# -- the run ---------------------------------------------------------------------------------


@dataclass
class Cell:
    mode: str  # "plain" | "stream"
    conc: int
    target: str
    runs: list[dict[str, float]] = field(default_factory=list)

    def med(self, key: str) -> float:
        return median(r[key] for r in self.runs)

    def ratio(self, other: Cell, key: str = "cpu_us_per_req") -> float:
        """Median over rounds of this cell's ``key`` over ``other``'s in the same round.

        Paired per round, so a round where the whole machine was slower cancels out.
        """
        return median(a[key] / b[key] for a, b in zip(self.runs, other.runs, strict=True))


async def measure(
    target: Target, script: Path, conc: int, threads: int, duration: float, warmup: float
) -> dict[str, float]:
    if warmup > 0:
        await run_wrk(target.url, script, conc, threads, warmup)
    before = cpu_seconds(target.pid)
    res = await run_wrk(target.url, script, conc, threads, duration)
    cpu = cpu_seconds(target.pid) - before
    return {
        "rps": res.rps,
        "p50_ms": res.p50_ms,
        "p99_ms": res.p99_ms,
        "requests": float(res.requests),
        "errors": float(res.errors),
        "cpu_s": cpu,
        "cores": cpu / res.seconds if res.seconds else float("nan"),
        "cpu_us_per_req": cpu / res.requests * 1e6 if res.requests else float("nan"),
    }


async def bench(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="proxy-bench-"))
    modes = [m for m in ("plain", "stream") if m in args.modes]
    scripts = {}
    for mode in modes:
        scripts[mode] = workdir / f"{mode}.lua"
        write_lua(scripts[mode], request_bodies(args.tenants, mode == "stream"))

    bindir = ensure_rust_venv(Path(args.rust_venv)) if args.rust_routers else None
    targets: list[Target] = []
    cells: dict[tuple[str, int, str], Cell] = {}
    async with SimFleet(n=args.backends, model=MODEL, trivial=True) as fleet:
        try:
            urls = fleet.urls
            sim0 = fleet[0]
            targets.append(Target("direct", "direct (1 engine)", sim0.url, sim0.proc.pid))
            pah = "PrefixAwareHash"
            variants = [
                ("bare", "continuum bare (RR, no prefix)", "RoundRobin", False, False, "router"),
                ("full", "continuum full (PrefixAwareHash)", pah, True, False, "router"),
                ("full-aiohttp", "continuum full, aiohttp client", pah, True, False, AIOHTTP),
            ]
            if args.decompose:
                variants += [
                    ("rr-key", "continuum RR + prefix keys", "RoundRobin", True, False, "router"),
                    (
                        "pah-nokey",
                        "continuum PrefixAwareHash, no keys",
                        pah,
                        False,
                        False,
                        "router",
                    ),
                ]
            if args.with_cache:
                # The workload repeats its deterministic bodies: after the warm-up every
                # request is a response cache hit that never reaches an engine.
                variants.append(
                    ("cached", "continuum + response cache (hits)", pah, True, True, "router")
                )
            for key, label, strategy, prefix, cache, module in variants:
                targets.append(
                    await start_continuum(
                        Target(key, label), strategy, prefix, urls, workdir, cache, module
                    )
                )
            if args.ref_tree:
                ref = Path(args.ref_tree)
                for key, label, strategy, prefix in (
                    ("bare@ref", f"bare, router of {ref.name}", "RoundRobin", False),
                    ("full@ref", f"full, router of {ref.name}", pah, True),
                ):
                    targets.append(
                        await start_continuum(
                            Target(key, label), strategy, prefix, urls, workdir, tree=ref
                        )
                    )
            if bindir is not None:
                for kind in ("vllm", "sglang"):
                    for policy in ("round_robin", "cache_aware"):
                        t = Target(f"{kind}-{policy}", f"{kind}-router {policy}")
                        try:
                            targets.append(await start_rust(t, bindir, kind, policy, urls, workdir))
                        except (RuntimeError, TimeoutError) as exc:
                            log = t.child.tail() if t.child else ""
                            print(f"warning: {t.label} did not start ({exc}); skipping\n{log}")
            print(
                f"engines: {args.backends} x harness.sim --trivial; targets: "
                + ", ".join(t.label for t in targets),
                flush=True,
            )
            started = time.monotonic()
            for rnd in range(args.repeats):
                for mode in modes:
                    for conc in args.concurrency:
                        # Rotate the order every round so no target always runs first.
                        shift = rnd % len(targets)
                        for t in targets[shift:] + targets[:shift]:
                            r = await measure(
                                t, scripts[mode], conc, args.threads, args.duration, args.warmup
                            )
                            cell = cells.setdefault((mode, conc, t.key), Cell(mode, conc, t.key))
                            cell.runs.append(r)
                            if args.verbose:
                                print(
                                    f"  round {rnd + 1} {mode:<6} c={conc:<4} {t.label:<34}"
                                    f" {r['rps']:>8.0f} req/s  p50 {r['p50_ms']:.2f} ms"
                                    f"  cpu {r['cpu_us_per_req']:.0f} us/req"
                                    f"  errors {r['errors']:.0f}",
                                    flush=True,
                                )
                print(
                    f"round {rnd + 1}/{args.repeats} done ({time.monotonic() - started:.0f}s)",
                    flush=True,
                )
        finally:
            for t in targets:
                await t.stop()
    if not args.keep_logs:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"logs and configs kept in {workdir}")
    return {"targets": targets, "cells": cells, "modes": modes}


def report(args: argparse.Namespace, res: dict[str, Any]) -> dict[str, Any]:
    targets: list[Target] = res["targets"]
    cells: dict[tuple[str, int, str], Cell] = res["cells"]
    modes: list[str] = res["modes"]
    rows = []
    for mode in modes:
        for conc in args.concurrency:
            direct = cells[(mode, conc, "direct")]
            bare = cells[(mode, conc, "bare")]
            for t in targets:
                c = cells[(mode, conc, t.key)]
                is_direct = t.key == "direct"
                rows.append(
                    [
                        f"{mode} c={conc}",
                        t.label,
                        fmt_float(c.med("rps"), 0),
                        fmt_float(c.med("p50_ms"), 2),
                        fmt_float(c.med("p99_ms"), 2),
                        "-" if is_direct else fmt_float(c.med("p50_ms") - direct.med("p50_ms"), 2),
                        "-" if is_direct else fmt_float(c.med("p99_ms") - direct.med("p99_ms"), 2),
                        fmt_float(c.med("cpu_us_per_req"), 0),
                        fmt_float(c.med("cores"), 2),
                        "-" if is_direct else fmt_float(c.ratio(bare), 2),
                        f"{sum(r['errors'] for r in c.runs):.0f}",
                    ]
                )
    print()
    print(
        f"wrk: {args.threads} threads, {args.duration:g}s per run after {args.warmup:g}s warm-up, "
        f"{args.repeats} round(s), medians; {args.tenants} tenants with 1 KB system prompts; "
        "CPU = target process utime+stime per request (direct: the engine's); "
        "cores = its CPU seconds per second; "
        "CPU vs bare = over continuum bare, paired per round, median"
    )
    print(
        render_table(
            [
                "cell",
                "target",
                "req/s",
                "p50 ms",
                "p99 ms",
                "+p50 ms",
                "+p99 ms",
                "CPU us/req",
                "cores",
                "CPU vs bare",
                "errors",
            ],
            rows,
            left=2,
        )
    )

    verdict_rows = []
    summary = []
    for mode in modes:
        for conc in args.concurrency:
            bare = cells[(mode, conc, "bare")]
            full = cells[(mode, conc, "full")]
            ratio = full.ratio(bare)
            rps = full.med("rps")
            cpu = full.med("cpu_us_per_req")
            ok = (ratio <= TARGET_CPU_RATIO, rps >= TARGET_RPS, cpu <= TARGET_CPU_US)
            verdict_rows.append(
                [
                    f"{mode} c={conc}",
                    fmt_float(ratio, 3),
                    verdict(ok[0]),
                    fmt_float(rps, 0),
                    verdict(ok[1]),
                    fmt_float(cpu, 0),
                    verdict(ok[2]),
                ]
            )
            summary.append(
                {
                    "mode": mode,
                    "concurrency": conc,
                    "full_over_bare_cpu": ratio,
                    "full_rps": rps,
                    "full_cpu_us_per_req": cpu,
                    "pass": {"cpu_ratio": ok[0], "rps": ok[1], "cpu_us": ok[2]},
                }
            )
    print()
    print("targets (continuum full pipeline vs bare proxy, same run):")
    print(
        render_table(
            [
                "cell",
                "full/bare CPU",
                f"<={TARGET_CPU_RATIO:g}",
                "full req/s",
                f">={TARGET_RPS:g}",
                "full CPU us/req",
                f"<={TARGET_CPU_US:g}",
            ],
            verdict_rows,
        )
    )
    client_rows = []
    for mode in modes:
        for conc in args.concurrency:
            full = cells[(mode, conc, "full")]
            aio = cells[(mode, conc, "full-aiohttp")]
            rps_ratio, cpu_ratio = full.ratio(aio, "rps"), full.ratio(aio)
            client_rows.append(
                [
                    f"{mode} c={conc}",
                    fmt_float(full.med("rps"), 0),
                    fmt_float(aio.med("rps"), 0),
                    fmt_float(rps_ratio, 2),
                    fmt_float(full.med("cpu_us_per_req"), 0),
                    fmt_float(aio.med("cpu_us_per_req"), 0),
                    fmt_float(cpu_ratio, 2),
                ]
            )
            summary[len(client_rows) - 1].update(
                full_over_aiohttp_rps=rps_ratio, full_over_aiohttp_cpu=cpu_ratio
            )
    print()
    print(
        "upstream client, same run: full (router.http.client, httptools) over full-aiohttp "
        "(the same router on aiohttp's client), paired per round, median:"
    )
    print(
        render_table(
            [
                "cell",
                "full req/s",
                "aiohttp req/s",
                "full/aiohttp req/s",
                "full CPU us/req",
                "aiohttp CPU us/req",
                "full/aiohttp CPU",
            ],
            client_rows,
        )
    )
    if args.ref_tree:
        ref_rows = []
        for mode in modes:
            for conc in args.concurrency:
                for key in ("bare", "full"):
                    this, ref = cells[(mode, conc, key)], cells[(mode, conc, key + "@ref")]
                    rps_ratio, cpu_ratio = this.ratio(ref, "rps"), this.ratio(ref)
                    ref_rows.append(
                        [
                            f"{mode} c={conc}",
                            key,
                            fmt_float(this.med("rps"), 0),
                            fmt_float(ref.med("rps"), 0),
                            fmt_float(rps_ratio, 3),
                            fmt_float(this.med("cpu_us_per_req"), 0),
                            fmt_float(ref.med("cpu_us_per_req"), 0),
                            fmt_float(cpu_ratio, 3),
                        ]
                    )
                    summary[(len(ref_rows) - 1) // 2].update(
                        {f"{key}_over_ref_rps": rps_ratio, f"{key}_over_ref_cpu": cpu_ratio}
                    )
        print()
        print(
            f"this tree over the router of {args.ref_tree}, same run, paired per round, median "
            "(CPU below 1 and req/s above 1: this tree is cheaper):"
        )
        print(
            render_table(
                [
                    "cell",
                    "router",
                    "req/s",
                    "ref req/s",
                    "req/s ratio",
                    "CPU us/req",
                    "ref CPU us/req",
                    "CPU ratio",
                ],
                ref_rows,
                left=2,
            )
        )
    families = [
        ("continuum", "bare", "full", "PrefixAwareHash"),
        ("vllm-router", "vllm-round_robin", "vllm-cache_aware", "cache_aware"),
        ("sglang-router", "sglang-round_robin", "sglang-cache_aware", "cache_aware"),
    ]
    keys = {t.key for t in targets}
    present = [f for f in families if f[1] in keys and f[2] in keys]
    if len(present) > 1:
        fam_rows = []
        for mode in modes:
            for conc in args.concurrency:
                for name, rr_key, smart_key, policy in present:
                    rr = cells[(mode, conc, rr_key)]
                    smart = cells[(mode, conc, smart_key)]
                    fam_rows.append(
                        [
                            f"{mode} c={conc}",
                            name,
                            policy,
                            fmt_float(rr.med("rps"), 0),
                            fmt_float(smart.med("rps"), 0),
                            fmt_float(rr.med("cpu_us_per_req"), 0),
                            fmt_float(smart.med("cpu_us_per_req"), 0),
                            fmt_float(smart.ratio(rr), 2),
                        ]
                    )
        print()
        print(
            "routing-logic overhead per router: its prefix/cache-aware policy over its own "
            "round robin (continuum: bare = RoundRobin without prefix keys), same run:"
        )
        print(
            render_table(
                [
                    "cell",
                    "router",
                    "aware policy",
                    "RR req/s",
                    "aware req/s",
                    "RR CPU us/req",
                    "aware CPU us/req",
                    "aware/RR CPU",
                ],
                fam_rows,
                left=3,
            )
        )
    return {
        "config": {
            k: v for k, v in vars(args).items() if isinstance(v, int | float | str | list | bool)
        },
        "targets": [{"key": t.key, "label": t.label} for t in targets],
        "cells": [
            {
                "mode": c.mode,
                "concurrency": c.conc,
                "target": c.target,
                "median": {
                    k: c.med(k)
                    for k in (
                        "rps",
                        "p50_ms",
                        "p99_ms",
                        "cpu_us_per_req",
                        "cores",
                        "requests",
                        "errors",
                    )
                },
                "runs": c.runs,
            }
            for c in cells.values()
        ],
        "summary": summary,
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.proxy_bench", description=__doc__)
    p.add_argument("--duration", type=float, default=8.0, help="seconds per measured run")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds of wrk before each run")
    p.add_argument("--repeats", type=int, default=3, help="rounds over all cells (medians)")
    p.add_argument("--concurrency", type=int, nargs="+", default=[32, 128])
    p.add_argument("--modes", nargs="+", default=["plain", "stream"], choices=["plain", "stream"])
    p.add_argument("--backends", type=int, default=3, help="engines behind the routers (2-4)")
    p.add_argument("--threads", type=int, default=2, help="wrk threads")
    p.add_argument("--tenants", type=int, default=64, help="distinct system prompts")
    p.add_argument(
        "--with-cache",
        action="store_true",
        help="add a router with the response cache on (all hits after warm-up)",
    )
    p.add_argument("--quick", action="store_true", help="2 s runs, 1 round (smoke test)")
    p.add_argument(
        "--rust-routers",
        action="store_true",
        help="also measure vllm-router and sglang-router (pip-installed into --rust-venv)",
    )
    p.add_argument("--rust-venv", default=str(DEFAULT_RUST_VENV))
    p.add_argument(
        "--ref-tree",
        metavar="DIR",
        help="also run bare and full from the router of this checkout (a ratio in one run)",
    )
    p.add_argument(
        "--decompose",
        action="store_true",
        help="also run RoundRobin with prefix keys and PrefixAwareHash without them, to split "
        "the full-over-bare CPU into key extraction and ring selection",
    )
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep configs and router logs")
    p.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = p.parse_args(argv)
    if args.quick:
        args.duration, args.warmup, args.repeats = 2.0, 0.5, 1
    if shutil.which("wrk") is None:
        print("error: wrk not found on PATH (apt-get install wrk)", file=sys.stderr)
        return 2
    if args.ref_tree:
        ref = Path(args.ref_tree).resolve()
        if not (ref / "router" / "__main__.py").is_file():
            print(f"error: --ref-tree {ref} holds no router/ package", file=sys.stderr)
            return 2
        args.ref_tree = str(ref)
    try:
        import uvloop
    except ImportError:
        res = asyncio.run(bench(args))
    else:
        res = uvloop.run(bench(args))
    out = report(args, res)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
