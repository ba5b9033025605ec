"""Session predictor: features, training, the model file, and no torch for the listener."""

from __future__ import annotations

import contextlib
import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from bus._gen.continuum.listener.v1 import eviction_advisor_pb2 as pb
from listener.saecache import SessionClass
from listener.saecache.advisor import EvictionAdvisor, _InvalidArgument, _validate
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


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    """A model trained once for the module, and what the trainer printed."""
    tmp = tmp_path_factory.mktemp("predictor")
    data, model = tmp / "s.jsonl", tmp / "m.pt"
    _write(data, 400)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert train_main(["--data", str(data), "--out", str(model), "--epochs", "8"]) == 0
    return model, out.getvalue()


def test_train_save_load_and_classify(trained: tuple[Path, str]) -> None:
    model, out = trained
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


def _started(session: str, features: list[float], **kw: object) -> pb.BlockEvent:
    return pb.BlockEvent(
        kind=pb.BLOCK_EVENT_KIND_REQUEST_STARTED,
        session_id=session,
        timestamp=1.0,
        features=features,
        **kw,  # type: ignore[arg-type]
    )


def test_the_advisor_classifies_new_sessions_with_the_loaded_model(
    trained: tuple[Path, str],
) -> None:
    """A new session's REQUEST_STARTED with features and no class guess is routed by the
    predictor; an engine's own guess, a known session and no features are left alone."""
    advisor = EvictionAdvisor(["e1"], predictor=load_predictor(trained[0]))
    cont = text_features("sys", "please continue the story 0.5", 2, False)
    stop = text_features("sys", "translate this: 0.5", 2, False)
    events = [
        _started("a", cont),
        _started("b", stop),
        _started("c", cont, tools=True),
        _started("d", stop, session_class=pb.SESSION_CLASS_CHAT),
        _started("e", []),
    ]
    _validate(events, advisor.predictor)
    backend = advisor._backend("e1")
    assert backend is not None
    advisor.apply(backend, events)
    cache = advisor.cache("e1")
    assert cache is not None
    got = {s: cache.session_class(s) for s in "abcde"}
    assert got == {
        "a": SessionClass.CHAT,
        "b": SessionClass.SINGLE,
        "c": SessionClass.AGENT,
        "d": SessionClass.CHAT,  # the engine's guess wins
        "e": SessionClass.UNKNOWN,  # nothing to predict from
    }
    assert advisor.predictions == 3
    advisor.apply(backend, [_started("b", cont)])  # a returning session: multi-turn now
    assert advisor.predictions == 3


def test_features_of_the_wrong_size_are_invalid_argument(trained: tuple[Path, str]) -> None:
    advisor = EvictionAdvisor(["e1"], predictor=load_predictor(trained[0]))
    with pytest.raises(_InvalidArgument, match="5 features; the session predictor takes 72"):
        _validate([_started("a", [0.0] * 5)], advisor.predictor)
    with pytest.raises(_InvalidArgument, match="finite"):
        _validate([_started("a", [float("nan")] * FEATURES)], advisor.predictor)
    _validate([_started("a", [0.0] * 5)], None)  # no predictor: features are not used


def test_listener_config_checks_the_model_file(tmp_path: Path) -> None:
    from listener.config import ConfigError, parse_listener_config

    base = {"listen": "127.0.0.1:0", "grpc_listen": "127.0.0.1:0", "sources": []}
    with pytest.raises(ConfigError) as err:
        parse_listener_config({**base, "session_predictor": str(tmp_path / "missing.pt")})
    assert any(i.path == "session_predictor" for i in err.value.issues)
    with pytest.raises(ConfigError) as err:
        parse_listener_config(
            {**base, "grpc_listen": None, "session_predictor": str(tmp_path / "m.pt")}
        )
    assert any("requires eviction_advisor and grpc_listen" in i.message for i in err.value.issues)
