"""A second rank dying while the failure policy restarts the first: requests wait for
both restarts, never slip through between them to a rank that is still dead."""

from __future__ import annotations

import os
import signal

import pytest
from actors import HeldAtInit
from conftest import wait_no_orphans
from helpers import wait_until

from monarch_kernel.actor import this_host
from monarch_kernel.controller.state.events import MeshEvent, MeshPhaseChanged
from monarch_kernel.controller.state.records import MeshPhase

pytestmark = pytest.mark.local


def test_a_death_during_a_restart_keeps_requests_waiting_until_both_are_back(tmp_path):
    hold = str(tmp_path / "hold")
    procs = this_host().spawn_procs(per_host={"gpus": 3}, on_failure="restart")
    try:
        rt = procs.runtime
        actors = procs.spawn("held", HeldAtInit, hold)
        pids = list(actors.pid.call().get(timeout=60).values())
        # every phase the mesh announces, with the ranks dead at that moment
        seen: list[tuple[MeshPhase, tuple[int, ...]]] = []

        def on_phase(event: MeshEvent) -> None:
            if isinstance(event, MeshPhaseChanged):
                seen.append((event.phase, tuple(i.rank for i in rt.ranks if not i.alive)))

        rt.events.subscribe(on_phase, MeshPhaseChanged)
        open(hold, "w").close()
        os.kill(pids[1], signal.SIGKILL)
        # the policy's restart of rank 1 is re-creating its actor: held there
        wait_until(lambda: os.path.exists(hold + ".entered"), timeout=60, what="rank 1's restart")
        os.kill(pids[2], signal.SIGKILL)
        wait_until(lambda: not rt.ranks[2].alive, timeout=30, what="rank 2's death")
        os.remove(hold)  # rank 1's restart ends now, with rank 2 still dead
        # a call sent now waits for both restarts, then every rank answers
        after = list(actors.pid.call().get(timeout=120).values())
        assert after[0] == pids[0] and after[1] != pids[1] and after[2] != pids[2], after
        running = [dead for phase, dead in seen if phase is MeshPhase.RUNNING]
        assert running and all(dead == () for dead in running), seen
    finally:
        procs.stop()
    assert not wait_no_orphans(), "the mesh left processes behind"
