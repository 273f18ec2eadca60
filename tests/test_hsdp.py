"""Sharded training on the mesh's own dims: FSDP2 and HSDP on ``device_mesh()``.

A real kernel and real ranks over the mesh's re-formable gloo group:

* FSDP2 on ``device_mesh()["gpus"]`` of a 4-rank mesh and HSDP on a 2×2 mesh train
  like one process that sees every rank's batch (the losses match within float error);
* an HSDP rank SIGKILLed mid-training is restarted and takes its shards from its
  replica across the replicate dim: at most the step in flight is redone, the
  survivors keep their processes, the replicas' shards end bit-identical and the
  losses are those of an uninterrupted run;
* the stop button, ten times in an HSDP loop, leaves every rank alive and the
  replicas of each shard bit-identical, and the loop trains on.
"""

from __future__ import annotations

import os
import random
import re
import signal
import time

import pytest
import torch
import torch.nn.functional as F
from kernel_client import Kernel

pytestmark = pytest.mark.local

STEPS = 40

SETUP = """\
%%remote {mesh} --setup
import os, time, hashlib, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import fully_shard
from monarch_kernel.sharding import device_mesh
from monarch_kernel.training import TrainingState
RANK, WORLD = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
HSDP = {hsdp}

def build():
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    dm = device_mesh()
    on = dm if HSDP else dm["gpus"]
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=on)
    fully_shard(net, mesh=on)
    return net, torch.optim.Adam(net.parameters(), lr=1e-2)

def batch(step):
    g = torch.Generator().manual_seed(1000 * step + RANK)
    x = torch.randn(8, 16, generator=g)
    return x, x[:, :4] * 2 - 1

def digest():
    "This rank's shards of the model and of the optimizer state."
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.to_local().detach().numpy().tobytes())
    for st in opt.state_dict()["state"].values():
        for v in st.values():
            h.update((v.to_local() if hasattr(v, "to_local") else v).detach().numpy().tobytes())
    return h.hexdigest()[:16]

model, opt = build()
"""

TRAIN = """\
%%remote {mesh}
losses = []
state = TrainingState(model=model, optimizer=opt, extra={{"losses": losses}})
while state.step < {steps}:
    with state.stepping():
        x, y = batch(state.step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(round(total.item() / WORLD, 7))
        opt.step()
        if RANK == 0:
            print(f"step {{state.step}}", flush=True)
    time.sleep({pause})
_mk_result = (digest(), state.step, losses)
"""


def reference_losses(world: int, steps: int) -> list[float]:
    """One process, the same model and every rank's batch at once (its mean loss is the
    mean of the ranks' losses; FSDP averages the ranks' gradients)."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 4),
    )
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        xs = []
        for rank in range(world):
            g = torch.Generator().manual_seed(1000 * step + rank)
            xs.append(torch.randn(8, 16, generator=g))
        x = torch.cat(xs)
        loss = F.mse_loss(net(x), x[:, :4] * 2 - 1)
        opt.zero_grad()
        loss.backward()
        losses.append(loss.item())
        opt.step()
    return losses


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.shutdown_and_check()


@pytest.fixture(scope="module")
def hs(kernel):
    """A 2×2 mesh (hosts × gpus) with an HSDP model built in its set-up cell."""
    start(kernel, "hs", "--hosts 2 --gpus 2", hsdp=True)
    yield "hs"
    kernel.run("%mesh stop hs")


def start(kernel: Kernel, mesh: str, shape: str, hsdp: bool) -> None:
    r = kernel.run(f"%mesh {mesh} {shape} --dist", timeout=120)
    assert "ready" in r.stdout and not r.errors, r.stdout + r.stderr + r.error_text
    r = kernel.run(SETUP.format(mesh=mesh, hsdp=hsdp), timeout=120)
    assert not r.errors, r.error_text


def train(kernel: Kernel, mesh: str, steps: int = STEPS, pause: float = 0.0) -> str:
    return kernel.submit(TRAIN.format(mesh=mesh, steps=steps, pause=pause))


def outcome(kernel: Kernel, mesh: str) -> list[tuple[str, int, list[float]]]:
    """Each rank's (digest of its shards, step, losses) of the last training cell."""
    r = kernel.run(f"_mk_out = %pull {mesh} _mk_result\n[v for v in _mk_out.values()]", timeout=60)
    assert not r.errors, r.error_text
    return eval(r.results[0]["data"]["text/plain"])


def digests(kernel: Kernel, mesh: str) -> list[str]:
    r = kernel.run(f"%remote {mesh} _mk_d = digest()", timeout=60)
    assert not r.errors, r.error_text
    r = kernel.run(f"_mk_d = %pull {mesh} _mk_d\n[v for v in _mk_d.values()]", timeout=60)
    assert not r.errors, r.error_text
    return eval(r.results[0]["data"]["text/plain"])


