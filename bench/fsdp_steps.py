"""FSDP2 (or HSDP) steps of a small MLP on CPU (gloo); the same file under torchrun and in
a mesh.

Under torchrun it prints ``steps/s X`` on rank 0: ``torchrun --nproc-per-node 4
bench/fsdp_steps.py 60`` (FSDP2 over 4 ranks) or ``... 60 hsdp`` (HSDP on a 2×2 device
mesh: replicate over the first dim, shard over the second). In a mesh the ranks call
:func:`train` with the mesh's own ``device_mesh()``.
"""

from __future__ import annotations

import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

WARMUP = 3
WIDTH, DEPTH = 512, 6


def train(steps: int, mesh: Any) -> float:
    """Seconds for ``steps`` steps after a short warm-up (the same on every rank), with
    every linear layer and the whole model ``fully_shard``-ed on ``mesh``."""
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(DEPTH):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(64, WIDTH, generator=torch.Generator().manual_seed(dist.get_rank()))
    for i in range(WARMUP + steps):
        if i == WARMUP:
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    dist.barrier()
    return time.perf_counter() - t0


if __name__ == "__main__":
    from torch.distributed.device_mesh import init_device_mesh

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 60
    hsdp = len(sys.argv) > 2 and sys.argv[2] == "hsdp"
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    if hsdp:
        dm = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("hosts", "gpus"))
    else:
        dm = init_device_mesh("cpu", (world,), mesh_dim_names=("gpus",))
    secs = train(n, dm)
    if dist.get_rank() == 0:
        print(f"steps/s {n / secs:.3f}")
    dist.destroy_process_group()
