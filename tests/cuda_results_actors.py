"""Actors of ``tests/test_cuda_results.py``: a rank that calls ranks of its machine and
reads (or does not read) what they return, and the ranks it calls, which return large
tensors, with host shared memory in CUDA's place (``tests/ipc_host_memory.py``: to the
data plane a CPU tensor is then "on the device")."""

from __future__ import annotations

import gc
import os
import time
from typing import Any

import torch
from cuda_args_actors import BIG, NotHere

from monarch_kernel.actor import Actor, current_rank, endpoint


def _summary(value: dict[str, Any]) -> dict[str, Any]:
    """Per key: the sum, requires_grad, the type's name and the shape."""
    return {
        k: (float(v.detach().sum()), v.requires_grad, type(v).__name__, tuple(v.shape))
        for k, v in value.items()
    }


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _wait_held(count: int, timeout: float = 30.0) -> int:
    """How many tensors this rank's data plane holds, once it is ``count`` (or the
    timeout passed)."""
    from monarch_kernel.rank.dataplane.plane import server

    deadline = time.monotonic() + timeout
    while len(server().tensors) != count and time.monotonic() < deadline:
        time.sleep(0.02)
    return len(server().tensors)


class ResultPeer(Actor):
    def __init__(self) -> None:
        from ipc_host_memory import HostMemory

        from monarch_kernel.rank.dataplane import cuda_ipc

        cuda_ipc.device = HostMemory()
        self.weight = torch.arange(BIG, dtype=torch.float32)

    # -- the rank called ----------------------------------------------------------------
    @endpoint
    def give(self, fail_on: int = -1, unreadable_on: int = -1) -> dict[str, Any]:
        """Large tensors of every kind (its own ``weight`` first, which :meth:`bump`
        changes later), and a small one; fails on rank ``fail_on``; on rank
        ``unreadable_on`` the value cannot be unpickled by the caller (before its
        tensors)."""
        rank = current_rank().rank
        if rank == fail_on:
            raise ValueError("no tensors from this rank")
        first = {"first": NotHere()} if rank == unreadable_on else {}
        return {
            **first,
            "weight": self.weight,
            "param": torch.nn.Parameter(torch.ones(BIG)),
            "grad": torch.full((BIG,), 2.0, requires_grad=True),
            "strided": torch.ones(2 * BIG)[::2],
            "small": torch.ones(16),
        }

    @endpoint
    def give_once(self, path: str) -> dict[str, Any]:
        """:meth:`give`, once ``path`` exists (at most a minute); ``path.started`` says
        the call arrived."""
        with open(f"{path}.started", "w"):
            pass
        deadline = time.monotonic() + 60
        while not os.path.exists(path) and time.monotonic() < deadline:
            time.sleep(0.02)
        return self.give(-1, -1)

    @endpoint
    def bump(self) -> None:
        self.weight.add_(1.0)

    @endpoint
    def kept(self) -> dict[str, int]:
        """What this rank's data plane holds, and how many results it sent by handle."""
        from monarch_kernel.rank.dataplane.common import counters_
        from monarch_kernel.rank.dataplane.plane import server

        return {"held": len(server().tensors), "sent": counters_["ipc_results"]}

    @endpoint
    def held_once(self, count: int) -> int:
        return _wait_held(count)

    # -- the caller ---------------------------------------------------------------------
    @endpoint
    def fetch(self, other: Any, how: str) -> dict[str, Any]:
        """Call ``other.give`` ``how`` and read it; its ``weight`` is changed on the
        called rank before this reads the reply (it must see it as it was returned)."""
        from monarch_kernel.rank.dataplane.common import counters_

        before = counters_["bytes_in"]
        if how == "call_one":
            future = other.give.call_one()
        elif how == "call":
            future = other.give.call()
        elif how == "choose":
            future = other.give.choose()
        elif how == "stream":
            future = next(iter(other.give.stream()))
        else:
            raise ValueError(how)
        while not future.done():
            time.sleep(0.01)
        other.bump.call_one().get(timeout=60)  # after the reply came, before it is read
        value = future.get(timeout=60)
        if how == "call":
            value = value.values()[0]
        return {"seen": _summary(value), "bytes_in": counters_["bytes_in"] - before}

    @endpoint
    def fetch_unread(self, other: Any, how: str, held: int) -> int:
        """Call ``other.give`` ``how``, let the replies arrive and drop them unread; how
        many tensors ``other`` holds once it holds ``held`` again (or 30 s passed). The
        cyclic garbage collector is off meanwhile: a dropped future must let its replies
        go at once, not at the collector's next run."""
        gc.disable()
        try:
            future = other.give.call_one() if how == "call_one" else other.give.call()
            while not future.done():
                time.sleep(0.01)
            del future
            return other.held_once.call_one(held).get(timeout=60)
        finally:
            gc.enable()

    @endpoint
    def fetch_unreadable(self, others: Any, unreadable_on: int, held: list[int]) -> Any:
        """A gathered call whose value from rank ``unreadable_on`` cannot be unpickled:
        the read stops there, and the values of the others are never read. What it
        raised, and how many tensors each of ``others`` holds once it holds ``held`` (its
        count before) again, with the cyclic collector off meanwhile (the error's
        traceback must not keep them)."""
        gc.disable()
        try:
            try:
                others.give.call(-1, unreadable_on).get(timeout=60)
                text = "no error"
            except Exception as exc:
                text = f"{type(exc).__name__}: {exc}"
            counts = [
                others.slice(gpus=i).held_once.call_one(n).get(timeout=60)
                for i, n in enumerate(held)
            ]
            return text, counts
        finally:
            gc.enable()

    @endpoint
    def fetch_failing(self, others: Any, fail_on: int) -> str:
        """A gathered call in which rank ``fail_on`` fails: the others' replies are
        never read."""
        try:
            others.give.call(fail_on).get(timeout=60)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    @endpoint
    def call_and_die(self, other: Any, path: str) -> None:
        """Call ``other.give_once(path)`` and die once it runs, before it answers (not
        at once: the call must leave this process first)."""
        other.give_once.call_one(path)
        deadline = time.monotonic() + 60
        while not os.path.exists(f"{path}.started") and time.monotonic() < deadline:
            time.sleep(0.02)
        os._exit(3)

    @endpoint
    def fetch_and_die(self, other: Any) -> None:
        """Call ``other.give``, let the reply arrive unread, and die with it."""
        future = other.give.call_one()
        while not future.done():
            time.sleep(0.01)
        os._exit(3)

    @endpoint
    def fetch_after_death(self, other: Any) -> str:
        """Call ``other.give``, let the reply arrive, have ``other`` die, then read it:
        what the read raised."""
        future = other.give.call_one()
        while not future.done():
            time.sleep(0.01)
        pid = other.pid.call_one().get(timeout=60)
        other.die.call_one()
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.02)
        try:
            future.get(timeout=60)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    @endpoint
    def die(self) -> None:
        os._exit(4)

    @endpoint
    def pid(self) -> int:
        return os.getpid()
