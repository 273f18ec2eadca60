"""What the dashboard's buttons do: interrupt, cancel a job, show stacks, restart dead
ranks, stop the mesh.

Clicks arrive on whichever thread the kernel handles the comm message on (see
:mod:`~monarch_kernel.widgets.dashboard`); they only record the request. Slow actions
(cancel, stacks, restart, stop) run on a worker thread, one at a time; every action says
what it did on the dashboard's status line.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.state.records import RankState
from monarch_kernel.widgets.state import MeshState

if TYPE_CHECKING:
    from monarch_kernel.actor.meshes import ProcMesh
    from monarch_kernel.controller.mesh import MeshRuntime

CONFIRM_S = 4.0  # the stop button asks for a second click within this time


class MeshActions:
    """The actions on one mesh. ``set_status`` writes the status line; ``show_stacks``
    puts the stacks' HTML under the buttons."""

    def __init__(
        self,
        runtime: MeshRuntime,
        state: MeshState,
        set_status: Callable[[str], None],
        show_stacks: Callable[[str], None],
    ) -> None:
        self.runtime = runtime
        self.state = state
        self._set_status = set_status
        self._show_stacks = show_stacks
        self._confirm_stop_until = 0.0
        self._action: threading.Thread | None = None

    def confirming(self, now: float) -> bool:
        """Whether the Stop button waits for its second click (``now``: monotonic)."""
        return now < self._confirm_stop_until

    def _procs(self) -> ProcMesh:
        from monarch_kernel.actor.meshes import ProcMesh

        return ProcMesh(self.runtime)

    def interrupt(self) -> None:
        """Send SIGINT to every live rank (KeyboardInterrupt in their user code)."""
        rt = self.runtime
        alive = [i.rank for i in rt.ranks if i.alive]
        if rt.state.ended or not alive:
            self._set_status("nothing to interrupt")
            return
        self._procs().interrupt()
        self._set_status(f"interrupt sent to ranks {format_ranks(alive)}")

    def cancel(self, request_id: str) -> None:
        """Cancel a running job (see :meth:`Dashboard.cancel
        <monarch_kernel.widgets.dashboard.Dashboard.cancel>`)."""
        what = self.state.errors.what(request_id) or f"request {request_id}"
        rt = self.runtime
        if rt.state.ended:
            self._set_status(f"the mesh is stopped: {what} is not running")
            return

        def work() -> None:
            try:
                ranks = rt.cancel_request(request_id)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"cancel of {what} failed: {exc}".split("\n")[0])
                return
            if not ranks:
                self._set_status(f"{what} had finished")
                return
            self.state.running.cancelling.add(request_id)  # its row says so until it ends
            many = "ranks" if len(ranks) > 1 else "rank"
            self._set_status(f"cancelled {what} on {many} {format_ranks(ranks)}")

        self._run(work, f"cancelling {what}…")

    def show_stacks(self) -> None:
        """Collect every rank's Python stacks and show them (see ``%mesh stacks``)."""
        from monarch_kernel.widgets.stacks_view import mesh_stacks

        rt = self.runtime
        if rt.state.ended:
            self._set_status("the mesh is stopped: no stacks to show")
            return

        def work() -> None:
            try:
                view = mesh_stacks(rt)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"stacks failed: {exc}".split("\n")[0])
                return
            self._show_stacks(view._repr_html_())
            odd = view.odd_ranks
            self._set_status(
                f"stacks of {len(view.stacks)} ranks in {view.elapsed:.2f}s"
                + (f"; odd ones out: ranks {format_ranks(odd)}" if odd else "")
            )

        self._run(work, "collecting stacks…")

    def restart(self, ranks: list[int] | None, selected: int | None) -> None:
        """Restart ``ranks`` (None: ``selected`` if it is dead, else every dead rank)."""
        rt = self.runtime
        if ranks is None:
            dead = [i.rank for i in rt.ranks if i.state is RankState.DEAD]
            if selected is not None and selected in dead:
                dead = [selected]
            ranks = dead
        if not ranks:
            self._set_status("no dead ranks to restart")
            return
        label = format_ranks(ranks)

        def work() -> None:
            t0 = time.monotonic()
            try:
                report = self._procs().restart(ranks)
            except Exception as exc:  # shown in the dashboard
                self._set_status(f"restart of ranks {label} failed: {exc}".split("\n")[0])
            else:
                n = len(report.problems)
                problems = f"; {n} problem(s), see below" if n else ""
                self._set_status(
                    f"restarted ranks {label} in {time.monotonic() - t0:.1f}s{problems}"
                )

        self._run(work, f"restarting ranks {label}…")

    def stop(self, confirm: bool = True) -> None:
        """Stop the mesh; with ``confirm`` the first call asks for a second one."""
        if confirm and time.monotonic() > self._confirm_stop_until:
            self._confirm_stop_until = time.monotonic() + CONFIRM_S
            self._set_status("click Stop again to stop every rank")
            return
        self._confirm_stop_until = 0.0

        def work() -> None:
            try:
                self.runtime.stop()
            except Exception as exc:
                self._set_status(f"stop failed: {exc}")
            else:
                self._set_status("mesh stopped")

        self._run(work, "stopping the mesh…")

    def _run(self, work: Callable[[], None], status: str) -> None:
        """Run ``work`` on a worker thread, unless the previous action still runs."""
        if self._action is not None and self._action.is_alive():
            self._set_status("still busy with the previous action")
            return
        self._set_status(status)
        self._action = threading.Thread(target=work, name="mk-dashboard-action", daemon=True)
        self._action.start()
