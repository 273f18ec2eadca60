"""One set of mesh classes: the same adverb through a notebook-side mesh handle and
through a rank-side one (a mesh handed to an actor) gives identical results and errors;
endpoints named like mesh attributes win on both sides; ranks never load the controller."""

from __future__ import annotations

import pytest
from sides_actors import OPS, Driver, Plain, Shadowing, controller_modules, run

from monarch_kernel.actor import ActorMesh, this_host
from monarch_kernel.actor.peer.requester import PeerRequester
from monarch_kernel.controller.mesh import MeshRuntime

pytestmark = pytest.mark.local


@pytest.fixture(scope="module")
def two_meshes():
    """Targets (2 ranks, one actor of each class) and a driver (1 rank) that is handed
    them; both stopped at the end (orphans are checked then, see conftest)."""
    targets = this_host().spawn_procs(per_host={"gpus": 2}, name="sides_targets")
    drivers = this_host().spawn_procs(per_host={"gpus": 1}, name="sides_driver")
    plain = targets.spawn("plain", Plain)
    shadowing = targets.spawn("shadowing", Shadowing)
    driver = drivers.spawn("driver", Driver)
    yield targets, plain, shadowing, driver
    drivers.stop()
    targets.stop()


@pytest.mark.parametrize("op", sorted(OPS))
def test_same_adverb_same_answer_on_both_sides(two_meshes, op):
    targets, plain, shadowing, driver = two_meshes
    here = run(op, targets, plain, shadowing)
    there = driver.run.call_one(op, targets, plain, shadowing).get(timeout=60)
    assert there == here
    if op.startswith("error_"):
        assert here[0] == "error", f"{op} should fail: {here}"
    else:
        assert here[0] == "ok", f"{op} failed: {here}"


def test_the_rank_side_is_a_peer_requester_and_the_notebook_side_the_runtime(two_meshes):
    targets, plain, _, driver = two_meshes
    assert isinstance(plain._requester, MeshRuntime)
    fn, args = plain.__reduce__()
    back = fn(*args)  # unpickled where the mesh is owned: the controller's runtime again
    assert type(back) is ActorMesh and back._requester is plain._requester
    assert isinstance(PeerRequester(args[0]).reference(), type(args[0]))


def test_shadowing_endpoints_answer_with_their_values(two_meshes):
    _, _, shadowing, _ = two_meshes
    for ep in ("size", "slice", "stop", "name", "flatten"):
        assert list(getattr(shadowing, ep).call().get().values()) == [f"{ep}@0", f"{ep}@1"]
    assert ActorMesh.name(shadowing) == "shadowing" and ActorMesh.size(shadowing) == 2


def test_ranks_never_load_the_controller(two_meshes):
    _, _, _, driver = two_meshes
    # The driver has called the targets' meshes through every adverb by now (module
    # order), and imported monarch_kernel.actor to define its actors.
    assert driver.modules.call_one().get(timeout=30) == []
    assert driver.run.call_one("call", *two_meshes[:3]).get(timeout=30)[0] == "ok"
    assert driver.modules.call_one().get(timeout=30) == []
    assert controller_modules()  # (the notebook side has them: the check sees modules)
