"""Micro-benchmark: cost of ``extract_prefix_key`` per request body.

Baseline: ``hashlib.sha256(<the same 1 KB of system prompt bytes>).digest()``, the floor
for any scheme that hashes the anchor text. Everything else the key costs (finding the
anchor in the body, encoding, the UTF-8 cut, hashing the model name) shows up as the
ratio against it. Target: at most 5 us per call (median) for a 1 KB anchor; the 64 KB
row shows that truncation to ``max_prefix_length`` keeps the cost flat.

Run: ``.venv/bin/python -m bench.prefix_key_bench [--loops N] [--repeats R] [--json F]``
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

from bus.prefix_key import extract_prefix_key

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved, verdict

TARGET_US = 5.0
MODEL = "meta-llama/Llama-3.1-8B-Instruct"


def _text(n_bytes: int, seed: str = "") -> str:
    """ASCII prose of exactly ``n_bytes`` bytes (distinct per ``seed``)."""
    base = (
        f"You are a helpful assistant for tenant {seed or 'acme'}. Answer concisely, cite "
        "sources when you use them, never invent facts, and follow the style guide: short "
        "sentences, active voice, no marketing language. "
    )
    return (base * (n_bytes // len(base) + 1))[:n_bytes]


def _cjk_text(n_bytes: int) -> str:
    """Non-ASCII text (3 bytes a code point) of about ``n_bytes`` bytes."""
    return ("你是一个乐于助人的助手。请简洁地回答问题，并引用来源。" * (n_bytes // 60 + 1))[
        : n_bytes // 3
    ]


def _openai(system: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "Paris."},
            {"role": "user", "content": "And of Italy?"},
        ],
        "max_tokens": 64,
    }


def _anthropic(system: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "system": system,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 64,
    }


def _anthropic_blocks(system: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "system": [{"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi there"}]}],
        "max_tokens": 64,
    }


def _no_system(first: str) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": first}]}


def cases() -> list[tuple[str, Callable[[], Any], bool]]:
    """(label, zero-argument callable, judged against the target)."""
    one_kb = _text(1024)
    one_kb_bytes = one_kb.encode()
    assert len(one_kb_bytes) == 1024
    sha = hashlib.sha256
    ext = extract_prefix_key
    bodies = {
        "OpenAI, 1 KB system message": _openai(one_kb),
        "Anthropic, 1 KB top-level system (str)": _anthropic(one_kb),
        "Anthropic, 1 KB system blocks": _anthropic_blocks(one_kb),
        "OpenAI, no system, 1 KB first user msg": _no_system(one_kb),
        "OpenAI, 1 KB system, non-ASCII (CJK)": _openai(_cjk_text(1024)),
        "OpenAI, 64 KB system (cut to 1 KB)": _openai(_text(64 * 1024)),
        "OpenAI, 1 MB system (cut to 1 KB)": _openai(_text(1024 * 1024)),
    }
    out: list[tuple[str, Callable[[], Any], bool]] = [
        ("baseline: sha256(1 KB).digest()", lambda: sha(one_kb_bytes).digest(), False)
    ]
    for label, body in bodies.items():
        assert ext(body) is not None, label

        def enabled(b: dict[str, Any] = body) -> Any:
            return ext(b, enabled=True, max_prefix_length=1024)

        out.append((label, enabled, True))

    def disabled(b: dict[str, Any] = bodies["OpenAI, 1 KB system message"]) -> Any:
        return ext(b, enabled=False)

    out.append(("disabled (enabled=False)", disabled, False))
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.prefix_key_bench", description=__doc__)
    p.add_argument("--loops", type=int, default=20_000, help="calls per repeat")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    args = p.parse_args(argv)

    all_cases = cases()
    timings = time_interleaved(
        [fn for _, fn, _ in all_cases], loops=args.loops, repeats=args.repeats
    )
    base = timings[0]
    results: list[dict[str, Any]] = []
    for (label, _, judged), per in zip(all_cases, timings, strict=True):
        med = median(per) * 1e6
        results.append(
            {
                "case": label,
                "median_us": med,
                "min_us": min(per) * 1e6,
                "max_us": max(per) * 1e6,
                "ratio": paired_ratio(per, base),
                "judged": judged,
                "pass": (med <= TARGET_US) if judged else None,
            }
        )

    rows = [
        [
            r["case"],
            fmt_float(r["median_us"], 3),
            fmt_float(r["min_us"], 3),
            fmt_float(r["max_us"], 3),
            fmt_float(r["ratio"], 2) + "x",
            verdict(r["pass"]),
        ]
        for r in results
    ]
    print(
        f"extract_prefix_key: thread CPU time, median of {args.repeats} interleaved repeats "
        f"x {args.loops} calls; target <= {TARGET_US:g} us/call"
    )
    print(
        render_table(
            ["case", "us/call", "min", "max", "vs sha256", f"<={TARGET_US:g}us"],
            rows,
        )
    )
    judged_rows = [r for r in results if r["judged"]]
    ok = all(r["pass"] for r in judged_rows)
    worst = max(judged_rows, key=lambda r: r["median_us"])
    print(
        f"\nworst judged case: {worst['case']}: {worst['median_us']:.3f} us/call "
        f"({worst['ratio']:.2f}x sha256 of 1 KB) -> {verdict(ok)}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "target_us": TARGET_US,
                    "loops": args.loops,
                    "repeats": args.repeats,
                    "results": results,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
