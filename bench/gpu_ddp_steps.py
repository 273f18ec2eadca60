"""DDP steps of an MLP on CUDA (NCCL); the same file under torchrun and in a mesh.

Under torchrun it prints ``steps/s X`` on rank 0. Ranks that share a GPU (more ranks
than GPUs) get an ``NCCL_HOSTID`` each, as the mesh gives its workers (NCCL refuses two
ranks of a communicator on one GPU otherwise).
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP = 5
#: About 14 ms a step on an H100 (fp32): a small model, still a step long enough that
#: what is measured is the group and the mesh, not Python's cost per step.
WIDTH = 4096
LAYERS = 8
BATCH = 1024


def train(steps: int) -> float:
    """Seconds for ``steps`` steps after a short warm-up (the same on every rank)."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local % torch.cuda.device_count())
    torch.cuda.set_device(device)
    if not dist.is_initialized():
        if int(os.environ.get("LOCAL_WORLD_SIZE", "1")) > torch.cuda.device_count():
            os.environ.setdefault("NCCL_HOSTID", f"bench-{local}")
            os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        dist.init_process_group("nccl")
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(LAYERS):
        layers += [torch.nn.Linear(WIDTH, WIDTH), torch.nn.ReLU()]
    model = DDP(torch.nn.Sequential(*layers).to(device), device_ids=[device.index])
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(BATCH, WIDTH, device=device)
    for i in range(WARMUP + steps):
        if i == WARMUP:
            torch.cuda.synchronize(device)
            dist.barrier()
            t0 = time.perf_counter()
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    torch.cuda.synchronize(device)
    dist.barrier()
    return time.perf_counter() - t0


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 50
    secs = train(n)
    if dist.get_rank() == 0:
        print(f"steps/s {n / secs:.3f}")
    dist.destroy_process_group()
