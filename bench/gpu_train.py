"""GPU row of the training workload: the GPT-style decoder of :mod:`bench.train_gpt` on
one GPU, steps/s under plain ``torchrun`` and in a mesh of one rank (ours), one after
the other, the same seed and batches; the loss curves must agree.

``python -m bench.gpu_train OUT_JSON`` writes ``{"rows": [...], "failures": [...]}`` for
bench/gpu_check.py; without CUDA one row says it was skipped. ``MK_GPU_TRAIN_DEVICE=cpu``
runs the same code paths on the CPU (gloo, a small model): a dry run of this file where
there is no GPU, not a figure.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any

from bench import train_gpt
from monarch_kernel.actor import Actor, endpoint

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "train_gpt.py")
#: The mesh must keep at least this share of torchrun's steps/s.
TARGET = 0.99
#: The loss curves must agree, or the comparison is void. On a GPU two runs of the same
#: script are not bit-identical (attention's backward and other kernels add with
#: atomics, in no fixed order), and the small differences grow over the steps (0.1 at
#: some step of 110 was seen), so the check is: the first step's loss (the same initial
#: weights and batch, no backward yet) within FIRST_TOL, and the mean loss of the last
#: TAIL steps within TAIL_TOL of torchrun's (relative). On the CPU the curves agree to
#: the bit (bench/train.py checks that).
FIRST_TOL = 1e-3
TAIL = 10
TAIL_TOL = 0.02
#: A model a GPU steps through in milliseconds is all Python overhead; this one is the
#: CPU benchmark's decoder made wider and fed longer sequences (about 50M parameters).
GPU = train_gpt.Config(
    vocab=16384, dim=768, layers=6, heads=12, seq=512, batch=16, warmup=10, steps=100
)
DRY = train_gpt.Config(vocab=512, dim=64, layers=2, heads=4, seq=16, batch=2, warmup=2, steps=6)


class Trainer(Actor):
    """Runs the workload's loop in a rank of ours (the process group formed there)."""

    @endpoint
    def train(self, fields: dict[str, Any]) -> bool:
        import torch.distributed as dist

        if HERE not in sys.path:
            sys.path.insert(0, HERE)
        import train_gpt as tg  # type: ignore[import-not-found]  # bench/, on sys.path

        cfg = tg.Config(**fields)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
        tg.train(cfg, dist.get_rank())
        return True


def steps_per_s(cfg: train_gpt.Config) -> tuple[float, list[float]]:
    """Steps/s over the timed window and the loss curve, from the progress file."""
    done: dict[int, tuple[float, float]] = {}
    with open(cfg.progress) as f:
        for line in f:
            parts = line.split()
            if parts[0] == "step":
                done.setdefault(int(parts[1]), (float(parts[2]), float(parts[3])))
    a, b = cfg.warmup, cfg.warmup + cfg.steps
    losses = [done[s][0] for s in range(1, b + 1)]
    return cfg.steps / (done[b][1] - done[a][1]), losses


def torchrun(cfg: train_gpt.Config) -> tuple[float, list[float]]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1"]
    ref = subprocess.run([*cmd, SCRIPT, *cfg.args()], capture_output=True, text=True, timeout=300)
    if ref.returncode != 0:
        raise RuntimeError(f"torchrun failed: {ref.stdout[-1500:]}\n{ref.stderr[-3000:]}")
    return steps_per_s(cfg)


def mesh(cfg: train_gpt.Config) -> tuple[float, list[float]]:
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": 1})
    try:
        procs.spawn("trainer", Trainer).train.call(dataclasses.asdict(cfg)).get()
    finally:
        procs.stop()
    return steps_per_s(cfg)


def row(
    what: str, value: float, unit: str, target: str = "", ok: bool | None = None
) -> dict[str, Any]:
    return {"what": what, "value": round(value, 4), "unit": unit, "target": target, "ok": ok}


def measure(cfg: train_gpt.Config, work: str) -> list[dict[str, Any]]:
    """torchrun, then ours, each with a progress file of its own; the rows."""
    ref_cfg = dataclasses.replace(cfg, progress=os.path.join(work, "torchrun.log"))
    our_cfg = dataclasses.replace(cfg, progress=os.path.join(work, "mesh.log"))
    t0 = time.monotonic()
    ref, ref_losses = torchrun(ref_cfg)
    ours, our_losses = mesh(our_cfg)
    gap = max(abs(x - y) for x, y in zip(ref_losses, our_losses, strict=True))
    first = abs(ref_losses[0] - our_losses[0])
    tail = abs(_tail(ref_losses) - _tail(our_losses)) / _tail(ref_losses)
    ratio = ours / ref
    what = f"GPT workload ({train_gpt.describe(cfg)}) on one {cfg.device.upper()}"
    print(f"{what}: torchrun {ref:.2f}, mesh {ours:.2f} steps/s ({ratio:.3f}x, "
          f"first-step loss gap {first:.2e}, last {TAIL} steps' mean loss "
          f"{_tail(ref_losses):.4f} vs {_tail(our_losses):.4f}, largest gap {gap:.2e}, "
          f"{time.monotonic() - t0:.0f}s)", flush=True)  # fmt: skip
    return [
        row(f"{what}: torchrun steps/s", ref, "steps/s"),
        row(f"{what}: mesh steps/s", ours, "steps/s"),
        row(f"{what}: mesh / torchrun", ratio, "x", f">= {TARGET}", ratio >= TARGET),
        row(f"{what}: first-step loss gap", first, "", f"<= {FIRST_TOL:g}", first <= FIRST_TOL),
        row(
            f"{what}: last {TAIL} steps' mean loss, relative gap",
            tail,
            "",
            f"<= {TAIL_TOL:g}",
            tail <= TAIL_TOL,
        ),
        row(f"{what}: largest loss gap", gap, "", "info: GPU kernels are not bit-reproducible"),
    ]


def _tail(losses: list[float]) -> float:
    return sum(losses[-TAIL:]) / len(losses[-TAIL:])


def main(out: str) -> None:
    rows: list[dict[str, Any]] = []
    failures: list[str] = []
    dry = os.environ.get("MK_GPU_TRAIN_DEVICE") == "cpu"
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda and not dry:
        rows.append(row("GPT workload steps/s", 0, "") | {"note": "skipped: no CUDA"})
    else:
        cfg = dataclasses.replace(DRY if dry else GPU, device="cpu" if dry else "cuda")
        try:
            with tempfile.TemporaryDirectory(prefix="mk-gpu-train-") as work:
                rows += measure(cfg, work)
        except Exception:
            failures.append(f"GPT workload:\n{traceback.format_exc()[-4000:]}")
    with open(out, "w") as f:
        json.dump({"rows": rows, "failures": failures}, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
