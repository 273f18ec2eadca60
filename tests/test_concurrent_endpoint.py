"""``@concurrent_endpoint`` as Monarch's: calls overlap (shown by two calls that each
wait for the other), ``explicit_response_port=True``, inherited endpoints, and Monarch's
``ValueError`` for a sync method or a stack over ``@endpoint``; an exception escaping an
endpoint that answers through its port fails the actor (Monarch's rule)."""

from __future__ import annotations

import asyncio

import pytest
from helpers import wait_until

from monarch_kernel.actor import Actor, Port, concurrent_endpoint, endpoint

pytestmark = pytest.mark.local


class Rendezvous(Actor):
    """Two calls of ``meet`` complete only if they run at the same time."""

    def __init__(self) -> None:
        self.arrived: dict[str, asyncio.Event] = {}

    def _event(self, name: str) -> asyncio.Event:
        return self.arrived.setdefault(name, asyncio.Event())

    @concurrent_endpoint
    async def meet(self, me: str, other: str) -> str:
        self._event(me).set()
        await self._event(other).wait()
        return f"{me} met {other}"

    @concurrent_endpoint(explicit_response_port=True)
    async def meet_port(self, port: Port, me: str, other: str) -> None:
        self._event(me).set()
        await self._event(other).wait()
        port.send(f"{me} met {other} (port)")

    @concurrent_endpoint
    async def fail(self) -> None:
        raise KeyError("nope")


class Inherits(Rendezvous):
    """No endpoints of its own: the concurrent ones are inherited."""


@pytest.mark.parametrize("cls", [Rendezvous, Inherits])
def test_two_calls_overlap(mesh2, cls):
    actors = mesh2.spawn(f"meet_{cls.__name__}", cls)
    one = actors.slice(gpus=0)
    first = one.meet.call_one("a", "b")  # waits for the second call to arrive
    second = one.meet.call_one("b", "a")
    assert first.get(timeout=30) == "a met b"
    assert second.get(timeout=30) == "b met a"
    # with explicit_response_port=True, the answer is what the method sends
    first = one.meet_port.call_one("c", "d")
    second = one.meet_port.call_one("d", "c")
    assert first.get(timeout=30) == "c met d (port)"
    assert second.get(timeout=30) == "d met c (port)"
    # on every rank at once
    both = actors.meet.call("e", "f"), actors.meet.call("f", "e")
    assert both[0].get(timeout=30).values() == ["e met f"] * 2
    assert both[1].get(timeout=30).values() == ["f met e"] * 2


def test_an_exception_reaches_the_caller(mesh2):
    from monarch_kernel.actor import ActorError

    actors = mesh2.spawn("meet_fail", Rendezvous)
    with pytest.raises(ActorError, match="KeyError"):
        actors.slice(gpus=0).fail.call_one().get(timeout=30)


def test_monarch_value_errors():
    with pytest.raises(ValueError, match="can only wrap async endpoints"):

        class Sync(Actor):
            @concurrent_endpoint
            def f(self) -> None: ...

    with pytest.raises(ValueError, match="does not wrap @endpoint"):

        class Stacked(Actor):
            @concurrent_endpoint
            @endpoint
            async def f(self) -> None: ...


class Escapes(Actor):
    @concurrent_endpoint(explicit_response_port=True)
    async def boom(self, port: Port, x: int) -> None:
        await asyncio.sleep(0)
        raise ValueError(f"escaped {x}")  # not sent through the port

    @concurrent_endpoint
    async def ok(self) -> int:
        return 1


class SyncEscapes(Actor):
    @endpoint(explicit_response_port=True)
    def boom(self, port: Port, x: int) -> None:
        raise ValueError(f"escaped {x}")

    @endpoint
    def ok(self) -> int:
        return 1


@pytest.mark.parametrize("cls", [Escapes, SyncEscapes])
@pytest.mark.parametrize("where", ["rank", "controller"])
def test_an_exception_escaping_a_port_endpoint_fails_the_actor(mesh2, monkeypatch, cls, where):
    """Monarch's rule: an endpoint that answers through its port and raises instead fails
    the actor: the caller gets a SupervisionError, supervision hears of it, later calls
    raise SupervisionError saying why (in a rank and in the controller's own process)."""
    import monarch_kernel.actor as actor_api
    from monarch_kernel.actor import SupervisionError, this_proc

    hooked: list[object] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", hooked.append)
    procs = mesh2.slice(gpus=0) if where == "rank" else this_proc()
    try:
        actors = procs.spawn("escapes", cls)
        who = f"{procs.name}/escapes[0]"
        with pytest.raises(SupervisionError) as info:
            actors.boom.call_one(1).get(timeout=30)
        text = str(info.value)
        assert text.startswith(
            f"Endpoint call escapes.boom() failed, The actor {who} and all its descendants "
            "have failed:\n  Traceback (most recent call last):\n"
        ) and text.endswith("  ValueError: escaped 1"), text
        wait_until(lambda: hooked, timeout=10, what="the fault hook")
        (failure,) = hooked
        assert str(failure).startswith(
            f"MeshFailure(mesh_name={procs.name}, crashed_ranks=[0], event=Supervision "
            f"event: actor {who} failed:\n  Traceback (most recent call last):\n"
        ) and str(failure).endswith("  ValueError: escaped 1\n)"), str(failure)
        with pytest.raises(SupervisionError) as info:
            actors.ok.call_one().get(timeout=30)
        assert str(info.value) == (
            f"Endpoint call escapes.ok() failed, The actor {who} and all its descendants have "
            f"failed:\n  actor 'escapes' ({cls.__name__}) failed: {cls.__name__}.boom raised "
            "ValueError: escaped 1 without answering through its response port"
        )
    finally:
        if where == "controller":
            this_proc().stop()
