"""Elastic meshes: grow and shrink a live mesh while a ``--bg`` DDP loop trains.

One real kernel and one mesh (gloo, ``--dist``) for the module. The loop splits a
global batch of 12 samples by ``state.rank::state.world_size`` inside each step, so
the gradient DDP averages is that of the whole batch at any world size (2, 3 and 4
divide 12): the losses of the resized run must equal those of one process training on
the whole batch (up to float rounding: sums are taken in another order; 1e-5).
"""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterable
from typing import Any

import pytest
from helpers import wait_until
from kernel_client import Kernel

pytestmark = pytest.mark.local

STEPS = 300  # room for a grow and a shrink on a loaded machine (each takes seconds)
BATCH = 12
MESH = "el"

SETUP = """\
%%remote {mesh} --setup
import os, time, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState

def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn({batch}, 16, generator=g)
    return x, x[:, :4] * 2 - 1

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
model = DDP(net)
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
progress = 0
"""

TRAIN = """\
%%remote {mesh} --bg
losses, worlds, changed = [], [], []
extra = {{"losses": losses, "worlds": worlds, "changed": changed}}
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
        changed.append(state.world_changed)
        opt.step()
    progress = state.step
    time.sleep(0.02)
"""


def reference_losses(seeds: Iterable[int] = range(STEPS)) -> list[float]:
    """One process, the whole batch of each step (its batch drawn with the step's seed
    from ``seeds``; the model and optimizer go on from one to the next): the run the
    mesh must reproduce."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9)
    out = []
    for step in seeds:
        g = torch.Generator().manual_seed(step)
        x = torch.randn(BATCH, 16, generator=g)
        loss = F.mse_loss(net(x), x[:, :4] * 2 - 1)
        opt.zero_grad()
        loss.backward()
        out.append(loss.item())
        opt.step()
    return out


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    work = tmp_path_factory.mktemp("elastic")
    k = Kernel()
    r = k.run(f"import os; os.chdir({str(work)!r})")
    assert not r.errors, r.error_text
    r = k.run(f"%mesh {MESH} --gpus 2 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    r = k.run(SETUP.format(mesh=MESH, batch=BATCH), timeout=120)
    assert not r.errors, r.error_text
    yield k
    k.shutdown_and_check()


def pids_of(kernel: Kernel) -> list[int]:
    r = kernel.run(f"%remote {MESH} __import__('os').getpid()")
    assert not r.errors, r.error_text
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


#: IPython shows at most 1,000 items of a sequence ("..." after): a loop of more steps
#: would come back cut (and eval to Ellipsis). Prefixed to a cell (not a cell magic).
WHOLE_REPR = "get_ipython().display_formatter.formatters['text/plain'].max_seq_length = 0\n"


def value(kernel: Kernel, code: str, timeout: float = 60) -> Any:
    """The value of ``code``'s last expression in ``kernel`` (its whole repr, eval'd)."""
    r = kernel.run(WHOLE_REPR + code, timeout=timeout)
    assert not r.errors, r.error_text
    return eval(r.results[-1]["data"]["text/plain"])


def usage_error(kernel: Kernel, line: str) -> str:
    """The one-line error ``line`` shows (IPython prints a UsageError on stderr)."""
    r = kernel.run(line)
    text = r.stderr.strip()
    assert text.startswith("UsageError: ") and "\n" not in text, (line, text, r.errors)
    return text


def wait_progress(
    kernel: Kernel,
    at_least: int,
    mesh: str = MESH,
    job: str | None = None,
    every_rank: bool = False,
) -> int:
    """Wait until rank 0's loop (``every_rank``: every rank's) has done ``at_least``
    steps; the steps it has done (the fewest of them). A time-out shows the last output
    of the loop's cell ``job`` when given."""
    seen = [0]

    def far() -> bool:
        steps = value(kernel, f"_p = %pull {mesh} progress\nlist(_p.values())")
        seen[0] = int(min(steps) if every_rank else steps[0])
        return seen[0] >= at_least

    wait_until(
        far,
        timeout=60,
        what=f"{'every rank' if every_rank else 'the loop'} to reach step {at_least}",
        detail=lambda: (
            f"at step {seen[0]}; its cell showed: "
            + (repr(kernel.output_so_far(job))[-1500:] if job else "(not followed)")
        ),
    )
    return seen[0]


