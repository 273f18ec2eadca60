"""Actor classes of tests/test_actor_lifecycle.py (importable by ranks through sys.path):
actors that note their ``__cleanup__`` (and their children's) in a shared file, owners
of child meshes, actors that fail or exit in every way Monarch reports."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import sys
import time
from typing import Any

from monarch_kernel.actor import Actor, concurrent_endpoint, context, current_rank, endpoint


def note(path: str, text: str) -> None:
    """One line in the shared events file (appends are atomic for short lines)."""
    with open(path, "a") as f:
        f.write(text + "\n")


def events(path: str) -> list[str]:
    try:
        with open(path) as f:
            return f.read().splitlines()
    except FileNotFoundError:
        return []


class ActorExitError(BaseException):
    """Fails the actor that raises it (a BaseException: Monarch's supervision event)."""


class SyncCleanup(Actor):
    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = path, tag

    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: Exception | None) -> None:
        note(self.path, f"{self.tag} cleanup {current_rank().rank} {exc!r}")


class AsyncCleanup(Actor):
    def __init__(self, path: str, tag: str) -> None:
        self.path, self.tag = path, tag

    @endpoint
    async def ping(self) -> str:
        return "pong"

    async def __cleanup__(self, exc: Exception | None) -> None:
        await asyncio.sleep(0.01)
        note(self.path, f"{self.tag} cleanup {current_rank().rank} {exc!r}")


class SyncCleanupDel(SyncCleanup):
    """Notes its ``__del__`` too (after ``__cleanup__``, when its process mesh stops)."""

    def __del__(self) -> None:
        note(self.path, f"{self.tag} del {current_rank().rank}")


class AsyncCleanupDel(AsyncCleanup):
    """Notes its ``__del__`` too (after ``__cleanup__``, when its process mesh stops)."""

    def __del__(self) -> None:
        note(self.path, f"{self.tag} del {current_rank().rank}")


class RaisingCleanup(Actor):
    @endpoint
    def ping(self) -> str:
        return "pong"

    def __cleanup__(self, exc: Exception | None) -> None:
        raise RuntimeError("cleanup refused")


class Parent(Actor):
    """Owns a mesh of ``child`` actors spawned on ``procs``; fails in several ways."""

    @endpoint
    def pid(self) -> int:
        return os.getpid()

    def __init__(self, path: str, procs: Any, child: type, tag: str = "parent") -> None:
        self.path, self.tag = path, tag
        self.children = procs.spawn(f"{tag}_child", child, path, f"{tag}-child")

    @endpoint
    def child_mesh(self) -> Any:
        return self.children

    @endpoint
    def ping_children(self) -> list[str]:
        return self.children.ping.call().get(timeout=30).values()

    @endpoint
    def fail(self) -> None:
        raise ActorExitError("the parent fails")

    @endpoint
    def abort(self, reason: str) -> None:
        context().actor_instance.abort(reason)

    def __cleanup__(self, exc: Exception | None) -> None:
        note(self.path, f"{self.tag} cleanup {current_rank().rank} {exc!r}")


class Exits(Actor):
    """Every way an endpoint ends its actor or its process (sync endpoints)."""

    @endpoint
    def ok(self) -> str:
        return "ok"

    @endpoint
    def base(self) -> None:
        raise ActorExitError("boom")

    @endpoint
    def exit(self, code: int) -> None:
        sys.exit(code)

    @endpoint
    def os_exit(self, code: int) -> None:
        sys.stdout.flush()
        os._exit(code)

    @endpoint
    def segfault(self) -> None:
        ctypes.string_at(0)


class AsyncExits(Actor):
    """The same from ``async def`` endpoints."""

    @endpoint
    async def ok(self) -> str:
        return "ok"

    @endpoint
    async def base(self) -> None:
        raise ActorExitError("boom")

    @endpoint
    async def exit(self, code: int) -> None:
        sys.exit(code)

    @endpoint
    async def os_exit(self, code: int) -> None:
        sys.stdout.flush()
        os._exit(code)

    @endpoint
    async def segfault(self) -> None:
        ctypes.string_at(0)


