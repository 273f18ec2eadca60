"""Monarch's supervision inside ranks: ``MeshFailure`` and who is told of a failure.

An actor that spawns an actor mesh from a rank *owns* it. A failure of that mesh with
nobody waiting for an answer (an exception under ``broadcast``, an actor stopped by
``SystemExit``) goes to the owner's ``__supervise__(failure)``, on the owner's own rank
and thread, instead of to the controller. ``__supervise__`` returns True when it handled
the failure; otherwise (or if the owner has none, or it raises) the failure goes on to
the owner's own owner, and in the end to the controller, whose
``unhandled_fault_hook`` gets it.

The owner also ends what it owns: stopping an actor (or its failing) first stops the
actor meshes it spawned (:func:`stop_owned`), recursively, as Monarch does.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from monarch_kernel.calls.errors import PROCESS_ENDED, failure_reason
from monarch_kernel.wire.reports import FailureReport


class MeshFailure(Exception):
    """A failure of a mesh, as given to ``__supervise__`` and ``unhandled_fault_hook``.

    ``mesh_name``: the process mesh; ``actor_name``: the actor that failed (empty for a
    rank death); ``rank``: the global rank in that mesh; ``failure``: the report (type,
    message, traceback, where ...); ``path``: the owners it went through, innermost
    first (actor ids that did not handle it)."""

    def __init__(
        self,
        mesh_name: str,
        actor_name: str,
        rank: int,
        failure: FailureReport,
        path: tuple[str, ...] = (),
    ):
        self.mesh_name = mesh_name
        self.actor_name = actor_name
        self.rank = rank
        self.failure: FailureReport = FailureReport(**failure)  # a copy of its own
        self.path = tuple(path)
        super().__init__(self._describe())

    @property
    def mesh(self) -> str:
        return self.mesh_name

    @property
    def crashed_ranks(self) -> list[int]:
        """The ranks that failed (Monarch's name)."""
        return [self.rank]

    @property
    def actor_id(self) -> str:
        """This failure's actor, ``mesh/actor[rank]`` (``mesh[rank]`` for a process)."""
        if self.actor_name:
            return f"{self.mesh_name}/{self.actor_name}[{self.rank}]"
        return f"{self.mesh_name}[{self.rank}]"

    def _event(self) -> str:
        """Monarch's supervision event: the actor that failed first, then each owner on
        the way up that did not handle it (``path``), each wrapping its child's event."""
        levels = [str(self.failure.get("origin") or self.actor_id), *self.path]
        event = f"Supervision event: actor {levels[0]} failed:\n" + _indent(
            failure_reason(self.failure)
        )
        for owner in levels[1:]:
            event = (
                f"Supervision event: actor {owner} failed because it did not handle a "
                f"supervision event from its child. The child's event was:\n{_indent(event)}"
            )
        return event

    def _describe(self) -> str:
        """Monarch's form: ``MeshFailure(mesh_name=..., crashed_ranks=[r], event=...)``."""
        return (
            f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, "
            f"event={self._event()})"
        )

    def report(self) -> str:
        """The failure in words (Monarch's): ``The actor X and all its descendants have
        failed:`` and why, with the remote traceback; X is the actor that failed first."""
        leaf = str(self.failure.get("origin") or self.actor_id)
        text = f"The actor {leaf} and all its descendants have failed:\n"
        return text + _indent(failure_reason(self.failure))

    def __reduce__(self) -> tuple[Any, ...]:
        return MeshFailure, (self.mesh_name, self.actor_name, self.rank, self.failure, self.path)


#: Seconds an actor that stops (or fails) waits for the meshes it owns to stop first
#: (Monarch's ``stop_actor_timeout``); one that has not by then goes on stopping alone.
STOP_OWNED_TIMEOUT = 10.0

#: actor name -> the actor meshes it spawned, newest last (Monarch: an actor owns the
#: meshes it spawns; they stop before it does, and when it fails). In this rank.
owned: dict[str, list[Any]] = {}
_owned_lock = threading.Lock()


def own(owner: str, mesh: Any) -> None:
    """Actor ``owner`` of this rank spawned actor mesh ``mesh``: it owns it."""
    with _owned_lock:
        owned.setdefault(owner, []).append(mesh)


def stop_owned(owner: str, timeout: float = STOP_OWNED_TIMEOUT) -> None:
    """Stop the meshes actor ``owner`` owns (newest first; each stops the meshes its own
    actors own, recursively) and wait for them, at most ``timeout`` seconds in all; a
    mesh already gone is skipped."""
    with _owned_lock:
        meshes = owned.pop(owner, [])
    futures = []
    for mesh in reversed(meshes):
        try:
            futures.append(mesh.stop())
        except Exception:  # its ranks are gone: nothing left to stop
            continue
    deadline = time.monotonic() + timeout
    for fut in futures:
        try:
            fut.get(timeout=max(0.0, deadline - time.monotonic()))
        except Exception:  # gone meanwhile, or still stopping: it stops without us
            continue


def _indent(text: str) -> str:
    return "".join("  " + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))


__all__ = ["PROCESS_ENDED", "MeshFailure", "failure_reason", "own", "owned", "stop_owned"]
