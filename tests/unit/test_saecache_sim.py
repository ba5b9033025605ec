"""The SAECache evaluation's trace builder and block-level simulator."""

from __future__ import annotations

import io
import itertools
import json
from array import array

import pytest

from bench.saecache.sim import (
    LfuPolicy,
    LruPolicy,
    MinPolicy,
    SaePolicy,
    next_uses,
    replay,
)
from bench.saecache.trace import MIXES, Mix, Request, build_trace, read_sharegpt


def _conv(i: int) -> dict:
    return {
        "id": f"c{i}",
        "conversations": [
            {"from": "human", "value": f"question {i} ünïcode"},
            {"from": "gpt", "value": f"answer {i}"},
            {"from": "human", "value": "more"},
            {"from": "gpt", "value": "sure"},
        ],
    }


def test_read_sharegpt_stops_at_a_record_cut_off_mid_way() -> None:
    body = json.dumps([_conv(i) for i in range(3)], indent=2)
    cut = body[: body.rindex('"more"')]  # third record truncated
    bad = {"id": "x", "conversations": [{"from": "gpt", "value": "starts with gpt"}]}
    text = "[\n" + json.dumps(bad) + ",\n" + cut[2:]
    convs = read_sharegpt(100, io.BytesIO(text.encode()))
    assert [c[0][1] for c in convs] == ["question 0 ünïcode", "question 1 ünïcode"]
    assert convs[0] == [
        ("user", "question 0 ünïcode"),
        ("assistant", "answer 0"),
        ("user", "more"),
        ("assistant", "sure"),
    ]
    assert len(read_sharegpt(1, io.BytesIO(text.encode()))) == 1


def test_read_sharegpt_chunk_boundaries() -> None:
    text = json.dumps([_conv(i) for i in range(40)]).encode()

    class Slow(io.BytesIO):
        def read(self, n: int | None = -1, /) -> bytes:  # 7-byte reads split records and UTF-8
            return super().read(7)

    assert len(read_sharegpt(100, Slow(text))) == 40


def _req(t: float, sid: int, blocks: list[int], n_prompt: int | None = None) -> Request:
    n = len(blocks) if n_prompt is None else n_prompt
    return Request(
        t=t,
        session=sid,
        kind="chat",
        first=False,
        tools=False,
        prompt_tokens=16 * n + 1,
        blocks=blocks,
        types=bytes([1] * len(blocks)),
        n_prompt=n,
    )


def test_lru_evicts_like_vllm_free_queue() -> None:
    # request 1 caches a->b, request 2 caches x; capacity 3. A third request needs one block:
    # vLLM's free queue holds b, a (tail first), then x, so b goes first.
    trace = [_req(0, 1, [1, 2]), _req(1, 2, [9]), _req(2, 3, [5]), _req(3, 1, [1, 2])]
    res = replay(trace, LruPolicy(), 3)
    # last request hits a only: b was evicted
    assert res.hit_tokens == 16
    assert res.max_cached == 3


@pytest.mark.parametrize("policy", ["lru", "lfu", "min", "sae"])
def test_capacity_is_never_exceeded_and_replay_is_deterministic(policy: str) -> None:
    import random

    rng = random.Random(5)
    trace = []
    for i in range(300):
        root = rng.randrange(5)
        depth = rng.randint(1, 8)
        blocks = [root * 1000 + d + 100 * rng.randrange(3) * (d > 2) for d in range(depth)]
        trace.append(_req(float(i), rng.randrange(20), blocks))
    uses = next_uses(trace)

    def make():
        return {
            "lru": LruPolicy,
            "lfu": LfuPolicy,
            "min": lambda: MinPolicy(uses),
            "sae": SaePolicy,
        }[policy]()

    a = replay(trace, make(), 7)
    b = replay(trace, make(), 7)
    assert a.max_cached <= 7
    assert (a.hit_tokens, a.evictions) == (b.hit_tokens, b.evictions)
    assert 0 < a.hit_rate < 1


def test_min_beats_online_policies_on_a_cyclic_scan() -> None:
    # 5 one-block prompts in a loop through a 4-block cache: LRU never hits, MIN does
    trace = [_req(float(i), i, [i % 5 + 1]) for i in range(50)]
    uses = next_uses(trace)
    lru = replay(trace, LruPolicy(), 4)
    opt = replay(trace, MinPolicy(uses), 4)
    assert lru.hit_tokens == 0
    assert opt.hit_tokens > 0


def test_build_trace_chains_turns_and_drops_chain_of_thought() -> None:
    conv = [
        (0, array("I", range(2000, 2100))),
        (1, array("I", range(3000, 3080))),
        (0, array("I", range(4000, 4050))),
        (1, array("I", range(5000, 5040))),
    ]
    for kind, mix in (("chat", Mix("c", 1, 0, 0, 0)), ("reasoning", Mix("r", 0, 1, 0, 0))):
        trace = build_trace(mix, sessions=1, conversations=[conv], seed=3)
        assert [r.kind for r in trace] == [kind, kind]
        first, second = trace
        assert first.first and not second.first
        out_blocks = first.blocks[first.n_prompt :]
        assert out_blocks
        nxt = set(second.blocks[: second.n_prompt])
        assert set(first.blocks[: first.n_prompt]) <= nxt  # the prompt is re-sent
        if kind == "chat":
            assert set(out_blocks) <= nxt  # the answer is re-sent
        else:
            assert not set(out_blocks) & nxt  # chain of thought (and what follows) is not
            assert 3 in first.types[first.n_prompt :]  # TokenType.REASONING


def test_mixtures_are_seeded_and_time_ordered() -> None:
    conv = [(0, array("I", range(2000, 2040))), (1, array("I", range(3000, 3040)))]
    a = build_trace(MIXES["agent"], sessions=12, conversations=[conv] * 4, seed=9)
    b = build_trace(MIXES["agent"], sessions=12, conversations=[conv] * 4, seed=9)
    assert [(r.t, r.blocks) for r in a] == [(r.t, r.blocks) for r in b]
    assert all(x.t <= y.t for x, y in itertools.pairwise(a))
