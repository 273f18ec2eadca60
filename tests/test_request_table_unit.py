"""The request table when a rank dies: what a later request that found the rank gone
fails (its own part), and what it leaves alone (a training cell's part that a recovery
from peers kept waiting for the restarted rank).

CI once failed a recovered training cell with the death of a rank the recovery had
already claimed (``test_peer_state``'s second death): an order of the recovery went to
that rank as it died, and the mesh then failed the rank's part of *every* request, the
kept cell's included.
"""

from __future__ import annotations

import pytest

from monarch_kernel.calls.errors import RankDiedError
from monarch_kernel.calls.reply import Reply
from monarch_kernel.controller.state.events import EventBus, RequestKind
from monarch_kernel.controller.state.records import RankInfo, RankState
from monarch_kernel.controller.state.requests import RequestTable

pytestmark = pytest.mark.unit


class Told:
    """A request observer that keeps what it was told."""

    def __init__(self) -> None:
        self.replies: list[Reply] = []
        self.lost: list[tuple[int, str]] = []

    def on_reply(self, reply: Reply) -> None:
        self.replies.append(reply)

    def on_lost(self, rank: int, error: BaseException) -> None:
        self.lost.append((rank, str(error)))


def _table(n: int) -> tuple[RequestTable, list[RankInfo]]:
    ranks = [RankInfo(rank=r, host=0, local_rank=r, coords=(r,)) for r in range(n)]
    for info in ranks:
        info.state = RankState.IDLE
    return RequestTable("m", ranks, EventBus()), ranks


def _died(table: RequestTable, ranks: list[RankInfo], rank: int, keep: frozenset[str]) -> None:
    """What supervision does when ``rank`` dies: mark it, take it out of the requests
    not in ``keep`` and tell their observers."""
    ranks[rank].state = RankState.DEAD
    error = RankDiedError(f"rank {rank} died", None, "m")
    table.lose(rank, table.take_rank(rank, keep), error)


def test_a_request_sent_to_a_dead_rank_fails_its_own_part_only() -> None:
    table, ranks = _table(4)
    cell, cell_told = "cell", Told()
    table.add(cell, [0, 1, 2, 3], cell_told, RequestKind.CELL)
    _died(table, ranks, 3, keep=frozenset({cell}))  # claimed by a recovery
    assert cell_told.lost == []
    assert table.waiting(cell) == {0, 1, 2, 3}

    order, order_told = "order", Told()
    table.add(order, [0, 1, 3], order_told, RequestKind.CALL)
    table.fail_part(order, 3, RankDiedError("rank 3 died", None, "m"))

    assert order_told.lost == [(3, "rank 3 died")]
    assert table.waiting(order) == {0, 1}
    assert cell_told.lost == [], "the kept cell must go on waiting for the new rank 3"
    assert table.waiting(cell) == {0, 1, 2, 3}
    assert ranks[3].outstanding == 0  # the order's count on the dead rank was undone


def test_failing_a_part_that_was_already_taken_or_answered_does_nothing() -> None:
    table, ranks = _table(2)
    told = Told()
    table.add("r", [0, 1], told, RequestKind.CALL)
    _died(table, ranks, 1, keep=frozenset())  # the death was handled after the add
    assert told.lost == [(1, "rank 1 died")]
    table.fail_part("r", 1, RankDiedError("again", None, "m"))
    table.fail_part("gone", 0, RankDiedError("no such request", None, "m"))
    assert told.lost == [(1, "rank 1 died")], "told once"
    assert table.waiting("r") == {0}


def test_the_last_part_failed_completes_the_request() -> None:
    table, ranks = _table(1)
    told = Told()
    ranks[0].state = RankState.DEAD
    table.add("r", [0], told, RequestKind.CELL)
    table.fail_part("r", 0, RankDiedError("rank 0 died", None, "m"))
    assert table.get("r") is None
    assert not table
    assert told.lost == [(0, "rank 0 died")]
