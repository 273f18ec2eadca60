"""State from peers: a rank killed mid-training is replaced without a checkpoint.

A real kernel, 4 ranks, gloo, ``%mesh NAME --gpus 4 --dist``, a foreground training
loop over a ``TrainingState``. The test SIGKILLs one rank by pid while the loop runs;
the cell must complete with the survivors' processes untouched, the same parameters on
every rank, no file written, and the per-step losses of an uninterrupted run.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from kernel_client import Kernel

pytestmark = pytest.mark.local

STEPS = 60

SETUP = """\
%%remote {mesh} --setup
import os, time, hashlib, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState
RANK = int(os.environ["RANK"])
RESTARTED = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
PIDS = {pids!r}

def pid_of(rank):
    return int(open(os.path.join(PIDS, f"pid{{rank}}")).read())

class Batches:
    "A deterministic stream of batches, different per rank; its position is its state."
    def __init__(self):
        self.pos = 0
    def next(self):
        g = torch.Generator().manual_seed(1000 * self.pos + RANK)
        self.pos += 1
        x = torch.randn(8, 16, generator=g)
        return x, x[:, :4] * 2 - 1
    def state_dict(self):
        return {{"pos": self.pos}}
    def load_state_dict(self, s):
        self.pos = s["pos"]

def fresh():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    model = DDP(net)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return model, opt, Batches()

def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]

model, opt, batches = fresh()
bodies = 0
if PIDS:  # where the tests that kill a second rank find the others' pids
    open(os.path.join(PIDS, f"pid{{RANK}}"), "w").write(str(os.getpid()))
{extra}  # step bodies run on this rank (not part of the state: counts redone steps)
"""

TRAIN = """\
%%remote {mesh}
losses = []
state = TrainingState(model=model, optimizer=opt, data=batches, extra={{"losses": losses}})
while state.step < {steps}:
    with state.stepping():
        bodies += 1
        x, y = batches.next()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(round(total.item() / 4, 7))
        opt.step()
        if RANK == 0:
            print(f"step {{state.step}}", flush=True)
    time.sleep({pause})
(digest(model), state.step, bodies, losses)
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    work = tmp_path_factory.mktemp("peer-state")
    k = Kernel()
    r = k.run(f"import os; os.chdir({str(work)!r})")  # the ranks start here
    assert not r.errors, r.error_text
    k.work = work  # type: ignore[attr-defined]
    yield k
    k.shutdown_and_check()


def _start(kernel: Kernel, mesh: str, pids: str = "", extra: str = "") -> None:
    r = kernel.run(f"%mesh {mesh} --gpus 4 --dist", timeout=120)
    assert "ready" in r.stdout and not r.errors, r.stdout + r.stderr + r.error_text
    r = kernel.run(SETUP.format(mesh=mesh, pids=pids, extra=extra), timeout=120)
    assert not r.errors, r.error_text


def pids_of(kernel: Kernel, mesh: str) -> list[int]:
    r = kernel.run(f"%remote {mesh} __import__('os').getpid()")
    assert not r.errors, r.error_text
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


def _outcome(kernel: Kernel, mesh: str) -> list[tuple[str, int, int, list[float]]]:
    """Each rank's (digest, step, bodies run, losses) of the last training cell."""
    r = kernel.run(f"_mk_out = %pull {mesh} _mk_result\n[v for v in _mk_out.values()]", timeout=60)
    assert not r.errors, r.error_text
    return eval(r.results[0]["data"]["text/plain"])


def train(kernel: Kernel, mesh: str, pause: float) -> str:
    code = TRAIN.format(mesh=mesh, steps=STEPS, pause=pause)
    return kernel.submit(code.replace("(digest(model)", "_mk_result = (digest(model)"))


def _reference(kernel: Kernel, mesh: str) -> list[float]:
    """Losses of an uninterrupted run from fresh state on the same mesh."""
    r = kernel.run(f"%remote {mesh} model, opt, batches = fresh(); bodies = 0", timeout=60)
    assert not r.errors, r.error_text
    r = kernel.collect(train(kernel, mesh, 0.0), timeout=120)
    assert not r.errors, r.error_text
    runs = _outcome(kernel, mesh)
    assert len({run[0] for run in runs}) == 1, runs
    return runs[0][3]


