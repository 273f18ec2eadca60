"""Elastic shrink that drops ranks or hosts anywhere: the survivors are renumbered.

One real kernel for the module, real ranks. Three hosts of one rank each train a
``--bg`` DDP loop (the loop of ``test_elastic``: each step splits a batch of 12 by
``state.rank::state.world_size``, so the losses do not depend on the world size) with
``--on-failure shrink:2``; host 1's agent (the middle one) is killed: the loop goes on
at world size 2 without restarting anybody, the old rank 2 is rank 1 now (``RANK``,
``dist.get_rank()``, ``state.rank``), and the losses are those of one process. Between
cells, ``%mesh shrink NAME --drop-ranks 1`` renumbers a 4-rank mesh: environments,
process group, the mesh handle, an actor mesh spawned before, ``%remote``/``%pull``/
``%push``, and the mesh handles an actor of another mesh holds all follow; a grow after
works. Bad input gets one line that says what to do.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

import pytest
from helpers import wait_until
from kernel_client import Kernel
from test_elastic import BATCH, SETUP, STEPS, reference_losses, usage_error, value

pytestmark = pytest.mark.local

#: test_elastic's loop, which also records the rank each step ran as (``state.rank``,
#: the process group's rank and ``RANK``).
TRAIN = """\
%%remote {mesh} --bg
losses, worlds, ranks = [], [], []
extra = {{"losses": losses, "worlds": worlds}}
state = TrainingState(model=model, optimizer=opt, extra=extra)
while state.step < {steps}:
    with state.stepping():
        x, y = batch(state.step)
        mine = slice(state.rank, None, state.world_size)  # re-split at every step
        loss = F.mse_loss(model(x[mine]), y[mine])
        opt.zero_grad()
        loss.backward()
        total = loss.detach() * x[mine].shape[0]
        dist.all_reduce(total)
        losses.append(round(total.item() / {batch}, 7))
        worlds.append(state.world_size)
        ranks.append((state.rank, dist.get_rank(), int(os.environ["RANK"])))
        opt.step()
    progress = state.step
    time.sleep(0.02)
"""

ACTORS = """\
import os
from monarch_kernel.actor import Actor, endpoint, current_rank

class Who(Actor):
    @endpoint
    def who(self):
        return (current_rank().rank, int(os.environ["RANK"]), os.getpid())

class Holder(Actor):
    '''Keeps the mesh handles it is given (a ProcMesh and an ActorMesh of another mesh).'''

    def __init__(self, procs, who):
        self.procs, self.who = procs, who

    @endpoint
    def look(self):
        return (dict(self.procs.sizes), len(self.who), self.who.who.call().get().values())
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic-drop")
    k = Kernel()
    r = k.run(f"import os; os.chdir({str(work)!r})")
    assert not r.errors, r.error_text
    yield k
    k.shutdown_and_check()


def remote(kernel: Kernel, mesh: str, expr: str, timeout: float = 60) -> list[Any]:
    """``expr`` on every rank of ``mesh``, in rank order."""
    return value(kernel, f"_v = %remote {mesh} {expr}\nlist(_v.values())", timeout)


#: A set-up cell (new ranks of a grow run it too).
IMPORTS = (
    "%%remote {mesh} --setup\nimport os, torch, torch.distributed as dist\n"
    "from monarch_kernel.actor import current_rank"
)
#: Every rank's part of an all_reduce of ones over the process group: the world size.
ALL_REDUCE = "(lambda t: (dist.all_reduce(t), t.item())[1])(torch.ones(1))"


def wait_progress(kernel: Kernel, mesh: str, at_least: int) -> int:
    seen = [0]

    def far() -> bool:
        seen[0] = int(value(kernel, f"_p = %pull {mesh} progress\nlist(_p.values())[0]"))
        return seen[0] >= at_least

    wait_until(far, timeout=60, what=f"the loop to reach step {at_least}")
    return seen[0]