def test_grow_2_to_4_then_shrink_to_3_while_training(kernel):
    before = pids_of(kernel)
    assert len(before) == 2
    job = kernel.submit(TRAIN.format(mesh=MESH, steps=STEPS, batch=BATCH))
    assert not kernel.collect(job, timeout=60).errors

    wait_progress(kernel, 20)
    r = kernel.run(f"%mesh grow {MESH} --ranks +2", timeout=120)
    assert not r.errors, r.error_text
    grown = re.search(
        r"world size 2 → 4 at step ([\d,]+); state of .* copied to ranks 2-3", r.stdout
    )
    assert grown, r.stdout
    at_grow = int(grown.group(1).replace(",", ""))
    assert "no survivor restarted" in r.stdout

    wait_progress(kernel, at_grow + 20)
    r = kernel.run(f"%mesh shrink {MESH} --ranks 3", timeout=120)
    assert not r.errors, r.error_text
    shrunk = re.search(r"world size 4 → 3 at step ([\d,]+); rank 3 stopped", r.stdout)
    assert shrunk, r.stdout
    at_shrink = int(shrunk.group(1).replace(",", ""))
    assert at_grow < at_shrink < STEPS

    # a foreground cell runs after the --bg loop on each rank's main thread
    outcome = value(
        kernel,
        f"_o = %remote {MESH} (state.step, losses, worlds, os.environ['WORLD_SIZE'], changed)\n"
        "list(_o.values())",
        timeout=120,
    )
    assert [o[0] for o in outcome] == [STEPS] * 3, outcome
    assert [o[3] for o in outcome] == ["3"] * 3
    steps, losses, worlds, _, changed = outcome[0]
    assert all(o[1] == losses and o[2] == worlds for o in outcome), outcome
    # state.world_changed: true in the first step after each resize, on every rank
    assert [i for i, c in enumerate(changed) if c] == [at_grow, at_shrink], changed
    assert all(o[4] == changed for o in outcome[1:]), outcome
    assert worlds == [2] * at_grow + [4] * (at_shrink - at_grow) + [3] * (STEPS - at_shrink)
    assert losses == pytest.approx(reference_losses(), rel=1e-5, abs=1e-6)

    after = pids_of(kernel)
    assert len(after) == 3
    assert after[:2] == before, "a survivor was restarted"
    # the replica check's digests: every rank holds the same model and optimizer
    digests = value(
        kernel,
        f"_d = %remote {MESH} __import__('monarch_kernel.rank.replicas.replicas', "
        "fromlist=['_']).digest_namespace(globals())\n"
        "[sorted((o.name, o.digest) for o in d.objects) for d in _d.values()]",
    )
    assert len(digests[0]) >= 2 and all(d == digests[0] for d in digests), digests
    r = kernel.run(f"%mesh\n{MESH}.shape.describe()")
    assert "gpus=3" in r.text or "{'gpus': 3}" in r.text, r.text


