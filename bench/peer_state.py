"""State from peers vs a disk checkpoint: a rank SIGKILLed mid-training (ours only).

Through a real kernel (jupyter_client), ``%mesh pb --gpus 4 --dist``, a 100M-parameter
MLP under DDP with SGD + momentum (the state a replica sends: parameters, buffers and
momentum, about 0.8 GB), a foreground loop over a ``TrainingState``:

* ``peer_first_step``: SIGKILL of rank 2 -> the first training step completed after the
  recovery (survivors parked, rank 2 restarted, process group re-formed, state pulled
  from a peer); ``peer_recovery``: SIGKILL -> the survivors resume (the controller's
  own figure); ``peer_step``: one step's time without failures, for scale;
* ``peer_state_gbps``: the state transfer alone (the new rank's load), in GB/s, next to
  ``peer_raw_gbps``: the same bytes through the data plane (``share`` + ``read_into``
  between the same ranks) in the same run;
* ``peer_steps_lost``: step bodies run beyond the steps counted (1: the step in flight);
* ``disk_first_step`` and ``disk_steps_lost``: the same kill with the usual path, a
  checkpoint on disk every ``CKPT_EVERY`` steps: the cell fails, the mesh restarts the
  rank, and the cell run again loads the checkpoint on every rank.
"""

from __future__ import annotations

import os
import queue
import re
import shutil
import signal
import sys
import tempfile
import time

from bench.common import Recorder, Settings

MESH = "pb"
DISK_MESH = "pd"
CKPT_EVERY = 10
#: Rows this module fills (``rec.guard`` them together).
ROWS = (
    "peer_first_step",
    "peer_recovery",
    "peer_step",
    "peer_state_gbps",
    "peer_state_gb",
    "peer_raw_gbps",
    "peer_steps_lost",
    "disk_first_step",
    "disk_steps_lost",
)

SETUP = """\
%%remote {mesh} --setup
import os, time, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState
RANK = int(os.environ["RANK"])
WIDTH, DEPTH = {width}, {depth}

def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh()]
    model = DDP(torch.nn.Sequential(*layers), gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
    return model, opt, Batches()

class Batches:
    def __init__(self):
        self.pos = 0
    def next(self):
        g = torch.Generator().manual_seed(1000 * self.pos + RANK)
        self.pos += 1
        return torch.randn(4, WIDTH, generator=g)
    def state_dict(self):
        return {{"pos": self.pos}}
    def load_state_dict(self, s):
        self.pos = s["pos"]

def step_once(model, opt, batches):
    x = batches.next()
    loss = F.mse_loss(model(x), x)
    opt.zero_grad()
    loss.backward()
    opt.step()

{build_now}
"""

TRAIN = """\
%%remote {mesh}
state = TrainingState(model=model, optimizer=opt, data=batches)
bodies = 0
while state.step < {steps}:
    with state.stepping():
        bodies += 1
        step_once(model, opt, batches)
    if RANK == 0:
        print(f"done {{state.step}} {{time.time()!r}}", flush=True)
bodies - state.step
"""

DISK = """\
%%remote {mesh}
model, opt, batches = build()
step = 0
if os.path.exists(CKPT):  # what a training script does today: resume from the last one
    ckpt = torch.load(CKPT, weights_only=False)
    model.load_state_dict(ckpt["model"])
    opt.load_state_dict(ckpt["opt"])
    batches.load_state_dict(ckpt["data"])
    step = ckpt["step"]
    if RANK == 0:
        print(f"resumed {{step}}", flush=True)
while step < {steps}:
    step_once(model, opt, batches)
    step += 1
    if RANK == 0:
        print(f"done {{step}} {{time.time()!r}}", flush=True)
        if step % {every} == 0:
            ckpt = {{"model": model.state_dict(), "opt": opt.state_dict(),
                    "data": batches.state_dict(), "step": step}}
            torch.save(ckpt, CKPT + ".tmp")
            os.replace(CKPT + ".tmp", CKPT)
"""

