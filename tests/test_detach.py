"""Detachable meshes: the kernel can die, the training lives (``--detachable``,
``%mesh attach``), through real kernels, ranks and sockets.

Every test runs in a :class:`~detach_place.Place` (a TMPDIR and a Jupyter runtime
directory of its own) and ends with nothing of it left: no process started with its
TMPDIR, wherever it was re-parented to, and no ``mk-*`` temporary directory.
"""

from __future__ import annotations

import os
import re
import signal
import stat
import time

import psutil
import pytest
from conftest import pid_alive
from detach_place import Place, log_has, ok, steps
from helpers import wait_until
from kernel_client import Kernel

from monarch_kernel.controller.attach_file import read as read_attach_file
from monarch_kernel.controller.detach.attach import DeskClient
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
#: A DDP loop's body that reads ``lr`` and ``stop`` each step (test_detach_join too).
#: The ranks agree on ``stop`` before each step: ``%push`` reaches each rank at a moment
#: of its own, and a rank that left the loop a step before the other would leave that
#: one in DDP's all-reduce until gloo's timeout (test_detach_join failed so).
LOOP_BODY = """import time, monarch_kernel
while True:
    halt = torch.tensor([float(stop)])
    dist.all_reduce(halt, op=dist.ReduceOp.MAX)
    if halt.item():
        break
    step += 1
    for group in opt.param_groups:
        group["lr"] = lr
    loss = model(torch.ones(8, 4)).pow(2).mean()
    opt.zero_grad(); loss.backward(); opt.step()
    monarch_kernel.report(step=step, loss=loss.item())
    print(f"step {step} lr {lr}", flush=True)
    time.sleep(0.05)
"""
LOOP = "%%remote dm --bg\n" + LOOP_BODY


def _all_ended(pids: list[int], timeout: float) -> None:
    wait_until(
        lambda: not any(pid_alive(p) for p in pids),
        timeout=timeout,
        what="the mesh's processes to end",
        detail=lambda: f"alive: {[p for p in pids if pid_alive(p)]}",
    )


ACTOR = """from monarch_kernel.actor import Actor, endpoint
class Counter(Actor):
    def __init__(self):
        self.n = 0
    @endpoint
    def incr(self):
        self.n += 1
        return self.n
counters = dm.spawn("counters", Counter)
counters.incr.call().get()
"""
#: The loss series of rank 0 as the dashboard charts it: (first step, points reported).
CHARTED = (
    "st = dm.dashboard().state; st.drain(); s = st.metrics['loss'][0]; "
    "print('charted', s.points()[0][0], s.count)"
)


def _start_training(place: Place):
    """A kernel with mesh ``dm`` (setup cell, DDP model, an actor) training in the
    background; the kernel and the ``--bg`` cell's message id."""
    k = place.kernel()
    r = ok(k, "%mesh dm --gpus 2 --detachable --keep 10m")
    assert "is detachable" in r.stdout and "%mesh attach dm" in r.stdout
    ok(k, SETUP)
    ok(k, MODEL)
    ok(k, ACTOR)
    job = k.submit(LOOP)
    k.wait_for_output(job, "step 3 lr 0.1")
    wait_until(lambda: place.attach_file("dm")["jobs"], timeout=10, what="the job in the file")
    return k


def test_killed_kernel_mesh_trains_on_and_a_new_kernel_takes_it_over(place):
    k1 = _start_training(place)
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
    assert "cell 5" in listed  # what runs on it: the --bg cell
    attach = k2.submit("jobs = %mesh attach dm")
    k2.wait_for_output(attach, "attached mesh 'dm'")
    at_attach = steps(log)
    # live output resumes in the job's block under this cell
    k2.wait_for_output(attach, f"step {at_attach + 5} lr 0.1")
    r = k2.collect(attach)
    assert not r.errors, r.error_text
    assert "2/2 ranks running" in r.stdout and "actor meshes back: counters" in r.stdout
    assert "printed while no kernel was attached" in r.stdout
    shown = [int(n) for n in re.findall(r"^\[1\] step (\d+) lr 0.1$", r.stdout, re.M)]
    assert len(shown) == 10 and min(shown) > at_kill and max(shown) <= at_attach, shown
    assert "running" in ok(k2, "repr(jobs[0])").text
    # the dashboard charts the whole run: from step 1, through the time without a kernel
    charted = ok(k2, CHARTED).stdout.split()
    assert charted[1] == "1.0" and int(charted[2]) >= at_attach - 1, charted

    pulled = [int(v) for v in re.findall(r"}: (\d+)", ok(k2, "%pull dm step").text)]
    assert len(pulled) == 2 and min(pulled) >= at_kill + 10, pulled
    ok(k2, "%push dm lr=0.5")
    wait_until(lambda: log_has(log, "lr 0.5"), timeout=30, what="the pushed lr in use")
    ok(k2, "%push dm stop=True")
    ok(k2, "jobs[0].wait()")
    assert "done in" in ok(k2, "repr(jobs[0])").text
    r = ok(k2, "%%remote dm\nstep > 0, lr, dist.get_world_size()")
    assert r.text.count("(True, 0.5, 2)") == 2, r.text
    assert "{gpus=0}: 2" in ok(k2, "counters.incr.call().get()").text  # the actor's state
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


