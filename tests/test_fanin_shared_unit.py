"""The controller's side of a ``fan_in`` part: several ranks' identical answer, taken in
one pass (``RequestTable.on_results``) and gathered (``Gather``) with the value
unpickled once when it is immutable, once per rank when it is not.

No processes: the table, its rank records and the gather are real; the parts are fed
by hand, as ``Inbound._on_fan_in`` feeds them."""

from __future__ import annotations

import pickle

import pytest

from monarch_kernel.calls.gather import Each, Gather, One
from monarch_kernel.controller.state.events import (
    EventBus,
    RankStateChanged,
    ReplyReceived,
    RequestFailed,
    RequestKind,
)
from monarch_kernel.controller.state.records import RankInfo, RankState
from monarch_kernel.controller.state.requests import RequestTable
from monarch_kernel.wire import Message
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.serialize import is_immutable

pytestmark = pytest.mark.unit


def _table(n: int) -> tuple[RequestTable, list[RankInfo], list[object]]:
    ranks = [RankInfo(rank=r, host=0, local_rank=r, coords=(r,)) for r in range(n)]
    for info in ranks:
        info.state = RankState.IDLE
    events = EventBus()
    seen: list[object] = []
    events.subscribe(seen.append, ReplyReceived, RequestFailed, RankStateChanged)
    return RequestTable("m", ranks, events), ranks, seen


def _part(value: object, ok: bool = True) -> Message:
    """One ``fan_in`` part as Inbound makes it: one message shared by its ranks."""
    return Message({"k": K.RESULT, "i": "q", "ok": 1 if ok else 0}, pickle.dumps(value, 5))


def _gather(table: RequestTable, ranks: list[int]) -> Gather:
    g = Gather(list(ranks), None, None)
    table.add("q", list(ranks), g, RequestKind.CALL)
    return g


def test_a_mutable_value_is_each_ranks_own_object() -> None:
    table, infos, _ = _table(4)
    g = _gather(table, [0, 1, 2, 3])
    table.on_results([0, 1, 2, 3], "q", _part({"loss": [1.0, 2.0]}))
    values = g.future.get(timeout=5).values()
    assert values == [{"loss": [1.0, 2.0]}] * 4
    assert len({id(v) for v in values}) == 4
    first = values[0]
    assert isinstance(first, dict)
    first["loss"].append(3.0)  # one rank's value changed: the others' are not
    assert values[1] == {"loss": [1.0, 2.0]}


def test_an_immutable_value_is_unpickled_once_and_shared() -> None:
    table, _, _ = _table(3)
    g = _gather(table, [0, 1, 2])
    table.on_results([0, 1, 2], "q", _part(("ok", 7, (1.5, None))))
    values = g.future.get(timeout=5).values()
    assert values == [("ok", 7, (1.5, None))] * 3
    assert values[0] is values[1] is values[2]


def test_parts_of_several_hosts_and_single_replies_fill_one_gather_in_rank_order() -> None:
    table, infos, _ = _table(5)
    g = _gather(table, [0, 1, 2, 3, 4])
    table.on_results([3, 1], "q", _part([1]))  # one host's part, ranks in any order
    table.on_result(4, "q", Message({"k": K.RESULT, "i": "q", "r": 4, "ok": 1}, pickle.dumps(4)))
    assert not g.future.done()
    table.on_results([0, 2], "q", _part("two"))
    assert g.future.get(timeout=5).values() == ["two", [1], "two", [1], 4]
    assert not table and all(i.state is RankState.IDLE and i.outstanding == 0 for i in infos)


def test_a_rank_named_twice_answers_once() -> None:
    table, infos, seen = _table(2)
    g = _gather(table, [0, 1])
    table.on_results([0, 0], "q", _part(None))
    assert not g.future.done() and table.waiting("q") == {1}
    assert infos[0].outstanding == 0 and infos[1].outstanding == 1
    assert [e.rank for e in seen if isinstance(e, ReplyReceived)] == [0]
    table.on_results([1], "q", _part(None))
    assert g.future.get(timeout=5).values() == [None, None]


def test_failures_in_a_part_keep_a_report_per_rank_and_fail_the_gather() -> None:
    table, _, seen = _table(2)
    g = _gather(table, [0, 1])
    report = {"type": "ValueError", "message": "bad", "traceback": "tb\n", "where": ""}
    table.on_results([0, 1], "q", _part(report, ok=False))
    failed = [e for e in seen if isinstance(e, RequestFailed)]
    assert [e.rank for e in failed] == [0, 1]
    assert failed[0].report is not failed[1].report  # each rank's report names it
    assert [e.report["rank"] for e in failed] == [0, 1]
    with pytest.raises(Exception, match="bad"):
        g.future.get(timeout=5)


def test_observers_without_a_batch_method_hear_each_rank() -> None:
    table, _, _ = _table(3)
    each = Each([0, 1, 2])
    table.add("q", [0, 1, 2], each, RequestKind.CALL)
    table.on_results([2, 0, 1], "q", _part([5]))
    got = [f.get(timeout=5) for f in each.in_order_of_answers()]
    assert got == [[5], [5], [5]] and len({id(v) for v in got}) == 3
    one = One(None)
    table.add("r", [1], one, RequestKind.CALL)
    table.on_results([1], "r", Message({"k": K.RESULT, "i": "r", "ok": 1}, pickle.dumps(9)))
    assert one.future.get(timeout=5) == 9


def test_late_and_abandoned_answers_in_a_part() -> None:
    table, infos, _ = _table(3)
    g = _gather(table, [0, 1, 2])
    table.abandon("q", {2}, RuntimeError("given up"))
    assert infos[2].state is RankState.BUSY  # still running it
    table.on_results([0, 1, 2], "q", _part(1))
    assert (infos[2].state, infos[2].outstanding) == (RankState.IDLE, 0)
    with pytest.raises(RuntimeError, match="given up"):
        g.future.get(timeout=5)
    table.on_results([0, 1], "q", _part(1))  # after the request: dropped
    assert all(i.outstanding == 0 for i in infos)


@pytest.mark.parametrize(
    "value, shared",
    [
        (None, True),
        (3, True),
        ("s", True),
        (b"b", True),
        ((1, ("a", 2.5)), True),
        (frozenset({1, 2}), True),
        ([1], False),
        ((1, [2]), False),
        ({"a": 1}, False),
        ({1}, False),
        (bytearray(b"x"), False),
        ((((((1,),),),),), False),  # deeper than is_immutable looks
    ],
)
def test_is_immutable(value: object, shared: bool) -> None:
    assert is_immutable(value) is shared