RAW = """\
%%remote {mesh}
import monarch_kernel
nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
nbytes += sum(
    t.numel() * t.element_size() for s in opt.state_dict()["state"].values()
    for t in s.values() if torch.is_tensor(t)
)
blob = torch.ones(nbytes // 4)
ref = monarch_kernel.share(blob) if RANK == 0 else None
"""

READ = """\
%%remote {mesh} --ranks 2
dst = torch.empty(ref.shape, dtype=torch.float32)
t0 = time.perf_counter()
ref.read_into(dst)
raw = (ref.nbytes, time.perf_counter() - t0)
del dst
raw
"""


class _Kernel:
    """A monarch kernel driven as a notebook would be; ``run`` returns a cell's text."""

    def __init__(self) -> None:
        from jupyter_client.manager import start_new_kernel

        from monarch_kernel.kernel.install import install

        install(prefix=sys.prefix)
        self.km, self.kc = start_new_kernel(kernel_name="monarch")

    def start(self, code: str) -> str:
        return self.kc.execute(code)

    def read(self, msg_id: str, until: str | None = None, timeout: float = 600) -> str:
        """The cell's text until ``until`` shows (None: until the cell ends)."""
        text, deadline = [], time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                m = self.kc.get_iopub_msg(timeout=1)
            except queue.Empty:
                continue
            if m["parent_header"].get("msg_id") != msg_id:
                continue
            kind, c = m["msg_type"], m["content"]
            if kind == "stream":
                text.append(c["text"])
            elif kind == "execute_result":
                text.append(c["data"].get("text/plain", ""))
            elif kind == "error":
                text.append("\n".join(c["traceback"]))
            elif kind == "status" and c["execution_state"] == "idle":
                if until is not None and until not in "".join(text):
                    raise RuntimeError(f"cell ended before {until!r}: {''.join(text)[-1500:]}")
                return "".join(text)
            if until is not None and until in "".join(text):
                return "".join(text)
        raise TimeoutError(f"cell did not show {until!r} in {timeout:.0f}s: {''.join(text)[-800:]}")

    def run(self, code: str, timeout: float = 600) -> str:
        text = self.read(self.start(code), None, timeout)
        if "Traceback" in text or "Error in the cell" in text:
            raise RuntimeError(f"cell failed: {text[-1500:]}")
        return text

    def stop(self) -> None:
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)


def _done(text: str) -> dict[int, float]:
    return {int(s): float(t) for s, t in re.findall(r"done (\d+) ([0-9.]+)", text)}


def _pids(k: _Kernel, mesh: str) -> list[int]:
    text = k.run(f"%remote {mesh} __import__('os').getpid()")
    return [int(p) for p in re.findall(r": (\d+)", text)]


def _kill_at(k: _Kernel, cell: str, step: int, pid: int) -> tuple[float, str]:
    """Wait for step ``step`` to complete, SIGKILL ``pid``; the kill's time and the text."""
    before = k.read(cell, f"done {step} ")
    t_kill = time.time()
    os.kill(pid, signal.SIGKILL)
    return t_kill, before + k.read(cell)


def peers_run(k: _Kernel, steps: int, rec: Recorder) -> None:
    pids = _pids(k, MESH)
    cell = k.start(TRAIN.format(mesh=MESH, steps=steps))
    t_kill, text = _kill_at(k, cell, 4, pids[2])
    done = _done(text)
    got = re.search(r"copied from rank \d+ in ([0-9.]+) s; resumed at step (\d+)", text)
    took = re.search(r"recovery took ([0-9.]+) s", text)
    lost = re.findall(r"\{gpus=\d+\}: (-?\d+)", text)
    if got is None or took is None:
        raise RuntimeError(f"no recovery in the output: {text[-1500:]}")
    resumed = int(got.group(2))
    first = min(t for s, t in done.items() if s > resumed) - t_kill
    rec.value("peer_first_step", first)
    phases = k.run(
        f"print({{k: round(v, 3) for k, v in {MESH}.runtime.peers.last.phases.items()}})"
    )
    rec.value("peer_recovery", float(took.group(1)), phases=phases.strip())
    print(f"  phases: {phases.strip()}", flush=True)
    rec.value("peer_step", done[3] - done[2])
    rec.value("peer_steps_lost", max(int(x) for x in lost))
    load_s = float(got.group(1))
    nbytes = _state_bytes(k)
    rec.value("peer_state_gbps", nbytes / load_s / 1e9)
    rec.value("peer_state_gb", nbytes / 1e9)


