"""Ranks run at a lower CPU priority than their host agent and the controller
(``rank.forked.RANK_NICE``), so that a machine with more busy ranks than cores still
runs the control plane: heartbeats, the controller's receiving, the notebook."""

from __future__ import annotations

import os

import pytest

from monarch_kernel.actor import Actor, endpoint, this_host
from monarch_kernel.rank.forked import RANK_NICE, RANK_NICE_ENV

pytestmark = pytest.mark.local


class Niceness(Actor):
    @endpoint
    def niceness(self) -> tuple[int, int]:
        """This rank's nice value, and its host agent's (the template's parent)."""
        import psutil

        template = psutil.Process().parent()
        assert template is not None
        agent = template.parent()
        assert agent is not None
        return os.getpriority(os.PRIO_PROCESS, 0), agent.nice()


def test_ranks_run_below_their_host_agent(mesh2) -> None:
    got = mesh2.spawn("nice", Niceness).niceness.call().get().values()
    assert got == [(RANK_NICE + agent, agent) for _, agent in got]


@pytest.mark.parametrize("value, step", [("0", 0), ("2", 2), ("soon", RANK_NICE)])
def test_the_step_comes_from_the_mesh_environment(value: str, step: int) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": 1}, env={RANK_NICE_ENV: value})
    try:
        rank, agent = procs.spawn("nice", Niceness).niceness.call_one().get()
        assert rank == agent + step
    finally:
        procs.stop()
