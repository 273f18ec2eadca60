"""``shard_model``: FSDP2 by a policy on the mesh's own dims, and the plan it prints.

A real kernel and a 2×2 mesh (``--hosts 2 --gpus 2 --dist``, gloo on CPU): a small
GPT-like model of three blocks is sharded per block (HSDP: replicate over ``hosts``,
shard over ``gpus``), the printed plan names the wrapped modules and their bytes, a few
training steps match a one-process reference on the same batches, and every choice can
be overridden (modules, strategy, mixed precision, reshard, dry run).
"""

from __future__ import annotations

import re

import pytest
from helpers import ranks_showing
from kernel_client import Kernel

pytestmark = pytest.mark.local

MESH = "sp"
ALL = {0, 1, 2, 3}

SETUP = """\
%%remote {mesh}
import os, torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from monarch_kernel.sharding import ShardPlan, shard_model
RANK = int(os.environ["RANK"])
WORLD = int(os.environ["WORLD_SIZE"])

class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.attn = nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x):
        x = x + self.attn(self.ln(x))
        return x + self.mlp(x)

class GPT(nn.Module):
    def __init__(self, vocab=64, d=32, n=3):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx):
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

def batch(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(0, 64, (4, 8), generator=g)
    return idx, torch.roll(idx, -1, dims=1)

def wrapped(model):
    return sorted(n or "(root)" for n, m in model.named_modules() if isinstance(m, FSDPModule))
"""


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    try:
        r = k.run(f"%mesh {MESH} --hosts 2 --gpus 2 --dist", timeout=120)
        assert "ready" in r.stdout, r.stderr + r.error_text
        r = k.run(SETUP.format(mesh=MESH), timeout=120)
        assert not r.errors, r.error_text
        yield k
        k.run(f"%mesh stop {MESH}", timeout=60)
    finally:
        k.shutdown_and_check()


def _lines(text: str) -> list[str]:
    """The cell's output lines without their ``[0]``/``[0-3]`` rank prefix."""
    return [re.sub(r"^\[[0-9,\- ]+\] ?", "", line) for line in text.splitlines()]


def test_the_plan_per_block_on_a_2x2_mesh_is_printed_once(kernel):
    r = kernel.run(
        f"%%remote {MESH}\n"
        "torch.manual_seed(0)\n"
        "model = GPT()\n"
        "plan = shard_model(model)\n"
        "print('wrapped', wrapped(model), plan.wrapped, type(plan).__name__)\n",
        timeout=120,
    )
    assert not r.errors, r.error_text
    out = r.stdout
    lines = _lines(out)
    head = (
        "shard_model: HSDP on mesh (hosts=2, gpus=2): replicate over 'hosts' (2), shard "
        "over 'gpus' (2); policy 'blocks': 3 × Block in 'blocks'"
    )
    assert ranks_showing(out, head) == {0}, out  # shown by the mesh's first rank only
    # d=32: a block holds 9472 parameters (37888 bytes, half of it per rank); the root
    # (embedding, final norm, head) 4224.
    for i in range(3):
        row = re.compile(rf"^\s+blocks\.{i}\s+Block\s+9\.5K\s+37\.0 KiB\s+18\.5 KiB$")
        assert any(row.match(line) for line in lines), out
    assert any(re.match(r"^\s+\(root\)\s+GPT\s+4\.2K\s+16\.5 KiB\s+8\.2 KiB$", x) for x in lines)
    assert (
        "parameters: 32.6K, 127.5 KiB per rank before, 63.8 KiB per rank after "
        "(reshard after forward: yes; mixed precision: none)" in lines
    ), out
    # forward gathers every group (127.5 KiB), backward the resharded blocks again
    # (3 × 37 KiB), the reduce-scatter takes every gradient, and the replicas all-reduce
    # their shards across hosts.
    assert (
        "communication per training step, per rank: all-gather 238.5 KiB (forward 127.5 KiB "
        "+ backward 111.0 KiB), reduce-scatter 127.5 KiB, all-reduce across replicas "
        "(hosts) 63.8 KiB" in lines
    ), out
    expected = (
        "wrapped ['(root)', 'blocks.0', 'blocks.1', 'blocks.2'] "
        "('blocks.0', 'blocks.1', 'blocks.2', '') ShardPlan"
    )
    assert ranks_showing(out, expected) == ALL, out
    # The plan travels to the notebook as data (without the model and its mesh).
    r = kernel.run(f"_p = %pull {MESH} plan\n_v = list(_p.values())\n_v[0].wrapped, str(_v[3])")
    assert not r.errors, r.error_text
    assert "('blocks.0', 'blocks.1', 'blocks.2', '')" in r.text, r.text
    assert "3 × Block in 'blocks'" in r.text, r.text


