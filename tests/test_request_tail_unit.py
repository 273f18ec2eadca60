"""``osutil.request_tail``: what a dead rank's report shows of its log."""

from __future__ import annotations

import pytest

from monarch_kernel.wire.osutil import REQUEST_END, REQUEST_START, request_tail, tail_lines

pytestmark = pytest.mark.unit

START, END = REQUEST_START + "\n", REQUEST_END + "\n"


def _log(tmp_path, *parts: str) -> str:
    path = tmp_path / "rank.log"
    path.write_text("".join(parts))
    return str(path)


def test_a_rank_that_died_in_a_request_shows_only_what_that_request_printed(tmp_path):
    path = _log(tmp_path, START, "old\n", END, START, "step 1\n", "step 2\n")
    assert request_tail(path) == ["step 1", "step 2"]


def test_a_rank_that_died_in_a_silent_request_shows_nothing(tmp_path):
    path = _log(tmp_path, START, "old\n", END, START)
    assert request_tail(path) == []


def test_a_rank_that_died_idle_shows_its_last_lines_without_markers(tmp_path):
    path = _log(tmp_path, "boot\n", START, "a\n", END, START, END, "b\n")
    assert request_tail(path, n=3) == ["boot", "a", "b"]


def test_thousands_of_silent_requests_do_not_hide_the_last_lines_of_an_idle_rank(tmp_path):
    # 5,000 silent calls write ~170 KB of markers after the last output: far more than
    # the first 16 KiB window the tail reads
    lines = [f"line {i}\n" for i in range(30)]
    path = _log(tmp_path, START, *lines, END, (START + END) * 5000)
    assert request_tail(path) == [f"line {i}" for i in range(10, 30)]


def test_the_search_back_is_bounded(tmp_path):
    path = _log(tmp_path, "far back\n", (START + END) * 5000)
    assert request_tail(path, max_bytes=64 * 1024) == []
    assert request_tail(path) == ["far back"]


def test_a_request_that_printed_more_than_the_window_shows_its_last_lines(tmp_path):
    path = _log(tmp_path, START, *(f"{i:06d} " + "x" * 90 + "\n" for i in range(1000)))
    got = request_tail(path)
    assert len(got) == 20
    assert got[-1].startswith("000999")


def test_a_cut_first_line_is_left_out_of_a_tail(tmp_path):
    path = _log(tmp_path, "y" * 100 + "\n", "last\n")
    assert tail_lines(path, max_bytes=20) == ["last"]
    assert tail_lines(str(tmp_path / "missing.log")) == []
