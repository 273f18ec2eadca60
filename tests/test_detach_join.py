"""A detachable mesh across machines: the ``join`` backend with its host agents in
network namespaces (emulated machines, see ``netns.py``), the kernel on this one.

The agents' desks listen on tcp with CURVE (their own keys; only the mesh controller's
key is admitted), and a kernel that attaches binds the controller's tcp addresses again
with the keys from the attach file: the agents and ranks on the other machines reconnect
by themselves.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import time

import psutil
import pytest
from conftest import pid_alive
from detach_place import Place, log_has, ok, steps
from helpers import wait_until
from netns import Joiner, NetHosts, agent_env, netns_hosts_fixture
from test_detach import LOOP_BODY

pytestmark = pytest.mark.cluster

SETUP = """%%remote jd --setup
import torch, torch.distributed as dist
lr, stop, step = 0.1, False, 0
"""
MODEL = """%%remote jd
import datetime
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""
LOOP = "%%remote jd --bg\n" + LOOP_BODY
#: After the attach: rank 0 calls both ranks directly (across the machines) and rank 1
#: calls an actor of the new kernel's own process, whose answer reaches rank 1's reply
#: socket over TCP: both only if this kernel took the mesh's listener key over (the ranks'
#: listeners admit no other client key, see ``rank.listener_gate``).
PEERS = """\
import socket
from monarch_kernel.actor import Actor, endpoint, this_proc
class Where(Actor):
    @endpoint
    def where(self):
        return socket.gethostname()
    @endpoint
    def ask(self, other):
        return list(other.where.call().get(timeout=30).values())
w = jd.spawn("where", Where)
side = this_proc().spawn("side", Where)
across = w.slice(hosts=0).ask.call_one(w).get(timeout=60)
print("peers", across, w.slice(hosts=1).ask.call_one(side).get(timeout=60))
"""
CHARTED = (
    "st = jd.dashboard().state; st.drain(); s = st.metrics['loss'][0]; "
    "print('charted', s.points()[0][0], s.count)"
)


def _left_in_namespaces(net: NetHosts) -> list[str]:
    """Network namespaces and veths of ``net`` still there."""
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    ours = [h.ns for h in net.hosts if h.ns in names]
    ours += [h.veth for h in net.hosts if re.search(rf"\b{h.veth}\b", links)]
    return ours + ([net.bridge] if re.search(rf"\b{net.bridge}\b", links) else [])


@pytest.fixture(scope="module")
def net():
    gen = netns_hosts_fixture(2)
    hosts = next(gen)
    yield hosts
    next(gen, None)
    assert not _left_in_namespaces(hosts), _left_in_namespaces(hosts)


def _on_hosts(net: NetHosts) -> list[psutil.Process]:
    """Processes running with the emulated machines' TMPDIR (agents and ranks)."""
    out = []
    mine = f"TMPDIR={net.tmp}"
    for p in psutil.process_iter():
        try:
            with open(f"/proc/{p.pid}/environ", "rb") as f:
                environ = f.read().decode(errors="replace").split("\0")
            if mine in environ and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            continue
    return out


def _copy(place: Place, file_name: str, mode: int = 0o600, **changes: object) -> str:
    """A copy of mesh ``jd``'s attach file (as brought from another machine), with
    ``changes`` made to it; its path."""
    folder = os.path.join(place.tmp, "copies")
    os.makedirs(folder, mode=0o700, exist_ok=True)
    path = os.path.join(folder, file_name)
    with open(path, "w") as f:
        json.dump(dict(place.attach_file("jd"), **changes), f)
    os.chmod(path, mode)
    return path


def _from_file_refusals(k, place: Place) -> str:
    """``%mesh attach jd --from FILE`` refuses, in one clear line each, a copy others
    can read, one naming another mesh, a forged one, and one whose controller address is
    not this machine's; a faithful copy's path (the attach then uses it)."""
    refusals = {
        _copy(place, "loose.json", 0o644): "readable or writable by others (mode 644)",
        _copy(place, "other.json", name="other"): "attach file of mesh 'other', not 'jd'",
        _copy(place, "forged.json", key=os.urandom(32).hex()): "not signed with this mesh's key",
        _copy(place, "far.json", send="tcp://192.0.2.1:5555", recv="tcp://192.0.2.1:5556"): (
            "an address this machine does not have"
        ),
    }
    for path, why in refusals.items():
        r = k.run(f"%mesh attach jd --from {path}", timeout=60)
        assert why in r.stderr and not r.error_text, (path, r.stderr, r.error_text)
    return _copy(place, "jd.json")


