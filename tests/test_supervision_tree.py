"""Supervision trees as in Monarch (issue 51): a failed actor's event goes to its owner's
``__supervise__`` (sync, async, async that never awaits), once per failed actor; a
handled failure is invisible to the owner's callers; an unhandled one (False, or a
handler that raises) fails the owner and goes up once; at the root the controller's
``unhandled_fault_hook`` gets each event once, per failed rank, also when it raises."""

from __future__ import annotations

import itertools
import logging

import pytest
from helpers import wait_until
from supervision_actors import (
    AsyncNoAwaitSupervise,
    AsyncSupervise,
    BadInit,
    ErrorActor,
    RaisingSupervise,
    SyncSupervise,
)

import monarch_kernel.actor as actor_api
from monarch_kernel.actor import MeshFailure, SupervisionError, this_host

pytestmark = pytest.mark.local

HANDLERS = [SyncSupervise, AsyncSupervise, AsyncNoAwaitSupervise]
_names = itertools.count()


@pytest.fixture(scope="module")
def two_meshes():
    """The owners' mesh (1 rank) and the children's (2 ranks)."""
    owners = this_host().spawn_procs(per_host={"gpus": 1}, name="owners")
    children = this_host().spawn_procs(per_host={"gpus": 2}, name="children")
    yield owners, children
    children.stop()
    owners.stop()


def _owner(meshes, cls, should_handle=True):
    owners, children = meshes
    return owners.spawn(f"{cls.__name__.lower()}{next(_names)}", cls, children, should_handle)


def _failures_of(owner) -> list[str]:
    return owner.get_failures.call_one().get(timeout=30)


@pytest.mark.parametrize("cls", HANDLERS, ids=lambda c: c.__name__)
def test_handled_failure_is_invisible_to_the_owners_callers(two_meshes, hooked, cls):
    owner = _owner(two_meshes, cls)
    assert owner.subworker_fail.call_one(2).get(timeout=30) == "caught"
    failures = _failures_of(owner)
    assert len(failures) == 2  # one event per failed actor (rank) of the child mesh
    for rank in (0, 1):
        assert any(f"crashed_ranks=[{rank}]" in f and "error_actor" in f for f in failures)
    assert owner.ok.call_one().get(timeout=30) == "ok"  # the owner lives on
    assert hooked == []


@pytest.mark.parametrize("cls", HANDLERS, ids=lambda c: c.__name__)
def test_failure_without_await_reaches_supervise(two_meshes, hooked, cls):
    owner = _owner(two_meshes, cls)
    assert owner.subworker_broadcast_fail.call_one(2).get(timeout=60) == "seen"
    assert len(_failures_of(owner)) == 2
    assert owner.ok.call_one().get(timeout=30) == "ok"
    assert hooked == []


def test_failure_goes_to_the_owner_of_the_mesh_not_the_caller(two_meshes, hooked):
    caller = _owner(two_meshes, SyncSupervise)
    owner = _owner(two_meshes, SyncSupervise)
    mesh = owner.get_mesh.call_one().get(timeout=30)
    assert caller.subworker_fail_on_mesh_ref.call_one(mesh).get(timeout=30) == "caught"
    wait_until(lambda: len(_failures_of(owner)) == 2, timeout=30, what="the owner's events")
    assert _failures_of(caller) == [] and hooked == []


@pytest.mark.parametrize("cls", HANDLERS, ids=lambda c: c.__name__)
def test_unhandled_failure_fails_the_owner_and_reaches_the_hook(two_meshes, hooked, cls):
    owner = _owner(two_meshes, cls, should_handle=False)
    # the owner stays in its endpoint until __supervise__ saw an event: it failed
    # meanwhile, so its caller gets a SupervisionError naming the child
    with pytest.raises(SupervisionError, match=r"(?s)did not handle.*error_actor"):
        owner.subworker_fail.call_one(1).get(timeout=30)
    with pytest.raises(SupervisionError):
        owner.ok.call_one().get(timeout=30)  # later calls too
    wait_until(lambda: len(hooked) >= 2, timeout=30, what="the hook")
    assert len(hooked) == 2  # once per event, each as the owner's (path: the owner)
    assert all(f.mesh_name == "owners" and len(f.path) == 1 for f in hooked), [
        (f.mesh_name, f.path, f.report()) for f in hooked
    ]
    assert all("error_actor" in f.report() for f in hooked)


def test_raising_handler_propagates_once(two_meshes, hooked):
    owner = _owner(two_meshes, RaisingSupervise)
    with pytest.raises(SupervisionError):
        owner.subworker_fail.call_one(1).get(timeout=30)
    wait_until(lambda: len(hooked) >= 2, timeout=30, what="the hook")
    assert len(hooked) == 2, hooked  # once per child event, not once more for the raise
    assert any("the handler failed" in str(f) for f in hooked), [str(f) for f in hooked]
    assert all(f.actor_name == owner.name for f in hooked)


@pytest.mark.parametrize(
    "raises", [None, RuntimeError, SystemExit], ids=["returns", "raises", "exits"]
)
def test_fault_hook_once_per_failed_rank(two_meshes, monkeypatch, caplog, raises):
    """A constructor that raises on both ranks: two events, each given to the hook
    exactly once, also when the hook raises (logged; the controller lives on)."""
    _, children = two_meshes
    calls: list[MeshFailure] = []

    def hook(failure: MeshFailure) -> None:
        calls.append(failure)
        if raises is not None:
            raise raises("the hook refused")

    monkeypatch.setattr(actor_api, "unhandled_fault_hook", hook)
    with caplog.at_level(logging.ERROR):
        bad = children.spawn(f"bad{next(_names)}", BadInit)
    assert sorted(f.rank for f in calls) == [0, 1]
    if raises is not None:
        assert caplog.text.count("unhandled_fault_hook raised") == 2
    with pytest.raises(SupervisionError):
        bad.ok.call().get(timeout=30)
    assert (
        children.spawn(f"ok{next(_names)}", ErrorActor).check.call().get(timeout=30).values()
        == ["healthy"] * 2
    )
