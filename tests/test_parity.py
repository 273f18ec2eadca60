"""Monarch parity: meshes passed to actors, rank-to-rank calls, and Monarch's API names."""

from __future__ import annotations

import os
import socket
import time

import pytest
from helpers import controller_bytes
from parity_actors import AsyncTrainer, Generator, Trainer

from monarch_kernel.actor import ActorError, SliceError, SupervisionError, this_host
from monarch_kernel.actor.meshes import procs_of


@pytest.fixture(scope="module")
def two_meshes():
    """Two separate 2-rank meshes: generators and trainers."""
    gprocs = this_host().spawn_procs(per_host={"gpus": 2}, name="gens")
    tprocs = this_host().spawn_procs(per_host={"gpus": 2}, name="trainers")
    yield gprocs, tprocs
    tprocs.stop()
    gprocs.stop()


@pytest.fixture(scope="module")
def pair(two_meshes):
    gprocs, tprocs = two_meshes
    gens = gprocs.spawn("gen", Generator)
    trainers = tprocs.spawn("trainer", Trainer, gens)  # a mesh as a spawn argument
    return gens, trainers


def test_mesh_passed_to_spawn_is_callable_on_the_other_mesh(pair):
    gens, trainers = pair
    assert trainers.step.call(3).get().values() == [[30, 30], [30, 30]]
    one = trainers.slice(gpus=0).one.call_one(4).get()
    assert one["rank"] == 1 and one["y"] == 40


def test_every_adverb_from_a_rank(pair, two_meshes):
    gens, trainers = pair
    t0 = trainers.slice(gpus=0)
    a0 = two_meshes[1].spawn("async_trainer", AsyncTrainer, gens).slice(gpus=0)
    assert a0.step_async.call_one(2).get() == [20, 20]
    assert t0.stream.call_one(5).get() == [50, 50]
    assert t0.choose.call_one(6).get() == 60
    assert t0.dims.call_one().get() == {"len": 2, "size": 2, "extent": {"gpus": 2}}


def test_generator_and_trainer_call_each_other(pair):
    gens, trainers = pair
    t0 = trainers.slice(gpus=0)
    # trainer 0 hands the generators a reference to the trainer mesh (slice of one)...
    assert t0.wire_back.call_one(trainers.slice(gpus=0)).get() == ["ActorMesh/PeerRequester"] * 2
    # ...and they call back into it, while the trainer calls them.
    versions = trainers.slice(gpus=1).refresh_all.call_one().get()
    assert len(versions) == 2 and all(v >= 1 for v in versions)
    # broadcast from a rank (fire and forget): the generators refresh from trainer 0
    t0.broadcast.call_one().get()
    assert gens.refresh.call().get().values() == [versions[0]] * 2


def test_calls_go_rank_to_rank_not_through_the_controller(pair):
    gens, trainers = pair
    before = controller_bytes(procs_of(gens).runtime)
    trainers.slice(gpus=0).ping_pong.call_one(20).get()
    assert controller_bytes(procs_of(gens).runtime) == before  # no request to the generators' ranks


def test_remote_error_keeps_its_chain(pair):
    gens, trainers = pair
    text = trainers.slice(gpus=0).failing.call_one().get()
    assert text.startswith("ActorError") and "generation failed" in text
    assert "KeyError" in text  # the cause is shown (raise ... from ...)
    with pytest.raises(ActorError) as info:
        gens.fail.call("x").get()
    assert "caused by KeyError: 'x'" in str(info.value)
    assert "direct cause" in str(info.value)
    assert info.value.failures[0]["causes"] == [{"type": "KeyError", "message": "'x'"}]


def test_spawn_on_a_proc_mesh_passed_to_an_actor(pair, two_meshes):
    gprocs, _ = two_meshes
    gens, trainers = pair
    assert trainers.slice(gpus=0).spawn_on.call_one(gprocs).get() == [10, 10]


def test_mesh_returned_to_the_controller_is_its_own_mesh(two_meshes):
    gprocs, _ = two_meshes
    from monarch_kernel.actor.meshes import ActorMesh, rebuild_actor_mesh

    gens = gprocs.spawn("g2", Generator)
    fn, args = gens.__reduce__()
    back = fn(*args)
    assert isinstance(back, ActorMesh) and fn is rebuild_actor_mesh
    assert back.generate.call(1).get().values()[0]["y"] == 10
    assert back.runtime is gprocs.runtime  # the controller's own runtime, not a peer one


