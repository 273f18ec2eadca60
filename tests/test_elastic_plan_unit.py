"""Dropping ranks or hosts anywhere, in pure Python: the plan (who leaves, who is
renumbered how, what the report says), the controller's slot maps and a request's
gather following a renumbering."""

from __future__ import annotations

import pytest

from monarch_kernel.calls.gather import Each, Gather
from monarch_kernel.calls.reply import Reply
from monarch_kernel.calls.requester import ActorSpec, MeshRef
from monarch_kernel.controller.elastic.plan import (
    MeshSize,
    ResizeError,
    parse_numbers,
    plan_drop,
    plan_shrink,
)
from monarch_kernel.controller.state.records import HostInfo, MeshRecipe, RankInfo, Slots
from monarch_kernel.shape import Shape
from monarch_kernel.wire import Message

pytestmark = pytest.mark.unit


def test_numbers_take_commas_and_ranges():
    assert parse_numbers("3, 1,2-4", "--drop-ranks") == [1, 2, 3, 4]
    for bad in ("", "a", "1-", "-1", "3-1", "1,,2"):
        with pytest.raises(ResizeError):
            parse_numbers(bad, "--drop-ranks")


def test_dropping_the_middle_host_renumbers_the_last_one():
    plan = plan_drop("m", MeshSize(3, 1, "gpus"), None, "1")
    assert (plan.removed, plan.removed_hosts) == ([1], [1])
    assert plan.renumbering == {0: 0, 2: 1} and plan.host_renumbering == {0: 0, 2: 1}
    assert plan.moved == [(2, 1)] and plan.after == MeshSize(2, 1, "gpus")
    assert plan.report(40, 0.31).describe() == (
        "mesh 'm': world size 3 → 2 at step 40; host 1 (rank 1) dropped; rank 2 → 1 "
        "renumbered; paused 0.31 s, no survivor restarted"
    )


def test_dropping_ranks_of_one_host():
    plan = plan_drop("m", MeshSize(1, 6, "gpus"), "1,3-4", None)
    assert plan.renumbering == {0: 0, 2: 1, 5: 2} and plan.removed_hosts == []
    assert plan.report(None, 0.1).describe() == (
        "mesh 'm': world size 6 → 3; ranks 1, 3-4 dropped; ranks 2 → 1, 5 → 2 renumbered; "
        "paused 0.10 s, no survivor restarted"
    )
    # the last ones only: nobody is renumbered
    plan = plan_drop("m", MeshSize(1, 4, "gpus"), "2-3", None)
    assert plan.moved == [] and "ranks 2-3 dropped; paused" in plan.report(None, 0).describe()


def test_a_mesh_of_several_hosts_drops_whole_hosts():
    size = MeshSize(3, 2, "gpus")
    plan = plan_drop("m", size, "0,1", None)
    assert plan.drop_hosts == (0,) and plan.renumbering == {2: 0, 3: 1, 4: 2, 5: 3}
    assert plan.host_renumbering == {1: 0, 2: 1}
    with pytest.raises(ResizeError, match=r"drop whole hosts \(--drop-hosts 0\)"):
        plan_drop("m", size, "1", None)


@pytest.mark.parametrize(
    "ranks,hosts,minimum,words",
    [
        ("0-3", None, 1, "drops every rank; a mesh keeps at least 1 rank"),
        ("4", None, 1, "has no rank 4 (its ranks are 0-3)"),
        (None, "1", 1, "has no host 1 (its hosts are 0)"),
        ("1,2", None, 3, "leaves 2 rank(s), below the mesh's minimum of 3"),
        (None, None, 1, "give one of --drop-ranks"),
    ],
)
def test_bad_drops_say_what_to_do(ranks, hosts, minimum, words):
    with pytest.raises(ResizeError, match=words.replace("(", r"\(").replace(")", r"\)")):
        plan_drop("m", MeshSize(1, 4, "gpus"), ranks, hosts, minimum)


def test_a_shrink_from_the_end_keeps_its_words_and_its_minimum():
    plan = plan_shrink("m", MeshSize(1, 4, "gpus"), "3", None)
    assert plan.renumbering == {0: 0, 1: 1, 2: 2} and plan.moved == []
    assert "; rank 3 stopped; " in plan.report(5, 0.1).describe()
    with pytest.raises(ResizeError, match="below the mesh's minimum of 4"):
        plan_shrink("m", MeshSize(1, 4, "gpus"), "3", None, minimum=4)


def test_slots_map_wire_ids_to_ranks_and_are_never_given_twice():
    ranks = [RankInfo(r, r, 0, (r, 0)) for r in range(3)]
    hosts = [HostInfo(h) for h in range(3)]
    slots = Slots(ranks, hosts)
    assert slots.rank == {0: 0, 1: 1, 2: 2} and slots.rank_host == {0: 0, 1: 1, 2: 2}
    # host 1 dropped: the third rank (slot 2) is rank 1 on host 1 now
    del ranks[1], hosts[1]
    ranks[1].rank = ranks[1].host = hosts[1].index = 1
    slots.rebuild()
    assert slots.rank == {0: 0, 2: 1} and slots.host == {0: 0, 2: 1}
    assert slots.gone(1, None) and not slots.gone(2, None) and not slots.gone(7, None)
    assert slots.new_rank() == 3 and slots.new_host() == 3


def test_a_gather_and_a_stream_follow_a_renumbering():
    shape = Shape(("gpus",), (3,))
    ranks = [0, 2, 3]
    g = Gather(ranks, shape, None)
    g.renumber({0: 0, 2: 1, 3: 2})
    assert ranks == [0, 2, 3], "the caller's list is not changed"
    for r in (0, 1, 2):
        g.on_reply(Reply(r, Message({"k": "res", "ok": 1}, b"")))
    assert g.future.done() and g.ranks == [0, 1, 2]
    each = Each([1, 3])
    each.renumber({1: 0, 3: 1})
    each.on_reply(Reply(1, Message({"k": "res", "ok": 1}, b"")))
    assert sorted(each._futures) == [0, 1]


def test_a_recipe_and_a_reference_follow_a_renumbering():
    recipe = MeshRecipe()
    recipe.remember_actor(ActorSpec("a", b"", (), frozenset({0, 1, 2})))
    recipe.remember_actor(ActorSpec("b", b"", (), frozenset({1})))
    recipe.renumber({0: 0, 2: 1})
    assert recipe.actors["a"].ranks == frozenset({0, 1}) and "b" not in recipe.actors
    ref = MeshRef("m", "k", (), Shape(("gpus",), (2,)), (0, 2), 1)
    assert [ref.slot(r) for r in range(2)] == [0, 2]
    assert MeshRef("m", "k", (), Shape(("gpus",), (2,))).slot(1) == 1


def test_the_newest_reference_of_a_mesh_wins():
    """Handles unpickled in a process take the newest reference the controller sent;
    one of the same generation is used as given (``this_proc()``'s one-point reference
    never stands in for the whole mesh's)."""
    from monarch_kernel.calls import mesh_refs

    def ref(size: int, generation: int) -> MeshRef:
        return MeshRef("unit-refs", "k", (), Shape(("gpus",), (size,)), (), generation)

    one, whole = ref(1, 0), ref(4, 0)
    assert mesh_refs.newest(one) is one and mesh_refs.newest(whole) is whole
    seen: list[MeshRef] = []
    mesh_refs.subscribe(seen.append)
    shrunk = ref(3, 1)
    assert mesh_refs.publish(shrunk) and not mesh_refs.publish(ref(4, 0))
    assert mesh_refs.newest(whole) is shrunk and seen == [shrunk]
