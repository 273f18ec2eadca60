"""DDP steps of a small MLP on CPU (gloo); the same file under torchrun and in a mesh.

Under torchrun it prints ``steps/s X`` on rank 0.
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

WARMUP = 5


def train(steps: int) -> float:
    """Seconds for ``steps`` steps after a short warm-up (the same on every rank)."""
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DDP(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(64, 256)
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
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 100
    secs = train(n)
    if dist.get_rank() == 0:
        print(f"steps/s {n / secs:.3f}")
    dist.destroy_process_group()
