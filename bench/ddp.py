"""Row 8: DDP training throughput in a mesh vs the same script under torchrun."""

from __future__ import annotations

import os
import subprocess
import sys

from bench.common import Recorder, Settings
from monarch_kernel.actor import Actor, endpoint

RANKS = 2
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ddp_steps.py")


class Trainer(Actor):
    @endpoint
    def train(self, steps: int) -> float:
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import ddp_steps  # type: ignore[import-not-found]  # bench/ddp_steps.py, on sys.path

        return ddp_steps.train(steps)


def ours(s: Settings, rec: Recorder) -> None:
    from monarch_kernel.actor import this_host

    steps = 30 if s.quick else 120
    ref = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(RANKS),
            SCRIPT,
            str(steps),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if ref.returncode != 0:
        raise RuntimeError(f"torchrun failed: {ref.stderr[-500:]}")
    torchrun_sps = float(ref.stdout.strip().splitlines()[-1].split()[-1])
    rec.value("ddp_torchrun_sps", torchrun_sps)
    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        secs = procs.spawn("trainer", Trainer).train.call(steps).get().values()
        mesh_sps = steps / max(secs)
        rec.value("ddp_mesh_sps", mesh_sps)
        rec.value("ddp_ratio", mesh_sps / torchrun_sps)
    finally:
        procs.stop()
