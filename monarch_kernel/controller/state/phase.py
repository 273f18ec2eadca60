"""The phase of one mesh and the condition that threads wait on while it changes.

A :class:`MeshLifecycle` holds the mesh's :class:`~.records.MeshPhase` and one condition
variable, ``cv``. Threads that wait for ranks or hosts to change state (start-up, a
restart in place, a request waiting for a restart to end) wait on ``cv``; whoever
changes a rank's or host's state calls :meth:`MeshLifecycle.notify`.

Invariants: the phase changes only with ``cv`` held; a change is announced
(:class:`~.events.MeshPhaseChanged`) after ``cv`` is released, never under it; once
STOPPING, the phase only moves on to STOPPED (a stop wins over a restart ending);
while a recovery is held (:meth:`MeshLifecycle.hold_recovery`), RECOVERING does not end.
"""

from __future__ import annotations

import threading
import time

from monarch_kernel.calls.errors import MeshStartError
from monarch_kernel.controller.state.events import EventBus, MeshPhaseChanged
from monarch_kernel.controller.state.records import MeshPhase


class MeshLifecycle:
    """The phase of mesh ``name`` (read by anyone, any time) and its condition."""

    def __init__(self, name: str, events: EventBus):
        self.name = name
        self._events = events
        self.phase = MeshPhase.STARTING
        self.cv = threading.Condition()
        #: Recoveries announced but not yet run (see :meth:`hold_recovery`).
        self._held = 0

    def notify(self) -> None:
        """Wake threads waiting for ranks or hosts to change state (start, restart)."""
        with self.cv:
            self.cv.notify_all()

    def set(self, phase: MeshPhase, announce: bool = True) -> None:
        """Enter ``phase`` and (unless told not to: the caller announces it later)
        announce it."""
        with self.cv:
            self.phase = phase
        if announce:
            self.announce()

    def announce(self) -> None:
        """Tell listeners the current phase."""
        if self._events.wants(MeshPhaseChanged):
            self._events.emit(MeshPhaseChanged(self.name, self.phase))

    def begin_recovery(self) -> None:
        """RUNNING -> RECOVERING (nothing in any other phase)."""
        with self.cv:
            if self.phase is not MeshPhase.RUNNING:
                return
            self.phase = MeshPhase.RECOVERING
        self.announce()

    def end_recovery(self) -> None:
        """RECOVERING -> RUNNING, waking requests that wait for it, unless a recovery is
        held (it has not run yet); a stop meanwhile wins. Announces the phase either way."""
        with self.cv:
            if self.phase is MeshPhase.RECOVERING and not self._held:
                self.phase = MeshPhase.RUNNING
                self.cv.notify_all()
        self.announce()

    def hold_recovery(self) -> None:
        """Enter RECOVERING (from RUNNING) for a recovery that another thread will run,
        and stay there until :meth:`release_recovery`: another recovery that ends first
        (it holds the restart lock meanwhile) must not let a request through to ranks
        this one has not re-formed yet."""
        with self.cv:
            if self.phase is MeshPhase.RUNNING:
                self.phase = MeshPhase.RECOVERING
            self._held += 1
        self.announce()

    def release_recovery(self) -> None:
        """The held recovery ran (or failed): end RECOVERING if no other is held."""
        with self.cv:
            self._held -= 1
        self.end_recovery()

    def begin_stop(self) -> bool:
        """Enter STOPPING (False if the mesh already ended); waiters give up."""
        with self.cv:
            if self.phase.ended:
                return False
            self.phase = MeshPhase.STOPPING
            self.cv.notify_all()  # requests waiting for a recovery give up
        self.announce()
        return True

    def wait_while_recovering(self, timeout: float | None) -> None:
        """Block (interruptibly) while the phase is RECOVERING, at most ``timeout``."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.cv:
            while self.phase is MeshPhase.RECOVERING:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise MeshStartError(
                        f"mesh {self.name!r} is still restarting ranks after {timeout:.0f}s"
                    )
                self.cv.wait(0.1 if left is None else min(left, 0.1))
