"""A small DDP training script, unchanged between torchrun and a monarch mesh.

Prints one line per step on rank 0: ``step N loss X``.
"""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


def train(steps: int = 20) -> list[float]:
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    ddp = DDP(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1234)
    x_all = torch.randn(64 * world, 16, generator=gen)
    y_all = x_all.sum(dim=1, keepdim=True) * 0.5
    x, y = x_all[rank::world], y_all[rank::world]
    losses = []
    for step in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        if rank == 0:
            print(f"step {step} loss {losses[-1]:.6f}", flush=True)
    return losses


if __name__ == "__main__":
    assert "TORCHELASTIC_RUN_ID" in os.environ
    train()
    dist.destroy_process_group()
