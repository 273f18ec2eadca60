"""Elastic meshes: the pause of a grow and of a shrink while DDP trains (ours only).

Through a real kernel (jupyter_client): ``%mesh eb --gpus 2 --dist``, a 100 MB model
(6 x 2048 x 2048 MLP, 25.2M parameters) under DDP with SGD + momentum, a ``--bg`` loop
over a ``TrainingState``. Then ``%mesh grow eb --ranks +2`` (2 -> 4: the new ranks take
the parameters and momentum from a live replica) and ``%mesh shrink eb --ranks 3``.

* ``elastic_grow`` / ``elastic_shrink``: seconds the training loop was paused (the
  controller's figure: from telling the ranks to hold at a step boundary until they
  resumed), target <= 1.5 s;
* ``elastic_grow_gap``: the longest time between two steps of rank 0 across the grow
  (the pause as the loop sees it, the redone step included);
* ``elastic_restarted``: survivors whose process changed (must be 0).
"""

from __future__ import annotations

import re

from bench.common import Recorder, Settings
from bench.peer_state import _Kernel, _pids

MESH = "eb"
ROWS = ("elastic_grow", "elastic_grow_gap", "elastic_shrink", "elastic_restarted")

SETUP = """\
%%remote {mesh} --setup
import time, torch, torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from monarch_kernel.training import TrainingState
torch.manual_seed(0)
layers = []
for _ in range(6):
    layers += [torch.nn.Linear({width}, {width}), torch.nn.Tanh()]
model = DDP(torch.nn.Sequential(*layers), gradient_as_bucket_view=True)
opt = torch.optim.SGD(model.parameters(), lr=1e-4, momentum=0.9)
stop = False
progress = 0
"""

TRAIN = """\
%%remote {mesh} --bg
times = []
state = TrainingState(model=model, optimizer=opt, extra={{"times": times}})
while not stop and state.step < 100000:
    with state.stepping():
        x = torch.randn(4, {width})
        loss = F.mse_loss(model(x), x)
        opt.zero_grad()
        loss.backward()
        opt.step()
    times.append(time.time())
    progress = state.step
"""


def _wait_steps(k: _Kernel, n: int) -> int:
    """Wait until rank 0 has done ``n`` more steps; its step count."""
    import time

    first = None
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        text = k.run(f"print({MESH}.slice(gpus=0).pull('progress').item())")
        step = int(text.strip().splitlines()[-1])
        first = step if first is None else first
        if step >= first + n:
            return step
    raise TimeoutError("the loop did not advance")


def _paused(text: str) -> float:
    got = re.search(r"paused ([0-9.]+) s", text)
    if got is None:
        raise RuntimeError(f"no resize report: {text[-1500:]}")
    return float(got.group(1))


def _phases(k: _Kernel) -> str:
    """Seconds per phase of the last resize (the controller's figures)."""
    text = k.run(f"print({{k: round(v, 3) for k, v in {MESH}.runtime.peers.last.phases.items()}})")
    print(f"  phases: {text.strip()}", flush=True)
    return text.strip()


def ours(s: Settings, rec: Recorder) -> None:
    width = 512 if s.quick else 2048
    k = _Kernel()
    try:
        k.run(f"%mesh {MESH} --gpus 2 --dist", timeout=300)
        k.run(SETUP.format(mesh=MESH, width=width), timeout=600)
        with rec.guard(*ROWS):
            before = _pids(k, MESH)
            k.run(TRAIN.format(mesh=MESH, width=width))
            _wait_steps(k, 3)
            text = k.run(f"%mesh grow {MESH} --ranks +2", timeout=300)
            print(f"  {text.strip()}", flush=True)
            rec.value("elastic_grow", _paused(text), phases=_phases(k))
            _wait_steps(k, 3)
            text = k.run(f"%mesh shrink {MESH} --ranks 3", timeout=300)
            print(f"  {text.strip()}", flush=True)
            rec.value("elastic_shrink", _paused(text), phases=_phases(k))
            k.run(f"%push {MESH} stop=True")
            gaps = k.run(
                f"%%remote {MESH} --ranks 0\nprint(max(b - a for a, b in zip(times, times[1:])))"
            )
            rec.value("elastic_grow_gap", float(re.findall(r"([0-9.]+)\s*$", gaps.strip())[0]))
            after = _pids(k, MESH)
            rec.value("elastic_restarted", sum(1 for a, b in zip(before, after) if a != b))
        k.run(f"%mesh stop {MESH}")
    finally:
        k.stop()
