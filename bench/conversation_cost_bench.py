"""Router CPU per request of conversation-depth routing, against the prefix-key path.

Real processes under ``wrk`` load, as in ``proxy_bench``: 3 ``harness.sim --trivial``
engines and, per row, a router with Tier 4 on (PrefixAwareHash, the KV index, no event
source):

* ``prefix``: the prefix-key path (``kv_cache_index.conversation`` off): the prefix key
  and the overlap scorer's index lookup per request;
* ``conversation``: conversation-depth routing on, with Qwen2's chat template: every
  request rendered, normalized and hashed into its prompt chain, the chain index queried,
  the chosen backend's keys written as predictions; with the render cache on (64 MiB:
  a conversation's later turn renders only its new messages);
* ``nocache``: the conversation row with the render cache off
  (``render_cache_bytes: 0``, the default): every request rendered whole;
* ``miss``: the render cache on but too small to keep anything (1 byte): every request a
  miss, the cost of a conversation's first turn.

Three workloads (``--workloads``), each its own table:

* ``single``: 64 distinct conversations of about 2k, 8k and 32k prompt tokens, each sent
  again and again (the figures before the render cache are this workload's; with the
  cache every request after the first of its conversation is a retry of it);
* ``sessions``: conversations sent turn by turn, each turn the previous one's messages
  and one more question and answer, ``--sessions`` of them interleaved (turn k of every
  session, then turn k+1), from about 0.75x to 1.25x the size; every pass over the list
  tags each conversation anew (a new session), so its first turn misses and the others
  extend the previous turn. After each run the router's ``render_cache`` counters
  (``GET /admin/kv-index/stats``) give the hit rate and the cache's bytes.

* ``agent``: 64 distinct agent loops of about the size (``render_bench``'s shape: tools
  declared, tool calls and their results), each sent again and again: read in one pass
  (``messages.agent_slots``) and rendered by the segment renderer too.

The first two workloads are plain chats, so the segment renderer
(``router/conversation/segments.py``) serves them before the render cache: ``concat`` is
the share of the conversation row's requests rendered by concatenation (no jinja), and
``conversation``, ``nocache`` and ``miss`` then differ only in the cache's bookkeeping
(for agent loops too, which the render cache leaves to the segment renderer).

Per size and row: req/s and router CPU per request (utime + stime of the router process
over the measured run / requests), the rows of a size interleaved per round and the
table's ratios paired per round (a question and its answer are 1,800 bytes by default,
``--turn-bytes``: rendering costs per message). Targets: ``conversation / prefix`` CPU
per request <= 1.3 at every size, and the conversation path <= 400 us per request at 8k
tokens.

``--ref-tree DIR`` adds a third row, ``ref``: the conversation row's router from another
checkout (the code before a change), interleaved with the others, and the paired ratio
``conv/ref`` of CPU per request: on a shared machine the way to see a change smaller than
the run-to-run spread.

Run: ``.venv/bin/python -m bench.conversation_cost_bench [--tokens 2000 8000 32000]
[--workloads single sessions agent] [--sessions 32] [--repeats 3] [--duration 6]
[--ref-tree DIR] [--json F]``
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.procs import launch, python_module
from harness.sim.fleet import SimFleet
from harness.sim.tokenizer import bundled_qwen2_config, bundled_qwen2_json

from ._table import fmt_float, render_table, verdict
from .proxy_bench import (
    CHAT_PATH,
    MODEL,
    Cell,
    Target,
    _from_tree,
    _lua_long_string,
    measure,
    wait_serving,
    write_lua,
)
from .render_bench import conversation as agent_conversation

TARGET_RATIO = 1.3
TARGET_US_AT_8K = 400.0
ROWS = ("prefix", "conversation", "nocache", "miss")
CACHE_BYTES = {"conversation": 64 << 20, "nocache": 0, "miss": 1}
"""Each conversation row's ``render_cache_bytes``."""
TAG = "@@SESSION@@"