def test_stop_returns_a_future_and_size_flatten(two_meshes):
    gprocs, _ = two_meshes
    g = gprocs.spawn("g3", Generator)
    assert gprocs.size() == 2 and gprocs.size("gpus") == 2
    flat = gprocs.flatten("all")
    assert flat.extent == {"all": 2}
    assert g.flatten("x").generate.call(1).get().extent == {"x": 2}
    assert gprocs.slice(gpus=1).flatten("x").ranks() == [1]
    with pytest.raises(SliceError, match="no dimension"):
        flat.slice(gpus=0)
    fut = g.stop()
    assert fut.get() is None
    with pytest.raises(SupervisionError) as info:  # Monarch's error and words
        g.generate.call(1).get()
    assert str(info.value) == (
        "Endpoint call g3.generate() failed, Supervision event: actor gens/g3[0] has status:\n"
        "  stopped: actor 'g3' was stopped (its actor mesh's stop())\n(on rank(s) 0-1 of 2)"
    )
    gprocs.logging_option(stream_to_client=True, aggregate_window_sec=None)


def test_death_of_a_target_fails_the_peer_call(mesh2):
    gens = mesh2.spawn("gdie", Generator)
    tprocs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        trainer = tprocs.spawn("t", Trainer, gens)
        t0 = time.monotonic()
        assert trainer.call_crashing.call_one().get() == "RankDiedError"
        assert time.monotonic() - t0 < 30
    finally:
        tprocs.stop()


def test_hosts_in_per_host_and_bootstrap():
    procs = this_host().spawn_procs(per_host={"hosts": 2, "gpus": 1}, bootstrap=_set_flag)
    try:
        assert procs.extent == {"hosts": 2, "gpus": 1}
        g = procs.spawn("g", _FlagReader)
        assert g.flag.call().get().values() == ["set", "set"]
    finally:
        procs.stop()


def _set_flag() -> None:
    os.environ["MK_BOOTSTRAPPED"] = "set"


from monarch_kernel.actor import Actor, endpoint  # noqa: E402


class _FlagReader(Actor):
    @endpoint
    def flag(self) -> str:
        return os.environ.get("MK_BOOTSTRAPPED", "")


# -- Monarch's runtime helpers -----------------------------------------------------------
from parity_actors import Introspect  # noqa: E402

from monarch_kernel.actor import (  # noqa: E402
    Accumulator,
    Channel,
    context,
    current_actor_name,
    get_or_spawn_controller,
    this_proc,
)


@pytest.fixture(scope="module")
def intro(two_meshes):
    gprocs, _ = two_meshes
    return gprocs.spawn("intro", Introspect, 5)


def test_context_and_actor_name(intro):
    vm = intro.who.call().get()
    first = vm.values()[0]
    assert first["name"] == "gens/intro[0]" and first["born_as"] == "gens/intro[0]"
    assert [v["rank"] for v in vm.values()] == [0, 1]
    assert vm.values()[1]["message_rank"] == {"gpus": 1}
    # called on a slice: the message rank is the point within that slice
    (only,) = intro.slice(gpus=1).who.call().get().values()
    assert only["rank"] == 1 and only["message_rank"] == {}
    (kept,) = intro.slice(gpus=slice(1, 2)).who.call().get().values()
    assert kept["message_rank"] == {"gpus": 0}
    assert current_actor_name() == "client"
    assert context().actor_instance.rank.rank == 0


def test_this_proc_spawn_and_call_on_own_rank(intro):
    assert intro.child.call().get().values() == [[41, [41], True]] * 2


def test_explicit_response_port(intro):
    assert intro.later.call(4).get().values() == [8, 8]
    assert intro.slice(gpus=1).later.call_one(3).get() == 6
    with pytest.raises(ActorError, match="negative: -1"):
        intro.later.call(-1).get()


def test_channel_port_passed_to_actors(intro):
    port, receiver = Channel[tuple[int, int]].open()
    intro.send_to.call(port, 3).get()
    got = sorted(receiver.recv().get(timeout=10) for _ in range(6))
    assert got == [(r, i) for r in (0, 1) for i in range(3)]


