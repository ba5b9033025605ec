"""Accuracy of the session class derived from engine-visible request features.

``python -m bench.saecache.classes`` builds the traces of the robustness grid
(``grid.py``'s evaluation variants and seeds by default) and compares, request by
request, ``listener.saecache.classify.classify(request.engine)`` with the session's true
class (``sim.TRUE_CLASS``). It prints the accuracy per mixture over every request and
over first requests only (where the class matters most: a continuing session is
recognised as multi-turn by the cache itself), and the confusion of first requests.

``--fit`` chooses the classifier's two thresholds (``RuleConfig``) on the *tuning*
traces (``--variants base --seeds 1,2``, the data the policy's constants were chosen
on) by first-request accuracy over a small grid of values, and prints the table it chose
from; never run it on the evaluation grid.
"""

from __future__ import annotations

import argparse
import itertools
from collections import Counter
from collections.abc import Sequence

from bench._table import render_table
from listener.saecache.classify import RuleConfig, classify
from listener.saecache.types import SessionClass

from .grid import EVAL_SEEDS, EVAL_VARIANTS
from .sim import TRUE_CLASS
from .trace import MIXES, VARIANTS, Request, build_trace, load_conversations

__all__ = ["accuracy", "main"]

_TEMPS = (0.0, 0.1, 0.2, 0.3, 0.5, 0.7)
_CAPS = (0, 256, 512, 1024, 2048)


def accuracy(trace: Sequence[Request], cfg: RuleConfig, *, first_only: bool) -> tuple[int, int]:
    """(correct, total) of the derived class against the true one."""
    ok = n = 0
    for r in trace:
        if first_only and not r.first:
            continue
        n += 1
        ok += classify(r.engine, cfg) == TRUE_CLASS[r.kind]
    return ok, n


def _traces(args: argparse.Namespace) -> dict[str, list[list[Request]]]:
    convs = load_conversations(args.records, skip=args.skip)
    out: dict[str, list[list[Request]]] = {}
    for m in args.mixes.split(","):
        out[m] = [
            build_trace(
                MIXES[m],
                sessions=args.sessions,
                conversations=convs,
                seed=int(seed),
                variant=VARIANTS[v],
            )
            for v in args.variants.split(",")
            for seed in args.seeds.split(",")
        ]
    return out


def _pct(ok: int, n: int) -> str:
    return f"{100 * ok / n:.1f}" if n else "-"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.saecache.classes", description=__doc__)
    ap.add_argument("--variants", default=EVAL_VARIANTS)
    ap.add_argument("--seeds", default=EVAL_SEEDS)
    ap.add_argument("--mixes", default="chat,agent,single")
    ap.add_argument("--sessions", type=int, default=120)
    ap.add_argument("--records", type=int, default=1000)
    ap.add_argument("--skip", type=int, default=6000)
    ap.add_argument("--fit", action="store_true", help="choose RuleConfig on these traces")
    args = ap.parse_args(argv)
    traces = _traces(args)
    every = [r for trs in traces.values() for tr in trs for r in tr]
    print(f"traces: variants {args.variants}; seeds {args.seeds}; {args.sessions} sessions each")
    cfg = RuleConfig()
    if args.fit:
        rows = []
        best: tuple[float, RuleConfig] | None = None
        for t, c in itertools.product(_TEMPS, _CAPS):
            cand = RuleConfig(temperature_max=t, max_tokens_max=c)
            ok, n = accuracy(every, cand, first_only=True)
            rows.append([t, c, _pct(ok, n)])
            if best is None or ok / n > best[0]:
                best = (ok / n, cand)
        print(render_table(["temperature_max", "max_tokens_max", "first-request acc %"], rows))
        assert best is not None
        cfg = best[1]
        print(f"chosen: {cfg}")
    rows = []
    for m, trs in traces.items():
        reqs = [r for tr in trs for r in tr]
        firsts = [r for r in reqs if r.first]
        majority = Counter(TRUE_CLASS[r.kind] for r in firsts).most_common(1)[0][1]
        rows.append(
            [
                MIXES[m].name,
                len(reqs),
                _pct(*accuracy(reqs, cfg, first_only=False)),
                len(firsts),
                _pct(*accuracy(firsts, cfg, first_only=True)),
                _pct(majority, len(firsts)),
            ]
        )
    print(
        render_table(
            ["mixture", "requests", "acc %", "first requests", "first acc %", "majority %"],
            rows,
            left=1,
        )
    )
    conf: Counter[tuple[SessionClass, SessionClass]] = Counter()
    for r in every:
        if r.first:
            conf[(TRUE_CLASS[r.kind], classify(r.engine, cfg))] += 1
    names = [SessionClass.CHAT, SessionClass.AGENT, SessionClass.SINGLE, SessionClass.UNKNOWN]
    print("first requests, true class (rows) x derived class (columns):")
    print(
        render_table(
            ["true", *(c.name.lower() for c in names)],
            [[t.name.lower(), *(conf[(t, d)] for d in names)] for t in names[:3]],
            left=1,
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