def _chat(c: int, target_bytes: int, turn_bytes: int, tag: str = "") -> list[dict[str, str]]:
    """Conversation ``c``'s messages up to ``target_bytes``: a system prompt (``tag`` in
    it), then questions and answers, without the final question."""
    q_len, a_len = max(20, turn_bytes // 6), max(40, turn_bytes - turn_bytes // 6)
    system = (f"You are the assistant of team {c:03d}. Be precise and brief. " * 24)[:1024]
    messages: list[dict[str, str]] = [{"role": "system", "content": tag + system}]
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
    return messages


def _request(messages: list[dict[str, str]]) -> bytes:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    return json.dumps(body, separators=(",", ":")).encode()


def _body(messages: list[dict[str, str]], c: int) -> bytes:
    final = {"role": "user", "content": f"And after that, for conversation {c}?"}
    return _request([*messages, final])


def conversation_bodies(tokens: int, n: int = 64, *, turn_bytes: int = 1800) -> list[bytes]:
    """``n`` multi-turn chats of about ``tokens`` prompt tokens (4 bytes a token), each
    under its own 1 KiB system prompt, ending with a user turn. ``turn_bytes`` is one
    question and its answer (a sixth and five sixths of it): 1800 is a chat with answers
    of a few hundred tokens; small values give the many short messages of an agent loop."""
    return [_body(_chat(c, tokens * 4, turn_bytes), c) for c in range(n)]


def session_bodies(tokens: int, sessions: int, *, turn_bytes: int = 1800) -> list[bytes]:
    """Turn after turn of ``sessions`` conversations, interleaved (every session's turn k,
    then every session's turn k+1), from about 0.75x to 1.25x ``tokens``: each turn the
    previous one's messages, its answer and a new question. Each body holds ``TAG`` once,
    in its system prompt (the load generator writes a session tag there)."""
    per: list[list[bytes]] = []
    for c in range(sessions):
        chat = _chat(c, tokens * 5, turn_bytes, TAG)
        low = tokens * 3
        # every prefix that ends with a question, from 0.75x the size on
        ends = [
            e for e in range(2, len(chat) + 1, 2) if sum(len(m["content"]) for m in chat[:e]) >= low
        ]
        per.append([_request(chat[:e]) for e in ends])
    turns = min(len(p) for p in per)
    return [per[c][t] for t in range(turns) for c in range(sessions)]


def agent_bodies(tokens: int, n: int = 64) -> list[bytes]:
    """``n`` distinct agent loops of about ``tokens`` prompt tokens (``render_bench``'s
    shape: two tools declared, rounds of a tool call, its result, an answer and a
    question; about 5.2 bytes a token as Qwen's tokenizer counts these)."""
    out = []
    for c in range(n):
        turns = 0
        while True:
            body = {**agent_conversation(turns, c), "model": MODEL, "max_tokens": 16}
            if len(json.dumps(body)) >= tokens * 5.2:
                break
            turns += 1
        out.append(json.dumps(body, separators=(",", ":")).encode())
    return out


def write_session_lua(path: Path, bodies: list[bytes]) -> None:
    """wrk sends the bodies in order, each pass over them with a new tag per thread and
    pass (new sessions), so a session's turn k+1 always follows its turn k."""
    heads, tails = [], []
    for b in bodies:
        head, tail = b.decode().split(TAG)
        heads.append("  " + _lua_long_string(head))
        tails.append("  " + _lua_long_string(tail))
    path.write_text(
        "local heads = {\n" + ",\n".join(heads) + "\n}\n"
        "local tails = {\n" + ",\n".join(tails) + "\n}\n"
        "local counter = 0\n"
        "setup = function(thread)\n"
        "  counter = counter + 1\n"
        "  thread:set('tid', counter)\n"
        "end\n"
        "local headers = {['Content-Type'] = 'application/json'}\n"
        "local i, pass, run = 0, 0, 0\n"
        "init = function(args)\n"
        "  math.randomseed(os.time() * 100 + (tid or 0))\n"
        "  run = math.random(1, 1000000000)\n"
        "end\n"
        "request = function()\n"
        "  if i == #heads then i = 0; pass = pass + 1 end\n"
        "  i = i + 1\n"
        "  local tag = 'session ' .. run .. '-' .. (tid or 0) .. '-' .. pass .. '. '\n"
        f"  return wrk.format('POST', '{CHAT_PATH}', headers, heads[i] .. tag .. tails[i])\n"
        "end\n"
    )


def router_yaml(urls: list[str], conversation: bool, render_cache_bytes: int | None = None) -> str:
    """``render_cache_bytes`` None: the default."""
    conv = ""
    if conversation:
        conv = (
            "  conversation:\n"
            "    enabled: true\n"
            "    templates:\n"
            f"      - {{model: {MODEL}, tokenizer_config: '{bundled_qwen2_config()}', "
            f"tokenizer: '{bundled_qwen2_json()}'}}\n"
        )
        if render_cache_bytes is not None:
            conv += f"    render_cache_bytes: {render_cache_bytes}\n"
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
    key: str,
    urls: list[str],
    conversation: bool,
    workdir: Path,
    tree: Path | None = None,
    render_cache_bytes: int | None = None,
) -> Target:
    cfg = workdir / f"{key}.yaml"
    cfg.write_text(router_yaml(urls, conversation, render_cache_bytes))
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


