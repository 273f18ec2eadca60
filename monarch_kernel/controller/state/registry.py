"""A registry of live meshes, by name: :class:`MeshRegistry`.

Every mesh registers itself when it is created (by ``%mesh``, ``spawn_procs`` or
anything else) and leaves when it stops, so ``%mesh`` lists them all and shutdown
stops them all. Holding a mesh here keeps it alive until it is stopped. Of the last few
stopped meshes a one-line summary is kept, so that the table says what became of them.

The kernel's one registry, of ``MeshRuntime`` objects, is
:data:`monarch_kernel.controller.mesh.registry` (next to the class that registers
itself in it); this module only knows what it needs of a mesh (:class:`Registered`).
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from monarch_kernel.controller.state.records import MeshPhase

log = logging.getLogger("monarch_kernel.controller")


#: Stopped meshes remembered for the ``%mesh`` table.
RECENTLY_STOPPED = 16


@dataclass(frozen=True)
class MeshSummary:
    """One row of the ``%mesh`` table."""

    name: str
    shape: str
    backend: str
    alive: int
    world: int
    state: MeshPhase
    started_at: float


class MeshNameTaken(ValueError):
    """A live mesh already has that name."""


class Registered(Protocol):
    """What the registry needs of a mesh."""

    @property
    def name(self) -> str: ...
    @property
    def state(self) -> MeshPhase: ...
    def summary(self) -> MeshSummary: ...
    def stop(self, timeout: float = ..., grace: float = ...) -> None: ...


M = TypeVar("M", bound=Registered)


class MeshRegistry(Generic[M]):
    """Live meshes by name (insertion order)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._meshes: dict[str, M] = {}
        self._counters: dict[str, int] = {}
        self._stopped: deque[MeshSummary] = deque(maxlen=RECENTLY_STOPPED)

    def add(self, mesh: M) -> None:
        """Register ``mesh``; its name must not be taken by a live mesh."""
        with self._lock:
            old = self._meshes.get(mesh.name)
            if old is not None and old is not mesh and not old.state.ended:
                raise MeshNameTaken(
                    f"a live mesh is already named {mesh.name!r}; stop it first "
                    "or choose another name"
                )
            self._meshes[mesh.name] = mesh

    def discard(self, mesh: M) -> None:
        """Forget ``mesh`` (when it stopped)."""
        with self._lock:
            if self._meshes.get(mesh.name) is mesh:
                del self._meshes[mesh.name]
                self._stopped.append(mesh.summary())

    def forget(self, mesh: M) -> None:
        """Forget ``mesh`` without a trace (it never got as far as starting)."""
        with self._lock:
            if self._meshes.get(mesh.name) is mesh:
                del self._meshes[mesh.name]

    def stopped(self, name: str) -> MeshSummary | None:
        """The summary of the last stopped mesh called ``name``, if it is remembered."""
        with self._lock:
            for summary in reversed(self._stopped):
                if summary.name == name:
                    return summary
        return None

    def get(self, name: str) -> M | None:
        """The live (or stopping) mesh called ``name``, if any."""
        with self._lock:
            return self._meshes.get(name)

    def live(self) -> list[M]:
        """Every registered mesh that has not stopped, oldest first."""
        with self._lock:
            return [m for m in self._meshes.values() if not m.state.ended]

    def listed(self) -> list[MeshSummary]:
        """What ``%mesh`` shows: the live meshes and the recently stopped ones (unless
        a live mesh took their name), oldest first."""
        with self._lock:
            current = [m.summary() for m in self._meshes.values()]  # live, or stopping
            taken = {m.name for m in current}
            gone = [m for m in self._stopped if m.name not in taken]
        latest = {m.name: m for m in gone}  # one row per name: its last incarnation
        shown = [m for m in gone if latest[m.name] is m] + current
        return sorted(shown, key=lambda m: m.started_at)

    def names(self) -> list[str]:
        """Names of the live meshes, oldest first."""
        return [m.name for m in self.live()]

    def auto_name(self, prefix: str) -> str:
        """``prefix0``, ``prefix1`` ...: the next name not taken by a live mesh."""
        with self._lock:
            while True:
                n = self._counters.get(prefix, 0)
                self._counters[prefix] = n + 1
                name = f"{prefix}{n}"
                if name not in self._meshes:
                    return name

    def stop_all(self, timeout: float = 5.0) -> None:
        """Stop every live mesh (kernel shutdown, interpreter exit); best effort."""
        for mesh in self.live():
            try:
                mesh.stop(timeout=timeout)
            except Exception:  # pragma: no cover - best effort on the way out
                log.exception("stopping mesh %s failed", mesh.name)
