"""Failures inside a collective, and restart in place (ours only: no peer has either).

* ``death_collective``: 4 ranks loop over gloo ``all_reduce``; one is SIGKILLed; seconds
  until the call on all 4 raises (target <= 2 s).
* ``raise_collective``: one rank raises before ``all_reduce`` while 3 enter it; seconds
  until the call raises (the grace, 0.5 s here, then the process group is aborted).
* ``restart_1of4``: ``procs.restart([1])`` after that rank died: restart it, re-form the
  process group on all 4, re-create the actor; seconds.
"""

from __future__ import annotations

import os
import signal
import time

from bench.common import Recorder, Settings, median
from monarch_kernel.actor import (
    Actor,
    ActorError,
    ProcMesh,
    RankDiedError,
    endpoint,
    this_host,
)

GRACE = 0.5


class Collective(Actor):
    @endpoint
    def init(self) -> int:
        import torch.distributed as dist

        dist.init_process_group("gloo")
        return os.getpid()

    @endpoint
    def loop(self, seconds: float) -> int:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        n = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            dist.all_reduce(t)
            n += 1
        return n

    @endpoint
    def raise_before(self, bad_rank: int) -> float:
        import torch
        import torch.distributed as dist

        if dist.get_rank() == bad_rank:
            raise ValueError("bad batch")
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()

    @endpoint
    def world(self) -> float:
        import torch
        import torch.distributed as dist

        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()


def ours(s: Settings, rec: Recorder) -> None:
    reps = 2 if s.quick else 3
    procs = this_host().spawn_procs(per_host={"gpus": 4}, grace=GRACE)
    try:
        actors = procs.spawn("coll", Collective)
        pids = actors.init.call().get().values()
        deaths, raises, restarts = [], [], []
        for _ in range(reps):
            with rec.guard("raise_collective"):
                t0 = time.perf_counter()
                try:
                    actors.raise_before.call(2).get(timeout=30)
                except ActorError:
                    raises.append(time.perf_counter() - t0)
                procs.runtime.wait_recovered(60)  # the process group is re-formed
            with rec.guard("death_collective", "restart_1of4"):
                fut = actors.loop.call(60)
                time.sleep(0.3)
                t0 = time.perf_counter()
                os.kill(pids[1], signal.SIGKILL)
                try:
                    fut.get(timeout=30)
                except RankDiedError:
                    deaths.append(time.perf_counter() - t0)
                # the default policy restarts it at once; time a restart by hand as well
                procs.runtime.wait_recovered(60)
                t0 = time.perf_counter()
                procs.restart([1])
                restarts.append(time.perf_counter() - t0)
                assert actors.world.call().get().values() == [4.0] * 4
                pids = _pids(procs)
        if raises:
            rec.value("raise_collective", median(raises), samples=raises)
        if deaths:
            rec.value("death_collective", median(deaths), samples=deaths)
        if restarts:
            rec.value("restart_1of4", median(restarts), samples=restarts)
    finally:
        procs.stop()


def _pids(procs: ProcMesh) -> list[int]:
    return [info.pid or 0 for info in procs.runtime.ranks]
