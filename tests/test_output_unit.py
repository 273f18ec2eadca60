"""CellOutput on its own: how rank output lines are collapsed, labelled and grouped.

No processes: lines are fed by hand and ``emit`` collects what would go to the cell.
The module's clock is replaced by one the tests move by hand, and each CellOutput is
taken off the background flusher, so what is emitted (and when) is deterministic.
"""

from __future__ import annotations

import threading
import time

import pytest

from monarch_kernel.kernel import output
from monarch_kernel.kernel.channel import LiveText
from monarch_kernel.kernel.output import (
    COLLAPSE_WINDOW,
    START_SPAN,
    START_WINDOW,
    CellOutput,
)

pytestmark = pytest.mark.unit

#: Comfortably longer than the window a line waits for the same line from other ranks.
PAST_WINDOW = 1.5 * COLLAPSE_WINDOW
#: Past the longer wait for a rank not heard from yet at a cell's start.
PAST_START_WINDOW = 1.5 * START_WINDOW


class Clock:
    """Stands in for the ``time`` module inside monarch_kernel.kernel.output."""

    def __init__(self) -> None:
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:  # the flusher thread still sleeps for real
        time.sleep(seconds)

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    c = Clock()
    monkeypatch.setattr(output, "time", c)
    return c


@pytest.fixture
def make(clock, monkeypatch):
    """``make(ranks, mode, label)`` -> (CellOutput, list of emitted (stream, text)).

    Lines go out as soon as they are ready (no minimum time between two messages: the
    throttle has tests of its own below).
    """
    monkeypatch.setattr(output, "EMIT_BURST", 10**9)

    def make(ranks=(0, 1, 2, 3), mode="collapse", label=True):
        emitted: list[tuple[str, str]] = []
        out = CellOutput(lambda name, text: emitted.append((name, text)), list(ranks), mode, label)
        output._active.discard(out)  # only this test's feed/flush/close emit
        return out, emitted

    return make


def feed_all(out: CellOutput, text: str, ranks=(0, 1, 2, 3), name: str = "stdout") -> None:
    for r in ranks:
        out.feed(r, name, text)


# -- collapse (the default) -----------------------------------------------------------


def test_identical_line_from_all_ranks_is_one_line_at_once(make):
    out, emitted = make()
    feed_all(out, "epoch 1 done\n", ranks=(0, 1, 2))
    assert emitted == []  # rank 3 has not printed it yet (and the window has not passed)
    out.feed(3, "stdout", "epoch 1 done\n")
    assert emitted == [("stdout", "[0-3] epoch 1 done\n")]  # no waiting for the window


def test_differing_lines_are_labelled_per_rank_after_the_window(make, clock):
    out, emitted = make()
    for r in range(4):
        out.feed(r, "stdout", f"loss {r}\n")
    out.flush()
    assert emitted == []  # each could still be matched by another rank
    clock.advance(COLLAPSE_WINDOW / 2)
    out.flush()
    assert emitted == []
    clock.advance(COLLAPSE_WINDOW)
    out.flush()
    # consecutive lines of one stream go out as one message
    assert emitted == [("stdout", "[0] loss 0\n[1] loss 1\n[2] loss 2\n[3] loss 3\n")]


def test_line_from_some_ranks_is_shown_for_them_and_late_ranks_get_their_own(make, clock):
    out, emitted = make()
    feed_all(out, "hello\n", ranks=(0, 1, 3))
    clock.advance(PAST_START_WINDOW)  # rank 2 has shown nothing yet: it may start late
    out.flush()
    assert emitted == [("stdout", "[0-1, 3] hello\n")]
    out.feed(2, "stdout", "hello\n")
    clock.advance(PAST_WINDOW)
    out.flush()
    assert emitted[1:] == [("stdout", "[2] hello\n")]


def test_a_rank_that_starts_the_cell_late_still_joins_the_others_line(make, clock):
    out, emitted = make()
    feed_all(out, "hello\n", ranks=(0, 1, 2))
    clock.advance(PAST_WINDOW)  # longer than the usual window: rank 3 is silent so far
    out.flush()
    assert emitted == []
    out.feed(3, "stdout", "hello\n")
    assert emitted == [("stdout", "[0-3] hello\n")]


def test_a_rank_heard_from_or_a_line_after_the_start_gets_the_usual_window(make, clock):
    out, emitted = make(ranks=(0, 1))
    feed_all(out, "both\n", ranks=(0, 1))
    out.feed(0, "stdout", "only 0\n")
    clock.advance(PAST_WINDOW)  # rank 1 was heard: it is not starting late
    out.flush()
    assert emitted[1:] == [("stdout", "[0] only 0\n")]
    out2, emitted2 = make(ranks=(0, 1))
    clock.advance(START_SPAN)
    out2.feed(0, "stdout", "later\n")
    clock.advance(PAST_WINDOW)
    out2.flush()
    assert emitted2 == [("stdout", "[0] later\n")]


