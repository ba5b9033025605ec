"""ConfigReloader never raises: a reload that fails in any way is logged, counted as
rejected, and leaves the running config (and the file watcher) in place."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.config import RouterConfig, parse_config
from router.reload import ConfigReloader


class FakeRouter:
    def __init__(self, fail: bool = False) -> None:
        self.config, _ = parse_config({})
        self.fail = fail
        self.applied: list[RouterConfig] = []

    def apply_config(self, config: RouterConfig) -> None:
        if self.fail:
            raise RuntimeError("a bug while applying")
        self.applied.append(config)
        self.config = config


@pytest.mark.parametrize(
    "content",
    [
        b"selection_strategy: RoundRobin\n# \xe9\n",
        b"\xff\xfe\x00",
        b"selection_strategy: [\n",
        b"",
        b"# nothing but a comment\n",
        b"\n  \n",
    ],
    ids=["latin-1", "binary", "broken-yaml", "empty", "comment", "blank"],
)
def test_an_unreadable_file_is_a_counted_rejection(tmp_path: Path, content: bytes) -> None:
    """An empty file too: it is what a file written in place looks like between its
    truncation and its write, and it would validate as a config without backends."""
    path = tmp_path / "router.yaml"
    path.write_bytes(content)
    outcomes: list[bool] = []
    router = FakeRouter()
    reloader = ConfigReloader(path, router, on_outcome=outcomes.append)
    assert reloader.reload("SIGHUP") is False
    assert outcomes == [False]
    assert router.applied == []


def test_a_failure_while_applying_is_a_counted_rejection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("selection_strategy: RoundRobin\n", encoding="utf-8")
    outcomes: list[bool] = []
    reloader = ConfigReloader(path, FakeRouter(fail=True), on_outcome=outcomes.append)
    assert reloader.reload("file changed") is False
    assert outcomes == [False]
    assert "keeping the running config" in caplog.text


def test_a_good_file_is_a_counted_success(tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    path.write_text("selection_strategy: RoundRobin\n", encoding="utf-8")
    outcomes: list[bool] = []
    router = FakeRouter()
    assert ConfigReloader(path, router, on_outcome=outcomes.append).reload("SIGHUP")
    assert outcomes == [True]
    assert router.config.selection_strategy == "RoundRobin"


def _backends(*names: str) -> bytes:
    return "backends:\n".join(
        [
            "",
            "".join(
                f"  - {{name: {n}, url: 'http://127.0.0.1:9', type: vllm, models: [m]}}\n"
                for n in names
            ),
        ]
    ).encode()


def test_the_watcher_applies_a_change_once_the_file_held_still_for_a_poll(
    tmp_path: Path,
) -> None:
    """A file being rewritten (in place, piece by piece) is not applied half-way: a change
    is reloaded only when one poll later the file still holds the same bytes, and then
    exactly those bytes are applied."""
    path = tmp_path / "router.yaml"
    path.write_bytes(_backends("a", "b"))
    outcomes: list[bool] = []
    router = FakeRouter()
    reloader = ConfigReloader(path, router, on_outcome=outcomes.append)

    path.write_bytes(_backends("a"))  # the first half of a rewrite: valid, but not meant
    assert reloader.poll() is None
    path.write_bytes(_backends("a", "c"))  # the whole new file
    assert reloader.poll() is None  # changed since the last poll: not settled yet
    assert router.applied == []
    assert reloader.poll() is True  # held still for a poll: applied
    assert [b.name for b in router.config.backends] == ["a", "c"]
    assert reloader.poll() is None  # nothing new
    assert outcomes == [True]
