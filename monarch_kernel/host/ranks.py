"""The ranks one host agent runs: their pids, what each was forked with, the forks still
in flight, and whose exit is expected.

Forks are asynchronous (the warm template answers with a "forked" event), so a kill
that comes first (a restart that timed out) is remembered for the fork in flight and
carried out once its pid is known: that late incarnation must not run on unsupervised
and fight the next one for its inbox. Its exit is then never told to the controller.
Ranks are named by their slot (see :mod:`monarch_kernel.host.agent`).
"""

from __future__ import annotations

import os
import signal
from collections import deque
from dataclasses import replace

from monarch_kernel.host.template_handle import Template
from monarch_kernel.rank.config import RankConfig


class LocalRanks:
    """The agent's ranks (see the module's docstring). Used by the agent's loop only."""

    def __init__(self, template: Template):
        self.template = template
        self.pids: dict[int, int] = {}  # rank -> pid
        self.cfgs: dict[int, RankConfig] = {}  # what each rank was forked with
        self.expected_exits: set[int] = set()
        #: Forks asked of the template and not reported yet, per rank, in order: whether
        #: a kill came for it meanwhile.
        self.forking: dict[int, deque[bool]] = {}
        self.unborn: set[int] = set()  # pids of those, killed at once

    def fork(self, cfg: RankConfig) -> None:
        """Ask the template to fork ``cfg``'s rank (its pid comes as a "forked" event)."""
        self.cfgs[cfg.slot] = cfg
        self.forking.setdefault(cfg.slot, deque()).append(False)
        self.template.command(op="fork", cfg=cfg.to_json())

    def fork_again(self, rank: int) -> None:
        """Start ``rank`` again while no controller holds the mesh (its failure
        policy); it appends to its log and knows it starts with no controller."""
        cfg = self.cfgs.get(rank)
        if cfg is not None:
            self.fork(replace(cfg, restart_count=cfg.restart_count + 1, detachable=2))

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to those of ``ranks`` that run here."""
        for r in ranks:
            pid = self.pids.get(r)
            if pid:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def kill(self, ranks: list[int]) -> None:
        """SIGKILL ``ranks`` (their exits are expected), and each incarnation of them
        still being forked, once it is."""
        self.expected_exits.update(r for r in ranks if r in self.pids)
        self.signal(ranks, signal.SIGKILL)
        for r in ranks:
            pending = self.forking.get(r)
            if pending:
                self.forking[r] = deque(True for _ in pending)

    def expect_all_exits(self) -> None:
        """Every running rank's exit is expected from now on (the mesh stops)."""
        self.expected_exits.update(self.pids)

    def forked(self, rank: int, pid: int) -> bool:
        """The template forked ``rank`` as ``pid``: True if it runs on, False if it was
        killed before it was forked (killed now; the controller never hears of it)."""
        pending = self.forking.get(rank)
        if pending and pending.popleft():
            self.unborn.add(pid)
            os.kill(pid, signal.SIGKILL)
            return False
        self.pids[rank] = pid
        return True

    def exited(self, rank: int, pid: int) -> bool:
        """``pid`` (of ``rank``) exited: False for an unborn one (nobody is told),
        else True and the rank no longer runs here if ``pid`` was its current one."""
        if pid in self.unborn:
            self.unborn.discard(pid)
            return False
        if self.pids.get(rank) == pid:
            del self.pids[rank]
        return True
