"""Monarch's actor model, the rest: ``Instance.abort()``, ``.flatten()`` of mesh handles
held by actors, actors mixing sync and async endpoints rejected at spawn, ``ValueMesh``'s
``str``/``repr``, and actors' ``__del__`` run when their process mesh stops."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
from helpers import wait_until

import monarch_kernel.actor as actor_api
from monarch_kernel.actor import (
    Actor,
    ActorError,
    context,
    current_rank,
    endpoint,
    host_mesh,
    this_host,
)
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.shape import Shape

pytestmark = pytest.mark.local


class Aborts(Actor):
    @endpoint
    def ok(self) -> int:
        return current_rank().rank

    @endpoint
    def abort_me(self, reason: str) -> None:
        try:
            context().actor_instance.abort(reason)
        except Exception:
            pass


def test_abort_stops_the_actor_and_tells_supervision(mesh2, monkeypatch):
    hooked: list[Any] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", hooked.append)
    actors = mesh2.spawn("aborts", Aborts)
    one = actors.slice(gpus=1)
    with pytest.raises(ActorError, match=r"actor 'aborts' \(Aborts\) aborted: enough"):
        one.abort_me.call_one("enough").get(timeout=30)
    with pytest.raises(ActorError, match=r"aborted: enough"):
        one.ok.call_one().get(timeout=30)  # later calls say why it is gone
    assert actors.slice(gpus=0).ok.call_one().get(timeout=30) == 0  # the rest runs on
    wait_until(lambda: hooked, timeout=10, what="the fault hook")
    assert "aborted: enough" in str(hooked[0])
    with pytest.raises(RuntimeError, match="inside an actor's endpoint"):
        context().actor_instance.abort("from the controller")


class Flattens(Actor):
    @endpoint
    def flat(self, procs, actors) -> dict[str, Any]:
        fp = procs.flatten("x")
        fa = actors.flatten("x")
        return {
            "procs": dict(fp.extent),
            "actors": dict(fa.extent),
            "ranks": fa.ok.call().get().values(),
            "one": fa.slice(x=1).ok.call_one().get(),
        }


def test_flatten_of_handles_held_by_actors(mesh2):
    grid = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 1})
    try:
        targets = grid.spawn("flat_targets", Aborts)
        caller = mesh2.spawn("flattener", Flattens).slice(gpus=0)
        got = caller.flat.call_one(grid, targets).get(timeout=60)
        assert got == {"procs": {"x": 2}, "actors": {"x": 2}, "ranks": [0, 1], "one": 1}
    finally:
        grid.stop()


class Mixed(Actor):
    @endpoint
    def sync_one(self) -> None: ...

    @endpoint
    async def async_one(self) -> None: ...


class AsyncSupervise(Actor):
    @endpoint
    def sync_one(self) -> None: ...

    async def __supervise__(self, failure: Any) -> bool:
        return True


def test_mixing_sync_and_async_endpoints_is_rejected_at_spawn(mesh2):
    with pytest.raises(
        ValueError,
        match=r"mixes both async and sync endpoints.*"
        r"sync: \['sync_one'\] async: \['async_one'\]",
    ):
        mesh2.spawn("mixed", Mixed)
    with pytest.raises(ValueError, match="has sync endpoints, but an async __supervise__"):
        mesh2.spawn("async_supervise", AsyncSupervise)


def test_value_mesh_prints_as_monarch():
    vm = ValueMesh(Shape.from_extent({"hosts": 1, "gpus": 2}), [1, "a"])
    expected = (
        "ValueMesh({hosts: 1, gpus: 2}):\n"
        "  (({'hosts': 0/1, 'gpus': 0/2}, 1), ({'hosts': 0/1, 'gpus': 1/2}, 'a'))"
    )
    assert repr(vm) == str(vm) == expected
    long = ValueMesh(Shape.from_extent({"gpus": 4}), [1, 11, 21, 31])
    assert str(long) == (
        "ValueMesh({gpus: 4}):\n  (({'gpus': 0/4}, 1),\n   ({'gpus': 1/4}, 11),\n"
        "   ({'gpus': 2/4}, 21),\n   ({'gpus': 3/4}, 31))"
    )


class Finalized(Actor):
    def __init__(self, path: str) -> None:
        self.path = path

    @endpoint
    def ready(self) -> bool:
        return True

    def __del__(self) -> None:
        with open(f"{self.path}.{current_rank().rank}", "w") as f:
            f.write("finalized")


def test_finalizers_run_on_stop(tmp_path):
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    base = str(tmp_path / "del")
    try:
        assert procs.spawn("finalized", Finalized, base).ready.call().get().values() == [
            True,
            True,
        ]
    finally:
        procs.stop()
    for r in (0, 1):
        path = f"{base}.{r}"
        wait_until(partial(os.path.exists, path), timeout=10, what=f"rank {r}'s __del__")


def test_a_constructor_failure_shows_under_the_spawning_cell():
    from kernel_client import kernel_with_mesh

    kernel = kernel_with_mesh("m", 2)
    try:
        r = kernel.run(
            "from monarch_kernel.actor import Actor, endpoint, current_rank\n"
            "class Picky(Actor):\n"
            "    def __init__(self):\n"
            "        if current_rank().rank == 1:\n"
            "            raise KeyError('no dataset')\n"
            "    @endpoint\n"
            "    def ok(self):\n"
            "        return 1\n"
            "picky = m.spawn('picky', Picky)\n"
            "'spawned'"
        )
        assert r.text == "'spawned'", r.error_text
        assert "unhandled failure: MeshFailure(mesh_name=m, crashed_ranks=[1]" in r.stderr
        assert "KeyError" in r.stderr and "no dataset" in r.stderr
        r = kernel.run("picky.ok.call().get()")
        assert "SupervisionError" in r.error_text and "Picky.__init__ raised KeyError" in (
            r.error_text
        ), r.error_text
    finally:
        kernel.shutdown_and_check()
