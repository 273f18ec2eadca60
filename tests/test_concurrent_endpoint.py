"""``@concurrent_endpoint`` as Monarch's: calls overlap (shown by two calls that each
wait for the other), ``explicit_response_port=True``, inherited endpoints, and Monarch's
``ValueError`` for a sync method or a stack over ``@endpoint``."""

from __future__ import annotations

import asyncio

import pytest

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
