"""Actors and operations of tests/test_mesh_sides.py (importable by ranks through
sys.path): each operation runs the same way on a notebook-side mesh handle and on a
rank-side one, and returns what it saw as plain data."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

from monarch_kernel.actor import Actor, ActorMesh, ProcMesh, current_rank, endpoint


class Plain(Actor):
    """Endpoints with ordinary names."""

    def __init__(self) -> None:
        self.hits = 0

    @endpoint
    def value(self, x: int) -> int:
        return x * 10 + current_rank().rank

    @endpoint
    def bump(self) -> None:
        self.hits += 1

    @endpoint
    def count(self) -> int:
        return self.hits

    @endpoint
    def boom(self, message: str) -> None:
        raise ValueError(message)


class Shadowing(Actor):
    """Endpoints named like attributes of a mesh: the endpoints win."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def _answer(self, what: str) -> str:
        self.seen.append(what)
        return f"{what}@{current_rank().rank}"

    @endpoint
    def size(self) -> str:
        return self._answer("size")

    @endpoint
    def slice(self) -> str:
        return self._answer("slice")

    @endpoint
    def stop(self) -> str:
        return self._answer("stop")

    @endpoint
    def name(self) -> str:
        return self._answer("name")

    @endpoint
    def flatten(self) -> str:
        return self._answer("flatten")

    @endpoint
    def seen_count(self, what: str) -> int:
        return self.seen.count(what)


SHADOWED = ("size", "slice", "stop", "name", "flatten")


def _values(vm: Any) -> list[Any]:
    return list(vm.values())


def _broadcast_then_count(mesh: ActorMesh) -> list[int]:
    before = _values(mesh.count.call().get())
    mesh.bump.broadcast()
    after = _values(mesh.count.call().get())  # FIFO per sender: after the broadcast
    return [a - b for a, b in zip(after, before)]


def _spawn_call_stop(procs: ProcMesh) -> list[Any]:
    extra = procs.spawn("extra", Plain)
    got = _values(extra.value.call(7).get())
    extra.stop().get()
    try:
        extra.value.call(1).get()
    except Exception as exc:  # the stopped actor is gone on every rank
        return [got, type(exc).__name__]
    return [got, "no error"]


#: name -> operation(procs, plain mesh, shadowing mesh) -> plain data
OPS: dict[str, Callable[[ProcMesh, ActorMesh, ActorMesh], Any]] = {
    "call": lambda p, m, s: _values(m.value.call(2).get()),
    "call_on_a_slice": lambda p, m, s: _values(m.slice(gpus=1).value.call(1).get()),
    "call_one": lambda p, m, s: m.slice(gpus=0).value.call_one(3).get(),
    "choose_on_one_rank": lambda p, m, s: m.slice(gpus=1).value.choose(4).get(),
    "choose_any": lambda p, m, s: m.value.choose(0).get() in (0, 1),
    "stream": lambda p, m, s: sorted(f.get() for f in m.value.stream(5)),
    "broadcast": lambda p, m, s: _broadcast_then_count(m),
    "shape": lambda p, m, s: [len(m), m.size(), m.size("gpus"), m.extent, m.ranks()],
    "flatten": lambda p, m, s: [m.flatten("x").extent, _values(m.flatten("x").value.call(0).get())],
    "proc_mesh": lambda p, m, s: [p.name, len(p), p.slice(gpus=1).ranks(), p.extent],
    "spawn_call_stop": lambda p, m, s: _spawn_call_stop(p),
    "error_in_endpoint": lambda p, m, s: m.boom.call("bad input").get(),
    "error_call_one_on_many": lambda p, m, s: m.value.call_one(1),
    "error_no_endpoint": lambda p, m, s: m.nope,
    "error_unpicklable_argument": lambda p, m, s: m.value.call(threading.Lock()),
    "error_bad_slice": lambda p, m, s: m.slice(gpus=5),
    "error_unknown_dim": lambda p, m, s: m.size("hosts"),
}


def _shadow_ops(ep: str) -> dict[str, Callable[[ProcMesh, ActorMesh, ActorMesh], Any]]:
    """Every adverb through endpoint ``ep`` of the shadowing actor."""

    def one_rank(s: ActorMesh, gpus: int) -> Any:
        return getattr(ActorMesh.slice(s, gpus=gpus), ep)

    return {
        f"shadow_{ep}_call": lambda p, m, s: _values(getattr(s, ep).call().get()),
        f"shadow_{ep}_call_one": lambda p, m, s: one_rank(s, 1).call_one().get(),
        f"shadow_{ep}_choose": lambda p, m, s: one_rank(s, 0).choose().get(),
        f"shadow_{ep}_stream": lambda p, m, s: sorted(f.get() for f in getattr(s, ep).stream()),
        f"shadow_{ep}_broadcast": lambda p, m, s: _shadow_broadcast(s, ep),
    }


for _ep in SHADOWED:
    OPS.update(_shadow_ops(_ep))
OPS["shadowed_mesh_attributes_through_the_class"] = lambda p, m, s: [
    ActorMesh.size(s),
    ActorMesh.name(s),
    ActorMesh.slice(s, gpus=1).ranks(),
    ActorMesh.flatten(s, "x").extent,
]


def _shadow_broadcast(mesh: ActorMesh, ep: str) -> list[int]:
    before = _values(mesh.seen_count.call(ep).get())
    getattr(mesh, ep).broadcast()
    after = _values(mesh.seen_count.call(ep).get())
    return [a - b for a, b in zip(after, before)]


def run(op: str, procs: ProcMesh, plain: ActorMesh, shadowing: ActorMesh) -> tuple[Any, ...]:
    """Run ``op``: ``("ok", value)`` or ``("error", type, first line of the message)``."""
    try:
        return ("ok", OPS[op](procs, plain, shadowing))
    except Exception as exc:
        return ("error", type(exc).__name__, str(exc).splitlines()[0])


def controller_modules() -> list[str]:
    """Modules of the controller or the launchers loaded in this process."""
    prefixes = ("monarch_kernel.controller", "monarch_kernel.launchers")
    return sorted(m for m in sys.modules if m.startswith(prefixes))


class Driver(Actor):
    """Runs an operation on mesh handles it was given (the rank side)."""

    @endpoint
    def run(self, op: str, procs: ProcMesh, plain: ActorMesh, shadowing: ActorMesh) -> Any:
        return run(op, procs, plain, shadowing)

    @endpoint
    def modules(self) -> list[str]:
        return controller_modules()