def test_accumulator(intro):
    acc: Accumulator[int, int] = Accumulator(intro.value, 100, lambda a, v: a + v)
    assert acc.accumulate().get() == 110


def test_get_or_spawn_controller_is_a_singleton():
    try:
        a = get_or_spawn_controller("ctrl", Introspect, 7).get()
        b = get_or_spawn_controller("ctrl", Introspect, 99).get()
        assert a.value.call_one().get() == 7 and b.value.call_one().get() == 7
        assert len(a) == 1 and this_proc().size() == 1
    finally:
        this_proc().stop()


# -- supervision ---------------------------------------------------------------------------
from parity_actors import Supervisor  # noqa: E402

from monarch_kernel.actor import MeshFailure  # noqa: E402


@pytest.fixture
def tree_meshes():
    meshes = [this_host().spawn_procs(per_host={"gpus": 1}, name=n) for n in ("top", "mid", "leaf")]
    yield meshes
    for m in meshes:
        m.stop()


def _wait(cond, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("mid_handles,top_handles", [(True, False), (False, True), (False, False)])
def test_supervision_tree_three_levels(tree_meshes, hooked, mid_handles, top_handles):
    top_procs, mid_procs, leaf_procs = tree_meshes
    top = top_procs.spawn("sup_top", Supervisor, top_handles)
    top.spawn_child.call(mid_procs, mid_handles, leaf_procs, False).get()
    broken = top.break_grandchild.call()  # the leaf fails under broadcast, from mid
    if mid_handles or top_handles:
        broken.get()
    else:
        # Nobody handles it: top fails too. Its endpoint waits in a call to mid (in
        # ``.get()``), and a supervision event to it that comes meanwhile runs in
        # that wait, as a call from another rank does (and as in Monarch's async
        # actors, test_supervision_tree.py): mid's answer comes long before, but a
        # loaded machine can run top's rank only once both are there. The wait then
        # ends on the answer (``Inbox.pump``'s ``until``); the answer's own thread
        # can still be later than the event: then this call fails, for top's
        # failure, which is what the hook gets below.
        outcome = broken.exception(timeout=60)
        if outcome is not None:
            text = str(outcome)
            assert isinstance(outcome, SupervisionError), text
            assert "top/sup_top[0]" in text and "leaf failed" in text, text
    if mid_handles:
        assert _wait(lambda: top.child_seen.call_one().get() != [[]])
        (mid_seen,) = top.child_seen.call_one().get()
        assert mid_seen[0]["mesh"] == "leaf" and mid_seen[0]["actor"] == "sup_child"
        assert "leaf failed" in mid_seen[0]["message"] and mid_seen[0]["path"] == []
        time.sleep(0.3)
        assert top.seen_failures.call_one().get() == [] and hooked == []
    elif top_handles:
        assert _wait(lambda: top.seen_failures.call_one().get() != [])
        (seen,) = top.seen_failures.call_one().get()
        # unhandled by mid, it is a failure of mid's mesh (caused by the leaf's)
        assert seen["mesh"] == "mid" and seen["actor"] == "sup_child"
        assert "leaf failed" in seen["message"] and seen["path"] == ["mid/sup_child[0]"]
        # mid did not handle it: as in Monarch it failed with it (calls to it say why)
        with pytest.raises(ActorError, match=r"(?s)mid/sup_child\[0\].*did not handle"):
            top.child_seen.call_one().get()
        time.sleep(0.3)
        assert hooked == []
    else:
        assert _wait(lambda: bool(hooked))
        failure = hooked[0]
        assert isinstance(failure, MeshFailure) and failure.mesh_name == "top"
        assert failure.actor_name == "sup_top"
        assert failure.path == ("mid/sup_child[0]", "top/sup_top[0]")
        # Monarch's forms: the top actor failed as it did not handle its child's failure,
        # which did not handle the leaf's; report() names the actor that failed first
        nested = (
            "MeshFailure(mesh_name=top, crashed_ranks=[0], event=Supervision event: actor "
            "top/sup_top[0] failed because it did not handle a supervision event from its "
            "child. The child's event was:\n  Supervision event: actor mid/sup_child[0] "
            "failed because it did not handle a supervision event from its child. The "
            "child's event was:\n    Supervision event: actor leaf/sup_child[0] failed:\n"
            "      Traceback (most recent call last):\n"
        )
        assert str(failure).startswith(nested), str(failure)
        assert str(failure).endswith("      RuntimeError: leaf failed\n)"), str(failure)
        assert failure.report().startswith(
            "The actor leaf/sup_child[0] and all its descendants have failed:\n"
            "  Traceback (most recent call last):\n"
        )


def test_broadcast_failure_reaches_the_hook(two_meshes, hooked):
    gprocs, _ = two_meshes
    g = gprocs.spawn("gfail", Generator)
    g.fail.broadcast("x")
    assert _wait(lambda: len(hooked) >= 2)
    assert {f.rank for f in hooked} == {0, 1}
    assert all(f.mesh_name == "gens" and "generation failed" in f.report() for f in hooked)
    assert all(f.actor_name == "gfail" for f in hooked)


def test_concurrent_endpoints(two_meshes):
    from parity_actors import Concurrent

    gprocs, _ = two_meshes
    c = gprocs.slice(gpus=0).spawn("conc", Concurrent)
    waiting = c.wait_gate.call_one()  # awaits a gate that only the next call opens
    assert c.open_gate.call_one().get(timeout=10) == "opened"
    assert waiting.get(timeout=10) == "released"
    with pytest.raises(ActorError, match="async boom"):
        c.fails.call_one().get(timeout=10)


def test_owner_is_told_of_a_child_rank_death_and_init_failure(tree_meshes, hooked):
    top_procs, _, leaf_procs = tree_meshes
    top = top_procs.spawn("sup_top", Supervisor, True)
    top.spawn_child.call(leaf_procs, False).get()
    top.kill_child.call().get()  # the child's rank dies (os._exit)
    assert _wait(lambda: top.seen_failures.call_one().get() != [])
    (seen,) = top.seen_failures.call_one().get()
    assert seen["type"] == "RankDied" and seen["mesh"] == "leaf" and seen["actor"] == "sup_child"
    assert seen["message"] == (  # Monarch's words, then which rank and host
        f"the process this actor was running on exited with non-zero code 9 (rank 0 on host "
        f"{socket.gethostname()})"
    ), seen
    leaf_procs.runtime.wait_recovered()
    # a constructor that raises: calls to it fail in the owner, and its supervision hears
    assert top.spawn_bad.call_one(leaf_procs).get() == "SupervisionError"
    assert _wait(lambda: len(top.seen_failures.call_one().get()) == 2)
    bad = top.seen_failures.call_one().get()[1]
    assert bad["actor"] == "bad_child" and bad["type"] == "OSError"
    time.sleep(0.3)
    assert hooked == []  # handled by the owner: not at the root


def test_actors_spawned_by_a_rank_come_back_when_it_restarts(tree_meshes, hooked):
    """A restart in place re-creates the actors other ranks spawned on the restarted
    rank (with their owner, who supervises them again); one stopped from a rank is not
    re-created."""
    top_procs, _, leaf_procs = tree_meshes
    top = top_procs.spawn("sup_top", Supervisor, True)
    top.spawn_child.call(leaf_procs, False).get()
    old_pid = leaf_procs.runtime.ranks[0].pid
    report = leaf_procs.restart([0])
    assert leaf_procs.runtime.ranks[0].pid != old_pid
    assert "sup_child" in report.actors, report
    assert top.child_seen.call_one().get(timeout=10) == [[]]  # the owner reaches it
    top.break_child.call().get()
    assert _wait(lambda: top.seen_failures.call_one().get() != [])
    (seen,) = top.seen_failures.call_one().get()
    assert seen["actor"] == "sup_child" and "leaf failed" in seen["message"], seen
    assert hooked == []  # its owner handled it, as before the restart
    assert top.stop_child.call_one().get(timeout=30) == "stopped"
    report = leaf_procs.restart([0])
    assert "sup_child" not in report.actors, report


def test_a_rank_stops_a_proc_mesh_it_was_given(mesh2):
    from parity_actors import Stopper

    victim = this_host().spawn_procs(per_host={"gpus": 1}, name="victim")
    try:
        stopper = mesh2.slice(gpus=0).spawn("stopper", Stopper)
        assert stopper.stop_mesh.call_one(victim).get(timeout=60) == "stopped"
        assert victim.stopped
        with pytest.raises(ActorError, match="cannot stop itself"):
            stopper.stop_mesh.call_one(mesh2).get(timeout=60)
    finally:
        victim.stop()


@pytest.mark.parametrize(
    "n,transport",
    [(1000, "auto"), (1 << 19, "auto"), (1 << 19, "tcp")],
    ids=["socket", "shm", "tcp"],
)
def test_tensor_rank_to_rank_across_meshes(pair, n, transport):
    gens, trainers = pair
    assert trainers.slice(gpus=1).pull_weights.call_one(n, transport).get() == float(n)


def test_monarch_ping_pong_pattern(two_meshes):
    import asyncio

    from parity_actors import PingPong

    gprocs, tprocs = two_meshes
    a = gprocs.spawn("ping_a", PingPong, "a")
    b = tprocs.spawn("ping_b", PingPong, "b")

    async def main() -> None:
        await asyncio.gather(a.init.call(b), b.init.call(a))
        await a.send.call("ping")
        await b.send.call("pong")

    asyncio.run(main())
    assert b.received.call().get().values() == [["a:0 says ping"], ["a:1 says ping"]]
    assert a.received.call().get().values() == [["b:0 says pong"], ["b:1 says pong"]]


def test_call_chain_bouncing_between_two_meshes(two_meshes):
    import asyncio

    from parity_actors import Relay

    gprocs, tprocs = two_meshes
    left = gprocs.slice(gpus=0).spawn("relay_l", Relay)
    right = tprocs.slice(gpus=0).spawn("relay_r", Relay)

    async def main() -> tuple[int, int]:
        await left.remember.call(left)
        await right.remember.call(right)
        await right.bounce.call(9, left)  # right, left, right ... 10 hops
        return await left.seen.call_one(), await right.seen.call_one()

    assert asyncio.run(main()) == (5, 5)


def test_sync_call_cycle_between_two_meshes(pair):
    """Trainer 0 (sync endpoint, blocked in .get()) calls the generators, which call
    trainer 0 back: it serves that call while it waits."""
    gens, trainers = pair
    t0 = trainers.slice(gpus=0)
    t0.wire_back.call_one(t0).get()
    versions = t0.refresh_all.call_one().get(timeout=30)
    assert len(versions) == 2 and versions[0] == versions[1] >= 1


@pytest.mark.unit
def test_value_mesh_monarch_methods():
    from monarch_kernel.actor import ValueMesh
    from monarch_kernel.shape import Shape

    vm = ValueMesh(Shape(("hosts", "gpus"), (2, 3)), list(range(6)))
    assert vm.get(4) == 4 and vm.size() == 6 and vm.size("gpus") == 3
    assert vm.size(["hosts", "gpus"]) == 6 and vm.sizes == {"hosts": 2, "gpus": 3}
    assert vm.slice(hosts=1).values() == [3, 4, 5] and vm.slice(hosts=1).extent == {"gpus": 3}
    assert vm.slice(gpus=slice(1, 3)).values() == [1, 2, 4, 5]
    assert vm.slice(hosts=1).slice(gpus=2).values() == [5]
    assert vm.flatten("all").extent == {"all": 6} and vm.flatten("all").values() == vm.values()
    assert vm.rename(gpus="tp").extent == {"hosts": 2, "tp": 3}


def test_get_or_spawn_controller_from_actors(two_meshes):
    from parity_actors import Registrant, Registry

    gprocs, tprocs = two_meshes
    try:
        a = gprocs.spawn("registrant_a", Registrant)
        b = tprocs.slice(gpus=1).spawn("registrant_b", Registrant)
        first = a.register.call().get().values()
        second = b.register.call_one().get()
        longest = max(first, key=len)
        assert sorted(longest) == [0, 1] and len(second) == 3  # one singleton
        mine = get_or_spawn_controller("registry", Registry).get()
        assert len(mine.add.call_one("controller").get()) == 4
    finally:
        this_proc().stop()
