"""Two hangs that now complete or fail clearly: ``get_or_spawn_controller`` awaited in an
async endpoint (also of an actor on the controller's ``this_proc()``, the controller's own
process, where the singleton lives), and an actor whose ``__init__`` never returns after
sending a handle of its process out (as in Monarch it fails after
``actor_spawn_max_idle``, naming its constructor, and later work on its process goes
on)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from monarch_kernel import config
from monarch_kernel.actor import (
    Actor,
    endpoint,
    get_or_spawn_controller,
    shutdown_context,
    this_host,
    this_proc,
)

pytestmark = pytest.mark.local


class Singleton(Actor):
    @endpoint
    async def ping(self) -> str:
        return "pong"


class Asker(Actor):
    @endpoint
    async def ask(self, name: str) -> str:
        ctl = await get_or_spawn_controller(name, Singleton)
        return await ctl.ping.call_one()


@pytest.fixture
def controller_procs():
    yield
    shutdown_context().get(timeout=60)  # this_proc()'s mesh and every other


def test_get_or_spawn_controller_awaited_in_an_endpoint(controller_procs):
    # on this_proc(): an actor of the controller's own process, where the singleton lives
    on_client = this_proc().spawn("asker_here", Asker)
    assert on_client.ask.call_one("ctl_a").get(timeout=60) == "pong"
    # from another mesh, for the same singleton and a new one: both ranks at once
    procs = this_host().spawn_procs(per_host={"gpus": 2})
    askers = procs.spawn("askers", Asker)
    for name in ("ctl_a", "ctl_b"):
        assert list(askers.ask.call(name).get(timeout=60).values()) == ["pong", "pong"]


class Caller(Actor):
    @endpoint
    async def ask(self, target: Any) -> str:
        return await target.ping.call_one()


def test_two_ranks_awaiting_one_async_endpoint_at_once(controller_procs):
    # The second call, served while the first awaited, can end in the very last turn of
    # the target's event loop: its reply (a done callback still queued) must still go.
    target = this_host().spawn_procs(per_host={"gpus": 1}).spawn("target", Singleton)
    callers = this_host().spawn_procs(per_host={"gpus": 2}).spawn("callers", Caller)
    for _ in range(40):
        assert list(callers.ask.call(target).get(timeout=60).values()) == ["pong", "pong"]


class Registry(Actor):
    def __init__(self) -> None:
        self.procs: Any = None

    @endpoint
    def register(self, procs) -> None:
        self.procs = procs

    @endpoint
    def spawn_on_registered(self) -> str:
        child = self.procs.spawn("child", Singleton)
        return child.ping.call_one().get(timeout=30)


class Stuck(Actor):
    def __init__(self, registry) -> None:
        registry.register.call_one(this_proc()).get()  # its handle goes out
        threading.Event().wait()  # and __init__ never returns

    @endpoint
    def ping(self) -> str:
        return "pong"


def test_an_init_that_never_returns_fails_the_actor_clearly(monkeypatch):
    import monarch_kernel.actor as actor_api
    from monarch_kernel.actor import SupervisionError

    faults: list[Any] = []
    monkeypatch.setattr(actor_api, "unhandled_fault_hook", faults.append)
    registry_procs = this_host().spawn_procs(per_host={"gpus": 1})
    procs = this_host().spawn_procs(per_host={"gpus": 1}, grace=1.0)
    try:
        registry = registry_procs.spawn("registry", Registry)
        with config.configured(actor_spawn_max_idle="2s"):
            stuck = procs.spawn("stuck", Stuck, registry)  # returns: the actor failed
        with pytest.raises(
            SupervisionError, match=r"(?s)stuck.*constructor did not return within 2s"
        ):
            stuck.ping.call_one().get(timeout=30)
        assert len(faults) == 1 and "did not return within 2s" in str(faults[0])
        # the handle it sent out: later work on its process goes on (a worker thread)
        assert registry.spawn_on_registered.call_one().get(timeout=60) == "pong"
    finally:
        procs.stop()
        registry_procs.stop()
