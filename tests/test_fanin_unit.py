"""The host agent's fan-in table on its own (monarch_kernel.wire.fanin): how several
ranks' output and replies to one request become the parts of one message.

No processes: ranks' messages are fed by hand, with a clock the tests move."""

from __future__ import annotations

import pytest

from monarch_kernel.wire.fanin import (
    MAX_PARTS,
    FanIn,
    Part,
    PartError,
    PartKind,
    decode_parts,
    encode_parts,
)

pytestmark = pytest.mark.unit

WINDOW = 0.02


def result(ranks: tuple[int, ...], data: bytes = b"v", ok: bool = True) -> Part:
    return Part(PartKind.RESULT, ranks, data, "", ok)


def line(ranks: tuple[int, ...], text: bytes, name: str = "stdout") -> Part:
    return Part(PartKind.STREAM, ranks, text, name)


def test_identical_replies_become_one_part_sent_when_all_replied() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1, 2])
    fan.result("q", 0, True, b"v", 0.0)
    fan.result("q", 1, True, b"v", 0.001)
    assert fan.due(0.001) == []  # rank 2 still owes its reply, the window is not over
    fan.result("q", 2, True, b"v", 0.002)
    assert fan.due(0.002) == [("q", [result((0, 1, 2))])]
    assert fan.batches == {}  # nothing is waited for: forgotten


def test_different_values_and_failures_keep_their_own_parts() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1, 2, 3])
    fan.result("q", 0, True, b"a", 0.0)
    fan.result("q", 1, False, b"report of 1", 0.0)
    fan.result("q", 2, True, b"a", 0.0)
    fan.result("q", 3, False, b"report of 3", 0.0)
    [(_, parts)] = fan.due(0.0)
    assert parts == [
        result((0, 2), b"a"),
        result((1,), b"report of 1", ok=False),
        result((3,), b"report of 3", ok=False),
    ]


def test_output_collapses_per_host_and_each_rank_keeps_its_order() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1])
    fan.stream("q", 0, "stdout", b"a\n", 0.0)
    fan.stream("q", 0, "stdout", b"b\n", 0.0)
    fan.stream("q", 1, "stdout", b"a\n", 0.0)
    fan.stream("q", 1, "stderr", b"a\n", 0.0)  # another stream: not the same line
    fan.result("q", 0, True, b"v", 0.0)
    # rank 1 prints "b" after its reply: it must not join rank 0's "b" part, which
    # comes before that reply (rank 1's own order holds)
    fan.result("q", 1, True, b"v", 0.0)
    fan.stream("q", 1, "stdout", b"b\n", 0.0)
    [(_, parts)] = fan.due(0.0)
    assert parts == [
        line((0, 1), b"a\n"),
        line((0,), b"b\n"),
        line((1,), b"a\n", "stderr"),
        result((0, 1)),
        line((1,), b"b\n"),  # after rank 1's reply, as it sent them
    ]


def test_window_sends_what_came_and_the_rest_goes_later() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1, 2])
    fan.result("q", 0, True, b"v", 1.0)
    fan.result("q", 1, True, b"v", 1.005)
    assert fan.next_deadline() == pytest.approx(1.0 + WINDOW)
    assert fan.due(1.0 + WINDOW / 2) == []
    assert fan.due(1.0 + WINDOW) == [("q", [result((0, 1))])]
    assert fan.next_deadline() is None  # nothing held: no wake-up needed
    fan.result("q", 2, True, b"v", 5.0)  # the slow one: sent at once (nobody else owes)
    assert fan.due(5.0) == [("q", [result((2,))])]
    assert fan.batches == {}


def test_a_dead_rank_is_not_waited_for() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1])
    fan.result("q", 0, True, b"v", 0.0)
    fan.rank_gone(1)  # the controller names it from the agent's rank_exit
    assert fan.due(0.0) == [("q", [result((0,))])]
    assert fan.batches == {}


def test_what_a_dead_rank_sent_goes_at_once_before_its_death_is_reported() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1, 2])
    fan.result("q", 1, True, b"v", 0.0)  # rank 1 replied, then died: its reply must not
    fan.stream("r", 2, "stdout", b"x", 0.0)  # wait for the window behind its exit report
    assert fan.rank_gone(1) == [("q", [result((1,))])]
    assert fan.batches["q"].waiting == {0, 2} and not fan.batches["q"].parts
    assert "r" in fan.batches  # another rank's batch waits for its window as before


def test_a_reply_sent_directly_is_not_waited_for() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1])
    fan.result("q", 0, True, b"v", 0.0)
    fan.answered_elsewhere("q", 1)
    assert fan.due(0.0) == [("q", [result((0,))])]


def test_take_sends_what_is_held_before_a_message_passed_on() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1])
    fan.stream("q", 0, "stdout", b"x\n", 0.0)
    assert fan.take("q") == [line((0,), b"x\n")]
    assert "q" in fan.batches  # still waiting for both replies
    assert fan.take("other") == []


def test_a_flood_of_parts_is_not_held() -> None:
    fan = FanIn(WINDOW)
    fan.expect("q", [0, 1])
    for i in range(MAX_PARTS):
        fan.stream("q", 0, "stdout", b"%d\n" % i, 0.0)
    [(_, parts)] = fan.due(0.0)
    assert len(parts) == MAX_PARTS


def test_output_of_a_request_not_fanned_out_goes_at_once() -> None:
    fan = FanIn(WINDOW)
    fan.stream("late", 3, "stdout", b"x\n", 0.0)
    assert fan.due(0.0) == [("late", [line((3,), b"x\n")])]


def test_parts_round_trip_and_garbage_is_refused() -> None:
    parts = [line((0, 1), b"a\n"), result((2,), b"\x80\x05K\x00.", ok=False)]
    assert decode_parts(encode_parts(parts)) == parts
    import marshal

    for bad in (b"", b"garbage", marshal.dumps(5), marshal.dumps([(1, 2)])):
        with pytest.raises(PartError):
            decode_parts(bad)
    with pytest.raises(PartError):
        decode_parts(marshal.dumps([(0, ("x",), "stdout", True, b"")]))
    with pytest.raises(PartError):
        decode_parts(marshal.dumps([(9, (0,), "stdout", True, b"")]))
