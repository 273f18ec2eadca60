"""Actor classes of tests/test_actor_concurrency.py (importable by ranks through sys.path):
two kinds of actor (sync and async endpoints) that call each other on the same ranks,
and endpoints that hold their thread (a blocking wait, a sleep, a Python loop)."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

from monarch_kernel.actor import Actor, current_rank, endpoint

#: Opened by a call to one actor, awaited by another's endpoint on the same rank (one
#: per rank process: module state is shared by the actors of a rank).
_GATES: dict[str, asyncio.Event] = {}


def _gate(name: str) -> asyncio.Event:
    return _GATES.setdefault(name, asyncio.Event())


class SyncCallee(Actor):
    @endpoint
    def g(self, x: int) -> int:
        return x + current_rank().rank

    @endpoint
    def open_gate(self, name: str) -> str:
        _gate(name).set()
        return "opened"


class AsyncCallee(Actor):
    @endpoint
    async def g(self, x: int) -> int:
        await asyncio.sleep(0)
        return x + current_rank().rank

    @endpoint
    async def open_gate(self, name: str) -> str:
        _gate(name).set()
        return "opened"


class SyncCaller(Actor):
    """Calls the other mesh (on the same ranks) on every rank from a sync endpoint."""

    def __init__(self, other: Any) -> None:
        self.other = other

    @endpoint
    def f(self, x: int) -> int:
        return sum(self.other.g.call(x).get(timeout=30).values())


class AsyncCaller(Actor):
    """The same from an async endpoint; also awaits gates and records its calls' order."""

    def __init__(self, other: Any) -> None:
        self.other = other
        self.seen: list[int] = []

    @endpoint
    async def f(self, x: int) -> int:
        return sum((await self.other.g.call(x)).values())

    @endpoint
    async def wait_gate(self, name: str) -> str:
        print(f"waiting at {name}", flush=True)
        await _gate(name).wait()
        _GATES.pop(name, None)
        return "released"

    @endpoint
    async def record(self, i: int) -> list[int]:
        self.seen.append(i)
        await asyncio.sleep(0)
        return list(self.seen)


class Dies(Actor):
    @endpoint
    async def die(self) -> None:
        import os

        print("about to die", flush=True)
        os._exit(7)


#: Set by one actor's endpoint, waited on (blocking, no ``.get()`` nor ``await``) by
#: another's on the same rank.
_EVENTS: dict[str, threading.Event] = {}


def _event(name: str) -> threading.Event:
    return _EVENTS.setdefault(name, threading.Event())


class Blocker(Actor):
    """Sync endpoints that hold their thread: a ``threading.Event`` wait, a sleep, a
    Python loop (what the stop button can interrupt on any thread)."""

    def __init__(self) -> None:
        self.seen: list[int] = []

    @endpoint
    def block(self, name: str, timeout: float = 30.0) -> str:
        print(f"blocking at {name}", flush=True)
        released = _event(name).wait(timeout)
        _EVENTS.pop(name, None)
        return "released" if released else "timed out"

    @endpoint
    def nap(self, seconds: float) -> str:
        print(f"napping {seconds}", flush=True)
        time.sleep(seconds)
        return "rested"

    @endpoint
    def spin(self, name: str, seconds: float = 60.0) -> str:
        """A Python loop (no blocking call): interruptible on any thread at once."""
        print(f"spinning at {name}", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "spun"

    @endpoint
    def spin_without_grad(self, name: str, seconds: float = 60.0) -> str:
        """:meth:`spin` with torch's gradient tracking turned off on this thread (as an
        optimizer step does for a moment): the stop button must not leave it off."""
        import torch

        torch.set_grad_enabled(False)
        print(f"spinning without grad at {name}", flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            pass
        return "spun"

    @endpoint
    def record(self, i: int) -> list[int]:
        self.seen.append(i)
        return list(self.seen)

    @endpoint
    def thread(self) -> str:
        return threading.current_thread().name


class Setter(Actor):
    @endpoint
    def set(self, name: str) -> str:
        _event(name).set()
        return "set"


class AsyncSetter(Actor):
    @endpoint
    async def set(self, name: str) -> str:
        await asyncio.sleep(0)
        _event(name).set()
        return "set"


class AsyncBlocker(Actor):
    """An async endpoint that blocks its thread (the rank's event loop) on an event."""

    @endpoint
    async def block(self, name: str, timeout: float = 30.0) -> str:
        print(f"blocking at {name}", flush=True)
        released = _event(name).wait(timeout)
        _EVENTS.pop(name, None)
        return "released" if released else "timed out"