def test_restart_kernel_keeps_the_mesh_and_its_job(place):
    k = _start_training(place)
    pids = place.mesh_pids("dm")
    place.restart(k)
    assert all(pid_alive(p) for p in pids)
    # the dashboard the old kernel showed is replaced by its last state, saying why
    retired = [
        m["content"]["data"]
        for m in k.other
        if m["msg_type"] == "update_display_data" and "mk-dash-retired" in str(m["content"])
    ]
    assert len(retired) == 1 and set(retired[0]) == {"text/html", "text/plain"}, k.other[-3:]
    assert "mesh 'dm' runs on" in retired[0]["text/plain"]
    # the snapshot's header says the mesh runs on, not that it stopped
    assert "detached: runs on without this kernel" in retired[0]["text/plain"], retired[0]
    assert "%mesh attach dm" in retired[0]["text/html"] and "rank 1" in retired[0]["text/plain"]
    r = ok(k, "jobs = %mesh attach dm\nprint(repr(jobs[0]))")
    assert "2/2 ranks running" in r.stdout and "cell 5 on dm ranks [0, 1]: running" in r.stdout
    ok(k, "jobs[0].cancel()")
    ok(k, "import contextlib\nwith contextlib.suppress(Exception):\n    jobs[0].wait(30)")
    assert "cancelled" in ok(k, "repr(jobs[0])").text
    ok(k, "%mesh stop dm")
    _all_ended(pids, timeout=30)


def test_failure_policy_works_while_detached(place):
    k1 = place.kernel()
    ok(k1, "%mesh dm --gpus 2 --detachable")
    ok(k1, SETUP)
    place.kill(k1)
    rank1 = place.attach_file("dm")["ranks"][1]["pid"]
    os.kill(rank1, 9)  # while no kernel holds the mesh
    file = read_attach_file(place.attach_path("dm"))
    client = DeskClient(file)
    me = ControllerId.of_this_process()

    def restarted():
        status = client.ask(file.hosts[0], DeskRequest(DeskOp.STATUS, me), 5)
        ranks = {s.rank: s for s in (status.ranks if status else ())}
        return 1 in ranks and ranks[1].alive and ranks[1].restarts == 1

    wait_until(restarted, timeout=30, what="its host agent to restart rank 1")
    k2 = place.kernel()
    r = ok(k2, "%mesh attach dm")
    assert "rank 1 died while detached (killed by SIGKILL) and was restarted" in r.stdout
    r = ok(k2, "%%remote dm\nlr")  # waits for the re-forming: the setup cell ran again
    assert "{gpus=1}: 0.1" in r.text, r.text
    pids = place.mesh_pids("dm")
    ok(k2, "%mesh stop dm")
    _all_ended(pids, timeout=30)


def test_a_bg_job_says_it_is_failing_while_other_ranks_still_run_it(place):
    k = place.kernel()
    ok(k, "%mesh m --gpus 2 --on-failure continue")
    job = k.submit(
        "%%remote m --bg\nimport os, time\nif os.environ['RANK'] == '1':\n    1 / 0\n"
        "while True:\n    time.sleep(0.05)"
    )
    k.wait_for_output(job, "failing: rank(s) 1 failed, the others still run")
    ok(k, "j = _monarch_magics.jobs[-1]")
    assert "failing: rank(s) 1 failed" in ok(k, "repr(j)").text
    ok(k, "j.cancel()\nimport contextlib\nwith contextlib.suppress(Exception):\n    j.wait(30)")
    assert ": failed" in ok(k, "repr(j)").text or "cancelled" in ok(k, "repr(j)").text
    ok(k, "%mesh stop m")


