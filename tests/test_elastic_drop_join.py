"""Dropping a host in the middle of a mesh that spans machines: the ``join`` backend (host
agents in network namespaces, see ``netns.py``), so every socket is a CURVE one and every
routing id carries its host's tag. After ``%mesh shrink NAME --drop-hosts 1`` the ranks of
host 2 are those of host 1 and their ranks are renumbered, but their routing ids, keys and
tags do not change (they are their slots'): nothing they send is taken for an impostor's,
calls fanned out through their host agents and the replies fanned back in reach them
under their new numbers, and the process group is re-formed across the machines.
"""

from __future__ import annotations

import pytest
from kernel_client import Kernel
from netns import Joiner, agent_env, netns_hosts_fixture
from test_detach_join import _left_in_namespaces
from test_elastic import value

pytestmark = [pytest.mark.cluster, pytest.mark.timeout(600)]

MESH = "jd"
JOIN_LINE = "python -m monarch_kernel.host --join"
SETUP = f"""\
%%remote {MESH} --setup
import os, socket, torch, torch.distributed as dist
"""
ACTORS = """\
import os
from monarch_kernel.actor import Actor, endpoint, current_rank

class Sizer(Actor):
    @endpoint
    def size(self, blob):
        return (current_rank().rank, os.getpid(), len(blob))
"""


@pytest.fixture
def net():
    gen = netns_hosts_fixture(3)
    hosts = next(gen)
    yield hosts
    next(gen, None)
    assert not _left_in_namespaces(hosts), _left_in_namespaces(hosts)


def test_drop_the_middle_host_of_a_curve_mesh(net):
    joiner = Joiner(net)
    k = Kernel(env={"PYTHONPATH": agent_env()["PYTHONPATH"]})
    try:
        job = k.submit(
            f"%mesh {MESH} --backend join --hosts 3 --gpus 2 --bind {net.gateway} --dist"
        )
        for h in (0, 1, 2):
            k.wait_for_output(job, f"host {h}: {JOIN_LINE}", timeout=60)
        joiner.progress(k.output_so_far(job)[0])
        r = k.collect(job, timeout=180)
        assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
        assert not k.run(SETUP, timeout=120).errors
        r = k.run(ACTORS + f"sizer = {MESH}.spawn('sizer', Sizer)")
        assert not r.errors, r.error_text
        where = f"_p = %remote {MESH} (os.getpid(), socket.gethostname())\nlist(_p.values())"
        before = value(k, where)
        r = k.run(f"%mesh shrink {MESH} --drop-hosts 1", timeout=180)
        assert (
            "world size 6 → 4; host 1 (ranks 2-3) dropped; ranks 4-5 → 2-3 renumbered" in r.stdout
        ), r.stdout + r.stderr
        kept = before[:2] + before[4:]
        after = value(
            k,
            f"_e = %remote {MESH} (os.getpid(), socket.gethostname(), os.environ['RANK'], "
            "os.environ['GROUP_RANK'], os.environ['LOCAL_RANK'], dist.get_rank(), "
            "(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(1)))\n"
            "list(_e.values())",
            timeout=120,
        )
        assert [a[:2] for a in after] == kept, after
        assert [a[2:] for a in after] == [
            (str(r), str(r // 2), str(r % 2), r, 4.0) for r in range(4)
        ], after
        # a large argument goes once per host through its agent (fan-out, by slots) and
        # the replies come back combined (fan-in): every survivor under its new rank
        sizes = value(k, "sizer.size.call(bytes(600_000)).get().values()", timeout=120)
        assert sizes == [(r, pid, 600_000) for r, (pid, _) in enumerate(kept)], sizes
        assert value(k, f"{MESH}.runtime.transport.ids.impostors") == 0
        assert value(k, f"[h.index for h in {MESH}.runtime.hosts]") == [0, 1]
        assert "stopped" in k.run(f"%mesh stop {MESH}", timeout=60).stdout
        for agent in joiner.agents.values():
            agent.wait(30)
    finally:
        k.shutdown_and_check()