def start_training(kernel: Kernel, mesh: str) -> tuple[list[int], str]:
    """Run the set-up cell and start :data:`TRAIN` as a ``--bg`` job on ``mesh``, and
    wait for its step 20: the ranks' pids and the job's message id."""
    r = kernel.run(SETUP.format(mesh=mesh, batch=BATCH), timeout=120)
    assert not r.errors, r.error_text
    pids = remote(kernel, mesh, "os.getpid()")
    job = kernel.submit(TRAIN.format(mesh=mesh, steps=STEPS, batch=BATCH))
    assert not kernel.collect(job, timeout=60).errors
    wait_progress(kernel, mesh, 20)
    return pids, job


def test_on_failure_shrink_drops_the_middle_host_while_training(kernel):
    mesh = "eld"
    r = kernel.run(f"%mesh {mesh} --gpus 1 --hosts 3 --dist --on-failure shrink:2", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        pids, job = start_training(kernel, mesh)
        agents = value(kernel, f"[h.pid for h in {mesh}.runtime.hosts]")
        os.kill(agents[1], signal.SIGKILL)  # host 1 (rank 1), the middle one: lost for good
        kernel.wait_for_output(job, "[resized] rank 1 died", timeout=60)
        said = "\n".join(kernel.output_so_far(job))
        assert re.search(
            r"world size 3 → 2 at step [\d,]+; host 1 \(rank 1\) dropped; rank 2 → 1 "
            r"renumbered; paused [\d.]+ s, no survivor restarted",
            said,
        ), said
        outcome = remote(
            kernel,
            mesh,
            "(state.step, losses, worlds, ranks, os.getpid(), os.environ['RANK'], "
            "os.environ['GROUP_RANK'], os.environ['WORLD_SIZE'], dist.get_rank(), "
            "dist.get_world_size(), state.rank)",
            timeout=120,
        )
        assert [o[0] for o in outcome] == [STEPS] * 2, kernel.output_so_far(job)
        # the survivors are the processes of old ranks 0 and 2, renumbered 0 and 1
        assert [o[4] for o in outcome] == [pids[0], pids[2]]
        assert [o[5:] for o in outcome] == [("0", "0", "2", 0, 2, 0), ("1", "1", "2", 1, 2, 1)]
        steps, losses, worlds, ranks, *_ = outcome[1]
        at = worlds.index(2)
        assert worlds == [3] * at + [2] * (STEPS - at) and at >= 20, worlds
        assert ranks == [(2, 2, 2)] * at + [(1, 1, 1)] * (STEPS - at)
        assert outcome[0][3] == [(0, 0, 0)] * STEPS
        assert outcome[0][1] == losses
        assert losses == pytest.approx(reference_losses(), rel=1e-5, abs=1e-6)
        # the replicas are identical after
        digests = value(
            kernel,
            f"_d = %remote {mesh} __import__('monarch_kernel.rank.replicas.replicas', "
            "fromlist=['_']).digest_namespace(globals())\n"
            "[sorted((o.name, o.digest) for o in d.objects) for d in _d.values()]",
        )
        assert len(digests[0]) >= 2 and digests[0] == digests[1], digests
        # the mesh's records, its handle and the sidebar's picture follow
        shape = value(
            kernel,
            f"(dict({mesh}.sizes), [(i.rank, i.host, i.pid) for i in {mesh}.runtime.ranks], "
            f"[h.index for h in {mesh}.runtime.hosts])",
        )
        assert shape == ({"hosts": 2, "gpus": 1}, [(0, 0, pids[0]), (1, 1, pids[2])], [0, 1])
        sidebar = value(
            kernel,
            "from monarch_kernel.kernel.lab import LabPublisher\n"
            f"_m = LabPublisher()._mesh({mesh}.runtime)\n"
            "(_m['world'], _m['shape'], [[r['rank'] for r in h['ranks']] for h in _m['hosts']])",
        )
        assert sidebar == (2, "hosts=2 × gpus=1", [[0], [1]]), sidebar
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)