def test_idle_grow_copies_state_and_bad_input_says_what_to_do(kernel):
    # between cells there is no TrainingState loop: the new rank runs the setup cells,
    # then takes the most advanced rank's model and optimizer (the replica check)
    before = pids_of(kernel)
    r = kernel.run(f"%mesh grow {MESH} --gpus +1", timeout=120)
    assert not r.errors, r.error_text
    assert "world size 3 → 4; rank 3 started" in r.stdout, r.stdout + r.stderr
    assert "copied" in r.stdout, r.stdout  # what the replica check did
    assert pids_of(kernel)[:3] == before
    digests = value(
        kernel,
        f"_d = %remote {MESH} __import__('monarch_kernel.rank.replicas.replicas', "
        "fromlist=['_']).digest_namespace(globals())\n"
        "[sorted((o.name, o.digest) for o in d.objects) for d in _d.values()]",
    )
    assert all(d == digests[0] for d in digests), digests

    errors = {
        f"%mesh shrink {MESH} --ranks 0": "keeps at least 1 rank; to end it, %mesh stop",
        f"%mesh shrink {MESH} --ranks 4": "the mesh has 4 rank(s); give fewer",
        f"%mesh grow {MESH} --ranks 2": "takes a count to add, like +2",
        f"%mesh grow {MESH} --ranks +100000": "grow by fewer ranks, or stop another mesh",
        "%mesh grow nosuch --ranks +1": "no mesh named 'nosuch'",
        f"%mesh grow {MESH}": "give one of --ranks +N, --gpus +N or --hosts +K",
    }
    for line, expected in errors.items():
        assert expected in usage_error(kernel, line), line

    # a --bg cell that is not a TrainingState loop: new ranks could not join it
    job = kernel.submit(
        f"%%remote {MESH} --bg\nstop = False\nwhile not stop:\n    time.sleep(0.01)"
    )
    assert not kernel.collect(job).errors
    text = usage_error(kernel, f"%mesh shrink {MESH} --ranks 2")
    assert "removes ranks that run a cell" in text and "not a TrainingState loop" in text
    r = kernel.run(f"%push {MESH} stop=True")
    assert not r.errors, r.error_text
    r = kernel.run(f"%remote {MESH} stop", timeout=60)  # runs once the --bg cell ended
    assert not r.errors, r.error_text
    r = kernel.run(f"%mesh shrink {MESH} --ranks 2", timeout=120)
    assert "world size 4 → 2; ranks 2-3 stopped" in r.stdout, r.stdout + r.stderr
    sizes = value(
        kernel,
        f"_w = %remote {MESH} (os.environ['WORLD_SIZE'], __import__('monarch_kernel.actor', "
        "fromlist=['_']).current_size())\nlist(_w.values())",
    )
    assert sizes == [("2", {"gpus": 2})] * 2
    assert pids_of(kernel) == before[:2]


