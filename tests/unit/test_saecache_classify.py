"""Session class from engine-visible request features: the rules, malformed input, the
advisor's use of them, and the trace generator's features."""

from __future__ import annotations

import math
from array import array
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench.saecache.sim import TRUE_CLASS, SaePolicy, replay
from bench.saecache.trace import MIXES, Mix, build_trace
from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from listener.saecache import SessionClass
from listener.saecache.advisor import EvictionAdvisor, request_features
from listener.saecache.classify import RequestFeatures, RuleConfig, classify, parse_features

C, A, S, U = SessionClass.CHAT, SessionClass.AGENT, SessionClass.SINGLE, SessionClass.UNKNOWN


@pytest.mark.parametrize(
    ("features", "expected"),
    [
        (RequestFeatures(tools=8, turns=1, temperature=0.0, max_tokens=256), A),
        (RequestFeatures(tools=0, tool_calls=2, tool_results=2, turns=5), A),
        (RequestFeatures(tool_results=1), A),
        (RequestFeatures(turns=3, temperature=0.0, max_tokens=128), C),
        (RequestFeatures(turns=1, reasoning=True, temperature=0.0), C),
        (RequestFeatures(turns=1, temperature=0.0), S),
        (RequestFeatures(turns=1, temperature=0.7, max_tokens=512), S),
        (RequestFeatures(turns=1, temperature=0.7), C),
        (RequestFeatures(turns=1), C),
        (RequestFeatures(temperature=1.0, max_tokens=4096), C),
        (RequestFeatures(), U),
        (RequestFeatures(tools=0, reasoning=False), U),
    ],
)
def test_rules(features: RequestFeatures, expected: SessionClass) -> None:
    assert classify(features) == expected


def test_thresholds_are_the_rules_only_parameters() -> None:
    f = RequestFeatures(turns=1, temperature=0.5)
    assert classify(f) == C
    assert classify(f, RuleConfig(temperature_max=0.5)) == S
    g = RequestFeatures(turns=1, max_tokens=2048)
    assert classify(g) == C and classify(g, RuleConfig(max_tokens_max=2048)) == S


def test_parse_drops_malformed_fields_one_by_one() -> None:
    f = parse_features(
        {
            "tools": -1,
            "turns": True,
            "tool_calls": "3",
            "tool_results": 2.5,
            "reasoning": 1,
            "temperature": math.nan,
            "max_tokens": 10**12,
        }
    )
    assert f == RequestFeatures()
    assert parse_features({"temperature": math.inf}).temperature is None
    assert parse_features({"temperature": -0.1}).temperature is None
    assert parse_features({"temperature": 0}).temperature == 0.0
    assert parse_features({"max_tokens": 0}).max_tokens is None  # proto3's "not sent"
    assert parse_features(None) == RequestFeatures()
    assert parse_features(["tools", 3]) == RequestFeatures()  # type: ignore[arg-type]
    ok = parse_features({"tools": 4, "turns": 3, "reasoning": False, "temperature": 0.6})
    assert ok == RequestFeatures(tools=4, turns=3, reasoning=False, temperature=0.6)


_junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=5),
    st.lists(st.integers(), max_size=2),
)


_loaded = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow])


@_loaded
@given(
    st.dictionaries(
        st.sampled_from([*RequestFeatures.__slots__, "other"]),
        _junk,
    )
)
def test_any_mapping_parses_and_classifies_without_raising(raw: dict[str, Any]) -> None:
    f = parse_features(raw)
    assert classify(f) in set(SessionClass)
    if f.temperature is not None:
        assert math.isfinite(f.temperature) and f.temperature >= 0
    for n in (f.tools, f.turns, f.tool_calls, f.tool_results, f.max_tokens):
        assert n is None or (isinstance(n, int) and not isinstance(n, bool) and n >= 0)


@_loaded
@given(
    st.integers(0, 64),
    st.integers(1, 200),
    st.floats(0, 2),
    st.integers(1, 1 << 16),
)
def test_tools_always_win_and_a_known_first_request_is_never_unknown(
    tools: int, turns: int, temp: float, cap: int
) -> None:
    f = RequestFeatures(tools=tools, turns=turns, temperature=temp, max_tokens=cap)
    got = classify(f)
    assert got != U
    assert (got == A) == (tools > 0)
    if tools == 0 and turns > 1:
        assert got == C


# -- the advisor ---------------------------------------------------------------------------


def _started(sid: str, **kw: Any) -> pb.BlockEvent:
    return pb.BlockEvent(kind=pb.BLOCK_EVENT_KIND_REQUEST_STARTED, session_id=sid, **kw)


def _apply(advisor: EvictionAdvisor, events: list[pb.BlockEvent]) -> Any:
    b = advisor._backend("e1")
    assert b is not None
    advisor.apply(b, events)
    return b.cache