def test_drop_rank_0_while_training(kernel):
    """``%mesh shrink --drop-ranks 0`` during a ``--bg`` loop: at a step boundary, rank 0
    (the rendezvous of the process group) leaves, ranks 1-2 go on as 0-1."""
    mesh = "dt"
    r = kernel.run(f"%mesh {mesh} --gpus 3 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        pids, job = start_training(kernel, mesh)
        r = kernel.run(f"%mesh shrink {mesh} --drop-ranks 0", timeout=120)
        assert re.search(
            r"world size 3 → 2 at step [\d,]+; rank 0 dropped; ranks 1-2 → 0-1 renumbered; "
            r"paused [\d.]+ s, no survivor restarted",
            r.stdout,
        ), r.stdout + r.stderr
        outcome = remote(
            kernel, mesh, "(state.step, losses, worlds, ranks, os.getpid())", timeout=120
        )
        assert [o[0] for o in outcome] == [STEPS] * 2, kernel.output_so_far(job)
        assert [o[4] for o in outcome] == pids[1:]
        steps, losses, worlds, ranks, _ = outcome[0]
        at = worlds.index(2)
        assert ranks == [(1, 1, 1)] * at + [(0, 0, 0)] * (STEPS - at)
        assert outcome[1][3] == [(2, 2, 2)] * at + [(1, 1, 1)] * (STEPS - at)
        assert outcome[1][1] == losses
        assert losses == pytest.approx(reference_losses(), rel=1e-5, abs=1e-6)
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)


def test_drop_a_rank_between_cells_renumbers_everything_that_names_it(kernel):
    mesh = "dr"
    r = kernel.run(f"%mesh {mesh} --gpus 4 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    r = kernel.run("%mesh hold --gpus 1", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        assert not kernel.run(IMPORTS.format(mesh=mesh)).errors
        r = kernel.run(ACTORS + f"who = {mesh}.spawn('who', Who)\n")
        assert not r.errors, r.error_text
        r = kernel.run(f"holder = hold.spawn('holder', Holder, {mesh}, who)")
        assert not r.errors, r.error_text
        pids = remote(kernel, mesh, "os.getpid()")
        r = kernel.run(f"%remote {mesh} mine = os.getpid()")
        assert not r.errors, r.error_text

        r = kernel.run(f"%mesh shrink {mesh} --drop-ranks 1", timeout=120)
        assert not r.errors, r.error_text
        assert re.search(
            r"mesh 'dr': world size 4 → 3; rank 1 dropped; ranks 2-3 → 1-2 renumbered; "
            r"paused [\d.]+ s, no survivor restarted",
            r.stdout,
        ), r.stdout + r.stderr
        kept = [pids[0], pids[2], pids[3]]
        envs = remote(
            kernel,
            mesh,
            "(os.getpid(), mine, os.environ['RANK'], os.environ['LOCAL_RANK'], "
            "os.environ['WORLD_SIZE'], dist.get_rank(), dist.get_world_size(), "
            "current_rank().rank)",
        )
        assert envs == [(p, p, str(i), str(i), "3", i, 3, i) for i, p in enumerate(kept)], envs
        # a collective over the re-formed group, and the mesh handle's shape
        sums = remote(kernel, mesh, ALL_REDUCE)
        assert sums == [3.0, 3.0, 3.0]
        assert value(kernel, f"(dict({mesh}.sizes), len({mesh}))") == ({"gpus": 3}, 3)
        # the actor mesh spawned before: every survivor, by its new rank
        assert value(kernel, "who.who.call().get().values()") == [
            (i, i, p) for i, p in enumerate(kept)
        ]
        assert value(kernel, "who.slice(gpus=2).who.call_one().get()") == (2, 2, pids[3])
        # cells, pull and push address the new ranks
        r = kernel.run(f"%%remote {mesh} --ranks 1 --out one\nos.getpid()")
        assert not r.errors, r.error_text
        assert value(kernel, "list(one.values())") == [pids[2]]
        r = kernel.run(f"%push {mesh} seven=7")
        assert not r.errors, r.error_text
        assert value(kernel, f"_p = %pull {mesh} mine\nlist(_p.values())") == kept
        assert value(kernel, f"_p = %pull {mesh} seven\nlist(_p.values())") == [7, 7, 7]
        # the handles an actor of another mesh keeps cover the new shape and addresses
        assert value(kernel, "holder.look.call_one().get()") == (
            {"gpus": 3},
            3,
            [(i, i, p) for i, p in enumerate(kept)],
        )

        # a grow after the drop: the new rank comes after the last one
        r = kernel.run(f"%mesh grow {mesh} --ranks +1", timeout=120)
        assert "world size 3 → 4; rank 3 started" in r.stdout, r.stdout + r.stderr
        who = value(kernel, "who.who.call().get().values()")
        assert who[:3] == [(i, i, p) for i, p in enumerate(kept)] and who[3][:2] == (3, 3)
        assert who[3][2] not in pids
        sums = remote(kernel, mesh, ALL_REDUCE)
        assert sums == [4.0] * 4
        # a grow too is seen by the handles an actor holds
        looked = value(kernel, "holder.look.call_one().get()")
        assert looked[:2] == ({"gpus": 4}, 4) and looked[2] == who, looked
        # a renumbered rank restarted: its new process is rank 1, with its actor again
        r = kernel.run(f"%mesh restart {mesh} --ranks 1", timeout=120)
        assert not r.errors, r.error_text
        again = value(kernel, "who.who.call().get().values()")
        assert again[1][:2] == (1, 1) and again[1][2] not in (*pids, who[3][2]), again
        assert again[:1] + again[2:] == who[:1] + who[2:]
        assert remote(kernel, mesh, "os.environ['RANK']") == ["0", "1", "2", "3"]
        assert remote(kernel, mesh, ALL_REDUCE) == [4.0] * 4
        assert value(kernel, "holder.look.call_one().get()")[2] == again
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)
        kernel.run("%mesh stop hold", timeout=60)