def test_training_after_shard_model_matches_a_one_process_reference(kernel):
    # HSDP averages the gradients of the four ranks' batches: the same as one process
    # training on the four batches together.
    r = kernel.run(
        f"%%remote {MESH}\n"
        "torch.manual_seed(0)\n"
        "ref = GPT()\n"
        "torch.manual_seed(0)\n"
        "net = GPT()\n"
        "shard_model(net, show=False)\n"
        "opt = torch.optim.SGD(net.parameters(), lr=0.5)\n"
        "ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)\n"
        "diffs, losses = [], []\n"
        "for step in range(4):\n"
        "    idx, tgt = batch(step, RANK)\n"
        "    loss = F.cross_entropy(net(idx).flatten(0, 1), tgt.flatten())\n"
        "    loss.backward(); opt.step(); opt.zero_grad()\n"
        "    mean = loss.detach().clone(); dist.all_reduce(mean); mean /= WORLD\n"
        "    parts = [batch(step, r) for r in range(WORLD)]\n"
        "    all_idx = torch.cat([p[0] for p in parts])\n"
        "    all_tgt = torch.cat([p[1] for p in parts])\n"
        "    ref_loss = F.cross_entropy(ref(all_idx).flatten(0, 1), all_tgt.flatten())\n"
        "    ref_loss.backward(); ref_opt.step(); ref_opt.zero_grad()\n"
        "    diffs.append(abs(mean.item() - ref_loss.item())); losses.append(ref_loss.item())\n"
        "print('maxdiff', max(diffs) < 1e-5, losses[-1] < losses[0], wrapped(net)[-1])\n",
        timeout=120,
    )
    assert not r.errors, r.error_text
    assert ranks_showing(r.stdout, "maxdiff True True blocks.2") == ALL, r.stdout


def test_every_choice_can_be_overridden_and_a_dry_run_applies_nothing(kernel):
    r = kernel.run(
        f"%%remote {MESH}\n"
        "g = GPT()\n"
        "p = shard_model(g, modules=['blocks.1', g.blocks[2].mlp], strategy='fsdp',\n"
        "                mixed_precision='bf16', reshard_after_forward=False, apply=False)\n"
        "print('dry', wrapped(g), p.applied, '<table>' in p._repr_html_())\n"
        "p = p.apply()\n"
        "print('applied', wrapped(g), p.applied)\n"
        "s = shard_model(GPT(), policy='size', min_params=5000, show=False)\n"
        "print('size', s.wrapped, s.policy.value)\n",
        timeout=120,
    )
    assert not r.errors, r.error_text
    lines = _lines(r.stdout)
    head = (
        "shard_model: FSDP (full shard) on mesh (hosts_gpus=4): shard over 'hosts_gpus' "
        "(4); policy 'modules': 2 module(s) given [dry run: nothing applied]"
    )
    assert ranks_showing(r.stdout, head) == {0}, r.stdout
    assert any(re.match(r"^\s+blocks\.1\s+Block\s+9\.5K\s+37\.0 KiB\s+9\.2 KiB$", x) for x in lines)
    assert any(re.match(r"^\s+blocks\.2\.mlp\s+Sequential\s+8\.4K", x) for x in lines), r.stdout
    footer = [x for x in lines if x.startswith("parameters: ")]
    assert footer and "(reshard after forward: no; mixed precision: params bfloat16, " in footer[0]
    assert "reduce float32)" in footer[0], footer
    assert ranks_showing(r.stdout, "dry [] False True") == ALL, r.stdout
    applied = "applied ['(root)', 'blocks.1', 'blocks.2.mlp'] True"
    assert ranks_showing(r.stdout, applied) == ALL, r.stdout
    expected = "size ('blocks.0.mlp', 'blocks.1.mlp', 'blocks.2.mlp', '') size"
    assert ranks_showing(r.stdout, expected) == ALL, r.stdout


# -- the policies themselves, in this process (no mesh) ---------------------------------


def _tiny() -> object:
    import torch

    class Block(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.mlp = torch.nn.Linear(16, 16)

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(100, 16)
            self.heads = torch.nn.ModuleList(torch.nn.Linear(16, 1) for _ in range(2))
            self.layers = torch.nn.Sequential(Block(), Block(), Block())
            self.out = torch.nn.Linear(16, 100)
            self.out.weight = self.emb.weight  # tied

    return Net()


def test_blocks_are_the_repeated_children_holding_the_most_parameters():
    from monarch_kernel.rank.sharding.policy import find_blocks

    net = _tiny()
    assert find_blocks(net) == (["layers.0", "layers.1", "layers.2"], "3 × Block in 'layers'")
    names, why = find_blocks(net, block_classes=["Linear"])
    assert names == ["heads.0", "heads.1", "layers.0.mlp", "layers.1.mlp", "layers.2.mlp", "out"]
    assert why == "6 module(s) of class Linear"


def test_size_policy_and_tied_weights_stay_in_their_parents_group():
    from monarch_kernel.rank.sharding.policy import _shared_outside, by_size

    net = _tiny()
    assert by_size(net, 1000) == ["emb", "out"]  # 1600 parameters each
    assert _shared_outside(net, ["emb", "layers.0"]) == {"emb": "emb.weight is tied to out.weight"}
