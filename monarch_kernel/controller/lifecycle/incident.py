"""An incident: one request's failure, and what the failure policy did about it (see
:mod:`.failures`)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from monarch_kernel.calls.errors import RankDiedError, format_ranks
from monarch_kernel.controller.state.events import RequestKind


class ReleasedError(RankDiedError):
    """A rank's part of a request was given up on by the failure policy (it was still
    running it after another rank failed); the message says what was done to it."""


@dataclass
class Incident:
    """One request's failure, and what the failure policy did about it.

    Written by the incident's thread; read (``summary``) when the request's error is
    built, after every rank of the request was accounted for and ``settled`` is set.
    """

    request: str
    what: str  #: how people call the request: ``cell 5``, ``trainer.step``
    root_rank: int
    cause: str  #: ``raised ValueError`` / ``died (killed by SIGKILL)``
    grace: float
    #: The ranks the request ran on, and what it was (a cell, an endpoint call ...).
    ranks: tuple[int, ...] = ()
    kind: RequestKind = RequestKind.CELL
    opened: float = field(default_factory=time.monotonic)
    #: rank -> how it was released (``process group aborted``, ``interrupted`` ...).
    released: dict[int, str] = field(default_factory=dict)
    #: What happens next (restart, stop), decided when the release ends.
    outcome: str = ""
    #: The release changed the mesh (process group aborted, ranks killed): the policy
    #: must run when it ends.
    needs_policy: bool = False
    #: A person interrupted the request: not a fault (a stop policy does not stop).
    cancelled: bool = False
    #: The release aborted the process group (step 1 began): a rank whose answer is
    #: then ``ProcessGroupAborted`` was released by the abort, however late it comes.
    aborted: bool = False
    #: Set when the release is over and this record is final.
    settled: threading.Event = field(default_factory=threading.Event)

    def summary(self) -> str:
        """What was done to the other ranks, for the request's error (empty if none)."""
        if not self.released:
            return self.outcome
        by_how: dict[str, list[int]] = {}
        for rank, how in self.released.items():
            by_how.setdefault(how, []).append(rank)
        ranks = format_ranks(list(self.released))
        who = f"ranks {ranks} were" if len(self.released) > 1 else f"rank {ranks} was"
        text = (
            f"{who} still running {self.what or 'it'} {self.grace:.1f}s after "
            f"rank {self.root_rank} {self.cause} (waiting for it in a collective?); "
            + "; ".join(f"{how}: {format_ranks(rs)}" for how, rs in by_how.items())
            + "."
        )
        return text + (" " + self.outcome if self.outcome else "")