def _fast_loop(place: Place, name: str) -> tuple[Kernel, str]:
    """A kernel running a loop of tens of thousands of reports a second on a detachable
    one-rank mesh ``name``, once it runs; and that rank's log."""
    k1 = place.kernel()
    ok(k1, f"%mesh {name} --gpus 1 --detachable --keep 5m")
    k1.submit(
        f"%%remote {name} --bg\nimport monarch_kernel\nstep = 0\nwhile True:\n"
        "    step += 1\n    for _ in range(100):\n        monarch_kernel.report(step=step)\n"
        "    print(f'step {step} lr 0.1', flush=True)"
    )
    log = place.rank_log(name, 0)
    wait_until(lambda: steps(log) > 100, timeout=60, what="the loop to run")
    return k1, log


def _runs_on_then_stops(place: Place, log: str, name: str) -> None:
    """The loop of :func:`_fast_loop` makes 2,000 more steps with its kernel gone; then a
    new kernel stops the mesh, and none of its processes is left."""
    at_kill = steps(log)
    wait_until(lambda: steps(log) > at_kill + 2_000, timeout=60, what="2k steps with no kernel")
    pids = place.mesh_pids(name)
    k2 = place.kernel()
    assert f"mesh '{name}' stopped" in ok(k2, f"%mesh stop {name}").stdout
    _all_ended(pids, timeout=30)


def test_a_fast_loop_never_blocks_when_its_kernel_dies(place):
    """Tens of thousands of reports a second: nothing may wait for a kernel that is gone
    (its queue fills in a millisecond, long before the rank hears it is gone, and a
    send that waits for room there would wait forever)."""
    k1, log = _fast_loop(place, "df")
    place.kill(k1)
    _runs_on_then_stops(place, log, "df")


def test_a_fast_loop_runs_on_when_its_kernel_is_frozen_then_killed(place):
    """The kernel stops reading (frozen) while the loop floods it: the rank's queue to it
    fills and every sender waits for room, the control thread too, at its next ``stats``.
    That thread is the one that hears the connection drop: once the frozen kernel is
    killed it must still hear it, and the loop go on (it waited forever while the
    waiting sender held the send lock, or the control thread waited for room itself)."""
    k1, log = _fast_loop(place, "dz")
    pid = place.kernel_pid(k1)
    os.kill(pid, signal.SIGSTOP)
    try:
        # The loop stalls once the queue is full; past a stats tick (once a second) the
        # control thread waits for room too.
        seen = {"steps": -1, "since": time.monotonic()}

        def stalled_for_2s() -> bool:
            now, n = time.monotonic(), steps(log)
            if n != seen["steps"]:
                seen.update(steps=n, since=now)
            return now - seen["since"] >= 2.0

        wait_until(stalled_for_2s, timeout=60, what="the loop to wait for the frozen kernel")
    finally:
        place.kill(k1)  # SIGKILL ends a stopped process too
    _runs_on_then_stops(place, log, "dz")


def test_mesh_stops_by_itself_once_keep_runs_out(place):
    k1 = place.kernel()
    ok(k1, "%mesh dk --gpus 2 --detachable --keep 3s")
    pids = place.mesh_pids("dk")
    place.kill(k1)
    t0 = time.monotonic()
    assert all(pid_alive(p) for p in pids)  # not at once: it waits for a kernel
    _all_ended(pids, timeout=60)
    assert time.monotonic() - t0 > 1.5, "the mesh ended long before its --keep ran out"
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


def test_an_agent_cleans_up_however_many_sigterms_come(short_tmp, monkeypatch):
    """A kernel killed outright ends its threads one by one, and its agents' parent-death
    signal (SIGTERM) comes again as each thread they were re-parented to ends. The first
    ends an agent; the others must not cut its clean-up short (they did: the agent ended
    by a second SystemExit, or killed by a third SIGTERM, leaving its directory and its
    kernel's behind, and test_killed_kernels_temp_dirs_are_removed failed)."""
    import tempfile

    from monarch_kernel.launchers.local import LocalLauncher

    monkeypatch.setattr(tempfile, "tempdir", str(short_tmp))
    launcher = LocalLauncher()
    try:
        launcher.prewarm(1)
        agent = launcher._pool[0]
        pid = agent.proc.pid
        # it starts its template once its SIGTERM handler is in place
        wait_until(lambda: psutil.Process(pid).children(), timeout=30, what="its template")
        deadline = time.monotonic() + 30
        while os.path.exists(agent.private_dir) and time.monotonic() < deadline:
            if agent.proc.poll() is not None:
                break
            os.kill(pid, signal.SIGTERM)  # one after another, as fast as they go
        assert agent.proc.wait(30) == 0, "the agent did not end by its own clean-up"
        assert not os.path.exists(agent.private_dir)
    finally:
        launcher.shutdown()


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
    wait_until(
        lambda: not place.temp_dirs(),
        timeout=30,
        what="the temp dirs to be removed",
        detail=place.describe_temp_dirs,
    )