def test_sigkill_mid_training_is_recovered_from_a_peer(kernel):
    mesh = "ps"
    _start(kernel, mesh)
    pids = pids_of(kernel, mesh)
    cell = train(kernel, mesh, 0.05)
    kernel.wait_for_output(cell, "step 20", timeout=60)
    os.kill(pids[2], signal.SIGKILL)
    r = kernel.collect(cell, timeout=120)
    assert not r.errors, r.error_text + r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "rank 2 died (killed by SIGKILL) at step" in text, text
    assert "copied from rank" in text and "resumed at step" in text, text
    runs = _outcome(kernel, mesh)
    assert len({run[0] for run in runs}) == 1, f"replicas differ: {runs}"
    assert all(run[1] == STEPS for run in runs)
    survivors = [runs[r] for r in (0, 1, 3)]
    assert all(STEPS <= run[2] <= STEPS + 1 for run in survivors), "more than one step lost"
    after = pids_of(kernel, mesh)
    assert [after[r] for r in (0, 1, 3)] == [pids[r] for r in (0, 1, 3)]
    assert after[2] != pids[2]
    assert not list(kernel.work.iterdir()), "a file was written"  # no checkpoint
    losses = runs[0][3]
    assert runs[2][3] == losses  # the restarted rank has the history too
    assert losses == _reference(kernel, mesh)
    kernel.run(f"%mesh stop {mesh}")


def _kill_rank_2_while_training(
    kernel: Kernel, mesh: str, pids_dir: str, extra: str, timeout: float
) -> tuple[list[int], str]:
    """Start ``mesh`` (set-up with ``extra``), SIGKILL rank 2 at step 10 of the training
    cell, and wait for the cell, which must end without an error: the ranks' pids before
    the kill and the cell's output."""
    _start(kernel, mesh, pids_dir, extra)
    pids = pids_of(kernel, mesh)
    cell = train(kernel, mesh, 0.05)
    kernel.wait_for_output(cell, "step 10", timeout=60)
    os.kill(pids[2], signal.SIGKILL)
    r = kernel.collect(cell, timeout=timeout)
    assert not r.errors, r.error_text + r.stdout + r.stderr
    return pids, r.stdout + r.stderr


def check_recovered(kernel: Kernel, mesh: str, pids: list[int], restarted: set[int]) -> None:
    """Every rank at the last step with the same parameters and the losses of an
    uninterrupted run; the ranks not restarted kept their processes."""
    runs = _outcome(kernel, mesh)
    assert len({run[0] for run in runs}) == 1, f"replicas differ: {runs}"
    assert all(run[1] == STEPS for run in runs)
    after = pids_of(kernel, mesh)
    for r in range(4):
        assert (after[r] == pids[r]) == (r not in restarted), (r, pids, after)
    losses = runs[0][3]
    assert all(run[3] == losses for run in runs)
    assert losses == _reference(kernel, mesh)


# The restarted rank 2 kills rank 3 while its set-up cell runs again (the others are
# parked, the process group was just re-formed): a second death during the recovery.
# Once: when the death is noticed before the set-up ends, the next round runs rank 2's
# set-up again (it must not kill the new rank 3, or a rank 3 already gone).
KILL_DURING_SETUP = """KILLED = os.path.join(PIDS, "killed") if PIDS else ""
if RESTARTED == 1 and RANK == 2 and not os.path.exists(KILLED):
    open(KILLED, "w").close()
    os.kill(pid_of(3), 9)
"""


def test_a_second_death_during_the_recovery_is_recovered_too(kernel, tmp_path):
    mesh = "ps2"
    pids, text = _kill_rank_2_while_training(kernel, mesh, str(tmp_path), KILL_DURING_SETUP, 180)
    assert "rank 2 died (killed by SIGKILL); rank 3 died (killed by SIGKILL) at step" in text
    check_recovered(kernel, mesh, pids, {2, 3})
    kernel.run(f"%mesh stop {mesh}")


