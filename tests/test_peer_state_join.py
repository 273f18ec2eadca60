"""State from peers across machines: the ``join`` backend on network-namespace hosts.

Two emulated machines (``netns.py``) x 2 ranks, ``%mesh ... --backend join --dist`` in a
real kernel; rank 2 (on the second machine) is SIGKILLed mid-training. Its host agent
restarts it there, and it pulls the state of a live replica on the *other* machine over
the data plane's TCP (CURVE) path; the cell completes with identical replicas and the
losses of an uninterrupted run.
"""

from __future__ import annotations

import os
import signal

import pytest
from kernel_client import Kernel
from netns import Joiner, agent_env, netns_hosts_fixture
from test_peer_state import SETUP, STEPS, check_recovered, pids_of, train

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def net():
    yield from netns_hosts_fixture(2)


def test_sigkill_on_another_machine_is_recovered_from_a_peer_there(net, tmp_path):
    k = Kernel(env={"PYTHONPATH": agent_env()["PYTHONPATH"]})
    joiner = Joiner(net)
    mesh = "pj"
    try:
        r = k.run(f"import os; os.chdir({str(tmp_path)!r})")
        assert not r.errors, r.error_text
        line = f"%mesh {mesh} --backend join --hosts 2 --gpus 2 --dist --bind {net.gateway}"
        mid = k.submit(line)
        k.wait_for_output(mid, "host 1: python -m monarch_kernel.host --join", timeout=60)
        joiner.progress(k.output_so_far(mid)[0])  # the people run the shown commands
        r = k.collect(mid, timeout=120)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        r = k.run(SETUP.format(mesh=mesh, pids="", extra=""), timeout=120)
        assert not r.errors, r.error_text
        pids = pids_of(k, mesh)
        cell = train(k, mesh, 0.05)
        k.wait_for_output(cell, "step 10", timeout=60)
        os.kill(pids[2], signal.SIGKILL)
        r = k.collect(cell, timeout=180)
        assert not r.errors, r.error_text + r.stdout + r.stderr
        text = r.stdout + r.stderr
        assert "rank 2 died (killed by SIGKILL) at step" in text, text
        assert "copied from rank 0" in text, text
        check_recovered(k, mesh, pids, {2})
        r = k.run(f"%remote {mesh} state.step")
        assert r.text.count(f": {STEPS}") == 4, r.text
        k.run(f"%mesh stop {mesh}")
    finally:
        k.shutdown_and_check()
        for agent in joiner.agents.values():
            agent.wait(10)