def test_grow_and_shrink_by_hosts(kernel):
    # local host agents stand for machines: --hosts adds one (its agent and ranks)
    r = kernel.run("%mesh elh --gpus 1 --hosts 2 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        r = kernel.run("%mesh grow elh --hosts +1", timeout=120)
        assert "world size 2 → 3; rank 2 started" in r.stdout, r.stdout + r.stderr
        text = usage_error(kernel, "%mesh grow elh --ranks +1")
        assert "grow it by whole hosts (%mesh grow NAME --hosts +1)" in text
        shapes = value(
            kernel,
            "%remote elh import os, torch.distributed as dist\n"
            "_s = %remote elh (os.environ['WORLD_SIZE'], os.environ['GROUP_RANK'], "
            "dist.get_world_size())\n"
            "list(_s.values())",
        )
        assert shapes == [("3", "0", 3), ("3", "1", 3), ("3", "2", 3)], shapes
        r = kernel.run("%mesh shrink elh --hosts 1", timeout=120)
        assert "world size 3 → 1; ranks 1-2 stopped" in r.stdout, r.stdout + r.stderr
        r = kernel.run("%mesh", timeout=30)
        assert "gpus=1" in r.text, r.text
    finally:
        kernel.run("%mesh stop elh", timeout=60)


@pytest.mark.timeout(300)  # longer than its own waits, so that those say what hung
def test_on_failure_shrink_after_a_host_is_killed(kernel):
    r = kernel.run("%mesh elf --gpus 1 --hosts 3 --dist --on-failure shrink:2", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        r = kernel.run(SETUP.format(mesh="elf", batch=BATCH), timeout=120)
        assert not r.errors, r.error_text
        job = kernel.submit(TRAIN.format(mesh="elf", steps=STEPS, batch=BATCH))
        assert not kernel.collect(job, timeout=60).errors
        wait_progress(kernel, 20, "elf")
        agents = value(kernel, "[h.pid for h in elf.runtime.hosts]")
        os.kill(agents[2], signal.SIGKILL)
        kernel.wait_for_output(job, "[resized] rank 2 died", timeout=60)
        # the loop goes on at world size 2 to its end (a hang here names its output)
        wait_progress(kernel, STEPS, "elf", job)
        outcome = value(
            kernel,
            "_o = %remote elf (state.step, losses, worlds, os.environ['WORLD_SIZE'])\n"
            "list(_o.values())",
            timeout=120,
        )
        assert [o[0] for o in outcome] == [STEPS] * 2, kernel.output_so_far(job)
        steps, losses, worlds, world = outcome[0]
        assert world == "2" and outcome[1][1] == losses, outcome
        at = worlds.index(2)
        assert worlds == [3] * at + [2] * (STEPS - at) and at >= 20, worlds
        assert losses == pytest.approx(reference_losses(), rel=1e-5, abs=1e-6)
        # at the minimum size (2): a lost host is restarted instead (without the setup
        # cell: a plain restart runs it on the new rank alone, and its DDP would wait
        # for the others)
        assert not kernel.run("%mesh setup elf --clear").errors
        agents = value(kernel, "[h.pid for h in elf.runtime.hosts]")
        os.kill(agents[1], signal.SIGKILL)
        wait_until(
            lambda: (
                value(kernel, "[i.state.value for i in elf.runtime.ranks]") == ["idle", "idle"]
                and value(kernel, "elf.runtime.hosts[1].pid") != agents[1]
            ),
            timeout=60,
            what="host 1 to be restarted",
            detail=lambda: repr(
                kernel.run(
                    "print(elf.runtime.state, [i.state for i in elf.runtime.ranks], "
                    "[h.pid for h in elf.runtime.hosts], elf.runtime.failures._recovering, "
                    "elf.runtime.failures._restart_not_stop)"
                )
            ),
        )
        sizes = value(
            kernel, "_w = %remote elf __import__('os').environ['WORLD_SIZE']\nlist(_w.values())"
        )
        assert sizes == ["2", "2"]
    finally:
        kernel.run("%mesh stop elf", timeout=60)


#: TRAIN with a death that leaves the survivors a step apart: rank 2 exits at the start
#: of step AT + 1 (every rank finished step AT), and rank 1 fails step AT after its
#: collectives, as a rank whose collective broke when its peer died inside it (gloo's
#: error, raised once): it redoes step AT while rank 0 has gone on to AT + 1.
AT = 20
APART = (
    TRAIN.replace(
        "        x, y = batch(state.step)\n",
        "        if state.step == {at} + 1 and state.world_size == 3 and state.rank == 2:\n"
        "            os._exit(1)\n"
        "        x, y = batch(state.step)\n",
    )
    .replace(
        "        dist.all_reduce(total)\n",
        "        dist.all_reduce(total)\n"
        "        if state.step == {at} and state.rank == 1 and not faulted:\n"
        "            faulted = True\n"
        "            raise RuntimeError('gloo: connection closed by peer')\n",
    )
    .replace("state = TrainingState(", "faulted = False\nstate = TrainingState(")
)


@pytest.mark.timeout(300)  # longer than its own waits, so that those say what hung
def test_survivors_a_step_apart_take_the_latest_state_before_going_on(kernel):
    assert APART.count("{at}") == 2 and "faulted = False" in APART  # the template matched
    r = kernel.run("%mesh ela --gpus 3 --dist --on-failure shrink:2", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        r = kernel.run(SETUP.format(mesh="ela", batch=BATCH), timeout=120)
        assert not r.errors, r.error_text
        job = kernel.submit(APART.format(mesh="ela", steps=STEPS, batch=BATCH, at=AT))
        assert not kernel.collect(job, timeout=60).errors
        kernel.wait_for_output(job, "[resized] rank 2 died", timeout=60)
        said = "".join(kernel.output_so_far(job))
        assert (
            f"rank 1 had not finished step {AT}; rank 0's state at step {AT + 1} copied to it"
            in said
        ), said
        # Every rank ends the loop (a rank left a step behind would wait in its last
        # step's collective for ever).
        wait_progress(kernel, STEPS, "ela", job, every_rank=True)
        outcome = value(
            kernel,
            "_o = %remote ela (state.step, losses, worlds)\nlist(_o.values())",
            timeout=60,
        )
        assert [o[0] for o in outcome] == [STEPS] * 2, outcome
        (_, losses, worlds), (_, losses_1, worlds_1) = outcome
        assert losses_1 == losses and worlds_1 == worlds
        assert worlds == [3] * (AT + 1) + [2] * (STEPS - AT - 1), worlds
        assert losses == pytest.approx(reference_losses(), rel=1e-5, abs=1e-6)
    finally:
        kernel.run("%mesh stop ela", timeout=60)


ENDS_SETUP = """\
%%remote {mesh} --setup
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState
torch.manual_seed(0)
model = DDP(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
progress = 0
if int(os.environ["RANK"]) >= 2:  # a rank the grow adds: the loop ends while it prepares
    open({flag!r}, "w").close()
    time.sleep(3)
"""

ENDS_LOOP = """\
%%remote {mesh} --bg
state = TrainingState(model=model, optimizer=opt)
while True:
    with state.stepping():
        loss = model(torch.ones(3, 4) * (state.step + 1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        done = torch.tensor([float(os.path.exists({flag!r}))])
        dist.all_reduce(done)  # every rank leaves the loop at the same step
    progress = state.step
    if done.item():
        break
    time.sleep(0.01)
state.step
"""


def test_a_grow_whose_training_cell_ends_before_the_pause_ends_between_cells(kernel, tmp_path):
    # The grow prepares its new ranks while the loop trains on; the loop here ends then
    # (the new ranks' setup cell makes it end), before it could be paused. The grow is
    # then finished as between cells, instead of failing and losing the new ranks.
    flag = str(tmp_path / "new-ranks-ready")
    r = kernel.run("%mesh ele --gpus 2 --dist", timeout=120)
    assert "ready" in r.stdout, r.stderr + r.error_text
    try:
        r = kernel.run(ENDS_SETUP.format(mesh="ele", flag=flag), timeout=120)
        assert not r.errors, r.error_text
        job = kernel.submit(ENDS_LOOP.format(mesh="ele", flag=flag))
        assert not kernel.collect(job, timeout=60).errors
        wait_progress(kernel, 3, "ele", job)
        r = kernel.run("%mesh grow ele --ranks +2", timeout=120)
        assert not r.errors, r.stdout + r.stderr + r.error_text
        assert "world size 2 → 4; ranks 2-3 started" in r.stdout, r.stdout + r.stderr
        assert "the training cell had ended before the loop could be paused" in r.stdout
        assert "copied" in r.stdout, r.stdout  # the replica check gave them the model
        # the loop ran on ranks 0-1 only; one process group of 4 ranks, the same model
        r = kernel.run(
            "%%remote ele\n"
            "_mk_t = torch.ones(1)\n"
            "dist.all_reduce(_mk_t)\n"
            "_mk_d = __import__('monarch_kernel.rank.replicas.replicas', fromlist=['_'])"
            ".digest_namespace(globals())\n"
            "_mk_c = (globals().get('progress'), dist.get_world_size(), _mk_t.item(), "
            "sorted((o.name, o.digest) for o in _mk_d.objects))",
            timeout=60,
        )
        assert not r.errors, r.error_text
        checks = value(kernel, "_c = %remote ele _mk_c\nlist(_c.values())")
        ran = [c[0] for c in checks]
        assert ran[0] == ran[1] and ran[0] > 3 and ran[2:] == [0, 0], checks
        assert [c[1:3] for c in checks] == [(4, 4.0)] * 4, checks
        assert checks[0][3] and all(c[3] == checks[0][3] for c in checks), checks
    finally:
        kernel.run("%mesh stop ele", timeout=60)
