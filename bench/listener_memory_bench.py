"""Memory benchmark: the listener's resident memory at 100k tracked blocks, against the bound.

The chain tracker bounds what it keeps per source (``listener/chains``)::

    retained token IDs <= min(max_retained_tokens, max_tracked_blocks * max_chain_tokens)

and keeps them as ``array('I')`` (4 bytes a token), so the token payload is bounded by that
many tokens x 4 bytes (64 MiB with the defaults). Everything else grows with the number of
tracked blocks (``max_tracked_blocks``, default 100,000): the per-block metadata.

For each scenario a fresh ``continuum-kv-listener`` (config in a temp file, source
``engine: vllm``, ``zmq_mode: connect``) receives burst chains (1 block of 16 tokens per
event, 8 events per batch, chains of 64 blocks) from ``python -m harness.publisher`` (the
engine simulator's burst code), with no SSE subscriber:

* ``pending, tokens kept``: the unsalted burst, ``detokenize_endpoint`` at a port nobody
  listens on. No chain can be attributed (every /detokenize fails and is retried with
  backoff), so every block stays pending and keeps its 16 token IDs: the worst case for
  retained tokens at the default limits.
* ``pending, max_retained_tokens 1M``: the same with ``max_retained_tokens: 1000000``:
  the token bound binds, the oldest holders lose their text (they become unattributed).
* ``keyed (salted chains)``: router-salted chains (the publisher's ``--salted``, one
  prefix per chain): every block keyed at once, no tokens kept; one
  ``cache_created`` per event goes into the hub's history ring (10,000 records).
* ``keyed, conversation keys``: the same with Qwen2 vocabulary token ids (the publisher's
  ``--token-ids qwen2``) to a listener in conversation mode (``conversation.enabled``,
  Qwen2's ``tokenizer.json``): every block also keeps its node in its chain and the bytes
  it adds after the last 1 KiB boundary, bounded by::

      retained chain bytes <= min(max_retained_bytes, max_tracked_blocks * (chunk_bytes - 1))

  (``chain bytes``: ``chain_retained_bytes`` at 100k and 150k, both within the bound).

Measured: VmRSS (``/proc/<pid>/status``) of the listener right after start (empty: the
baseline, the same process before ingestion), after exactly 100,000 blocks were stored
(``tracked_blocks`` = 100,000, nothing pruned yet) and after 50,000 more (150,000 pushed:
``tracked_blocks`` must stay <= ``max_tracked_blocks``, 100,000, by pruning), and the
``/stats`` counters. ``B/block`` = (RSS at 100k - RSS empty) / 100,000; ``meta B/block`` is
the same minus the retained token payload (retained_tokens x 4 B). Losses (``gaps``) must
be 0. Every scenario runs ``--repeats`` times (fresh processes, interleaved); medians.

Run: ``.venv/bin/python -m bench.listener_memory_bench [--repeats 3] [--json F]``
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.sim.tokenizer import bundled_qwen2_json

from ._kvstack import (
    BACKEND,
    Listener,
    Publisher,
    free_port,
    listener_config,
    rss_bytes,
    warm_up,
    workdir,
)
from ._table import fmt_float, median, render_table, verdict

EVENTS_PER_BATCH = 8
MAX_TRACKED = 100_000
MAX_CHAIN_TOKENS = 16_384
DEFAULT_RETAINED = 16_777_216
MiB = 2**20
CHAIN_BYTE_BOUND = min(64 * MiB, MAX_TRACKED * (1024 - 1))
"""The conversation defaults: max_retained_bytes 64 MiB, chunk_bytes 1024."""


@dataclass(frozen=True)
class Scenario:
    key: str
    label: str
    salted: bool  # False: unattributable chains stay pending; True: keyed at once
    max_retained_tokens: int = DEFAULT_RETAINED
    conversation: bool = False  # Qwen2 token ids, the listener in conversation mode

    @property
    def token_bound(self) -> int:
        return min(self.max_retained_tokens, MAX_TRACKED * MAX_CHAIN_TOKENS)


SCENARIOS: dict[str, Scenario] = {
    s.key: s
    for s in (
        Scenario("pending", "pending, tokens kept", False),
        Scenario(
            "pending-1M", "pending, max_retained_tokens 1M", False, max_retained_tokens=1_000_000
        ),
        Scenario("keyed", "keyed (salted chains)", True),
        Scenario("keyed-conv", "keyed, conversation keys", True, conversation=True),
    )
}


@dataclass
class Cell:
    scenario: Scenario
    runs: list[dict[str, Any]] = field(default_factory=list)

    def med(self, key: str) -> float:
        return median(float(r[key]) for r in self.runs if r["valid"])


def _push(pub: Publisher, lst: Listener, blocks: int, timeout: float = 300.0) -> dict[str, Any]:
    """Publish ``blocks`` block events and wait until the listener decoded all of them."""
    before = lst.source()["events"]
    pub.burst(blocks // EVENTS_PER_BATCH, EVENTS_PER_BATCH)
    deadline = time.monotonic() + timeout
    last, last_change = before, time.monotonic()
    while True:
        src = lst.source()
        if src["events"] - before >= blocks:
            return src
        now = time.monotonic()
        if src["events"] != last:
            last, last_change = src["events"], now
        elif now - last_change > 10 or now > deadline:
            return src  # lost batches: the caller sees gaps / missing events
        time.sleep(0.05)


def _settle_rss(pid: int, seconds: float = 1.0) -> int:
    """VmRSS after the process had ``seconds`` to finish what it queued (max of 3 reads)."""
    time.sleep(seconds)
    return max(rss_bytes(pid) for _ in range(3))


def run_scenario(s: Scenario, args: argparse.Namespace, workdir: Path, tag: str) -> dict[str, Any]:
    token_ids = "qwen2" if s.conversation else "simple"
    pub = Publisher(workdir, tag, salted=s.salted, hwm=args.hwm, token_ids=token_ids)
    lst: Listener | None = None
    try:
        extra: dict[str, Any] = {
            "max_tracked_blocks": MAX_TRACKED,
            "max_chain_tokens": MAX_CHAIN_TOKENS,
            "max_retained_tokens": s.max_retained_tokens,
        }
        dead = None if s.salted else f"http://127.0.0.1:{free_port()}/detokenize"
        top: dict[str, Any] = {}
        if s.conversation:
            top["conversation"] = {"enabled": True}
            extra.update(tokenizer=str(bundled_qwen2_json()), model="sim")
        cfg = listener_config(pub.connect_endpoint, detokenize_url=dead, top=top, source=extra)
        lst = Listener(cfg, workdir, tag)
        listener = lst
        lst.source()  # the HTTP server and the source are up
        rss_empty = _settle_rss(lst.pid, 0.5)
        warm_up(
            lambda: pub.burst(1, EVENTS_PER_BATCH),
            lambda: listener.source()["frames"] > 0,
        )
        time.sleep(0.2)
        src0 = lst.source()
        # exactly 100,000 tracked blocks: top up what the warm-up stored
        first = MAX_TRACKED - int(src0["tracked_blocks"])
        first -= first % EVENTS_PER_BATCH
        src1 = _push(pub, lst, first)
        rss_100k = _settle_rss(lst.pid)
        src1 = lst.source()
        hub1 = lst.stats()["hub"]["backends"][BACKEND]
        src2 = _push(pub, lst, MAX_TRACKED // 2)
        rss_150k = _settle_rss(lst.pid)
        src2 = lst.source()
        blocks = int(src1["tracked_blocks"])
        retained = int(src1["retained_tokens"])
        delta = rss_100k - rss_empty
        gaps = int(src2["gaps"])
        pushed = int(src2["events"])
        return {
            "rss_empty_mib": rss_empty / MiB,
            "rss_100k_mib": rss_100k / MiB,
            "rss_150k_mib": rss_150k / MiB,
            "tracked_at_100k": blocks,
            "bytes_per_block": delta / blocks if blocks else float("nan"),
            "meta_bytes_per_block": (delta - 4 * retained) / blocks if blocks else float("nan"),
            "retained_tokens": retained,
            "retained_mib": 4 * retained / MiB,
            "token_bound": s.token_bound,
            "token_bound_mib": 4 * s.token_bound / MiB,
            "retained_ok": retained <= s.token_bound
            and int(src2["retained_tokens"]) <= s.token_bound,
            "retained_tokens_150k": int(src2["retained_tokens"]),
            "chain_bytes": int(src1.get("chain_retained_bytes", 0)),
            "chain_bytes_150k": int(src2.get("chain_retained_bytes", 0)),
            "chain_ok": max(
                int(src1.get("chain_retained_bytes", 0)), int(src2.get("chain_retained_bytes", 0))
            )
            <= CHAIN_BYTE_BOUND,
            "pending_blocks": int(src1["pending_blocks"]),
            "keyed_blocks": int(src1["keyed_blocks"]),
            "history_records": int(hub1["history"]),
            "pushed_blocks": pushed,
            "tracked_at_150k": int(src2["tracked_blocks"]),
            "pruned_entries": int(src2["pruned_entries"]),
            "pruned_ok": int(src2["tracked_blocks"]) <= MAX_TRACKED,
            "gaps": gaps,
            "valid": gaps == 0 and pushed >= MAX_TRACKED * 3 // 2 and blocks == MAX_TRACKED,
        }
    finally:
        if lst is not None:
            lst.stop()
        pub.stop()


def report(args: argparse.Namespace, cells: list[Cell]) -> dict[str, Any]:
    print()
    print(
        f"listener RSS (VmRSS) at {MAX_TRACKED} tracked blocks (16 tokens each), "
        f"max_tracked_blocks {MAX_TRACKED}, max_chain_tokens {MAX_CHAIN_TOKENS}; "
        f"medians of {args.repeats} runs (fresh processes); baseline = the same process "
        "before ingestion"
    )
    print()
    headers = [
        "scenario",
        "RSS empty",
        "RSS @100k",
        "B/block",
        "meta B/block",
        "retained tokens",
        "x4 B",
        "bound (x4 B)",
        "<=bound",
        "chain bytes @100k/@150k",
        "RSS @150k",
        "tracked @150k",
        "<=100k",
        "pruned",
        "history",
        "lost",
    ]
    rows = []
    out: dict[str, Any] = {"params": vars(args), "scenarios": {}}
    for c in cells:
        s = c.scenario
        valid = [r for r in c.runs if r["valid"]]
        lost = sum(r["gaps"] for r in c.runs)
        invalid = len(c.runs) - len(valid)
        rows.append(
            [
                s.label,
                f"{fmt_float(c.med('rss_empty_mib'), 1)} MiB",
                f"{fmt_float(c.med('rss_100k_mib'), 1)} MiB",
                fmt_float(c.med("bytes_per_block"), 0),
                fmt_float(c.med("meta_bytes_per_block"), 0),
                fmt_float(c.med("retained_tokens"), 0),
                f"{fmt_float(c.med('retained_mib'), 1)} MiB",
                f"{s.token_bound} ({4 * s.token_bound / MiB:.1f} MiB)",
                verdict(bool(valid) and all(r["retained_ok"] and r["chain_ok"] for r in valid)),
                f"{c.med('chain_bytes') / MiB:.1f} / {c.med('chain_bytes_150k') / MiB:.1f} MiB"
                if s.conversation
                else "-",
                f"{fmt_float(c.med('rss_150k_mib'), 1)} MiB",
                fmt_float(c.med("tracked_at_150k"), 0),
                verdict(bool(valid) and all(r["pruned_ok"] for r in valid)),
                fmt_float(c.med("pruned_entries"), 0),
                fmt_float(c.med("history_records"), 0),
                f"{lost}" + (f" ({invalid} invalid)" if invalid else ""),
            ]
        )
        out["scenarios"][s.key] = {"label": s.label, "runs": c.runs}
    print(render_table(headers, rows))
    print()
    print(
        "B/block: (RSS @100k - RSS empty) / 100,000; meta B/block: the same without the token "
        "payload (retained tokens x 4 B); bound: min(max_retained_tokens, max_tracked_blocks x "
        "max_chain_tokens) tokens (and, with conversation keys, chain bytes <= "
        f"min(max_retained_bytes, max_tracked_blocks x 1023) = {CHAIN_BYTE_BOUND / MiB:.1f} MiB); "
        "@150k: after 50,000 more blocks (pruning must hold "
        "tracked_blocks <= 100,000); pruned: pruned_entries (blocks and token holders); "
        "history: records in the hub's resumption ring at 100k (history_size 10,000); "
        "lost: ZMQ gaps (must be 0)."
    )
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.listener_memory_bench", description=__doc__)
    p.add_argument("--repeats", type=int, default=3, help="runs per scenario (medians)")
    p.add_argument(
        "--scenarios",
        nargs="+",
        default=list(SCENARIOS),
        choices=list(SCENARIOS),
        help="which scenarios to run (default: all)",
    )
    p.add_argument("--hwm", type=int, default=100_000, help="publisher SNDHWM (batches)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument("--keep-logs", action="store_true", help="keep configs and process logs")
    p.add_argument("-v", "--verbose", action="store_true", help="print every run")
    args = p.parse_args(argv)
    cells = [Cell(SCENARIOS[k]) for k in args.scenarios]
    with workdir("continuum-memory-bench-", args.keep_logs) as wd:
        for r in range(args.repeats):
            for c in cells:
                res = run_scenario(c.scenario, args, wd, f"r{r}-{c.scenario.key}")
                c.runs.append(res)
                if args.verbose:
                    shown = {
                        k: (round(v, 2) if isinstance(v, float) else v) for k, v in res.items()
                    }
                    print(f"round {r + 1} {c.scenario.key:10} {shown}", flush=True)
            if not args.verbose:
                print(f"round {r + 1}/{args.repeats} done", flush=True)
    out = report(args, cells)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
