"""bench._callgrind: self instructions per shared object from a callgrind profile."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from bench._callgrind import CallgrindFormatError, self_cost_by_object

# Shaped like callgrind 3.19's own output (bus_bench's feeder under --separate-threads):
# compressed names defined on first use (also by cob=/cfn=), relative and repeated
# positions, and each call's inclusive cost on the line after calls=.
GOLDEN = """\
# callgrind format
version: 1
creator: callgrind-3.19.0
pid: 8622
part: 1
thread: 1

positions: line
events: Ir
summary: 1180

ob=(61) /usr/lib/python3.11/lib-dynload/_contextvars.cpython-311-x86_64-linux-gnu.so
fl=(78) Modules/_contextvarsmodule.c
fn=(838) _contextvars_copy_context
19 11
cob=(5) /usr/lib/libpython3.11.so.1.0
cfi=(79) Python/context.c
cfn=(842) PyContext_CopyCurrent
calls=11 +83
* 627
* 11

ob=(5)
fl=(79)
fn=(842)
102 600
+3 27
-1

ob=(14) /opt/grpc/_cython/cygrpc.cpython-311-x86_64-linux-gnu.so
fl=(7) src/core/tsi/ssl_transport_security.cc
fn=(38) ssl_seal
1597 500
+7 20
cob=(5)
cfn=(842)
calls=1 1804
* 50
* 11

totals: 1180
"""


def test_golden_profile_splits_by_object_and_sums_to_summary() -> None:
    costs = self_cost_by_object(GOLDEN)
    assert costs == {
        "_contextvars.cpython-311-x86_64-linux-gnu.so": 22,
        "libpython3.11.so.1.0": 627,
        "cygrpc.cpython-311-x86_64-linux-gnu.so": 531,
    }
    assert sum(costs.values()) == 1180


def test_inclusive_cost_of_a_call_is_not_the_callers_own() -> None:
    text = "events: Ir\nob=(1) /a.so\nfn=(1) f\n1 5\ncalls=1 2\n1 1000\n2 7\n"
    assert self_cost_by_object(text) == {"a.so": 12}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("events: Ir\n10 5\n", "line 2: a cost line outside any function"),
        ("events: Ir\nob=(3)\nfn=(1) f\n1 5\n", "line 2: name (3) used before"),
        ("ob=(1) /a.so\nfn=(1) f\ncalls=1 2\n", "ends right after a calls= line"),
        ("ob=(1) /a.so\nfn=(1) f\ncalls=1 2\nfn=(2) g\n1 1\n", "line 4: calls= is not"),
        ("ob=(1) /a.so\nfn=(1) f\n1 lots\n", "line 3: cost 'lots' is not an integer"),
    ],
)
def test_malformed_profiles_name_the_line(text: str, message: str) -> None:
    with pytest.raises(CallgrindFormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        self_cost_by_object(text)


_objects = st.sampled_from(["libpython3.11.so.1.0", "libc.so.6", "cygrpc.so", "orjson.so"])
_fn = st.tuples(
    _objects,
    st.lists(st.integers(0, 10**9), max_size=5),  # own cost lines
    st.lists(st.tuples(_objects, st.integers(0, 10**9)), max_size=3),  # calls: callee, cost
)


@given(st.lists(_fn, max_size=8), st.booleans())
def test_any_profile_callgrind_could_write(fns: list, compress: bool) -> None:
    """Rendered with or without name compression, the per-object sums are the own costs;
    calls' inclusive costs never count."""
    ids: dict[str, int] = {}

    def name(obj: str) -> str:
        if not compress:
            return f"/lib/{obj}"
        if obj in ids:
            return f"({ids[obj]})"
        ids[obj] = len(ids) + 1
        return f"({ids[obj]}) /lib/{obj}"

    lines = ["events: Ir"]
    expected: dict[str, int] = {}
    for k, (obj, own, calls) in enumerate(fns):
        lines += [f"ob={name(obj)}", f"fn=({k}) f{k}"]
        for i, cost in enumerate(own):
            lines.append(f"{'+1' if i else 10} {cost}")
            expected[obj] = expected.get(obj, 0) + cost
        for callee, inclusive in calls:
            lines += [f"cob={name(callee)}", f"cfn=({k}) f{k}", "calls=1 5", f"* {inclusive}"]
    costs = self_cost_by_object("\n".join(lines) + "\n")
    assert {o: c for o, c in costs.items() if c} == {o: c for o, c in expected.items() if c}
