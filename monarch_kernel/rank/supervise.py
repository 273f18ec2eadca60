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


def _indent(text: str) -> str:
    return "".join("  " + ln if ln.strip() else ln for ln in text.splitlines(keepends=True))


__all__ = ["PROCESS_ENDED", "MeshFailure", "failure_reason"]
