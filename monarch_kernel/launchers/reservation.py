"""What an engine holds for a detachable mesh, in a form another kernel can act on.

A ``--detachable`` mesh on the ray or slurm backend keeps its engine's reservation while
no kernel holds it (the Ray placement group and agent actors are *detached*, the Slurm
step runs under a keeper of its own: :mod:`.ray_agent`, :mod:`.slurm_keeper`). Each
releases itself once the mesh's agents end (``--keep`` ran out, or a ``%mesh stop``).
The record here goes into the mesh's attach file (``HostEntry.reservation``), so that a
kernel that attaches, or stops the mesh without attaching, releases it too on stop,
and ``%mesh`` can say what is reserved. It holds names and ids, never a secret.
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any

log = logging.getLogger("monarch_kernel.launchers")


@dataclass(frozen=True)
class Reservation:
    """One engine reservation of a detachable mesh (JSON in the attach file)."""

    engine: str  #: ``ray`` or ``slurm``
    #: Ray: the placement group's name; Slurm: the job id.
    name: str
    #: Ray: the cluster's GCS address. Slurm: "".
    address: str = ""
    #: Ray: the namespace of the group and actors. Slurm: "".
    namespace: str = ""
    #: Ray: the agent actors' names. Slurm: our steps' names (one per host).
    members: list[str] = field(default_factory=list)
    #: Slurm: whether we allocated the job (then it is cancelled; else only our step).
    ours: bool = True

    def describe(self) -> str:
        """A few words for ``%mesh`` (``ray pg mk-x``, ``slurm job 12``)."""
        if self.engine == "ray":
            return f"ray pg {self.name}"
        if self.engine == "slurm":
            return f"slurm job {self.name}" + ("" if self.ours else " (its step)")
        return f"{self.engine} {self.name}"

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Reservation:
        return cls(
            str(raw["engine"]),
            str(raw["name"]),
            str(raw.get("address", "")),
            str(raw.get("namespace", "")),
            [str(m) for m in raw.get("members", ())],
            bool(raw.get("ours", True)),
        )

    @property
    def key(self) -> tuple[str, str, str]:
        return (self.engine, self.address, self.name)


#: Reservations this process released already (several hosts share one).
_released: set[tuple[str, str, str]] = set()


def release(record: dict[str, Any] | None) -> None:
    """Release the reservation ``record`` describes (once per process; errors logged:
    the engine's own keeper releases it too once the mesh's agents ended)."""
    if not record:
        return
    try:
        res = Reservation.from_json(record)
    except (KeyError, TypeError, ValueError):
        log.warning("an attach file's reservation is not one this version reads: %r", record)
        return
    if res.key in _released:
        return
    _released.add(res.key)
    try:
        if res.engine == "ray":
            from monarch_kernel.launchers.ray_agent import release_detached

            release_detached(res.address, res.namespace, res.name, res.members)
        elif res.engine == "slurm":
            from monarch_kernel.launchers.slurm_keeper import release_job

            release_job(res.name, res.members, res.ours)
    except Exception:  # the keeper releases it anyway
        log.exception("releasing %s failed", res.describe())


def describe(record: dict[str, Any] | None) -> str:
    """``record``'s few words ("" if none)."""
    if not record:
        return ""
    try:
        return Reservation.from_json(record).describe()
    except (KeyError, TypeError, ValueError):
        return ""
