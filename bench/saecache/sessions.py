"""Export first requests with their outcome, to train the session predictor.

``python -m bench.saecache.sessions --out FILE.jsonl`` builds traces of every mixture from
ShareGPT records that the evaluation does not use (``--skip`` records, the evaluation's
``--records``, are passed over) and writes one JSON line per session:
``{"x": <text feature vector>, "y": 1 if the session sent another request else 0,
"kind": "chat" | "reasoning" | "agent" | "single"}``. Train with
``python -m listener.saecache.train --data FILE.jsonl --out model.pt``.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from .trace import MIXES, OUT_DIR, build_trace, first_user_texts, load_conversations

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.saecache.sessions", description=__doc__)
    ap.add_argument("--records", type=int, default=3000)
    ap.add_argument("--skip", type=int, default=3000, help="records the evaluation uses")
    ap.add_argument("--sessions", type=int, default=1500, help="sessions per mixture")
    ap.add_argument("--seed", type=int, default=101)
    ap.add_argument("--out", default=str(OUT_DIR / "sessions_train.jsonl"))
    args = ap.parse_args(argv)
    convs = load_conversations(args.records, skip=args.skip)
    firsts = first_user_texts(args.records, skip=args.skip)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    counts: Counter[tuple[str, int]] = Counter()
    with out.open("w") as fh:
        for i, mix in enumerate(MIXES.values()):
            trace = build_trace(
                mix,
                sessions=args.sessions,
                conversations=convs,
                seed=args.seed + i,
                first_texts=firsts,
            )
            n = Counter(r.session for r in trace)
            for r in trace:
                if r.first and r.text_features:
                    y = 1 if n[r.session] > 1 else 0
                    counts[(r.kind, y)] += 1
                    fh.write(json.dumps({"x": r.text_features, "y": y, "kind": r.kind}) + "\n")
    print(
        f"wrote {sum(counts.values())} sessions to {out}: "
        + ", ".join(
            f"{k}/{'continues' if y else 'ends'} {c}" for (k, y), c in sorted(counts.items())
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
