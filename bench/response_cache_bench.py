"""The response cache's hit path inside the router: key computation plus memory lookup.

A typical deterministic chat request (1 KB system prompt, a user turn) is keyed with
``router.cache.response.cache_key`` (the reference design's SHA-256 over model, the
messages' digest, sampling fields and tenant) and looked up in an ``InMemoryCacheStore``
holding 1,000 entries. Baseline, same run: ``hashlib.sha256`` over the same canonical
messages JSON. Target: key + lookup <= 10 us (median, thread CPU time).

    .venv/bin/python -m bench.response_cache_bench
"""

from __future__ import annotations

import hashlib
import sys

import orjson

from router.cache.memory_store import InMemoryCacheStore
from router.cache.response import cache_key, ineligible_reason, tenant_of

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved, verdict

TARGET_US = 10.0


def main() -> int:
    system = ("You are a careful assistant for tenant 7. " * 30)[:1024]
    body = {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Summarise the policy in two sentences."},
        ],
        "temperature": 0,
        "max_tokens": 128,
    }
    headers = {"authorization": "Bearer sk-tenant-7"}
    store = InMemoryCacheStore(1000, 300)
    key = cache_key(body, tenant_of(headers))
    for i in range(999):
        store.put(f"{i:064x}", b"x" * 512, 300)
    store.put(key, b'{"id":"cached"}', 300)
    canonical = orjson.dumps(body["messages"], option=orjson.OPT_SORT_KEYS)

    def baseline() -> None:
        hashlib.sha256(canonical).digest()

    def key_only() -> None:
        cache_key(body, tenant_of(headers))

    def hit_path() -> None:
        ineligible_reason(body)
        store.lookup(cache_key(body, tenant_of(headers)))

    cases = [
        ("baseline: sha256(canonical messages)", baseline, False),
        ("cache_key (with tenant digest)", key_only, False),
        ("eligibility + key + memory lookup", hit_path, True),
    ]
    timings = time_interleaved([fn for _, fn, _ in cases], loops=20_000, repeats=7)
    rows = []
    ok_all = True
    for (label, _, judged), per in zip(cases, timings, strict=True):
        us = median(per) * 1e6
        ok = us <= TARGET_US if judged else None
        ok_all = ok_all and (ok is not False)
        rows.append(
            [label, fmt_float(us, 3), fmt_float(paired_ratio(per, timings[0]), 2) + "x",
             f"<={TARGET_US:g}us" if judged else "-", verdict(ok)]
        )  # fmt: skip
    print("response cache hit path: thread CPU time, median of 7 interleaved repeats x 20000")
    print(render_table(["case", "us/call", "vs sha256", "target", ""], rows))
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