def test_on_failure_shrink_drops_a_dead_middle_rank_between_cells(kernel):
    mesh = "dk"
    r = kernel.run(f"%mesh {mesh} --gpus 3 --dist --on-failure shrink:2", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        assert not kernel.run(IMPORTS.format(mesh=mesh)).errors
        pids = remote(kernel, mesh, "os.getpid()")
        r = kernel.run(f"%%remote {mesh} --ranks 1\nos.kill(os.getpid(), 9)", timeout=60)
        assert "The failure policy (shrink) goes on without it" in r.error_text, r.error_text
        print(r.stderr)
        wait_until(
            lambda: (
                value(kernel, f"[i.state.value for i in {mesh}.runtime.ranks]") == ["idle", "idle"]
            ),
            timeout=60,
            what="the mesh to go on without rank 1",
        )
        envs = remote(kernel, mesh, "(os.getpid(), os.environ['RANK'], dist.get_rank())")
        assert envs == [(pids[0], "0", 0), (pids[2], "1", 1)], envs
        assert remote(kernel, mesh, ALL_REDUCE) == [2.0, 2.0]
        assert value(kernel, f"dict({mesh}.sizes)") == {"gpus": 2}
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)


def test_drop_a_host_between_cells_renumbers_hosts(kernel):
    mesh = "dh"
    r = kernel.run(f"%mesh {mesh} --gpus 1 --hosts 3 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        assert not kernel.run(IMPORTS.format(mesh=mesh)).errors
        pids = remote(kernel, mesh, "os.getpid()")
        r = kernel.run(f"%mesh shrink {mesh} --drop-hosts 0", timeout=120)
        assert re.search(
            r"world size 3 → 2; host 0 \(rank 0\) dropped; ranks 1-2 → 0-1 renumbered",
            r.stdout,
        ), r.stdout + r.stderr
        envs = remote(
            kernel,
            mesh,
            "(os.getpid(), os.environ['RANK'], os.environ['GROUP_RANK'], "
            "os.environ['WORLD_SIZE'], dist.get_rank())",
        )
        assert envs == [(pids[1], "0", "0", "2", 0), (pids[2], "1", "1", "2", 1)], envs
        sums = remote(kernel, mesh, ALL_REDUCE)
        assert sums == [2.0, 2.0]
        r = kernel.run(f"%mesh grow {mesh} --hosts +1", timeout=120)
        assert "world size 2 → 3; rank 2 started" in r.stdout, r.stdout + r.stderr
        envs = remote(kernel, mesh, "(os.environ['RANK'], os.environ['GROUP_RANK'])")
        assert envs == [("0", "0"), ("1", "1"), ("2", "2")]
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)


