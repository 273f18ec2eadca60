"""What the dashboard's parts show, as frozen records: a rank's tile, a running job's
row, a recovery. Compared between updates so that only what changed is sent."""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.controller.state.records import RecoveryReport


@dataclass(frozen=True)
class TileView:
    """Everything one tile shows; compared between ticks to send deltas only."""

    rank: int
    state: str  # starting | idle | busy | paused | error | dead | stopped
    what: str
    coords: str
    host: str
    pid: str
    device: str
    mem: str
    step: str
    seen: str
    rate_in: float | None
    rate_out: float | None
    restarts: int
    #: its GPU (host agents' NVML samples): ``87% 1.2/80G 312W``; "" without GPU fields
    gpu: str = ""
    gpu_tip: str = ""  #: the same in words, with PCIe/NVLink where known (the tooltip)
    #: tensor-engine ops issued to the rank from this notebook, and those of them it has
    #: not run yet (by its last once-a-second report); None where the tensor engine was
    #: never used on the mesh
    ops_issued: int | None = None
    ops_pending: int | None = None

    @property
    def ops(self) -> str:
        """``ops 300 · 12 pending`` (empty where the tensor engine was never used)."""
        if self.ops_issued is None:
            return ""
        pending = f" · {self.ops_pending} pending" if self.ops_pending else ""
        return f"ops {self.ops_issued}{pending}"


@dataclass(frozen=True)
class JobView:
    """One row of the running-jobs list; compared between ticks to send deltas only."""

    request: str
    what: str
    kind: str  # cell | call
    ranks: str  # "ranks 0-3", "rank 1 (3 of 4 done)"
    elapsed: str  # "12s", "3m 05s"
    cancelling: bool

    @property
    def text(self) -> str:
        """The row as plain text (the snapshot's text view)."""
        state = " · cancelling…" if self.cancelling else ""
        return f"{self.what} · running on {self.ranks} · {self.elapsed}{state}"


@dataclass(frozen=True)
class Recovery:
    """A restart in place (:class:`MeshRecovered`), as the dashboard shows it."""

    time: float  #: ``time.time()`` when the dashboard learnt of it
    report: RecoveryReport
    text: str  #: ``report.describe(mesh)``: ranks restarted, what was re-run, what was lost

    @property
    def summary(self) -> str:
        """One line for the status: ``recovered: restarted ranks 1 in 1.2s``."""
        rep = self.report
        if rep.restarted:
            what = f"restarted ranks {format_ranks(list(rep.restarted))}"
        elif rep.process_group is not None:
            what = "re-formed the process group"
        elif rep.replicas:
            what = "compared the replicas"
        else:
            what = "nothing to restart"
        text = f"recovered: {what} in {rep.seconds:.2f}s"
        if rep.reason:
            text += f", {rep.reason}"
        if rep.replicas:  # what differed and what was copied, or "DDP replicas identical"
            text += f"; {rep.replicas}"
        if rep.problems:
            text += f"; {len(rep.problems)} problem(s), see below"
        return text
