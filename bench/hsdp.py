"""Sharded training on the mesh (ours only; standalone: ``python -m bench hsdp``).

Through a real kernel (jupyter_client):

* ``fsdp_sps`` / ``hsdp_sps``: FSDP2 over ``%mesh --gpus 4`` and HSDP over
  ``%mesh --hosts 2 --gpus 2``, on the mesh's ``device_mesh()`` and re-formable group,
  next to the same script (``bench/fsdp_steps.py``) under ``torchrun`` in the same run;
* ``hsdp_recovery``: an HSDP rank SIGKILLed mid-training -> the survivors resume (the
  controller's figure: park, restart, re-form the group and its subgroups, set-up,
  state from the replica across the replicate dim); ``hsdp_first_step``: the kill ->
  the first step completed after it; ``hsdp_state_gbps``: the restarted rank's load of
  its shards (parameters and Adam moments) from its replica; ``hsdp_steps_lost``: step
  bodies run beyond the steps counted (1: the step in flight is redone).

Writes ``bench/results/hsdp.md``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

from bench.common import command_line, write_results
from bench.peer_state import _Kernel, _kill_at, _pids

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPT = os.path.join(HERE, "fsdp_steps.py")

STEPS_CELL = """\
%%remote {mesh}
import sys
sys.path.insert(0, {here!r})
import fsdp_steps
from monarch_kernel.sharding import device_mesh
_dm = device_mesh()
_secs = fsdp_steps.train({steps}, _dm if {hsdp} else _dm["gpus"])
print(f"secs {{_secs:.4f}}")
"""

SETUP = """\
%%remote {mesh} --setup
import os, time, torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from monarch_kernel.sharding import device_mesh
from monarch_kernel.training import TrainingState
RANK = int(os.environ["RANK"])
WIDTH, DEPTH = {width}, {depth}

def build():
    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers)
    dm = device_mesh()
    for layer in net:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=dm)
    fully_shard(net, mesh=dm)
    return net, torch.optim.Adam(net.parameters(), lr=1e-4)

model, opt = build()
bodies = 0
"""

TRAIN = """\
%%remote {mesh}
state = TrainingState(model=model, optimizer=opt)
bodies = 0
while state.step < {steps}:
    with state.stepping():
        bodies += 1
        x = torch.randn(32, WIDTH, generator=torch.Generator().manual_seed(state.step * 10 + RANK))
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        if RANK == 0:
            print(f"done {{state.step}} {{time.time():.4f}}", flush=True)
