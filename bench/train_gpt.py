"""The training workload: a small GPT-style decoder, DDP over gloo, synthetic tokens.

One file for every system of the workload benchmark (``bench/train.py``): plain
``torchrun`` and ``%torchrun`` run it as a script, Monarch's ``SPMDActor`` runs it with
``runpy``, and Ray Train, Dask and the ``%%remote`` loop import it. It needs only torch
and the standard library (it runs in processes that cannot import ``bench``).

Every system trains the same model (the same init seed) on the same batches: the batch
of step ``i`` on rank ``r`` comes from a generator seeded with ``(seed, i, r)``. The tokens
are arithmetic sequences over the first :data:`USED_TOKENS` ids (a random start and
stride per row), so the next token is predictable and the loss falls within a few steps.

Rank 0 appends one line per completed step to the progress file (``step I LOSS TIME``);
every rank writes ``pid RANK PID TIME`` when it starts. The driver reads that file: steps/s,
time to the first step, the loss curve, and which process to kill.

    torchrun --nproc-per-node 4 bench/train_gpt.py --steps 12 --progress /tmp/p.log
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

#: The batches use the first this many token ids of the vocabulary (the model learns
#: that within a few steps: the loss falls from about ln(vocab) at once).
USED_TOKENS = 256


@dataclass
class Config:
    """The model, the batches and the run; every system gets the same one."""

    vocab: int = 8192
    dim: int = 320
    layers: int = 6
    heads: int = 5
    seq: int = 32
    batch: int = 2
    seed: int = 0
    lr: float = 1e-3
    #: Steps before the timed window (not timed), the timed window, then more steps
    #: (the fault phase: a checkpoint at its start, a rank killed in it).
    warmup: int = 2
    steps: int = 10
    extra: int = 0
    #: A directory for the disk checkpoint (empty: none); written once, after the timed
    #: window, and loaded at start when it is there.
    ckpt: str = ""
    progress: str = ""
    #: "cpu" (gloo) or "cuda" (NCCL; each rank on GPU ``LOCAL_RANK % device_count``).
    device: str = "cpu"

    @property
    def total(self) -> int:
        return self.warmup + self.steps + self.extra

    @property
    def ckpt_step(self) -> int:
        """Steps done when the checkpoint is written (the end of the timed window)."""
        return self.warmup + self.steps

    def args(self) -> list[str]:
        """The command-line arguments that give this configuration to :func:`main`."""
        out = []
        for f in dataclasses.fields(self):
            out += [f"--{f.name}", str(getattr(self, f.name))]
        return out

    @classmethod
    def parse(cls, argv: list[str] | None = None) -> Config:
        ap = argparse.ArgumentParser(description="GPT-style DDP workload")
        for f in dataclasses.fields(cls):
            ap.add_argument(f"--{f.name}", type=type(f.default), default=f.default)
        return cls(**vars(ap.parse_args(argv)))


class Block(nn.Module):
    """Pre-norm decoder block: causal self-attention and an MLP."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        shape = (b, t, self.heads, d // self.heads)
        q, k, v = (z.view(shape).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token and position embeddings, decoder blocks, a tied output head."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.blocks = nn.Sequential(*[Block(cfg.dim, cfg.heads) for _ in range(cfg.layers)])
        self.ln = nn.LayerNorm(cfg.dim)
        for emb in (self.tok, self.pos):  # GPT-2's scale: the tied head starts near uniform
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.blocks(self.tok(idx) + self.pos(pos))
        return self.ln(x) @ self.tok.weight.t()


def parameters(cfg: Config) -> int:
    """The model's parameter count (tied head counted once)."""
    torch.manual_seed(cfg.seed)
    return sum(p.numel() for p in GPT(cfg).parameters())


class Batches:
    """Synthetic token batches of one rank; its position is part of the training state."""

    def __init__(self, cfg: Config, rank: int):
        self.cfg, self.rank, self.pos = cfg, rank, 0
        self.device = device_of(cfg)

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        c = self.cfg
        g = torch.Generator().manual_seed(((c.seed * 100_003) + self.pos) * 1009 + self.rank)
        self.pos += 1
        used = min(c.vocab, USED_TOKENS)
        start = torch.randint(0, used, (c.batch, 1), generator=g)
        stride = torch.randint(1, 17, (c.batch, 1), generator=g)
        seq = ((start + stride * torch.arange(c.seq + 1)) % used).to(self.device)
        return seq[:, :-1], seq[:, 1:]

    def state_dict(self) -> dict[str, int]:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.pos = state["pos"]


def device_of(cfg: Config) -> torch.device:
    """This rank's device: the CPU, or its GPU (``LOCAL_RANK`` modulo the GPUs)."""
    if cfg.device != "cuda":
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device("cuda", local % torch.cuda.device_count())


def build(cfg: Config) -> tuple[DDP, torch.optim.Optimizer]:
    """The model under DDP (the default process group) and its optimizer, same seed."""
    torch.manual_seed(cfg.seed)
    dev = device_of(cfg)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
        model = DDP(GPT(cfg).to(dev), device_ids=[dev.index])
    else:
        model = DDP(GPT(cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    return model, opt


def step_once(model: nn.Module, opt: torch.optim.Optimizer, batches: Batches) -> float:
    """One training step; the rank's loss before it."""
    x, y = batches.next()
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())  # on a GPU this waits for the step: its time is real


class Progress:
    """Appends lines to the progress file (one ``write`` each, so lines never mix)."""

    def __init__(self, path: str, rank: int):
        self.rank = rank
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT) if path else -1
        self.say(f"pid {rank} {os.getpid()}")

    def say(self, text: str) -> None:
        if self.fd >= 0:
            os.write(self.fd, f"{text} {time.time()!r}\n".encode())

    def step(self, done: int, loss: float) -> None:
        """Rank 0: step number ``done`` (counted from 1) completed with ``loss``."""
        if self.rank == 0:
            self.say(f"step {done} {loss!r}")


Save = Callable[[int, dict[str, Any]], None]
Load = Callable[[], "dict[str, Any] | None"]


def disk_saver(cfg: Config, rank: int) -> tuple[Save, Load]:
    """Save and load the training state as a torch checkpoint file in ``cfg.ckpt``."""
    path = os.path.join(cfg.ckpt, "state.pt")

    def save(step: int, state: dict[str, Any]) -> None:
        if rank == 0:
            os.makedirs(cfg.ckpt, exist_ok=True)
            torch.save({"step": step, **state}, path + ".tmp")
            os.replace(path + ".tmp", path)

    def load() -> dict[str, Any] | None:
        if not cfg.ckpt or not os.path.exists(path):
            return None
        state: dict[str, Any] = torch.load(path, weights_only=False, map_location="cpu")
        return state

    return save, load


def train(cfg: Config, rank: int, save: Save | None = None, load: Load | None = None) -> None:
    """The training loop of one rank (the process group already formed): ``cfg.total``
    steps, a checkpoint after the timed window when ``save`` is given, resuming from
    ``load()`` when that returns a state."""
    model, opt = build(cfg)
    batches = Batches(cfg, rank)
    log = Progress(cfg.progress, rank)
    done = 0
    state = load() if load is not None else None
    if state is not None:
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        batches.load_state_dict(state["data"])
        done = state["step"]
        log.say(f"resumed {done}")
    while done < cfg.total:
        loss = step_once(model, opt, batches)
        done += 1
        log.step(done, loss)
        if save is not None and done == cfg.ckpt_step:
            save(done, {"model": model.module.state_dict(), "opt": opt.state_dict(),
                        "data": batches.state_dict()})  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    """The torchrun entry point: form the group from the environment, train, leave."""
    cfg = Config.parse(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    dist.init_process_group("nccl" if cfg.device == "cuda" else "gloo")
    rank = dist.get_rank()
    save, load = disk_saver(cfg, rank) if cfg.ckpt else (None, None)
    train(cfg, rank, save, load)
    dist.destroy_process_group()


def describe(cfg: Config) -> str:
    """One line: the model and the batches (the benchmark's notes quote it)."""
    n = parameters(cfg)
    return (
        f"{n / 1e6:.1f}M parameters ({cfg.layers} layers, width {cfg.dim}, {cfg.heads} heads, "
        f"vocabulary {cfg.vocab}, tied head), AdamW lr {cfg.lr:g}, batch {cfg.batch} x "
        f"{cfg.seq} tokens per rank, {math.prod((cfg.batch, cfg.seq))} tokens per rank-step"
    )


if __name__ == "__main__":
    main()