def _state_bytes(k: _Kernel) -> int:
    text = k.run(RAW.format(mesh=MESH))
    if "Error" in text:
        raise RuntimeError(text)
    text = k.run(f"%%remote {MESH} --ranks 0\nnbytes")
    return int(re.findall(r": (\d+)", text)[0])


def raw_rate(k: _Kernel, rec: Recorder) -> None:
    """The same bytes through the data plane, rank 0 -> rank 2, in the same mesh."""
    k.run(f"ref = {MESH}.pull('ref').item(gpus=0)\n%push {MESH} ref")
    text = k.run(READ.format(mesh=MESH))
    nbytes, secs = (float(x) for x in re.findall(r"\(([0-9.e+]+), ([0-9.e-]+)\)", text)[0])
    rec.value("peer_raw_gbps", nbytes / secs / 1e9)
    k.run(f"%%remote {MESH}\nblob = ref = None")


def disk_run(k: _Kernel, rec: Recorder, ckpt: str) -> None:
    """The same kill with what a training script does today: a checkpoint on disk every
    CKPT_EVERY steps, the mesh's usual restart, and the cell run again to resume."""
    k.run(f"%push {DISK_MESH} CKPT={ckpt!r}")
    pids = _pids(k, DISK_MESH)
    kill_step = CKPT_EVERY + CKPT_EVERY // 2
    cell = k.start(DISK.format(mesh=DISK_MESH, steps=kill_step + 10, every=CKPT_EVERY))
    t_kill, _text = _kill_at(k, cell, kill_step, pids[2])
    k.run(f"%push {DISK_MESH} CKPT={ckpt!r}")  # the restarted rank lost it
    text = k.run(DISK.format(mesh=DISK_MESH, steps=kill_step + 3, every=CKPT_EVERY))
    resumed = int(re.findall(r"resumed (\d+)", text)[0])
    first = min(_done(text).values()) - t_kill
    rec.value("disk_first_step", first)
    rec.value("disk_steps_lost", kill_step + 1 - resumed)


def _mesh(k: _Kernel, mesh: str, width: int, build_now: bool) -> None:
    k.run(f"%mesh {mesh} --gpus 4 --dist", timeout=300)
    now = "model, opt, batches = build()" if build_now else ""
    k.run(SETUP.format(mesh=mesh, width=width, depth=6, build_now=now), timeout=600)


def ours(s: Settings, rec: Recorder) -> None:
    # 6 x (4096 x 4096 + 4096) = 100.7M parameters (MK_BENCH_PEER_WIDTH: a smaller trial)
    width = int(os.environ.get("MK_BENCH_PEER_WIDTH", "4096"))
    steps = 8 if width >= 1024 else 100  # a small trial model steps fast: more of them
    work = tempfile.mkdtemp(prefix="mk-bench-peer-")
    k = _Kernel()
    try:
        k.run(f"import os; os.chdir({work!r})")
        # The model is built in the set-up cell: a restarted rank builds it again there
        # (its collectives answered locally) before it takes a peer's state.
        _mesh(k, MESH, width, build_now=True)
        with rec.guard(*ROWS[:7]):
            peers_run(k, steps, rec)
            raw_rate(k, rec)
        k.run(f"%mesh stop {MESH}")
        if os.environ.get("MK_BENCH_PEER_ONLY"):  # a trial of the recovery alone
            return
        # Today's way builds it in the training cell, which the usual restart runs again.
        _mesh(k, DISK_MESH, width, build_now=False)
        with rec.guard(*ROWS[7:]):
            disk_run(k, rec, os.path.join(work, "ckpt.pt"))
        k.run(f"%mesh stop {DISK_MESH}")
    finally:
        k.stop()
        shutil.rmtree(work, ignore_errors=True)
