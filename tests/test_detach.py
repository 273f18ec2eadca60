"""Detachable meshes: the kernel can die, the training lives (``--detachable``,
``%mesh attach``), through real kernels, ranks and sockets.

Every test runs in a :class:`~detach_place.Place` (a TMPDIR and a Jupyter runtime
directory of its own) and ends with nothing of it left: no process started with its
TMPDIR, wherever it was re-parented to, and no ``mk-*`` temporary directory.
"""

from __future__ import annotations

import os
import re
import stat
import time

import pytest
from conftest import pid_alive
from detach_place import Place, log_has, ok, steps
from helpers import wait_until

from monarch_kernel.controller.attach import DeskClient
from monarch_kernel.controller.attach_file import read as read_attach_file
from monarch_kernel.wire import Codec
from monarch_kernel.wire.desk import DESK, ControllerId, DeskOp, DeskRequest

pytestmark = pytest.mark.local

#: A data-parallel training loop (gloo, DDP) that reads its learning rate and its stop
#: flag from the rank's namespace each step, so ``%push`` steers it.
SETUP = """%%remote dm --setup
import torch, torch.distributed as dist
lr, stop, step = 0.1, False, 0
"""
MODEL = """%%remote dm
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""
LOOP = """%%remote dm --bg
import time, monarch_kernel
while not stop:
    step += 1
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    monarch_kernel.report(step=step, loss=loss.item())
    print(f"step {step} lr {lr}", flush=True)
    time.sleep(0.05)
