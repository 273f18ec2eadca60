"""The re-formable NCCL group on a real GPU: a DDP loop on CUDA survives the stop button,
an exception on one rank and a SIGKILL mid-step, with no rank killed by the mesh, the
same DDP object training on, and the replicas bit-identical.

Two ranks share the machine's one GPU (``NCCL_HOSTID`` per rank, sockets on ``lo``:
behaviour, not speed). Needs CUDA: skipped elsewhere; bench/gpu_check.py runs it on a GPU
machine. Figures (stop button -> idle, SIGKILL -> resumed) go to the folder named by
``MONARCH_KERNEL_GPU_FIGURES`` when it is set, as benchmark rows."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from pathlib import Path

import pytest
from kernel_client import Kernel

pytestmark = [pytest.mark.local, pytest.mark.gpu]

MESH = "gn"
RANKS = 2

SETUP = f"""\
%%remote {MESH}
import hashlib, os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
RANK = int(os.environ["RANK"])
DEV = torch.device("cuda", torch.cuda.current_device())
torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
ddp = DDP(net.to(DEV), device_ids=[DEV.index])
opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
ddp_id = id(ddp)
mine = f"rank {{RANK}} data"

def digest():
    h = hashlib.sha1()
    for t in [*ddp.parameters(), *[v for s in opt.state.values() for v in s.values()]]:
        h.update(t.detach().reshape(-1).cpu().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()

def train(steps):
    for step in range(steps):
        opt.zero_grad()
        loss = ddp(torch.randn(32, 64, device=DEV)).pow(2).mean()
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        if step == 3 and RANK == 0:
            print("training", flush=True)
"""


def record(what: str, value: float, unit: str, target: str, ok: bool | None) -> None:
    """Add a benchmark row for bench/gpu_check.py (when it asked for figures)."""
    folder = os.environ.get("MONARCH_KERNEL_GPU_FIGURES")
    if not folder:
        return
    path = Path(folder) / "test_gpu_nccl.json"
    data = json.loads(path.read_text()) if path.exists() else {"rows": [], "failures": []}
    data["rows"].append(
        {"what": what, "value": round(value, 4), "unit": unit, "target": target, "ok": ok}
    )
    path.write_text(json.dumps(data, indent=1))


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    r = k.run(f"%mesh {MESH} --gpus {RANKS} --dist", timeout=180)
    assert "process group initialised" in r.stdout, r.stdout + r.stderr + r.error_text
    r = k.run(SETUP, timeout=120)
    assert not r.errors, r.error_text
    k.pids_before = _state(k)[0]  # type: ignore[attr-defined]
    yield k
    k.shutdown_and_check()


def _state(kernel: Kernel) -> tuple[list[str], str]:
    """(each rank's pid, whether the replicas are identical); checks that every rank
    holds the same DDP object and its own variables."""
    r = kernel.run(
        f"%%remote {MESH} -o _mk_state\n(os.getpid(), digest(), id(ddp) == ddp_id, mine)",
        timeout=60,
    )
    assert not r.errors, r.error_text
    r = kernel.run(
        "_s = list(_mk_state.values())\n"
        "print(([s[0] for s in _s], len({s[1] for s in _s}), all(s[2] for s in _s), "
        "[s[3] for s in _s]))"
    )
    pids, digests, same_ddp, mine = eval(r.stdout)
    assert same_ddp, "a rank holds another DDP object"
    assert mine == [f"rank {i} data" for i in range(RANKS)]
    return [str(p) for p in pids], "identical" if digests == 1 else f"{digests} different"


def _train_on(kernel: Kernel) -> None:
    r = kernel.run(f"%%remote {MESH}\ntrain(4)", timeout=60)
    assert not r.errors, r.error_text
    assert _state(kernel)[1] == "identical"


def test_the_group_is_the_reformable_nccl_one_and_computes(kernel):
    r = kernel.run(
        f"%%remote {MESH}\n"
        "t = torch.full((1024,), float(RANK + 1), device=DEV)\n"
        "dist.all_reduce(t)\n"
        "objs = [None] * dist.get_world_size()\n"
        "dist.all_gather_object(objs, {'rank': RANK})\n"  # CPU tensors: gloo beside NCCL
        "g = [torch.zeros(4, device=DEV) for _ in range(dist.get_world_size())]\n"
        "dist.all_gather(g, torch.full((4,), float(RANK), device=DEV))\n"
        "dist.barrier()\n"
        "(dist.get_backend(), t[0].item(), t.device.type, [o['rank'] for o in objs],\n"
        " [x[0].item() for x in g], torch.cuda.is_initialized())",
        timeout=60,
    )
    assert not r.errors, r.error_text
    for rank in range(RANKS):
        assert f"{{gpus={rank}}}: ('mknccl', 3.0, 'cuda', [0, 1], [0.0, 1.0], True)" in r.text, (
            r.text
        )


def test_exception_on_one_rank_in_the_backward_releases_the_other_alive(kernel):
    code = (
        "out = ddp(torch.randn(32, 64, device=DEV))\n"
        "if RANK == 1:\n"
        "    out.register_hook(lambda g: (_ for _ in ()).throw(ValueError('bad grad')))\n"
        "out.sum().backward()\nopt.step()"
    )
    t0 = time.monotonic()
    r = kernel.run(f"%%remote {MESH}\ntrain(2)\n{code}", timeout=120)
    took = time.monotonic() - t0
    text = r.error_text
    print(f"\nexception in backward on rank 1: cell failed after {took:.2f}s\n{text[:800]}")
    assert "on rank 1 of 2" in text and "bad grad" in text, text
    assert "released by aborting the process group: 0" in text, text
    assert "killed" not in text and "restarting rank" not in text, text
    assert "re-formed the process group (nccl) in place" in text, text
    pids, replicas = _state(kernel)
    assert pids == kernel.pids_before  # nobody was restarted
    assert replicas == "identical"
    record("exception in the DDP backward (NCCL) -> cell failed", took, "s", "", None)
    _train_on(kernel)


def test_stop_button_at_random_moments_keeps_every_rank_and_identical_replicas(kernel):
    seed = random.randrange(1 << 30)
    moments = random.Random(seed)
    print(f"\nrandom seed {seed}")
    idle, copied = [], 0
    for attempt in range(10):
        msg = kernel.submit(f"%%remote {MESH}\ntrain(10**6)")
        kernel.wait_for_output(msg, "training", timeout=60)
        time.sleep(moments.uniform(0.0, 0.4))  # a random moment of the loop
        t0 = time.monotonic()
        kernel.km.interrupt_kernel()
        r = kernel.collect(msg, timeout=60)
        idle.append(time.monotonic() - t0)
        text = r.error_text
        assert "interrupted cell" in text, f"attempt {attempt}: {text}"
        assert "killed" not in text and "did not stop" not in text, f"attempt {attempt}: {text}"
        copied += "copied to" in r.stdout  # (what the mesh did: printed before the error)
        pids, replicas = _state(kernel)
        assert pids == kernel.pids_before, f"attempt {attempt}: a rank was restarted"
        assert replicas == "identical", f"attempt {attempt}: {replicas}\n{r.stdout[-3000:]}\n{text}"
    idle.sort()
    print(
        f"stop button -> idle (NCCL DDP): median {idle[5]:.2f}s, max {idle[-1]:.2f}s "
        f"({copied} of 10 found the replicas different and copied them)"
    )
    record("stop button -> idle, NCCL DDP, median of 10", idle[5], "s", "<= 1 s", idle[5] <= 1.0)
    record("stop button -> idle, NCCL DDP, max of 10", idle[-1], "s", "<= 1 s", idle[-1] <= 1.0)
    record("stop button: tries whose replicas differed (copied)", copied, "of 10", "", None)
    _train_on(kernel)


STATE_MESH = "gs"
STEPS = 40

STATE_SETUP = f"""\
%%remote {STATE_MESH} --setup
import os, time, hashlib, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState
RANK = int(os.environ["RANK"])
DEV = torch.device("cuda", torch.cuda.current_device())

class Batches:
    def __init__(self):
        self.pos = 0
    def next(self):
        g = torch.Generator().manual_seed(1000 * self.pos + RANK)
        self.pos += 1
        x = torch.randn(8, 16, generator=g)
        return x.to(DEV), (x[:, :4] * 2 - 1).to(DEV)
    def state_dict(self):
        return {{"pos": self.pos}}
    def load_state_dict(self, s):
        self.pos = s["pos"]

torch.manual_seed(0)
net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
model = DDP(net.to(DEV), device_ids=[DEV.index])
opt = torch.optim.Adam(model.parameters(), lr=1e-2)
batches = Batches()

def digest(model):
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().cpu().numpy().tobytes())
    return h.hexdigest()[:16]

bodies = 0
"""

STATE_TRAIN = f"""\
%%remote {STATE_MESH}
losses = []
state = TrainingState(model=model, optimizer=opt, data=batches, extra={{"losses": losses}})
while state.step < {STEPS}:
    with state.stepping():
        bodies += 1
        x, y = batches.next()
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if RANK == 0:
            print(f"step {{state.step}}", flush=True)
    time.sleep(0.05)
_mk_result = (digest(model), state.step, bodies, next(model.parameters()).device.type)
"""


def test_sigkill_mid_step_is_recovered_from_the_peers_gpu_memory(kernel):
    r = kernel.run(f"%mesh stop {MESH}", timeout=60)
    r = kernel.run(f"%mesh {STATE_MESH} --gpus {RANKS} --dist", timeout=180)
    assert "ready" in r.stdout, r.stdout + r.stderr + r.error_text
    r = kernel.run(STATE_SETUP, timeout=120)
    assert not r.errors, r.error_text
    r = kernel.run(f"%remote {STATE_MESH} __import__('os').getpid()")
    pids = [int(p) for p in re.findall(r": (\d+)", r.text)]
    assert len(pids) == RANKS, r.text
    cell = kernel.submit(STATE_TRAIN)
    kernel.wait_for_output(cell, "step 15", timeout=120)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    kernel.wait_for_output(cell, "resumed at step", timeout=180)
    resumed = time.monotonic() - t0
    r = kernel.collect(cell, timeout=180)
    text = r.stdout + r.stderr
    print(f"\nSIGKILL -> resumed in {resumed:.2f}s\n{text[-1500:]}")
    assert not r.errors, r.error_text + text
    assert "rank 1 died (killed by SIGKILL) at step" in text, text
    assert "copied from rank 0" in text, text
    r = kernel.run(f"_mk_out = %pull {STATE_MESH} _mk_result\n[v for v in _mk_out.values()]")
    assert not r.errors, r.error_text
    runs = eval(r.results[0]["data"]["text/plain"])
    assert len({run[0] for run in runs}) == 1, f"replicas differ: {runs}"
    assert all(run[1] == STEPS and run[3] == "cuda" for run in runs), runs
    assert STEPS <= runs[0][2] <= STEPS + 1, "the survivor lost more than one step"
    r = kernel.run(f"%remote {STATE_MESH} __import__('os').getpid()")
    after = [int(p) for p in re.findall(r": (\d+)", r.text)]
    assert after[0] == pids[0] and after[1] != pids[1]
    record("SIGKILL of a rank mid-step (NCCL DDP) -> training resumed", resumed, "s", "", None)
    kernel.run(f"%mesh stop {STATE_MESH}", timeout=60)