def cache_counters(url: str) -> dict[str, float] | None:
    """The router's render cache counters (``/admin/kv-index/stats``), or None."""
    try:
        with urllib.request.urlopen(url + "/admin/kv-index/stats", timeout=5) as resp:
            doc = json.load(resp)
    except (OSError, ValueError):
        return None
    rendering = doc.get("conversation", {}).get("rendering", {})
    rc = rendering.get("render_cache")
    if not isinstance(rc, dict):
        return None
    out = {k: float(v) for k, v in rc.items()}
    # the segment renderer's share: requests rendered by concatenation, no jinja
    out["concat"] = float(sum(m["hits"] for m in rendering.get("segments", {}).values()))
    out["rendered"] = float(sum(rendering.get("rendered", {}).values()))
    return out


def _cache_delta(
    before: dict[str, float] | None, after: dict[str, float] | None
) -> dict[str, float]:
    if before is None or after is None:
        return {}
    hits, misses = after["hits"] - before["hits"], after["misses"] - before["misses"]
    # a rejected request is rendered whole and counted a miss too
    asked = hits + misses + after["bypassed"] - before["bypassed"]
    rendered = after["rendered"] - before["rendered"]
    return {
        "concat_rate": (after["concat"] - before["concat"]) / rendered if rendered else 0.0,
        "hit_rate": hits / asked if asked else 0.0,
        "cache_mib": after["bytes"] / 2**20,
        "entries": after["entries"],
        "evictions": after["evictions"] - before["evictions"],
    }


async def bench(args: argparse.Namespace) -> dict[tuple[str, int, str], Cell]:
    workdir = Path(tempfile.mkdtemp(prefix="conv-cost-"))
    cells: dict[tuple[str, int, str], Cell] = {}
    scripts: dict[tuple[str, int], Path] = {}
    for tokens in args.tokens:
        for wl in args.workloads:
            scripts[(wl, tokens)] = path = workdir / f"{wl}-{tokens}.lua"
            if wl == "single":
                write_lua(path, conversation_bodies(tokens, turn_bytes=args.turn_bytes))
            elif wl == "agent":
                write_lua(path, agent_bodies(tokens))
            else:
                bodies = session_bodies(tokens, args.sessions, turn_bytes=args.turn_bytes)
                write_session_lua(path, bodies)
    targets: list[Target] = []
    async with SimFleet(n=3, model=MODEL, trivial=True) as fleet:
        try:
            for key in ROWS:
                conv = key != "prefix"
                cache = CACHE_BYTES.get(key)
                targets.append(await start_router(key, fleet.urls, conv, workdir, None, cache))
            if args.ref_tree:
                ref = Path(args.ref_tree)
                targets.append(await start_router("ref", fleet.urls, True, workdir, ref))
            for rnd in range(args.repeats):
                for wl in args.workloads:
                    for tokens in args.tokens:
                        order = targets if rnd % 2 == 0 else targets[::-1]
                        for t in order:
                            script = scripts[(wl, tokens)]
                            before = cache_counters(t.url) if t.key == "conversation" else None
                            r = await measure(
                                t, script, args.concurrency, 2, args.duration, args.warmup
                            )
                            if before is not None:
                                r.update(_cache_delta(before, cache_counters(t.url)))
                            cell = cells.setdefault((wl, tokens, t.key), Cell(wl, tokens, t.key))
                            cell.runs.append(r)
                            extra = (
                                f" hits {r['hit_rate']:.0%} cache {r['cache_mib']:.1f} MiB"
                                f" concat {r['concat_rate']:.0%}"
                                if "hit_rate" in r
                                else ""
                            )
                            print(
                                f"  round {rnd + 1} {wl:<8} {tokens:>6} tokens {t.key:<13}"
                                f" {r['rps']:>7.0f} req/s {r['cpu_us_per_req']:>6.0f} us/req"
                                f" errors {r['errors']:.0f}{extra}",
                                flush=True,
                            )
        finally:
            for t in targets:
                await t.stop()
    shutil.rmtree(workdir, ignore_errors=True)
    return cells