"""


@pytest.fixture
def place():
    p = Place()
    yield p
    left, dirs = p.close()
    assert not left, f"processes left behind: {left}"
    assert not dirs, f"temporary directories left behind: {dirs}"


def _all_ended(pids: list[int], timeout: float) -> None:
    wait_until(
        lambda: not any(pid_alive(p) for p in pids),
        timeout=timeout,
        what="the mesh's processes to end",
        detail=lambda: f"alive: {[p for p in pids if pid_alive(p)]}",
    )


def test_killed_kernel_mesh_trains_on_and_a_new_kernel_takes_it_over(place):
    k1 = place.kernel()
    r = ok(k1, "%mesh dm --gpus 2 --detachable --keep 10m")
    assert "is detachable" in r.stdout and "%mesh attach dm" in r.stdout
    ok(k1, SETUP)
    ok(k1, MODEL)
    job = k1.submit(LOOP)
    k1.wait_for_output(job, "step 3 lr 0.1")
    path = place.attach_path("dm")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    key = place.attach_file("dm")["key"]
    pids = place.mesh_pids("dm")
    for p in place.processes():  # the key is never on a command line
        assert key not in " ".join(p.cmdline())

    place.kill(k1)
    log = place.rank_log("dm", 1)
    at_kill = steps(log)
    wait_until(lambda: steps(log) >= at_kill + 10, timeout=60, what="steps without a kernel")
    assert all(pid_alive(p) for p in pids)

    k2 = place.kernel()
    listed = ok(k2, "%mesh").text
    assert re.search(r"dm\s+gpus=2\s+1\s+2/2", listed) and "detached" in listed, listed
    assert "cell" in listed  # what runs on it: the --bg cell
    r = ok(k2, "%mesh attach dm")
    assert "attached mesh 'dm'" in r.stdout and "2/2 ranks running" in r.stdout, r.stdout
    pulled = [int(v) for v in re.findall(r"}: (\d+)", ok(k2, "%pull dm step").text)]
    assert len(pulled) == 2 and min(pulled) >= at_kill + 10, pulled
    ok(k2, "%push dm lr=0.5")
    wait_until(lambda: log_has(log, "lr 0.5"), timeout=30, what="the pushed lr in use")
    ok(k2, "%push dm stop=True")
    r = ok(k2, "%%remote dm\nstep > 0, lr, dist.get_world_size()")
    assert r.text.count("(True, 0.5, 2)") == 2, r.text
    # the failure policy and the --setup cell came back with the mesh
    assert "import torch, torch.distributed" in ok(k2, "%mesh setup dm").stdout
    killed = place.attach_file("dm")["ranks"][1]["pid"]
    os.kill(killed, 9)
    wait_until(
        lambda: place.attach_file("dm")["ranks"][1]["pid"] != killed,
        timeout=60,
        what="rank 1 to be restarted",
    )
    r = ok(k2, "%%remote dm\nlr, dist.get_world_size()")
    assert "{gpus=0}: (0.5, 2)" in r.text and "{gpus=1}: (0.1, 2)" in r.text, r.text

    pids = place.mesh_pids("dm")
    assert "stopped" in ok(k2, "%mesh stop dm").stdout
    _all_ended(pids, timeout=30)
    wait_until(lambda: not os.path.exists(path), timeout=10, what="the attach file to go")


def test_mesh_stops_by_itself_once_keep_runs_out(place):
    k1 = place.kernel()
    ok(k1, "%mesh dk --gpus 2 --detachable --keep 6s")
    pids = place.mesh_pids("dk")
    place.kill(k1)
    t0 = time.monotonic()
    assert all(pid_alive(p) for p in pids)  # not at once: it waits for a kernel
    _all_ended(pids, timeout=60)
    assert time.monotonic() - t0 > 3, "the mesh ended long before its --keep ran out"
    wait_until(lambda: not os.path.exists(place.attach_path("dk")), timeout=10, what="file gone")
    wait_until(lambda: not place.temp_dirs(), timeout=10, what="temp dirs gone")


def test_kernel_shutdown_detaches_and_a_new_kernel_stops_it_without_attaching(place):
    k1 = place.kernel()
    ok(k1, "%mesh ds --gpus 1 --detachable")
    pids = place.mesh_pids("ds")
    kernel_pid = place.kernel_pid(k1)
    k1.shutdown()
    place.forget(k1)
    wait_until(lambda: not pid_alive(kernel_pid), timeout=30, what="the kernel to exit")
    assert all(pid_alive(p) for p in pids)
    k2 = place.kernel()
    r = ok(k2, "%mesh stop ds")
    assert "mesh 'ds' stopped" in r.stdout, r.stdout
    _all_ended(pids, timeout=30)
    assert not os.path.exists(place.attach_path("ds"))
    assert "no mesh named 'ds'" in k2.run("%mesh stop ds").stderr


def test_attach_refused_without_file_forged_replayed_and_while_held(place):
    k1 = place.kernel()
    ok(k1, "%mesh dr --gpus 1 --detachable")
    k2 = place.kernel()
    refused = k2.run("%mesh attach nope").stderr  # a UsageError: one line, no traceback
    assert "no detached mesh named 'nope'" in refused, refused
    refused = k2.run("%mesh attach dr").stderr
    assert f"attached to the kernel (pid {place.kernel_pid(k1)})" in refused, refused
    assert "--force" in refused

    file = read_attach_file(place.attach_path("dr"))
    client = DeskClient(file)
    forged = DeskClient(file)
    forged.codec = Codec(os.urandom(32))
    me = ControllerId.of_this_process()
    answer = forged.ask(file.hosts[0], DeskRequest(DeskOp.ATTACH, me, force=True), 5)
    assert answer is not None and not answer.ok and "not signed" in answer.error
    frames = client.codec.encode({"k": DESK}, DeskRequest(DeskOp.STATUS, me).to_json())
    first, again = _send_twice(file.hosts[0].desk, frames, Codec(bytes.fromhex(file.key)))
    assert first.ok and not again.ok and "replayed" in again.error, (first, again)
    status = client.ask(file.hosts[0], DeskRequest(DeskOp.STATUS, me), 5)
    assert status is not None and status.refused == {"held": 1, "forged": 1, "replayed": 1}

    r = ok(k2, "%mesh attach dr --force")
    assert "taken over from the kernel" in r.stdout, r.stdout
    told = k1.run("%%remote dr\n1").stderr
    assert f"was taken over by the kernel (pid {place.kernel_pid(k2)})" in told, told
    r = ok(k2, "%%remote dr\n6 * 7")
    assert "42" in r.text
    pids = place.mesh_pids("dr")
    ok(k2, "%mesh stop dr")
    _all_ended(pids, timeout=30)


def _send_twice(desk: str, frames: list, codec: Codec) -> tuple:
    """The desk's answers to the same signed request sent twice (the second a replay)."""
    import zmq

    from monarch_kernel.wire.desk import DeskReply

    answers = []
    for _ in range(2):
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(desk)
        sock.send_multipart(frames)
        assert sock.poll(5000), "the desk did not answer"
        answers.append(DeskReply.from_json(bytes(codec.decode(sock.recv_multipart()).payload)))
        sock.close(0)
    return answers[0], answers[1]


def test_killed_kernels_temp_dirs_are_removed(place):
    # no host agent left to clean up after it: the next kernel does
    k1 = place.kernel()
    ok(k1, "%mesh m --gpus 1")
    ok(k1, "%mesh stop m")
    place.kill(k1)
    assert place.temp_dirs(), "expected the killed kernel's launcher directory"
    # killed with a live mesh: its agents clean up
    k2 = place.kernel()
    ok(k2, "%mesh m --gpus 1")
    place.kill(k2)
    wait_until(lambda: not place.temp_dirs(), timeout=30, what="the temp dirs to be removed")
