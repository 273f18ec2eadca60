"""An unchanged Lightning Fabric script (runs the same under torchrun)."""

import torch
from lightning.fabric import Fabric


def main() -> None:
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp")
    fabric.launch()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = fabric.setup(model, opt)
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(fabric.global_rank))
    y = x.sum(dim=1, keepdim=True)
    for step in range(3):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        fabric.backward(loss)
        opt.step()
        fabric.print(
            f"fabric step {step} rank-count {fabric.world_size} "
            f"env {type(fabric._connector.cluster_environment).__name__}"
        )


if __name__ == "__main__":
    main()