def test_advisor_derives_the_class_and_the_hint_wins() -> None:
    advisor = EvictionAdvisor(["e1"])
    templ = pb.RequestFeatures(turns=1, temperature=0.0, max_tokens=256)
    cache = _apply(
        advisor,
        [
            _started("tmpl", request=templ),
            _started("agent", request=pb.RequestFeatures(tools=7, turns=1)),
            _started("chat", request=pb.RequestFeatures(turns=1, temperature=0.8)),
            _started("hinted", request=templ, session_class=pb.SESSION_CLASS_CHAT),
            _started("bare"),
        ],
    )
    assert cache.session_class("tmpl") == S
    assert cache.session_class("agent") == A
    assert cache.session_class("chat") == C
    assert cache.session_class("hinted") == C
    assert cache.session_class("bare") == U
    assert advisor.derived == 3


def test_advisor_ignores_implausible_features() -> None:
    advisor = EvictionAdvisor(["e1"])
    bad = pb.RequestFeatures(temperature=math.nan, max_tokens=0, turns=1)
    assert request_features(bad) == RequestFeatures(turns=1)
    cache = _apply(
        advisor,
        [
            _started("nan", request=bad),
            _started("neg", request=pb.RequestFeatures(temperature=-3.0)),
            _started("inf", request=pb.RequestFeatures(temperature=math.inf, turns=1)),
        ],
    )
    assert cache.session_class("nan") == C  # the turn count alone: a first chat request
    assert cache.session_class("neg") == U  # nothing believable left
    assert cache.session_class("inf") == C


class _Aborted(Exception):
    pass


class _Context:
    async def abort(self, code: Any, detail: str) -> None:
        raise _Aborted(code, detail)


async def test_observe_accepts_malformed_features_without_aborting() -> None:
    advisor = EvictionAdvisor(["e1"])

    async def batches() -> Any:
        yield pb.ObserveRequest(
            backend="e1",
            events=[
                _started("s", request=pb.RequestFeatures(temperature=1e300, tools=1 << 31)),
                pb.BlockEvent(kind=pb.BLOCK_EVENT_KIND_INSERTED, block_hash=b"A", session_id="s"),
            ],
        )

    resp = await advisor.Observe(batches(), _Context())
    assert resp.events_applied == 2
    cache = advisor.cache("e1")
    assert cache is not None and cache.session_class("s") == U


# -- the trace generator -------------------------------------------------------------------


def _conv(turns: int) -> list[tuple[int, array]]:
    return [(k % 2, array("I", range(2000 + 100 * k, 2060 + 100 * k))) for k in range(turns)]


def test_every_generated_request_carries_what_its_engine_sees() -> None:
    trace = build_trace(
        Mix("all", 0.3, 0.2, 0.3, 0.2), sessions=40, conversations=[_conv(6)] * 5, seed=4
    )
    assert {r.kind for r in trace} == {"chat", "reasoning", "agent", "single"}
    step: dict[int, int] = {}
    for r in trace:
        f = r.engine
        assert f.known()
        k = step.get(r.session, 0)
        step[r.session] = k + 1
        if r.kind == "agent":
            assert f.tools and f.tools >= 6
            assert f.tool_calls == f.tool_results == k and f.turns == 1 + 2 * k
        else:
            assert f.tools == 0 and f.tool_calls == 0
            assert f.turns == 2 * k + 1
            assert f.reasoning == (r.kind == "reasoning")
        if not r.first:
            assert classify(f) == TRUE_CLASS[r.kind]  # later requests are unambiguous


def test_engine_features_leave_the_trace_unchanged_and_replay_with_every_hint() -> None:
    conv = _conv(4)
    a = build_trace(MIXES["chat"], sessions=30, conversations=[conv] * 3, seed=7)
    b = build_trace(MIXES["chat"], sessions=30, conversations=[conv] * 3, seed=7)
    assert [(r.t, r.blocks, r.engine) for r in a] == [(r.t, r.blocks, r.engine) for r in b]
    for hint in ("tools", "true", "derived", "none"):
        res = replay(a, SaePolicy(hint=hint), 64)
        assert res.requests == len(a)
    with pytest.raises(ValueError, match="hint"):
        SaePolicy(hint="oracle")


def test_the_fleet_workload_is_classified_by_what_its_engines_see() -> None:
    """The fleet's clients send their kind's sampling parameters, so the class an engine
    derives (``harness.sim.block_types.request_features``) is each session's kind."""
    from bench.saecache.fleet import workload
    from harness.sim.block_types import request_features

    plain = workload(40, seed=3)
    assert not any("tools" in body for _, body in plain)
    seen: dict[str, set[SessionClass]] = {}
    for sid, body in workload(40, seed=3, agents=0.5):
        msgs = body["messages"]
        got = classify(request_features(body, msgs, body.get("max_tokens")))
        if "tools" in body:
            kind = A
        elif msgs[0]["role"] == "system":
            kind = C
        else:
            kind = S
        assert got == kind, (sid, body)
        seen.setdefault(sid, set()).add(got)
    assert set().union(*seen.values()) == {A, C, S}
