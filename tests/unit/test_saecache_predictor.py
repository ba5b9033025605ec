"""Session predictor: features, training, the model file, and no torch for the listener."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from listener.saecache import SessionClass
from listener.saecache.predictor import FEATURES, load_predictor, text_features
from listener.saecache.train import main as train_main


def test_text_features_shape_and_content() -> None:
    f = text_features("You are helpful.", "How do I sort a list?\n```py\nx\n```", 2, False)
    assert len(f) == FEATURES
    assert f == text_features("You are helpful.", "How do I sort a list?\n```py\nx\n```", 2, False)
    assert f[3] == 0.0 and f[4] == 1.0 and f[5] == 1.0  # no tools, code, question
    assert sum(x * x for x in f[8:]) == pytest.approx(1.0)  # bag of words is unit length
    empty = text_features("", "", 1, True)
    assert empty[3] == 1.0 and empty[7] == 1.0 and all(x == 0 for x in empty[8:])


def _write(path: Path, n: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with path.open("w") as fh:
        for _ in range(n):
            y = rng.random() < 0.4
            user = ("please continue the story " if y else "translate this: ") + str(rng.random())
            x = text_features("sys", user, 2, False)
            fh.write(json.dumps({"x": x, "y": int(y)}) + "\n")


def test_train_save_load_and_classify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data, model = tmp_path / "s.jsonl", tmp_path / "m.pt"
    _write(data, 400)
    assert train_main(["--data", str(data), "--out", str(model), "--epochs", "8"]) == 0
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "parameters 84737" in out
    pred = load_predictor(model)
    assert pred.parameters == 84737 <= 1_000_000
    cont = text_features("sys", "please continue the story 0.5", 2, False)
    stop = text_features("sys", "translate this: 0.5", 2, False)
    assert pred.classify(cont) == SessionClass.CHAT
    assert pred.classify(cont, tools=True) == SessionClass.AGENT
    assert pred.classify(stop) == SessionClass.SINGLE
    with pytest.raises(ValueError, match="72 values"):
        pred.probabilities([[0.0] * 5])


def test_bad_training_data_and_model_files(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"x": [1, 2], "y": 1}\n{"x": [1], "y": 0}\n')
    assert train_main(["--data", str(bad), "--out", str(tmp_path / "m.pt")]) == 2
    assert "bad row" in capsys.readouterr().out
    bad.write_text("not json\n")
    assert train_main(["--data", str(bad), "--out", str(tmp_path / "m.pt")]) == 2
    assert "bad.jsonl:1" in capsys.readouterr().out
    import torch

    torch.save({"something": 1}, tmp_path / "x.pt")
    with pytest.raises(ValueError, match="not a session predictor"):
        load_predictor(tmp_path / "x.pt")


def test_listener_does_not_import_torch() -> None:
    code = (
        "import sys, listener.app, listener.saecache, listener.saecache.pruning, "
        "listener.saecache.advisor, listener.saecache.predictor; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