# Long: a join mesh, a DDP loop, a kill, a takeover (about 20 s on an idle machine).
@pytest.mark.timeout(300)
def test_killed_kernel_join_mesh_trains_on_and_a_new_kernel_takes_it_over(net):
    place = Place()
    env = dict(place.env, PYTHONPATH=agent_env()["PYTHONPATH"])
    joiner = Joiner(net)
    try:
        k1 = place.kernel_with(env)
        mid = k1.submit(
            f"%mesh jd --backend join --hosts 2 --gpus 1 --bind {net.gateway} "
            "--detachable --keep 10m"
        )
        k1.wait_for_output(mid, "host 1: python -m monarch_kernel.host --join", timeout=60)
        joiner.progress(k1.output_so_far(mid)[0])
        r = k1.collect(mid, timeout=90)
        assert "is detachable" in r.stdout, r.stdout + r.stderr + r.error_text
        ok(k1, SETUP)
        ok(k1, MODEL)
        job = k1.submit(LOOP)
        k1.wait_for_output(job, "step 3 lr 0.1", timeout=60)
        wait_until(lambda: place.attach_file("jd")["jobs"], timeout=10, what="the job in file")
        file = place.attach_file("jd")
        assert all(h["desk"].startswith("tcp://10.77.") for h in file["hosts"]), file["hosts"]
        assert file["curve"] and file["curve"]["secret"]

        place.kill(k1)
        killed_at = time.monotonic()
        log = place.rank_log("jd", 1)
        at_kill = steps(log)
        wait_until(
            lambda: steps(log) >= at_kill + 10 and time.monotonic() - killed_at >= 2,
            timeout=60,
            what="steps (and 2 s) with no kernel",
        )

        k2 = place.kernel_with(env)
        listed = ok(k2, "%mesh").text  # the hosts' desks answer over tcp (CURVE)
        assert re.search(r"jd\s+hosts=2 × gpus=1\s+2\s+2/2", listed), listed
        good = _from_file_refusals(k2, place)
        t0 = time.monotonic()
        attach = k2.submit(f"jobs = %mesh attach jd --from {good}")
        k2.wait_for_output(attach, "attached mesh 'jd'", timeout=60)
        print(f"\n%mesh attach (join, 2 hosts): 'attached' after {time.monotonic() - t0:.2f}s")
        at_attach = steps(log)
        # live output resumes under this cell (both ranks print the same: ``[0-1] step``)
        k2.wait_for_output(attach, f"step {at_attach + 20} lr 0.1", timeout=60)
        r = k2.collect(attach)
        assert not r.errors, r.error_text
        assert "2/2 ranks running" in r.stdout and "hosts=2" in r.stdout, r.stdout
        assert "printed while no kernel was attached" in r.stdout, r.stdout
        # counted from when the agents last heard the kernel, not from the attach request
        alone = re.search(r"after (\d+)s without a kernel", r.stdout)
        assert alone and int(alone.group(1)) >= 1, r.stdout
        charted = ok(k2, CHARTED).stdout.split()
        assert charted[1] == "1.0" and int(charted[2]) >= at_attach - 1, charted

        pulled = [int(v) for v in re.findall(r"}: (\d+)", ok(k2, "%pull jd step").text)]
        assert len(pulled) == 2 and min(pulled) >= at_kill + 10, pulled
        ok(k2, "%push jd lr=0.5")
        wait_until(lambda: log_has(log, "lr 0.5"), timeout=30, what="the pushed lr in use")
        ok(k2, "%push jd stop=True")
        ok(k2, "jobs[0].wait(60)")
        r = ok(k2, "%%remote jd\nimport socket\nsocket.gethostname(), lr, dist.get_world_size()")
        for h in net.hosts:
            assert f"'{h.name}', 0.5, 2" in r.text, r.text
        names = [h.name for h in net.hosts[:2]]
        assert f"peers {names} [{socket.gethostname()!r}]" in ok(k2, PEERS).stdout

        assert "stopped" in ok(k2, "%mesh stop jd").stdout
        for agent in joiner.agents.values():
            agent.wait(30)
        wait_until(lambda: not _on_hosts(net), timeout=30, what="the ranks on the hosts to end")
        assert not os.path.exists(place.attach_path("jd"))
    finally:
        left, dirs = place.close()
        for agent in joiner.agents.values():
            if agent.poll() is None:
                agent.kill()
    assert not left and not dirs, (left, dirs)
    assert not [n for n in os.listdir(net.tmp) if n.startswith("mk-")], os.listdir(net.tmp)
    assert all(not pid_alive(a.pid) for a in joiner.agents.values())