class SlowInit(Actor):
    """A constructor that does not return for ``seconds`` (on the ranks in ``ranks``)."""

    def __init__(self, seconds: float, ranks: list[int] | None = None) -> None:
        if ranks is None or current_rank().rank in ranks:
            print("constructing slowly", flush=True)
            time.sleep(seconds)

    @endpoint
    def ok(self) -> str:
        return "ok"


class BadInit(Actor):
    def __init__(self, ranks: list[int] | None = None) -> None:
        if ranks is None or current_rank().rank in ranks:
            raise RuntimeError("constructor refused")

    @endpoint
    def ok(self) -> str:
        return "ok"


class Concurrent(Actor):
    """``@concurrent_endpoint`` calls that wait forever (until the actor stops)."""

    def __init__(self, path: str) -> None:
        self.path = path

    @concurrent_endpoint
    async def wait_forever(self, tag: str) -> None:
        note(self.path, f"{tag} started {current_rank().rank}")
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            note(self.path, f"{tag} cancelled {current_rank().rank}")
            raise

    @concurrent_endpoint
    async def who(self) -> str:
        await asyncio.sleep(0)
        return context().actor_instance.name

    @concurrent_endpoint
    async def fail(self) -> None:
        raise KeyError("nope")

    async def __cleanup__(self, exc: Exception | None) -> None:
        note(self.path, f"cleanup {current_rank().rank}")


class ProcOwner(Actor):
    """Starts a process mesh of its own from its rank (it is that mesh's controller),
    with an actor on it; says its process id."""

    def __init__(self, path: str, tag: str) -> None:
        from monarch_kernel.actor import this_host

        self.procs = this_host().spawn_procs(per_host={"gpus": 1}, name=tag)
        self.kids = self.procs.spawn(f"{tag}_kid", SyncCleanup, path, f"{tag}-kid")

    @endpoint
    def pid(self) -> int:
        assert self.kids.ping.call_one().get(timeout=30) == "pong"
        return os.getpid()


class LoopBound(Actor):
    """A queue made in ``__init__``, bound to the actor's event loop by an ordinary
    ``async`` endpoint, then awaited by a ``@concurrent_endpoint`` (Monarch: both run on
    the actor's loop); failures of both kinds of endpoint, and a nap."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[str] = asyncio.Queue()

    @endpoint
    async def prime(self) -> str:
        waiting = asyncio.ensure_future(self.queue.get())  # binds the queue to this loop
        await asyncio.sleep(0)
        self.queue.put_nowait("first")
        return await waiting

    @concurrent_endpoint
    async def take(self) -> str:
        return await self.queue.get()

    @endpoint
    async def put(self, item: str) -> str:
        self.queue.put_nowait(item)
        return "put"

    @endpoint
    async def fail_plain(self) -> None:
        raise KeyError("nope")

    @concurrent_endpoint
    async def fail_concurrent(self) -> None:
        raise KeyError("nope")

    @concurrent_endpoint
    async def nap(self, seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "rested"


class Logs(Actor):
    """Its instance's name, and what its ``logging`` records say."""

    @endpoint
    def instance(self) -> str:
        return str(context().actor_instance)

    @endpoint
    def log(self, prefix: bool) -> list[str]:
        from monarch_kernel import config

        got: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                got.append(record.getMessage())

        config.prefix_python_logs_with_actor = prefix
        logger = logging.getLogger("lifecycle-test")
        keep = Keep()
        logger.addHandler(keep)
        try:
            logger.warning("hello %s", "there")
        finally:
            logger.removeHandler(keep)
            config.prefix_python_logs_with_actor = True
        return got

    @endpoint
    def levels(self) -> tuple[int, list[str]]:
        """The root logger's level here, and which of an INFO and a WARNING record of
        a plain logger get through to a handler."""
        got: list[str] = []

        class Keep(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                got.append(record.levelname)

        keep = Keep()
        root = logging.getLogger()
        root.addHandler(keep)
        try:
            logger = logging.getLogger("lifecycle-levels")
            logger.info("an info record")
            logger.warning("a warning record")
        finally:
            root.removeHandler(keep)
        return root.level, got