# Rank 3 dies as the first recovery tells it to resume, before it answers; ranks 0-1
# take 6 s to resume (a long step: they park again only after the next round has
# restarted rank 3). That round must wait for them to park, not send them its orders
# while they still run their step: they dropped those as stale when they parked, and
# the round waited 120 s for a rendezvous they never joined.
DIE_ON_RESUME = """KILLED = os.path.join(PIDS, "killed") if PIDS else ""
import monarch_kernel.rank.training.park as _park
_obey = _park._obey
slow_once = RANK in (0, 1)
def obey_then_die(state, order):
    global slow_once
    if order.op == "resume" and RANK == 3 and not os.path.exists(KILLED):
        open(KILLED, "w").close()
        os.kill(os.getpid(), 9)
    if order.op == "resume" and slow_once:
        slow_once = False
        time.sleep(6)
    return _obey(state, order)
_park._obey = obey_then_die
"""


def test_a_death_while_the_ranks_resume_is_recovered_too(kernel, tmp_path):
    mesh = "ps5"
    pids, text = _kill_rank_2_while_training(kernel, mesh, str(tmp_path), DIE_ON_RESUME, 100)
    assert "rank 2 died (killed by SIGKILL); rank 3 died (killed by SIGKILL) at step" in text
    check_recovered(kernel, mesh, pids, {2, 3})
    kernel.run(f"%mesh stop {mesh}")


# The restarted rank kills the replica that offered it its state just before it pulls
# the state: the sending peer dies during the transfer.
KILL_THE_SOURCE = """killed_source = False
_load = TrainingState.load
def load_after_killing_the_source(self, offer):
    global killed_source
    if RESTARTED == 1 and RANK == 2 and not killed_source:
        killed_source = True
        os.kill(pid_of(offer.source), 9)
        time.sleep(0.5)
    return _load(self, offer)
TrainingState.load = load_after_killing_the_source
"""


def test_the_sending_peer_dying_mid_transfer_is_replaced_by_another(kernel, tmp_path):
    mesh = "ps3"
    pids, text = _kill_rank_2_while_training(kernel, mesh, str(tmp_path), KILL_THE_SOURCE, 180)
    assert "rank 2 died (killed by SIGKILL); rank 0 died (killed by SIGKILL) at step" in text
    assert "copied from rank 1" in text, text
    check_recovered(kernel, mesh, pids, {0, 2})
    kernel.run(f"%mesh stop {mesh}")


RAISE_AT = """\
%%remote {mesh}
losses = []
state = TrainingState(model=model, optimizer=opt, data=batches, extra={{"losses": losses}})
while state.step < {steps}:
    with state.stepping():
        x, y = batches.next()
        if RANK == 1 and state.step == 5:
            raise ValueError("bad batch on rank 1")
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
"""


def test_a_rank_that_raises_releases_the_parked_ranks_at_the_boundary(kernel):
    """A Python error on one rank (not a death): the others, parked at the step boundary
    by their failed collective, raise at once; nobody is killed, every rank is at the
    same step with the same parameters, and the same objects train on."""
    mesh = "ps4"
    _start(kernel, mesh)
    pids = pids_of(kernel, mesh)
    r = kernel.run(RAISE_AT.format(mesh=mesh, steps=10), timeout=120)
    text = r.error_text
    assert "ValueError in the cell on rank 1 of 4" in text and "bad batch on rank 1" in text
    assert "killed" not in text, text
    r = kernel.run(f"%remote {mesh} (state.step, digest(model))")
    assert not r.errors, r.error_text
    assert r.text.count("(5, '") == 4 and len(set(re.findall(r"'(\w+)'", r.text))) == 1, r.text
    r = kernel.run(TRAIN.format(mesh=mesh, steps=12, pause=0.0).replace("losses = []\n", ""))
    assert not r.errors, r.error_text
    assert r.text.count(", 12, ") == 4 and len(set(re.findall(r"'(\w+)'", r.text))) == 1
    assert pids_of(kernel, mesh) == pids
    kernel.run(f"%mesh stop {mesh}")


