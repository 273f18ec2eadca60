"""Values gathered from a host's ranks through its agent's ``fan_in`` (a call fanned out
to 8 or more ranks of one host): ranks that returned the same bytes share one part, and
the controller still gives each rank a value of its own unless the value is immutable
(``Gather``, ``RequestTable.on_results``)."""

from __future__ import annotations

import pytest

from monarch_kernel.actor import Actor, ActorError, endpoint, this_host
from monarch_kernel.wire import kinds as K

pytestmark = pytest.mark.local

RANKS = 8  # = FANOUT_MIN_RANKS: calls to all of them go through the host agent ...


@pytest.fixture(autouse=True)
def _no_lanes(monkeypatch):
    """... on a mesh without same-machine lanes (with them, calls to fewer than
    ``FANOUT_MIN_RANKS_LANES`` ranks go to each rank directly)."""
    monkeypatch.setenv("MONARCH_KERNEL_LANES", "0")


class Answers(Actor):
    def __init__(self) -> None:
        from monarch_kernel.actor import current_rank

        self.rank = current_rank().rank

    @endpoint
    def same_list(self) -> list[int]:
        return [1, 2, 3]

    @endpoint
    def same_tuple(self) -> tuple[int, str]:
        return (7, "seven")

    @endpoint
    def own(self) -> dict[str, int]:
        return {"rank": self.rank}

    @endpoint
    def odd_fails(self) -> int:
        if self.rank % 2:
            raise ValueError(f"rank {self.rank} says no")
        return self.rank


def test_identical_answers_of_a_hosts_ranks_are_each_ranks_own_unless_immutable():
    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        actors = procs.spawn("answers", Answers)
        inbound = procs.runtime.inbound
        before = inbound.kinds.get(K.FAN_IN, 0)
        lists = actors.same_list.call().get().values()
        assert inbound.kinds.get(K.FAN_IN, 0) > before  # it did come through the agent
        assert lists == [[1, 2, 3]] * RANKS
        lists[0].append(4)  # a mutable value: every rank's is its own object
        assert lists[1] == [1, 2, 3]
        assert len({id(v) for v in lists}) == RANKS

        tuples = actors.same_tuple.call().get().values()
        assert tuples == [(7, "seven")] * RANKS

        owns = actors.own.call().get().values()
        assert owns == [{"rank": r} for r in range(RANKS)]

        # failures keep their per-rank detail (each report is the rank's own bytes)
        with pytest.raises(ActorError) as info:
            actors.odd_fails.call().get()
        assert sorted(info.value.ranks) == [1, 3, 5, 7]
        for f in info.value.failures:
            assert f"rank {f['rank']} says no" in f["message"], f
    finally:
        procs.stop()
