"""The restart-in-place and resize half of :class:`~.mesh.MeshRuntime`'s surface.

The layers above (magics, ``ProcMesh``, the failure policy) ask the mesh to recover,
restart, grow or shrink; the work is done by
:class:`~monarch_kernel.controller.lifecycle.restart.Restarter` and
:class:`~monarch_kernel.controller.elastic.resize.Resizer`. This mixin holds the
one-line delegates and the recipe (actors and setup cells re-created on restarted
ranks) so that ``mesh.py`` stays the request and stop path.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from monarch_kernel.calls.requester import ActorSpec
from monarch_kernel.controller.elastic.plan import ResizeReport
from monarch_kernel.controller.elastic.resize import Resizer
from monarch_kernel.controller.lifecycle.restart import Restarter
from monarch_kernel.controller.state.records import MeshRecipe, RecoveryReport, SetupCell

__all__ = ["RestartAndResize"]


class RestartAndResize:
    """Restart in place (:mod:`monarch_kernel.controller.lifecycle.restart`) and resizing
    (:mod:`monarch_kernel.controller.elastic.resize`) of a mesh.

    The class using it sets ``recipe``, ``restarter`` and ``resizer`` before any of
    these methods is called.
    """

    recipe: MeshRecipe
    restarter: Restarter
    resizer: Resizer

    # -- what a restarted rank gets again -------------------------------------------
    @property
    def actors(self) -> dict[str, ActorSpec]:
        """Actors spawned on this mesh, re-created on restarted ranks."""
        return self.recipe.actors

    @property
    def setup_cells(self) -> list[SetupCell]:
        """Cells re-run on restarted ranks (after the process group is re-formed)."""
        return self.recipe.setup_cells

    @setup_cells.setter
    def setup_cells(self, cells: list[SetupCell]) -> None:
        self.recipe.setup_cells = cells

    def actor_spawned(self, spec: ActorSpec) -> None:
        """``spec`` was spawned: re-create it on its ranks when they restart (the
        Requester protocol's name for :meth:`remember_actor`)."""
        self.remember_actor(spec)

    def actor_stopped(self, name: str, ranks: list[int]) -> None:
        """Actor ``name`` was stopped on ``ranks``: not re-created there any more."""
        self.forget_actor(name, ranks)

    def remember_actor(self, spec: ActorSpec) -> None:
        """``spec`` was spawned: re-create it on its ranks when they restart."""
        self.recipe.remember_actor(spec)

    def forget_actor(self, name: str, ranks: Sequence[int]) -> None:
        """Actor ``name`` was stopped on ``ranks``: do not re-create it there."""
        self.recipe.forget_actor(name, ranks)

    def remember_setup(self, cell: SetupCell) -> None:
        """Re-run ``cell`` on ranks when they restart (after the process group)."""
        self.recipe.remember_setup(cell)

    def forget_setup(self) -> list[SetupCell]:
        """Re-run no setup cell on restarts any more; returns those forgotten."""
        return self.recipe.forget_setup()

    # -- restart in place ------------------------------------------------------------
    @property
    def last_recovery(self) -> RecoveryReport | None:
        """What the last restart in place did."""
        return self.restarter.last_recovery

    @property
    def recovery_error(self) -> str | None:
        """Why the last restart in place failed (None if it did not)."""
        return self.restarter.recovery_error

    def recover(
        self,
        ranks: Sequence[int] | None = None,
        timeout: float = 120.0,
        reason: str = "",
        skip: frozenset[int] = frozenset(),
    ) -> RecoveryReport:
        """Restart in place (see
        :meth:`monarch_kernel.controller.lifecycle.restart.Restarter.recover`)."""
        return self.restarter.recover(ranks, timeout, reason, skip)

    def restart_ranks(self, ranks: list[int], timeout: float = 60.0) -> None:
        """Kill and start again ``ranks`` (see
        :meth:`monarch_kernel.controller.lifecycle.restart.Restarter.restart_ranks`)."""
        self.restarter.restart_ranks(ranks, timeout)

    def dead_ranks(self, among: Iterable[int]) -> list[int]:
        """The ranks ``among`` these that :meth:`recover` with no ranks would restart
        (see :meth:`monarch_kernel.controller.lifecycle.restart.Restarter.dead`)."""
        return self.restarter.dead(among)

    def wait_recovered(self, timeout: float | None = None) -> None:
        """Block (interruptibly) while the mesh restarts ranks after a failure (never
        on the restarting or the receiving thread)."""
        self.restarter.wait_recovered(timeout)

    def new_port(self, host: int = 0, timeout: float = 10.0) -> int:
        """A free port on ``host`` (for a new torch.distributed rendezvous)."""
        return self.restarter.new_port(host, timeout)

    # -- resizing ----------------------------------------------------------------------
    def grow(
        self, ranks: str | None = None, hosts: str | None = None, timeout: float = 120.0
    ) -> ResizeReport:
        """Add ranks (``"+2"``) or hosts (``"+1"``): see
        :mod:`monarch_kernel.controller.elastic.resize`."""
        return self.resizer.grow(ranks, hosts, timeout)

    def shrink(
        self,
        ranks: str | None = None,
        hosts: str | None = None,
        timeout: float = 120.0,
        drop_ranks: str | None = None,
        drop_hosts: str | None = None,
    ) -> ResizeReport:
        """Keep ``ranks`` ranks or ``hosts`` hosts (from the end), or drop the ranks
        ``drop_ranks`` (``"1,3"``) or hosts ``drop_hosts`` anywhere (the survivors are
        renumbered): see :mod:`monarch_kernel.controller.elastic.resize`."""
        return self.resizer.shrink(ranks, hosts, timeout, drop_ranks, drop_hosts)

    def shrink_dead(self) -> bool:
        """``on_failure='shrink'``: go on without the dead ranks (see
        :mod:`monarch_kernel.controller.elastic.resize`)."""
        return self.resizer.shrink_dead()
