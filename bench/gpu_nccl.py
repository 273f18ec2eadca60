"""GPU rows of the re-formable NCCL group: DDP steps/s in a mesh vs the same script under
torchrun (bench/gpu_ddp_steps.py), one rank.

Not two ranks sharing the GPU: NCCL then runs over sockets on ``lo`` (``NCCL_HOSTID``
per rank), a test of behaviour (tests/test_gpu_nccl.py), not of speed; its 537 MB of
gradients a step took over a minute for 30 steps on an H200, past this step's limit.

``python -m bench.gpu_nccl OUT_JSON`` writes ``{"rows": [...], "failures": [...]}`` for
bench/gpu_check.py; without CUDA one row says it was skipped. The stop-button and
SIGKILL figures come from tests/test_gpu_nccl.py (its ``record``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

from monarch_kernel.actor import Actor, endpoint

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_ddp_steps.py")
STEPS = 25
#: The mesh must keep at least this share of torchrun's steps/s (one rank).
TARGET = 0.99


class Trainer(Actor):
    @endpoint
    def train(self, steps: int) -> tuple[float, str]:
        sys.path.insert(0, os.path.dirname(SCRIPT))
        import gpu_ddp_steps  # type: ignore[import-not-found]  # bench/, on sys.path
        import torch.distributed as dist

        secs = gpu_ddp_steps.train(steps)
        return secs, str(dist.get_backend())


def torchrun(ranks: int) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks)]
    ref = subprocess.run([*cmd, SCRIPT, str(STEPS)], capture_output=True, text=True, timeout=120)
    if ref.returncode != 0:
        raise RuntimeError(f"torchrun failed: {ref.stdout[-1500:]}\n{ref.stderr[-3000:]}")
    return float(ref.stdout.strip().splitlines()[-1].split()[-1])


def mesh(ranks: int) -> tuple[float, str]:
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": ranks})
    try:
        results = list(procs.spawn("trainer", Trainer).train.call(STEPS).get().values())
    finally:
        procs.stop()
    return STEPS / max(secs for secs, _ in results), results[0][1]


def main(out: str) -> None:
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        rows.append(
            {
                "what": "DDP (NCCL) steps/s",
                "value": 0,
                "unit": "",
                "target": "",
                "ok": None,
                "note": "skipped: no CUDA",
            }
        )
    for ranks in (1,) if cuda else ():
        what = f"DDP (NCCL) {ranks} rank{'s sharing the GPU' if ranks > 1 else ''}"
        try:
            t0 = time.monotonic()
            ref = torchrun(ranks)
            ours, backend = mesh(ranks)
            ratio = ours / ref
            target = f">= {TARGET}" if ranks == 1 else ""
            rows.append(
                {
                    "what": f"{what}: torchrun steps/s",
                    "value": round(ref, 3),
                    "unit": "steps/s",
                    "target": "",
                    "ok": None,
                }
            )
            rows.append(
                {
                    "what": f"{what}: mesh steps/s ({backend})",
                    "value": round(ours, 3),
                    "unit": "steps/s",
                    "target": "",
                    "ok": None,
                }
            )
            rows.append(
                {
                    "what": f"{what}: mesh / torchrun",
                    "value": round(ratio, 3),
                    "unit": "x",
                    "target": target,
                    "ok": (ratio >= TARGET) if ranks == 1 else None,
                }
            )
            print(
                f"{what}: torchrun {ref:.2f}, mesh {ours:.2f} steps/s "
                f"({ratio:.3f}x, {time.monotonic() - t0:.0f}s)",
                flush=True,
            )
        except Exception:
            failures.append(f"{what}:\n{traceback.format_exc()[-4000:]}")
        _write(out, rows, failures)  # after each: a run cut off keeps what it measured
    _write(out, rows, failures)


def _write(out: str, rows: list[dict[str, Any]], failures: list[str]) -> None:
    with open(out, "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
