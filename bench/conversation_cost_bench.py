"""Router CPU per request of conversation-depth routing, against the prefix-key path.

Real processes under ``wrk`` load, as in ``proxy_bench``: 3 ``harness.sim --trivial``
engines and, per row, a router with Tier 4 on (PrefixAwareHash, the KV index, no event
source):

* ``prefix``: the prefix-key path (``kv_cache_index.conversation`` off): the prefix key
  and the overlap scorer's index lookup per request;
* ``conversation``: conversation-depth routing on, with Qwen2's chat template: every
  request rendered, normalized and hashed into its prompt chain, the chain index queried,
  the chosen backend's keys written as predictions.

For each conversation size (multi-turn chats of about 2k, 8k and 32k prompt tokens, 64
distinct conversations, 4 bytes a token; a question and its answer are 1,800 bytes by
default, ``--turn-bytes``: rendering costs per message) and each row: req/s and router
CPU per request (utime + stime of the router process over the measured run / requests),
the rows of a size interleaved per round and the table's ratio paired per round. Targets (issue 16):
``conversation / prefix`` CPU per request <= 1.3 at every size, and the conversation path
<= 400 us per request at 8k tokens.

``--ref-tree DIR`` adds a third row, ``ref``: the conversation row's router from another
checkout (the code before a change), interleaved with the others, and the paired ratio
``conv/ref`` of CPU per request: on a shared machine the way to see a change smaller than
the run-to-run spread.

Run: ``.venv/bin/python -m bench.conversation_cost_bench [--tokens 2000 8000 32000]
[--repeats 3] [--duration 6] [--ref-tree DIR] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.procs import launch, python_module
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json

from ._table import fmt_float, render_table, verdict
from .proxy_bench import MODEL, Cell, Target, _from_tree, measure, wait_serving, write_lua

TARGET_RATIO = 1.3
TARGET_US_AT_8K = 400.0
ROWS = ("prefix", "conversation")


def conversation_bodies(tokens: int, n: int = 64, *, turn_bytes: int = 1800) -> list[bytes]:
    """``n`` multi-turn chats of about ``tokens`` prompt tokens (4 bytes a token), each
    under its own 1 KiB system prompt, ending with a user turn. ``turn_bytes`` is one
    question and its answer (a sixth and five sixths of it): 1800 is a chat with answers
    of a few hundred tokens; small values give the many short messages of an agent loop."""
    out = []
    target_bytes = tokens * 4
    q_len, a_len = max(20, turn_bytes // 6), max(40, turn_bytes - turn_bytes // 6)
    for c in range(n):
        system = (f"You are the assistant of team {c:03d}. Be precise and brief. " * 24)[:1024]
        messages: list[dict[str, str]] = [{"role": "system", "content": system}]
        size, turn = len(system), 0
        while size < target_bytes:
            q = f"Turn {turn} of conversation {c}: explain the next step in detail. " * 40
            a = f"Step {turn}: here is what to do, with the reasons and the caveats. " * 80
            messages += [
                {"role": "user", "content": q[:q_len]},
                {"role": "assistant", "content": a[:a_len]},
            ]
            size += q_len + a_len
            turn += 1
        messages.append({"role": "user", "content": f"And after that, for conversation {c}?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 16}
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


def router_yaml(urls: list[str], conversation: bool) -> str:
    conv = ""
    if conversation:
        conv = (
            "  conversation:\n"
            "    enabled: true\n"
            "    templates:\n"
            f"      - {{model: {MODEL}, tokenizer_config: '{bundled_qwen2_config()}', "
            f"tokenizer: '{bundled_qwen2_json()}'}}\n"
        )
    lines = [
        'server: {listen: "127.0.0.1:0"}',
        "selection_strategy: PrefixAwareHash",
        "prefix_routing: {enabled: true, virtual_nodes: 150, load_factor_epsilon: 0.25}",
        "health_check: {interval_ms: 10000}",
        "kv_cache_index:",
        "  enabled: true",
        conv.rstrip("\n"),
        "backends:",
        *(
            f'  - {{name: b{i + 1}, url: "{u}", type: vllm, models: [{MODEL}]}}'
            for i, u in enumerate(urls)
        ),
    ]
    return "\n".join(line for line in lines if line) + "\n"


async def start_router(
    key: str, urls: list[str], conversation: bool, workdir: Path, tree: Path | None = None
) -> Target:
    cfg = workdir / f"{key}.yaml"
    cfg.write_text(router_yaml(urls, conversation))
    target = Target(key, key)
    argv = ["serve", "--config", str(cfg)]
    target.child = await launch(
        f"router {key}",
        _from_tree(tree, "router", *argv) if tree is not None else python_module("router", *argv),
        ready_timeout=60,
        log=workdir / f"{key}.log",
    )
    target.pid = target.child.pid
    target.url = target.child.ready.url()
    await wait_serving(target)
    return target


async def bench(args: argparse.Namespace) -> dict[tuple[int, str], Cell]:
    workdir = Path(tempfile.mkdtemp(prefix="conv-cost-"))
    cells: dict[tuple[int, str], Cell] = {}
    scripts = {}
    for tokens in args.tokens:
        scripts[tokens] = workdir / f"chat-{tokens}.lua"
        write_lua(scripts[tokens], conversation_bodies(tokens, turn_bytes=args.turn_bytes))
    targets: list[Target] = []
    async with SimFleet(n=3, model=MODEL, trivial=True) as fleet:
        try:
            for key in ROWS:
                targets.append(await start_router(key, fleet.urls, key == "conversation", workdir))
            if args.ref_tree:
                ref = Path(args.ref_tree)
                targets.append(await start_router("ref", fleet.urls, True, workdir, ref))
            for rnd in range(args.repeats):
                for tokens in args.tokens:
                    order = targets if rnd % 2 == 0 else targets[::-1]
                    for t in order:
                        r = await measure(
                            t, scripts[tokens], args.concurrency, 2, args.duration, args.warmup
                        )
                        cell = cells.setdefault((tokens, t.key), Cell("plain", tokens, t.key))
                        cell.runs.append(r)
                        print(
                            f"  round {rnd + 1} {tokens:>6} tokens {t.key:<13}"
                            f" {r['rps']:>7.0f} req/s {r['cpu_us_per_req']:>6.0f} us/req"
                            f" errors {r['errors']:.0f}",
                            flush=True,
                        )
        finally:
            for t in targets:
                await t.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return cells


def report(args: argparse.Namespace, cells: dict[tuple[int, str], Cell]) -> dict[str, Any]:
    rows, out = [], []
    for tokens in args.tokens:
        prefix, conv = cells[(tokens, "prefix")], cells[(tokens, "conversation")]
        ref = cells.get((tokens, "ref"))
        ratio = conv.ratio(prefix)
        us = conv.med("cpu_us_per_req")
        ok_ratio = ratio <= TARGET_RATIO
        ok_us = us <= TARGET_US_AT_8K if tokens == 8000 else None
        rows.append(
            [
                f"{tokens}",
                fmt_float(prefix.med("rps"), 0),
                fmt_float(conv.med("rps"), 0),
                fmt_float(prefix.med("cpu_us_per_req"), 0),
                fmt_float(us, 0),
                fmt_float(ratio, 2),
                verdict(ok_ratio),
                "-" if ok_us is None else verdict(ok_us),
                *(
                    [fmt_float(ref.med("cpu_us_per_req"), 0), fmt_float(conv.ratio(ref), 3)]
                    if ref
                    else []
                ),
            ]
        )
        out.append(
            {
                "tokens": tokens,
                "prefix_cpu_us": prefix.med("cpu_us_per_req"),
                "conversation_cpu_us": us,
                "ratio": ratio,
                **(
                    {"ref_cpu_us": ref.med("cpu_us_per_req"), "ratio_to_ref": conv.ratio(ref)}
                    if ref
                    else {}
                ),
                "errors": sum(r["errors"] for c in (prefix, conv) for r in c.runs),
            }
        )
    print()
    print(
        f"router CPU per request, wrk c={args.concurrency}, {args.duration:g}s runs, "
        f"{args.repeats} round(s), medians; ratio paired per round"
    )
    print(
        render_table(
            [
                "prompt tokens",
                "prefix req/s",
                "conv req/s",
                "prefix us/req",
                "conv us/req",
                "conv/prefix",
                f"<={TARGET_RATIO:g}",
                f"<={TARGET_US_AT_8K:g}us @8k",
                *(["ref us/req", "conv/ref"] if args.ref_tree else []),
            ],
            rows,
        )
    )
    return {"rows": out}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.conversation_cost_bench", description=__doc__)
    p.add_argument("--tokens", type=int, nargs="+", default=[2000, 8000, 32000])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--duration", type=float, default=6.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument(
        "--turn-bytes",
        type=int,
        default=1800,
        help="bytes of one question + answer (1800: a chat; 300: an agent loop's short turns)",
    )
    p.add_argument(
        "--ref-tree",
        metavar="DIR",
        help="another checkout: its conversation router as a third row, ratio paired per round",
    )
    p.add_argument("--json", metavar="FILE")
    args = p.parse_args(argv)
    if args.ref_tree:
        args.ref_tree = str(Path(args.ref_tree).resolve())
        if not (Path(args.ref_tree) / "router").is_dir():
            print(f"error: {args.ref_tree} is not a checkout (no router/)", file=sys.stderr)
            return 2
    if shutil.which("wrk") is None:
        print("error: wrk not found on PATH (apt-get install wrk)", file=sys.stderr)
        return 2
    cells = asyncio.run(bench(args))
    res = report(args, cells)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
