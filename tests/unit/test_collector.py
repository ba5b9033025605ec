"""The collector's settings for long-running processes (``bus.collector``)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from bus.collector import YOUNG_THRESHOLD, tune_collector


@pytest.fixture
def restored() -> Iterator[None]:
    before = gc.get_threshold()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.usefixtures("restored")
def test_startup_objects_are_frozen_and_young_passes_are_rarer() -> None:
    kept = [{"startup": i} for i in range(100)] + [[i] for i in range(100)]
    _, older, oldest = gc.get_threshold()
    tune_collector()
    assert gc.get_threshold() == (YOUNG_THRESHOLD, older, oldest)
    assert gc.get_freeze_count() >= len(kept)
    body = [[{"role": "user", "content": [i]}] for i in range(2_000)]  # a large request's
    assert gc.get_count()[0] >= 2_000 > 700  # would have run passes at the default
    del body
    assert gc.get_count()[0] < 1_000  # freed by reference counting, no pass needed


@pytest.mark.usefixtures("restored")
def test_rare_cyclic_garbage_is_still_collected() -> None:
    tune_collector(young_threshold=1_000)

    class Node:
        other: object

    collected: list[int] = []
    gc.callbacks.append(lambda phase, info: collected.append(info["collected"]))
    try:
        for _ in range(2_000):
            a, b = Node(), Node()
            a.other, b.other = b, a
    finally:
        gc.callbacks.pop()
    assert sum(collected) > 0
