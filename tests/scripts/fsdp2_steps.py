"""A few FSDP2 (fully_shard) steps on CPU with gloo; prints the losses on rank 0."""

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard


def main(steps: int = 3) -> list[float]:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    y = x.sum(dim=1, keepdim=True)
    losses = []
    for _ in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    if dist.get_rank() == 0:
        print("fsdp2 losses", [round(v, 4) for v in losses], flush=True)
    return losses


if __name__ == "__main__":
    main()