def test_a_complete_line_waits_behind_an_earlier_incomplete_one(make, clock):
    out, emitted = make()
    out.feed(0, "stdout", "only rank 0\n")
    feed_all(out, "everyone\n")
    assert emitted == []  # "everyone" is complete, but order is kept
    clock.advance(PAST_WINDOW)
    out.flush()
    assert emitted == [("stdout", "[0] only rank 0\n[0-3] everyone\n")]


def test_the_same_line_twice_from_each_rank_is_shown_twice(make):
    out, emitted = make()
    feed_all(out, "tick\ntick\n")
    assert emitted == [("stdout", "[0-3] tick\n[0-3] tick\n")]


def test_lines_are_grouped_in_the_order_ranks_print_them(make):
    out, emitted = make()
    out.feed(0, "stdout", "a\nb\n")
    feed_all(out, "a\n", ranks=(1, 2, 3))
    assert emitted == [("stdout", "[0-3] a\n")]
    feed_all(out, "b\n", ranks=(1, 2, 3))
    assert emitted == [("stdout", "[0-3] a\n"), ("stdout", "[0-3] b\n")]


def test_partial_lines_wait_for_their_newline(make, clock):
    out, emitted = make()
    for r in range(4):
        out.feed(r, "stdout", "hel")
    clock.advance(10 * COLLAPSE_WINDOW)
    out.flush()
    assert emitted == []  # not a line yet, however long it waits
    for r in range(4):
        out.feed(r, "stdout", "lo\nwor")
    assert emitted == [("stdout", "[0-3] hello\n")]
    feed_all(out, "ld\n")
    assert emitted[1:] == [("stdout", "[0-3] world\n")]


def test_partial_lines_are_kept_per_rank_and_per_stream(make, clock):
    out, emitted = make(ranks=[0, 1])
    out.feed(0, "stdout", "out-")
    out.feed(0, "stderr", "err\n")
    out.feed(1, "stdout", "other\n")
    out.feed(0, "stdout", "zero\n")
    clock.advance(PAST_WINDOW)
    out.flush()
    assert emitted == [
        ("stderr", "[0] err\n"),
        ("stdout", "[1] other\n[0] out-zero\n"),
    ]


def test_streams_are_collapsed_separately_and_sent_as_separate_messages(make):
    out, emitted = make(ranks=[0, 1])
    for r in (0, 1):
        out.feed(r, "stdout", "same\n")
        out.feed(r, "stderr", "same\n")
    assert emitted == [("stdout", "[0-1] same\n"), ("stderr", "[0-1] same\n")]


def test_stream_changes_split_the_messages_in_order(make, clock):
    out, emitted = make(ranks=[0, 1])
    out.feed(0, "stdout", "a\n")
    out.feed(0, "stderr", "b\n")
    out.feed(0, "stdout", "c\nd\n")
    clock.advance(PAST_START_WINDOW)
    out.flush()
    assert emitted == [
        ("stdout", "[0] a\n"),
        ("stderr", "[0] b\n"),
        ("stdout", "[0] c\n[0] d\n"),
    ]


def test_close_flushes_pending_and_partial_lines_at_once(make):
    out, emitted = make()
    out.feed(2, "stdout", "only rank 2\n")
    feed_all(out, "no newline")
    out.feed(1, "stderr", "half an error")
    assert emitted == []
    out.close()  # no waiting for the window
    assert emitted == [
        ("stdout", "[2] only rank 2\n[0-3] no newline\n"),
        ("stderr", "[1] half an error\n"),
    ]


def test_close_with_nothing_printed_emits_nothing(make):
    out, emitted = make()
    out.feed(0, "stdout", "")
    out.close()
    assert emitted == []


def test_rank_subset_labels_use_global_ranks(make):
    out, emitted = make(ranks=[1, 3])
    out.feed(1, "stdout", "x\n")
    assert emitted == []
    out.feed(3, "stdout", "x\n")
    assert emitted == [("stdout", "[1, 3] x\n")]


def test_without_labels_lines_are_shown_bare(make, clock):
    out, emitted = make(ranks=[0], label=False)
    out.feed(0, "stdout", "plain\n")
    assert emitted == [("stdout", "plain\n")]
    out.feed(0, "stdout", "tail")
    out.close()
    assert emitted[1:] == [("stdout", "tail\n")]


# -- order and rank modes -----------------------------------------------------------------