def pids_of(kernel: Kernel, mesh: str) -> list[int]:
    r = kernel.run(f"%remote {mesh} __import__('os').getpid()")
    assert not r.errors, r.error_text
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


def assert_close(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want), (len(got), len(want))
    worst = max(abs(a - b) for a, b in zip(got, want))
    assert worst < 2e-5, f"losses differ from one process by up to {worst}: {got} vs {want}"


def test_device_mesh_is_the_mesh_s_dims_and_its_views(kernel, hs):
    r = kernel.run(
        "%%remote hs\n"
        "dm = device_mesh()\n"
        "v = device_mesh(rename={'hosts': 'replicate', 'gpus': 'shard'})\n"
        "(dm.mesh_dim_names, tuple(dm.shape), dm.get_coordinate(), v.mesh_dim_names,\n"
        " v['shard'].get_group() is dm['gpus'].get_group(), device_mesh() is dm)",
        timeout=120,
    )
    assert not r.errors, r.error_text
    for hosts, gpus in ((0, 0), (0, 1), (1, 0), (1, 1)):
        want = (
            f"{{hosts={hosts}, gpus={gpus}}}: (('hosts', 'gpus'), (2, 2), ({hosts}, {gpus}), "
            "('replicate', 'shard'), True, True)"
        )
        assert want in r.text, r.text
    r = kernel.run("%%remote hs\ndevice_mesh(split={'gpus': {'dp': 3, 'tp': -1}})")
    assert "dim 'gpus' of size 2 cannot be split into {'dp': 3, 'tp': -1}" in r.error_text
    r = kernel.run("%%remote hs\ndevice_mesh(rename={'nodes': 'replicate'})")
    assert "no dim 'nodes' to rename; the dims are hosts=2 × gpus=2" in r.error_text


def test_fsdp2_on_the_gpus_dim_trains_like_one_process(kernel):
    start(kernel, "fs", "--gpus 4", hsdp=False)
    r = kernel.collect(train(kernel, "fs"), timeout=180)
    assert not r.errors, r.error_text
    runs = outcome(kernel, "fs")
    assert len({run[0] for run in runs}) == 4, "every rank holds its own shard"
    assert_close(runs[0][2], reference_losses(4, STEPS))
    r = kernel.run(
        "%%remote fs\ns = device_mesh(split={'gpus': {'dp': 2, 'tp': -1}})\n"
        "s.mesh_dim_names, tuple(s.shape), s.get_coordinate()",
        timeout=120,
    )
    assert not r.errors, r.error_text
    assert "{gpus=3}: (('dp', 'tp'), (2, 2), (1, 1))" in r.text, r.text
    kernel.run("%mesh stop fs")


def test_hsdp_on_a_2x2_mesh_trains_like_one_process(kernel, hs):
    r = kernel.collect(train(kernel, "hs"), timeout=180)
    assert not r.errors, r.error_text
    runs = outcome(kernel, "hs")
    shards = [run[0] for run in runs]
    assert shards[0] == shards[2] and shards[1] == shards[3], shards  # replicas
    assert shards[0] != shards[1]  # shards
    assert_close(runs[0][2], reference_losses(4, STEPS))


def test_sigkill_on_hsdp_takes_the_shards_from_the_replica(kernel, hs):
    r = kernel.run("%remote hs model, opt = build()", timeout=60)
    assert not r.errors, r.error_text
    pids = pids_of(kernel, "hs")
    cell = train(kernel, "hs", pause=0.05)
    kernel.wait_for_output(cell, "step 15", timeout=90)
    os.kill(pids[1], signal.SIGKILL)
    r = kernel.collect(cell, timeout=180)
    assert not r.errors, r.error_text + r.stdout + r.stderr
    text = r.stdout + r.stderr
    assert "rank 1 died (killed by SIGKILL) at step" in text, text
    assert "copied from rank 3" in text and "resumed at step" in text, text  # its replica
    runs = outcome(kernel, "hs")
    shards = [run[0] for run in runs]
    assert shards[0] == shards[2] and shards[1] == shards[3], f"replicas differ: {runs}"
    assert all(run[1] == STEPS for run in runs)
    after = pids_of(kernel, "hs")
    assert [after[r] for r in (0, 2, 3)] == [pids[r] for r in (0, 2, 3)]
    assert after[1] != pids[1]
    losses = runs[0][2]
    assert runs[1][2] == losses  # the restarted rank has the history too
    assert_close(losses, reference_losses(4, STEPS))