def report(args: argparse.Namespace, cells: dict[tuple[str, int, str], Cell]) -> dict[str, Any]:
    out = []
    for wl in args.workloads:
        rows = []
        for tokens in args.tokens:
            prefix, conv = cells[(wl, tokens, "prefix")], cells[(wl, tokens, "conversation")]
            nocache, miss = cells[(wl, tokens, "nocache")], cells[(wl, tokens, "miss")]
            ref = cells.get((wl, tokens, "ref"))
            ratio = conv.ratio(prefix)
            us = conv.med("cpu_us_per_req")
            ok_ratio = ratio <= TARGET_RATIO
            ok_us = us <= TARGET_US_AT_8K if tokens == 8000 else None
            hit = conv.med("hit_rate") if all("hit_rate" in r for r in conv.runs) else float("nan")
            mib = (
                conv.med("cache_mib") if all("cache_mib" in r for r in conv.runs) else float("nan")
            )
            concat = (
                conv.med("concat_rate")
                if all("concat_rate" in r for r in conv.runs)
                else float("nan")
            )
            rows.append(
                [
                    f"{tokens}",
                    fmt_float(prefix.med("rps"), 0),
                    fmt_float(conv.med("rps"), 0),
                    fmt_float(prefix.med("cpu_us_per_req"), 0),
                    fmt_float(us, 0),
                    fmt_float(nocache.med("cpu_us_per_req"), 0),
                    fmt_float(miss.med("cpu_us_per_req"), 0),
                    fmt_float(ratio, 2),
                    fmt_float(nocache.ratio(prefix), 2),
                    fmt_float(miss.ratio(prefix), 2),
                    f"{hit:.0%}",
                    fmt_float(mib, 1),
                    f"{concat:.0%}",
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
                    "workload": wl,
                    "tokens": tokens,
                    "prefix_cpu_us": prefix.med("cpu_us_per_req"),
                    "conversation_cpu_us": us,
                    "nocache_cpu_us": nocache.med("cpu_us_per_req"),
                    "miss_cpu_us": miss.med("cpu_us_per_req"),
                    "ratio": ratio,
                    "nocache_ratio": nocache.ratio(prefix),
                    "miss_ratio": miss.ratio(prefix),
                    "hit_rate": hit,
                    "cache_mib": mib,
                    **(
                        {"ref_cpu_us": ref.med("cpu_us_per_req"), "ratio_to_ref": conv.ratio(ref)}
                        if ref
                        else {}
                    ),
                    "errors": sum(
                        r["errors"] for c in (prefix, conv, nocache, miss) for r in c.runs
                    ),
                }
            )
        print()
        print(
            f"{wl}: router CPU per request, wrk c={args.concurrency}, {args.duration:g}s runs, "
            f"{args.repeats} round(s), medians; ratios paired per round"
            + (f"; {args.sessions} sessions interleaved" if wl == "sessions" else "")
        )
        print(
            render_table(
                [
                    "prompt tokens",
                    "prefix req/s",
                    "conv req/s",
                    "prefix us/req",
                    "conv us/req",
                    "nocache us/req",
                    "miss us/req",
                    "conv/prefix",
                    "nocache/prefix",
                    "miss/prefix",
                    "hits",
                    "cache MiB",
                    "concat",
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
    p.add_argument(
        "--workloads",
        nargs="+",
        choices=["single", "sessions", "agent"],
        default=["single", "sessions", "agent"],
    )
    p.add_argument("--sessions", type=int, default=32, help="sessions interleaved")
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
