"""The fault matrix's arithmetic (``tests/faults/record.py``): what counts as lost and
stale against the engines' truth, the percentile, the verdict and the table. The rows
themselves run as ``make faults``, outside the default test run."""

from __future__ import annotations

from tests.faults.record import RowResult, combine, compare, kinds_note, p99, pairs, render_table


def test_lost_and_stale_are_the_two_set_differences() -> None:
    truth = pairs({"sim-1": {"a", "b"}, "sim-2": {"c"}})
    index = pairs({"sim-1": {"a"}, "sim-2": {"c", "d"}})
    c = compare(truth, index)
    assert c.lost == {("b", "sim-1")}
    assert c.stale == {("d", "sim-2")}
    assert (c.lost_count, c.stale_count, c.clean) == (1, 1, False)


def test_entries_beyond_the_keys_asked_about_count_as_stale() -> None:
    same = pairs({"sim-1": {"a"}})
    c = compare(same, same, index_entry_count=3)
    assert c.lost_count == 0 and c.unexplained == 2 and c.stale_count == 2 and not c.clean
    assert compare(same, same, index_entry_count=1).clean
    # An entry count below what was seen (a sweep in between) is not negative staleness.
    assert compare(same, same, index_entry_count=0).stale_count == 0


def test_both_kinds_add_up_in_the_columns_and_stay_apart_in_the_note() -> None:
    prefix = compare(pairs({"sim-1": {"p" * 64}}), set(), index_entry_count=0)
    conv = compare(pairs({"sim-1": {"c" * 32}}), pairs({"sim-1": {"c" * 32}}), 3)
    total = combine({"prefix": prefix, "conversation": conv})
    assert (total.lost_count, total.stale_count, total.held, total.indexed) == (1, 2, 2, 1)
    assert not total.clean
    assert combine({"prefix": conv}).lost_count == 0
    note = kinds_note({"prefix": prefix, "conversation": conv})
    assert note == (
        "prefix keys: lost 1, stale 0 (1 pairs held, 0 indexed); "
        "conversation keys: lost 0, stale 2 (1 pairs held, 1 indexed)"
    )


def test_p99_is_nearest_rank() -> None:
    assert p99([]) is None
    assert p99([5.0]) == 5.0
    samples = [float(i) for i in range(1, 101)]
    assert p99(samples) == 99.0
    assert p99([*samples, 1000.0]) == 100.0


def test_verdict_names_each_missed_target() -> None:
    ok = RowResult("r", "f", 0, 0, 0, 0, 10, recover_s=1.0)
    assert ok.verdict == "ok"
    bad = RowResult("r", "f", 2, 1, 0, 3, 10, recover_s=None)
    assert bad.verdict == "DEFECT: lost, stale, failed, no recovery"
    # Failures nothing could have served are counted but do not fail the row.
    down = RowResult("r", "f", 0, 0, None, 5, 10, failed_unavoidable=True, recover_s=0.1)
    assert down.verdict == "ok"
    assert RowResult("r", "f", error="boom").verdict == "error"


def test_an_expected_loss_is_counted_apart_and_judged_separately() -> None:
    """A row whose fault loses pairs by design (``Row.outage_loss``) shows them in *lost*
    marked expected; only a loss beyond them is a defect."""
    expected = RowResult("r", "f", 0, 0, None, 0, 10, recover_s=1.0, lost_expected=11)
    assert expected.verdict == "ok"
    beyond = RowResult("r", "f", 2, 0, None, 0, 10, recover_s=1.0, lost_expected=11)
    assert beyond.verdict == "DEFECT: lost"
    cells = render_table([expected, beyond]).splitlines()
    assert [line.split("|")[3].strip() for line in cells[2:4]] == [
        "11 (11 expected)",
        "13 (11 expected)",
    ]


def test_table_has_one_line_per_row_and_the_notes() -> None:
    rows = [
        RowResult("a", "kill", 0, 0, 0, 0, 7, recover_s=0.5, p99_added_ms=12.4),
        RowResult(
            "b",
            "kill",
            3,
            0,
            None,
            4,
            9,
            failed_unavoidable=True,
            recover_s=2.0,
            recovered_after_traffic=True,
            notes=["a note"],
        ),
    ]
    text = render_table(rows)
    lines = text.splitlines()
    assert lines[0].split("|")[1].strip() == "row"
    assert "| 0/7 " in lines[2] and "+12 ms" in lines[2] and "0.50 s" in lines[2]
    assert "4/9 (no other)" in lines[3] and "2.00 s (idle)" in lines[3] and "| - " in lines[3]
    assert "DEFECT: lost" in lines[3]
    assert "* b: a note" in text
