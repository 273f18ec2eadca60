"""Monarch's supervision inside ranks: ``MeshFailure`` and who is told of a failure.

An actor that spawns an actor mesh from a rank *owns* it. A failure of that mesh with
nobody waiting for an answer (an exception under ``broadcast``, an actor stopped by
``SystemExit``) goes to the owner's ``__supervise__(failure)``, on the owner's own rank
and thread, instead of to the controller. ``__supervise__`` returns True when it handled
the failure; otherwise (or if the owner has none, or it raises) the failure goes on to
the owner's own owner, and in the end to the controller, whose
``unhandled_fault_hook`` gets it.
"""

from __future__ import annotations

from typing import Any

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

    def _describe(self) -> str:
        """Monarch's form: ``MeshFailure(mesh_name=..., crashed_ranks=[r], event=...)``;
        a failure that went up through owners that did not handle it names the last of
        them "and all its descendants"."""
        f = self.failure
        who = f"{self.mesh_name}/{self.actor_name}[{self.rank}]" if self.actor_name else ""
        what = f"actor {who}" if who else f"rank {self.rank} of mesh {self.mesh_name}"
        cause = f"{f.get('type', 'Error')}: {f.get('message', '')}"
        if self.path:
            event = (
                f"The actor {self.path[-1]} and all its descendants have failed:\n"
                f"  {what} failed: {cause}"
            )
        else:
            event = f"Supervision event: {what} failed:\n  {cause}"
        return (
            f"MeshFailure(mesh_name={self.mesh_name}, crashed_ranks={self.crashed_ranks}, "
            f"event={event})"
        )

    def report(self) -> str:
        """The failure in words, with the remote traceback."""
        f = self.failure
        who = f"actor {self.actor_name!r} on " if self.actor_name else ""
        text = (
            f"{who}rank {self.rank} of mesh {self.mesh_name!r} failed: "
            f"{f.get('type', 'Error')}: {f.get('message', '')}"
        )
        if self.path:
            text += f"\n(not handled by: {' -> '.join(self.path)})"
        tb = f.get("traceback")
        if tb:
            text += "\n" + str(tb).rstrip()
        return text

    def __reduce__(self) -> tuple[Any, ...]:
        return MeshFailure, (self.mesh_name, self.actor_name, self.rank, self.failure, self.path)
