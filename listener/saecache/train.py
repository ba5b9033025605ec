"""Train the session predictor: ``python -m listener.saecache.train --data F --out M``.

``--data`` is JSON lines ``{"x": [feature values...], "y": 0 | 1}`` (one per session's
first request; ``bench.saecache.sessions`` writes them from traces, with the text
features of ``predictor.text_features``, or any engine can write its final hidden states
instead). A seeded 80/20 split; binary cross-entropy with Adam, full-batch epochs of
minibatches; the decision threshold is the one with the best accuracy on the training
split. Prints held-out accuracy against the majority-class baseline, the parameter count
and CPU predictions per second (one at a time and in batches of 256), and writes the
model file the listener and ``bench.saecache --predictor`` load.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Sequence
from pathlib import Path

from .predictor import HIDDEN, Predictor, build_mlp

__all__ = ["main", "train"]


def _read(path: Path) -> tuple[list[list[float]], list[int]]:
    xs: list[list[float]] = []
    ys: list[int] = []
    with path.open() as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                x, y = row["x"], row["y"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{path}:{n}: expected {{'x': [...], 'y': 0|1}}: {exc}") from exc
            if y not in (0, 1) or not isinstance(x, list) or (xs and len(x) != len(xs[0])):
                raise ValueError(f"{path}:{n}: bad row (y must be 0 or 1, x of fixed width)")
            xs.append([float(v) for v in x])
            ys.append(int(y))
    if len(xs) < 10:
        raise ValueError(f"{path}: needs at least 10 rows, has {len(xs)}")
    return xs, ys


def train(
    xs: list[list[float]],
    ys: list[int],
    *,
    epochs: int = 40,
    seed: int = 0,
    hidden: int = HIDDEN,
) -> tuple[Predictor, dict[str, float]]:
    """Fit the MLP; returns the predictor and held-out figures."""
    import torch

    torch.manual_seed(seed)
    idx = list(range(len(xs)))
    random.Random(seed).shuffle(idx)
    cut = int(0.8 * len(idx))
    tr, te = idx[:cut], idx[cut:]
    x = torch.tensor(xs, dtype=torch.float32)
    y = torch.tensor(ys, dtype=torch.float32)
    model = build_mlp(x.shape[1], hidden)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-5)
    loss_fn = torch.nn.BCEWithLogitsLoss()
    tr_t = torch.tensor(tr)
    for _ in range(epochs):
        perm = tr_t[torch.randperm(len(tr_t))]
        for i in range(0, len(perm), 128):
            b = perm[i : i + 128]
            opt.zero_grad()
            loss = loss_fn(model(x[b]).squeeze(-1), y[b])
            loss.backward()
            opt.step()
    model.eval()
    with torch.inference_mode():
        p = torch.sigmoid(model(x).squeeze(-1))
    best_t, best_acc = 0.5, -1.0
    for t in [i / 20 for i in range(1, 20)]:
        acc = float(((p[tr_t] >= t).float() == y[tr_t]).float().mean())
        if acc > best_acc:
            best_t, best_acc = t, acc
    te_t = torch.tensor(te)
    held = float(((p[te_t] >= best_t).float() == y[te_t]).float().mean())
    majority = float(y[te_t].mean())
    pred = Predictor(model, x.shape[1], best_t)
    return pred, {
        "train_accuracy": best_acc,
        "test_accuracy": held,
        "majority_baseline": max(majority, 1 - majority),
        "threshold": best_t,
        "rows": float(len(xs)),
    }


def _throughput(pred: Predictor, width: int) -> tuple[float, float]:
    row = [0.1] * width
    pred.probabilities([row])
    n = 2000
    t0 = time.perf_counter()
    for _ in range(n):
        pred.probabilities([row])
    single = n / (time.perf_counter() - t0)
    batch = [row] * 256
    t0 = time.perf_counter()
    for _ in range(50):
        pred.probabilities(batch)
    batched = 50 * 256 / (time.perf_counter() - t0)
    return single, batched


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m listener.saecache.train", description=__doc__)
    ap.add_argument("--data", required=True, help="JSON lines {x, y}")
    ap.add_argument("--out", required=True, help="model file to write")
    ap.add_argument("--epochs", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("error: training needs torch (pip install torch)")
        return 2
    torch.set_num_threads(1)
    try:
        xs, ys = _read(Path(args.data))
    except (OSError, ValueError) as exc:
        print(f"error: {exc}")
        return 2
    pred, figs = train(xs, ys, epochs=args.epochs, seed=args.seed)
    single, batched = _throughput(pred, len(xs[0]))
    torch.save(
        {
            "input_dim": len(xs[0]),
            "hidden": HIDDEN,
            "state_dict": pred.model.state_dict(),
            "threshold": pred.threshold,
            "features": "text_features_v1" if len(xs[0]) == 72 else "custom",
        },
        args.out,
    )
    size = Path(args.out).stat().st_size
    print(
        f"rows {int(figs['rows'])}  held-out accuracy {100 * figs['test_accuracy']:.1f}% "
        f"(majority class {100 * figs['majority_baseline']:.1f}%, "
        f"train {100 * figs['train_accuracy']:.1f}%, threshold {figs['threshold']:.2f})\n"
        f"parameters {pred.parameters}  model file {size} bytes  "
        f"CPU predictions/s: {single:,.0f} one at a time, {batched:,.0f} in batches of 256"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