def test_bad_drops_say_what_to_do(kernel):
    mesh = "bd"
    r = kernel.run(f"%mesh {mesh} --gpus 4 --on-failure shrink:3", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        errors = {
            f"%mesh shrink {mesh} --drop-ranks 0-3": "drops every rank; a mesh keeps at least 1",
            f"%mesh shrink {mesh} --drop-ranks 7": "has no rank 7 (its ranks are 0-3)",
            f"%mesh shrink {mesh} --drop-hosts 2": "has no host 2 (its hosts are 0)",
            f"%mesh shrink {mesh} --drop-ranks one": "takes numbers separated by commas",
            f"%mesh shrink {mesh} --drop-ranks 1 --ranks 2": "not both",
            f"%mesh shrink {mesh} --drop-ranks 1,2": "below the mesh's minimum of 3",
            f"%mesh shrink {mesh} --ranks 2": "below the mesh's minimum of 3",
            "%mesh shrink nosuch --drop-ranks 1": "no mesh named 'nosuch'",
        }
        for line, expected in errors.items():
            assert expected in usage_error(kernel, line), line
        # a cell that runs on the ranks (not a TrainingState loop) keeps them
        job = kernel.submit(
            f"%%remote {mesh} --bg\nimport time\nstop = False\nwhile not stop:\n"
            "    time.sleep(0.01)"
        )
        assert not kernel.collect(job).errors
        text = usage_error(kernel, f"%mesh shrink {mesh} --drop-ranks 1")
        assert "removes ranks that run a cell" in text and "not a TrainingState loop" in text
        r = kernel.run(f"%push {mesh} stop=True")
        assert not r.errors, r.error_text
        r = kernel.run(f"%remote {mesh} stop", timeout=60)  # runs once the --bg cell ended
        assert not r.errors, r.error_text
        assert value(kernel, f"len({mesh})") == 4  # nothing was changed by the refusals
        # a multi-host mesh drops whole hosts
        r = kernel.run("%mesh bh --gpus 2 --hosts 2", timeout=120)
        assert "ready" in r.stdout, r.stderr + r.error_text
        text = usage_error(kernel, "%mesh shrink bh --drop-ranks 1")
        assert "drop whole hosts (--drop-hosts 0)" in text, text
    finally:
        kernel.run(f"%mesh stop {mesh}", timeout=60)
        kernel.run("%mesh stop bh", timeout=60)


def test_the_dashboard_follows_a_drop_in_process():
    """A dashboard open on the mesh: its tiles, a metric's series per rank and its
    status follow the renumbering (each series stays with its process)."""
    from monarch_kernel.actor import this_host
    from monarch_kernel.kernel.remote import RemoteJob
    from monarch_kernel.widgets import dashboard

    procs = this_host().spawn_procs(per_host={"gpus": 3}, name="dd")
    try:
        dash = dashboard(procs)
        code = "import os, monarch_kernel\nmonarch_kernel.report(step=1, pid=os.getpid())\n"
        RemoteJob(procs, code, "1", None).start().wait(timeout=30)
        wait_until(lambda: len(dash.state.metrics.get("pid", {})) == 3, what="every rank's metric")
        pids = [i.pid for i in procs.runtime.ranks]
        report = procs.shrink(drop_ranks=[0])
        assert report.describe().startswith("mesh 'dd': world size 3 → 2; rank 0 dropped; ")
        wait_until(lambda: "rank 0 dropped" in dash.status, what="the status")
        wait_until(lambda: len(dash._views) == 2, what="two tiles")
        series = dash.state.metrics["pid"]
        assert {r: s.last[1] for r, s in series.items() if s.last} == {0: pids[1], 1: pids[2]}
        assert [dash.state.tile(r).pid for r in range(2)] == [str(pids[1]), str(pids[2])]
        assert [r.rank for r in procs.runtime.ranks] == [0, 1] and len(procs) == 2
    finally:
        procs.stop()
