"""Actor classes of tests/test_supervision_tree.py (importable by ranks through
sys.path), after Monarch's own supervision tests: an owner of a child mesh that fails,
with each form of ``__supervise__``."""

from __future__ import annotations

import asyncio
from typing import Any

from monarch_kernel.actor import Actor, SupervisionError, endpoint


class ActorFailureError(BaseException):
    """Fails the actor that raises it (a BaseException: the actor stops, Monarch's
    supervision event)."""


class ErrorActor(Actor):
    @endpoint
    async def fail_with_supervision_error(self) -> None:
        raise ActorFailureError("simulated actor failure for supervision")

    @endpoint
    async def check(self) -> str:
        return "healthy"


class _Owner(Actor):
    """Owns an ``ErrorActor`` mesh spawned on the procs it is given."""

    def __init__(self, procs: Any, should_handle: bool = True) -> None:
        self.mesh = procs.spawn("error_actor", ErrorActor)
        self.failures: list[Any] = []
        self.should_handle = should_handle

    @endpoint
    async def subworker_fail(self, wait_for: int = 0) -> str:
        """Call the child mesh, which fails (caught here); with ``wait_for``, stay in
        the endpoint until that many failures reached ``__supervise__``."""
        await self.mesh.check.call()
        try:
            await self.mesh.fail_with_supervision_error.call()
        except SupervisionError:
            for _ in range(600):
                if len(self.failures) >= wait_for:
                    break
                await asyncio.sleep(0.05)
            return "caught"
        raise AssertionError("the child's failure raised no SupervisionError")

    @endpoint
    async def subworker_broadcast_fail(self, wait_for: int) -> str:
        """Fire and forget: the failure reaches ``__supervise__`` all the same."""
        self.mesh.fail_with_supervision_error.broadcast()
        for _ in range(600):
            if len(self.failures) >= wait_for:
                return "seen"
            await asyncio.sleep(0.05)
        return "not seen"

    @endpoint
    async def subworker_fail_on_mesh_ref(self, mesh: Any) -> str:
        """Fail a mesh this actor does not own: its owner is told, not this one."""
        try:
            await mesh.fail_with_supervision_error.call()
        except SupervisionError:
            return "caught"
        return "no error"

    @endpoint
    async def get_mesh(self) -> Any:
        return self.mesh

    @endpoint
    async def get_failures(self) -> list[str]:
        return [str(f) for f in self.failures]

    @endpoint
    async def ok(self) -> str:
        return "ok"


class SyncSupervise(_Owner):
    def __supervise__(self, failure: Any) -> bool:
        self.failures.append(failure)
        return self.should_handle


class AsyncSupervise(_Owner):
    async def __supervise__(self, failure: Any) -> bool:
        await asyncio.sleep(0)
        self.failures.append(failure)
        return self.should_handle


class AsyncNoAwaitSupervise(_Owner):
    async def __supervise__(self, failure: Any) -> bool:
        self.failures.append(failure)
        return self.should_handle


class RaisingSupervise(_Owner):
    def __supervise__(self, failure: Any) -> bool:
        self.failures.append(failure)
        raise RuntimeError("the handler failed")


class BadInit(Actor):
    def __init__(self) -> None:
        raise RuntimeError("constructor refused")

    @endpoint
    def ok(self) -> str:
        return "ok"