def test_order_mode_shows_each_line_as_it_arrives(make):
    out, emitted = make(mode="order")
    out.feed(1, "stdout", "same\n")
    assert emitted == [("stdout", "[1] same\n")]
    out.feed(0, "stdout", "same\npart")
    assert emitted[1:] == [("stdout", "[0] same\n")]  # not collapsed with rank 1's
    out.close()
    assert emitted[2:] == [("stdout", "[0] part\n")]


def test_rank_mode_holds_everything_and_shows_one_block_per_rank(make, clock):
    out, emitted = make(mode="rank")
    out.feed(1, "stdout", "a\nb\n")
    out.feed(0, "stdout", "c\n")
    out.feed(1, "stdout", "partial")
    feed_all(out, "same\n", ranks=(2, 3))
    clock.advance(10 * COLLAPSE_WINDOW)
    out.flush()
    assert emitted == []  # nothing until the cell ends
    out.close()
    assert emitted == [
        ("stdout", "[0] c\n[1] a\n[1] b\n[1] partial\n[2] same\n[3] same\n"),
    ]


def test_rank_mode_keeps_streams_apart_within_a_block(make):
    out, emitted = make(ranks=[0, 1], mode="rank")
    out.feed(0, "stdout", "out\n")
    out.feed(0, "stderr", "err\n")
    out.feed(1, "stdout", "out\n")
    out.close()
    assert emitted == [
        ("stdout", "[0] out\n"),
        ("stderr", "[0] err\n"),
        ("stdout", "[1] out\n"),
    ]


def test_unknown_mode_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown output grouping 'lines'; use one of collapse"):
        CellOutput(lambda name, text: None, [0], "lines")


# -- throughput: few messages, nothing lost silently -------------------------------------


def test_a_flood_goes_out_as_few_messages(clock, monkeypatch):
    monkeypatch.setattr(output, "EMIT_BURST", 1)
    monkeypatch.setattr(output, "EMIT_RATE", 100.0)
    emitted: list[tuple[str, str]] = []
    out = CellOutput(lambda name, text: emitted.append((name, text)), [0], "order")
    output._active.discard(out)
    out.feed(0, "stdout", "first\n")
    assert emitted == [("stdout", "[0] first\n")]  # after a quiet spell: at once
    for i in range(1000):
        out.feed(0, "stdout", f"line {i}\n")
    assert len(emitted) == 1  # no message left to send at once: held back ...
    clock.advance(output.EMIT_INTERVAL)
    out.flush()  # ... until the flusher's next turn: one message for all of them
    assert len(emitted) == 2 and emitted[1][1].count("\n") == 1000


def test_output_past_the_rate_is_elided_counted_and_pointed_at_the_logs(clock, monkeypatch):
    monkeypatch.setattr(output, "RATE_BYTES", 100)
    monkeypatch.setattr(output, "BURST_BYTES", 100)
    emitted: list[tuple[str, str]] = []
    out = CellOutput(
        lambda name, text: emitted.append((name, text)), [0], "order", logs="/tmp/x/rank0.log"
    )
    output._active.discard(out)
    for i in range(50):
        out.feed(0, "stdout", f"line {i:04d}\n")  # 14 bytes labelled: 7 fit in 100
    out.close()
    shown = "".join(t for n, t in emitted if n == "stdout").count("\n")
    note = "".join(t for n, t in emitted if n == "stderr")
    assert shown == out.shown == 7 and out.elided == 43
    assert "43 lines elided" in note and "/tmp/x/rank0.log" in note
    clock.advance(10)  # the allowance refills with time
    out2 = CellOutput(lambda name, text: emitted.append((name, text)), [0], "order")
    output._active.discard(out2)
    out2.feed(0, "stdout", "again\n")
    assert emitted[-1] == ("stdout", "[0] again\n")


class GatedChannel:
    """Where a ``LiveText`` sends its block (a ``CellChannel``'s ``display``): records
    each block's text; the first update waits at the gate (a send that is slow to leave)."""

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.gate = threading.Event()
        self.waiting = threading.Event()

    def display(self, data, display_id=None, update=False, metadata=None) -> None:
        if update and not self.waiting.is_set():
            self.waiting.set()
            self.gate.wait(10)
        self.sent.append(data["text/plain"])


def test_a_live_blocks_updates_leave_in_the_order_they_were_made():
    channel = GatedChannel()
    live = LiveText(channel, "[bg cell 1: running]")  # type: ignore[arg-type]
    first = threading.Thread(target=live.emit, args=("stdout", "[0] loop over\n"))
    first.start()  # made the block with the line, now slow to send it
    assert channel.waiting.wait(10)
    last = threading.Thread(target=live.set_title, args=("[bg cell 1: done in 1.0s]",))
    last.start()
    last.join(0.5)  # it may not overtake the block made before it
    channel.gate.set()
    first.join(10)
    last.join(10)
    assert channel.sent[-1] == "[bg cell 1: done in 1.0s]\n[0] loop over"
