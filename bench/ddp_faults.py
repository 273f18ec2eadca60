"""A DDP loop and the re-formable process group (ours only: no peer re-forms a group).

* ``ddp_stop_idle``: 4 ranks run a foreground DDP loop (``%%remote``); the stop button
  (the cell job's cancel, as the kernel's interrupt does it) -> every rank idle again,
  the process group re-formed in place and the replicas checked (copied if they
  differed); seconds, median of several stops at random moments.
* ``ddp_step_mkgloo`` / ``ddp_step_gloo``: one DDP step (a 25 MB gradient bucket: a
  2500x2500 linear layer, batch 8) on 4 ranks over the re-formable group and over
  torch's own gloo group in the same processes, steps interleaved in blocks so both see
  the same machine; ``ddp_step_overhead`` is their ratio.
"""

from __future__ import annotations

import random
import time

from bench.common import Recorder, Settings, median
from monarch_kernel.actor import ActorError, ProcMesh, this_host

RANKS = 4

SETUP = """
import os, time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group()  # the re-formable group (gloo on CPU)
RANK = int(os.environ["RANK"])
torch.manual_seed(0)
plain = dist.new_group(backend="gloo")  # torch's own gloo, same ranks
big = [torch.nn.Linear(2500, 2500) for _ in range(2)]
big[1].load_state_dict(big[0].state_dict())
on = {
    "mkgloo": DDP(big[0], bucket_cap_mb=25),
    "gloo": DDP(big[1], bucket_cap_mb=25, process_group=plain),
}
x = torch.randn(8, 2500)

def steps(name, n):
    model = on[name]
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):
        model(x).sum().backward()
    dist.barrier()
    return (time.perf_counter() - t0) / n

small = DDP(
    torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
)
opt = torch.optim.SGD(small.parameters(), lr=0.01)
"""

LOOP = """
while True:
    opt.zero_grad()
    small(torch.randn(32, 64)).square().mean().backward()
    opt.step()
    t = torch.ones(1)
    dist.all_reduce(t)
"""


def _run(procs: ProcMesh, code: str, timeout: float = 120.0) -> list[object]:
    from monarch_kernel.kernel.remote import RemoteJob

    job = RemoteJob(procs, code, "bench", None).start()
    return list(job.future.get(timeout=timeout).values())


def step_overhead(s: Settings, rec: Recorder, procs: ProcMesh) -> None:
    blocks, n = (2, 4) if s.quick else (5, 6)
    times: dict[str, list[float]] = {"mkgloo": [], "gloo": []}
    _run(procs, "steps('mkgloo', 2), steps('gloo', 2)")  # warm-up, buckets rebuilt
    for _ in range(blocks):
        for name in times:
            per_rank = [float(v) for v in _run(procs, f"steps({name!r}, {n})")]  # type: ignore[arg-type]
            times[name].append(max(per_rank))
    mine, theirs = median(times["mkgloo"]), median(times["gloo"])
    rec.value("ddp_step_mkgloo", mine, samples=times["mkgloo"])
    rec.value("ddp_step_gloo", theirs, samples=times["gloo"])
    rec.value("ddp_step_overhead", mine / theirs)


def stop_to_idle(s: Settings, rec: Recorder, procs: ProcMesh) -> None:
    from monarch_kernel.kernel.remote import RemoteJob

    moments = random.Random(0)
    idle: list[float] = []
    for _ in range(3 if s.quick else 8):
        job = RemoteJob(procs, LOOP, "loop", None).start()
        time.sleep(0.5 + moments.uniform(0.0, 0.3))  # let it train, stop at a random moment
        t0 = time.perf_counter()
        job.cancel()
        try:
            job.future.get(timeout=60)
        except ActorError:
            pass
        procs.runtime.wait_recovered(60)
        idle.append(time.perf_counter() - t0)
        assert all(r.state == "idle" for r in procs.runtime.ranks), procs.runtime.ranks
    rec.value("ddp_stop_idle", median(idle), samples=idle)


def ours(s: Settings, rec: Recorder) -> None:
    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        _run(procs, SETUP)
        with rec.guard("ddp_step_mkgloo", "ddp_step_gloo", "ddp_step_overhead"):
            step_overhead(s, rec, procs)
        with rec.guard("ddp_stop_idle"):
            stop_to_idle(s, rec, procs)
    finally:
        procs.stop()