def test_the_dashboard_says_what_the_recovery_did(tmp_path):
    from test_dashboard import WidgetKernel

    k = WidgetKernel()
    mesh = "pw"
    try:
        r = k.run(f"import os; os.chdir({str(tmp_path)!r})")
        assert not r.errors, r.error_text
        _start(k, mesh)
        pids = pids_of(k, mesh)
        cell = train(k, mesh, 0.05)
        k.wait_for_output(cell, "step 10", timeout=60)
        os.kill(pids[2], signal.SIGKILL)
        r = k.collect(cell, timeout=120)
        assert not r.errors, r.error_text

        def errors() -> str:
            return k.html(mesh, "mk-errors")

        k.wait_for(lambda: "copied from rank 0" in errors(), what="the recovery's report")
        assert "rank 2 died (killed by SIGKILL) at step" in errors(), errors()
        assert "lost on the restarted rank(s)" not in errors()  # nothing declared was lost
        k.wait_for(
            lambda: "recovered: restarted ranks 2 in" in k.html(mesh, "mk-status"),
            what="the status line",
        )
        k.run(f"%mesh stop {mesh}")
    finally:
        k.shutdown_and_check()


LONE = """\
%%remote {mesh} --ranks 0
import os, time, torch
from monarch_kernel.training import TrainingState
model = torch.nn.Linear(4, 1)
state = TrainingState(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
while state.step < 10_000:
    with state.stepping():
        model(torch.ones(1, 4)).sum().backward()
        state.optimizer.step()
        if state.step == 20:
            print("step 20", flush=True)
        time.sleep(0.01)
"""


def test_with_no_replica_the_cell_says_the_state_is_lost(kernel):
    """A rank whose state exists nowhere else (its cell ran on it alone) dies: the cell
    fails saying so, and the rank is restarted as the failure policy would."""
    mesh = "pn"
    r = kernel.run(f"%mesh {mesh} --gpus 2", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    pids = pids_of(kernel, mesh)
    cell = kernel.submit(LONE.format(mesh=mesh))
    kernel.wait_for_output(cell, "step 20", timeout=60)
    os.kill(pids[0], signal.SIGKILL)
    r = kernel.collect(cell, timeout=120)
    text = r.error_text
    assert "training state could not be recovered from peers" in text, text
    assert "no live replica holds the training state" in text, text
    assert "the state of rank(s) 0" in text, text
    after = pids_of(kernel, mesh)
    assert after[0] != pids[0] and after[1] == pids[1]
    kernel.run(f"%mesh stop {mesh}")


SHARDED = """\
%%remote {mesh} --setup
import os, time, torch
from torch.distributed.fsdp import fully_shard
from monarch_kernel.training import TrainingState
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
fully_shard(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
"""

SHARDED_TRAIN = """\
%%remote {mesh}
state = TrainingState(model=model, optimizer=opt)
while state.step < 10_000:
    with state.stepping():
        model(torch.ones(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
        if state.step == 20:
            print("step 20", flush=True)
        time.sleep(0.01)
"""


def test_a_sharded_model_fails_clearly_naming_the_shard(kernel):
    """FSDP2 over the whole world: the dead rank's shard exists nowhere else; the cell
    fails saying so (and which parameter is a shard), the survivors are not killed."""
    mesh = "pf"
    r = kernel.run(f"%mesh {mesh} --gpus 2 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    r = kernel.run(SHARDED.format(mesh=mesh), timeout=120)
    assert not r.errors, r.error_text
    pids = pids_of(kernel, mesh)
    cell = kernel.submit(SHARDED_TRAIN.format(mesh=mesh))
    kernel.wait_for_output(cell, "step 20", timeout=60)
    os.kill(pids[1], signal.SIGKILL)
    r = kernel.collect(cell, timeout=120)
    text = r.error_text
    assert "could not be recovered from peers: the model is sharded" in text, text
    assert "parameter '0.weight' is a shard" in text and "HSDP" in text, text
    assert "the state of rank(s) 1" in text, text
    assert pids_of(kernel, mesh)[0] == pids[0]  # the survivor kept its process
    kernel.run(f"%mesh stop {mesh}")