bodies - state.step
"""


def torchrun_sps(steps: int, hsdp: bool) -> float:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4", SCRIPT]
    cmd += [str(steps)] + (["hsdp"] if hsdp else [])
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise RuntimeError(f"torchrun failed: {out.stderr[-800:]}")
    return float(out.stdout.strip().splitlines()[-1].split()[-1])


def mesh_sps(k: _Kernel, mesh: str, shape: str, steps: int, hsdp: bool) -> float:
    k.run(f"%mesh {mesh} {shape} --dist", timeout=180)
    try:
        text = k.run(STEPS_CELL.format(mesh=mesh, here=HERE, steps=steps, hsdp=hsdp))
        secs = [float(x) for x in re.findall(r"secs ([0-9.]+)", text)]
        if len(secs) != 4:
            raise RuntimeError(f"expected 4 ranks' times: {text[-800:]}")
        return steps / max(secs)
    finally:
        k.run(f"%mesh stop {mesh}")


def recovery(k: _Kernel, width: int, depth: int, steps: int) -> dict[str, float]:
    mesh = "hk"
    k.run(f"%mesh {mesh} --hosts 2 --gpus 2 --dist", timeout=180)
    try:
        k.run(SETUP.format(mesh=mesh, width=width, depth=depth), timeout=300)
        pids = _pids(k, mesh)
        cell = k.start(TRAIN.format(mesh=mesh, steps=steps))
        t_kill, text = _kill_at(k, cell, 4, pids[1])
        done = {int(s): float(t) for s, t in re.findall(r"done (\d+) ([0-9.]+)", text)}
        got = re.search(
            r"state of ([0-9.]+) (KB|MB|GB) copied from rank (\d+) in ([0-9.]+) s", text
        )
        took = re.search(r"recovery took ([0-9.]+) s", text)
        resumed = re.search(r"resumed at step (\d+)", text)
        if got is None or took is None or resumed is None:
            raise RuntimeError(f"no recovery in the output: {text[-1500:]}")
        scale = {"KB": 1e3, "MB": 1e6, "GB": 1e9}[got.group(2)]
        nbytes = float(got.group(1)) * scale
        lost = [int(x) for x in re.findall(r"\{hosts=\d+, gpus=\d+\}: (-?\d+)", text)]
        if not lost:
            raise RuntimeError(f"no step counts in the output: {text[-1500:]}")
        # "done N" is printed inside step N's body (state.step is N until it ends): the
        # first step completed after the recovery is the one numbered as it resumed
        after = [t for s, t in done.items() if s >= int(resumed.group(1)) and t > t_kill]
        first = min(after) - t_kill
        return {
            "hsdp_recovery": float(took.group(1)),
            "hsdp_first_step": first,
            "hsdp_state_mb": nbytes / 1e6,
            "hsdp_state_gbps": nbytes / float(got.group(4)) / 1e9,
            "hsdp_source": float(got.group(3)),
            "hsdp_steps_lost": float(max(lost)),
        }
    finally:
        k.run(f"%mesh stop {mesh}")


def markdown(r: dict[str, float], command: str, params: int) -> str:
    return "\n".join(
        [
            "# Sharded training on the mesh: FSDP2 / HSDP",
            "",
            f"Written by `{command}` on {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
            f"{os.cpu_count()} CPUs, gloo (CPU). Steps/s: an MLP of {6} × 512² layers, Adam, "
            "batch 64 per rank, the same script (`bench/fsdp_steps.py`) in the mesh and "
            "under torchrun.",
            "",
            "| row | ours (mesh) | torchrun | ratio |",
            "|---|---|---|---|",
            f"| FSDP2, 4 ranks (steps/s) | {r['fsdp_sps']:.1f} | {r['fsdp_torchrun_sps']:.1f} | "
            f"{r['fsdp_sps'] / r['fsdp_torchrun_sps']:.2f} |",
            f"| HSDP, 2 × 2 (steps/s) | {r['hsdp_sps']:.1f} | {r['hsdp_torchrun_sps']:.1f} | "
            f"{r['hsdp_sps'] / r['hsdp_torchrun_sps']:.2f} |",
            "",
            f"HSDP SIGKILL of rank 1 at step 5 of a TrainingState loop ({params / 1e6:.1f} M "
            "parameters, Adam; 2 × 2 mesh):",
            "",
            "| row | value |",
            "|---|---|",
            f"| kill → survivors resume (recovery) | {r['hsdp_recovery']:.2f} s |",
            f"| kill → first step completed after it | {r['hsdp_first_step']:.2f} s |",
            f"| shards taken from the replica (rank {int(r['hsdp_source'])}) | "
            f"{r['hsdp_state_mb']:.1f} MB at {r['hsdp_state_gbps']:.2f} GB/s |",
            f"| step bodies run beyond the steps counted | {int(r['hsdp_steps_lost'])} |",
            "",
        ]
    )


def main(argv: list[str]) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m bench hsdp")
    ap.add_argument("--quick", action="store_true", help="fewer steps, a smaller model")
    args = ap.parse_args(argv)
    steps = 20 if args.quick else 60
    width, depth = (1024, 4) if args.quick else (2048, 8)
    params = depth * (width * width + width)
    r: dict[str, float] = {}
    r["fsdp_torchrun_sps"] = torchrun_sps(steps, hsdp=False)
    r["hsdp_torchrun_sps"] = torchrun_sps(steps, hsdp=True)
    k = _Kernel()
    try:
        r["fsdp_sps"] = mesh_sps(k, "fb", "--gpus 4", steps, hsdp=False)
        r["hsdp_sps"] = mesh_sps(k, "hb", "--hosts 2 --gpus 2", steps, hsdp=True)
        r.update(recovery(k, width, depth, 40))
    finally:
        k.stop()
    write_results("hsdp.md", markdown(r, command_line("hsdp", argv), params))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