def test_stop_button_ten_times_in_an_hsdp_loop_keeps_replica_shards_identical(kernel, hs):
    moments = random.Random(7)
    pids = pids_of(kernel, "hs")
    copied = 0
    for attempt in range(10):
        cell = train(kernel, "hs", steps=10**6)
        kernel.wait_for_output(cell, "step", timeout=60)
        time.sleep(moments.uniform(0.0, 0.3))  # a random moment of the loop
        kernel.km.interrupt_kernel()
        r = kernel.collect(cell, timeout=90)
        assert "interrupted cell" in r.error_text, f"attempt {attempt}: {r.error_text}"
        if "replicas identical" not in r.stdout:  # where every rank is now (seen once in
            # CI: "comparing the replicas failed: no answer in time"; not reproduced)
            where = kernel.run("%mesh stacks hs", timeout=60)
            raise AssertionError(
                f"attempt {attempt}: {r.stdout}\n{r.error_text}\n{where.text[-6000:]}"
            )
        assert "STILL DIFFER" not in r.stdout, f"attempt {attempt}: {r.stdout}"
        # (an optimizer missed on the ranks stopped inside a forward: its layer unsharded)
        assert "not on every rank" not in r.stdout, f"attempt {attempt}: {r.stdout}"
        copied += "copied from rank" in r.stdout  # (a replica had not stepped: copied)
        assert pids_of(kernel, "hs") == pids, f"attempt {attempt}: a rank was restarted"
        shards = digests(kernel, "hs")
        assert shards[0] == shards[2] and shards[1] == shards[3], f"attempt {attempt}: {shards}"
        r = kernel.run("%remote hs state.step")
        steps = set(re.findall(r"\}: (\d+)", r.text))
        assert len(steps) == 1, f"attempt {attempt}: the ranks' loops are at {r.text}"
    print(f"\nstop button x10 in an HSDP loop: {copied} found a replica's shards behind")
    r = kernel.collect(train(kernel, "hs", steps=3), timeout=120)
    assert not r.errors, r.error_text  # it trains on


def test_the_training_state_of_an_hsdp_model_is_a_distributed_checkpoint(kernel, hs, tmp_path):
    where = str(tmp_path / "ckpt")
    # its own model, trained a few steps (not what earlier tests' stops left)
    r = kernel.run("%remote hs model, opt = build()", timeout=60)
    assert not r.errors, r.error_text
    r = kernel.collect(train(kernel, "hs", steps=3), timeout=120)
    assert not r.errors, r.error_text
    r = kernel.run(
        "%%remote hs\n"
        "import torch.distributed.checkpoint as dcp\n"
        "state = TrainingState(model=model, optimizer=opt, step=7, extra={'note': 'kept'})\n"
        f"dcp.save(state.state_dict(), checkpoint_id={where!r})\n"
        "before = digest()\n"
        "model, opt = build()  # fresh: other parameters, no optimizer state\n"
        "fresh = digest()\n"
        "state = TrainingState(model=model, optimizer=opt)\n"
        "sd = state.state_dict()\n"
        f"dcp.load(sd, checkpoint_id={where!r})\n"
        "state.load_state_dict(sd)\n"
        "(before == digest(), fresh != before, state.step, state.extra)",
        timeout=120,
    )
    assert not r.errors, r.error_text
    assert r.text.count("(True, True, 7, {'note': 'kept'})") == 4, r.text
    assert len(list((tmp_path / "ckpt").glob("*.distcp"))) == 4  # every rank its shards


LAGGING = """\
%%remote hs
losses = []
state = TrainingState(model=model, optimizer=opt, extra={"losses": losses})
while state.step < 10:
    with state.stepping():
        x, y = batch(state.step)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if RANK >= 2 and state.step == 3:  # host 1 lags before its optimizer step
            print(f"rank {RANK} lags", flush=True)
            time.sleep(60)
        opt.step()
"""


def test_stop_while_a_host_lags_before_opt_step_copies_each_shard_from_its_replica(kernel, hs):
    r = kernel.run("%remote hs model, opt = build()", timeout=60)
    assert not r.errors, r.error_text
    cell = kernel.submit(LAGGING)
    kernel.wait_for_output(cell, "rank 2 lags", "rank 3 lags", timeout=90)
    kernel.km.interrupt_kernel()
    r = kernel.collect(cell, timeout=90)
    said = re.search(
        r"shards: rank 2 had not run opt\.step\(\) of the interrupted step; rank 3 had not run "
        r"opt\.step\(\) of the interrupted step; copied from ranks? 0-1 within the replicate "
        r"dim \([0-9.]+ KB, \d+ ms\); replicas identical",
        r.stdout,
    )
    assert said, r.stdout + r.error_text
    assert "WARNING" not in r.stdout, r.stdout
    shards = digests(kernel, "hs")
    assert shards[0] == shards[2] and shards[1] == shards[3], shards
    r = kernel.run("%remote hs state.step")
    assert set(re.findall(r"\}: (\d+)", r.text)) == {"4"}, r.text  # the steps agree too
