"""Sharding errors that name the tensor, not "shape mismatch on rank 2".

A real kernel and a 2×2 mesh (``--hosts 2 --gpus 2 --dist``, gloo on CPU). Each mistake
of issue 52 is made in a cell; the error under the cell must name the parameter or buffer
(qualified name), its global and local shapes and placements on the ranks involved and
the ranks that disagree. Before, (a) and (b) failed in FSDP's all-gather with gloo's
"Received data size doesn't match expected size" (a worker killed, the group aborted),
(c) with the same or with DTensor's "got mixed torch.Tensor and DTensor", (d) with
"Cross device mesh comm not supported yet!". After each, every rank is the same process
and the mesh's process group still works.
"""

from __future__ import annotations

import re

import pytest
from helpers import ranks_showing
from kernel_client import Kernel

from monarch_kernel.rank.sharding.fingerprint import (
    Fingerprint,
    TensorKind,
    TensorPrint,
    compare,
    local_shape_at,
)

pytestmark = pytest.mark.local

MESH = "se"

SETUP = """\
%%remote {mesh}
import os, torch, torch.nn as nn
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor
from monarch_kernel.sharding import ShardingError, check, device_mesh
RANK = int(os.environ["RANK"])
PID = os.getpid()
dm = device_mesh()
other = device_mesh(rename={{"hosts": "replicate", "gpus": "shard"}})
"""

#: Every rank is the process it was (its namespace still has PID) and the group works.
ALIVE = """\
%%remote {mesh}
t = torch.ones(1); dist.all_reduce(t)
print("alive", PID == os.getpid(), int(t.item()))
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


def _cell(kernel: Kernel, body: str, *made: str) -> str:
    """Run ``body`` on every rank; it must fail; the error's text, after checking that the
    ranks are alive and the mesh usable. ``made``: the names the cell bound, dropped after
    (models that differ by rank would otherwise make later stop-button checks repair
    them)."""
    r = kernel.run(f"%%remote {MESH}\n{body}", timeout=120)
    assert r.errors, r.stdout + r.stderr
    text = r.error_text
    drop = f"for _n in {list(made)!r}:\n    globals().pop(_n, None)\n"
    after = kernel.run(ALIVE.format(mesh=MESH) + drop, timeout=60)
    assert not after.errors, after.error_text
    assert ranks_showing(after.stdout, "alive True 4") == {0, 1, 2, 3}, after.stdout
    return text


def test_a_parameter_whose_shape_differs_on_one_rank(kernel):
    text = _cell(
        kernel,
        "width = 12 if RANK == 2 else 8\n"
        "model_a = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 2))\n"
        "for layer in (model_a[0], model_a[2]):\n"
        "    fully_shard(layer, mesh=dm)\n"
        "fully_shard(model_a, mesh=dm)\n"
        "model_a(torch.ones(4, 8)).sum().backward()\n",
        "model_a",
    )
    assert "ShardingError in the cell on ranks 0-3 of 4" in text, text
    assert "Received data size" not in text, text
    assert "rank 2 differs from the others" in text, text
    assert "parameter 'model_a.0.weight': global shape differs across ranks" in text, text
    placed = "float32, (Replicate(), Shard(dim=0)) on mesh (hosts=2, gpus=2)"
    assert f"ranks 0-1, 3: global (8, 8), local (4, 8), {placed}" in text, text
    assert f"rank 2: global (12, 8), local (6, 8), {placed}" in text, text
    assert "parameter 'model_a.2.weight'" in text and "rank 2: global (2, 12)" in text, text
    # the failure policy's replica check sees the ranks built different models: it says
    # so and copies nothing (a copy between different shapes waited 60 s for its deadline)
    assert "replicas built differently, left as they are" in text, text
    assert "model_a: rank 2 laid out differently from rank 0" in text, text
    assert "copying the most advanced replica's state failed" not in text, text


def test_a_module_wrapped_on_some_ranks_only(kernel):
    text = _cell(
        kernel,
        "model_b = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))\n"
        "if RANK < 2:\n"
        "    fully_shard(model_b[0], mesh=dm)\n"
        "fully_shard(model_b, mesh=dm)\n"
        "model_b(torch.ones(4, 8)).sum().backward()\n",
        "model_b",
    )
    assert "ShardingError in the cell on ranks 0-3 of 4" in text, text
    assert (
        "module 'model_b.0' is wrapped by fully_shard on ranks 0-1 but not on ranks 2-3: its "
        "parameters ('model_b.0.bias', 'model_b.0.weight') would be all-gathered in a group "
        "of their own on ranks 0-1 and with their parent's on ranks 2-3"
    ) in text, text
    assert "ranks 2-3 differ from the others" in text, text


def test_a_replicated_buffer_sharded_by_hand(kernel):
    # The mask should be whole on every rank; each rank kept its piece (10 over 4 ranks:
    # 3, 3, 2, 2): caught before FSDP's first collective.
    text = _cell(
        kernel,
        "class Masked(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(8, 10)\n"
        "        self.register_buffer('mask', torch.ones(10).tensor_split(4)[RANK])\n"
        "    def forward(self, x):\n"
        "        return self.proj(x) * self.mask\n"
        "net_c = Masked()\n"
        "fully_shard(net_c, mesh=dm)\n"
        "net_c(torch.ones(4, 8)).sum().backward()\n",
        "net_c",
    )
    assert "ShardingError in the cell on ranks 0-3 of 4" in text, text
    assert "buffer 'net_c.mask': global shape differs across ranks" in text, text
    plain = "float32, a plain tensor (whole on every rank)"
    assert f"ranks 0-1: global (3,), local (3,), {plain}" in text, text
    assert f"ranks 2-3: global (2,), local (2,), {plain}" in text, text
    assert "a buffer is not sharded by FSDP: every rank should hold it whole" in text, text


def test_a_replicated_buffer_made_a_sharded_dtensor(kernel):
    # The same on every rank, so the ranks agree; the forward fails in DTensor's
    # dispatch, and the note names the buffer, its placement and every rank's piece.
    text = _cell(
        kernel,
        "class Masked2(nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.proj = nn.Linear(8, 16)\n"
        "        self.register_buffer('mask', torch.ones(16))\n"
        "    def forward(self, x):\n"
        "        return self.proj(x) * self.mask\n"
        "net_c2 = Masked2()\n"
        "net_c2.mask = distribute_tensor(net_c2.mask, dm['gpus'], [Shard(0)])\n"
        "fully_shard(net_c2, mesh=dm)\n"
        "net_c2(torch.ones(4, 8)).sum().backward()\n",
        "net_c2",
    )
    assert "got mixed torch.Tensor and DTensor" in text, text
    assert re.search(
        r"buffer 'net_c2\.mask': global \(16,\), float32, placements \(Shard\(dim=0\),\) on "
        r"mesh \(gpus=2\) of ranks (0-1|2-3); local shape \(8,\) on ranks (0-1|2-3)",
        text,
    ), text
    assert "buffer 'net_c2.mask' is a DTensor, so it stays sharded in forward" in text, text


def test_a_dtensor_redistributed_to_another_mesh(kernel):
    r = kernel.run(
        f"%%remote {MESH}\nlin_d = nn.Sequential(nn.Linear(8, 8))\nfully_shard(lin_d, mesh=dm)\n"
        "None\n",
        timeout=60,
    )
    assert not r.errors, r.error_text
    redistribute = "moved = lin_d[0].weight.redistribute(other, [Replicate(), Replicate()])\n"
    text = _cell(kernel, redistribute, "lin_d")
    assert "Cross device mesh comm not supported yet!" in text, text
    assert (
        "parameter 'lin_d.0.weight': global (8, 8), float32, placements (Replicate(), "
        "Shard(dim=0)) on mesh (hosts=2, gpus=2) of ranks 0-3; local shape (4, 8) on ranks 0-3"
    ) in text, text
    assert "the mesh asked for: (replicate=2, shard=2) of ranks 0-3, not the DTensor's own" in text
    assert "redistribute() changes a DTensor's placements on its own mesh" in text, text


def test_check_names_the_difference_and_passes_when_the_ranks_agree(kernel):
    text = _cell(
        kernel,
        "plain = nn.Linear(4, 3 if RANK == 0 else 4)\ncheck(plain)\n",
        "plain",
    )
    assert "ShardingError in the cell on ranks 0-3 of 4" in text, text
    assert "compared across ranks 0-3 by check()" in text, text
    assert "rank 0 differs from the others" in text, text
    assert "rank 0: global (3, 4), local (3, 4), float32, a plain tensor" in text, text
    r = kernel.run(
        f"%%remote {MESH}\n"
        "same = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
        "check(same)\n"
        "fully_shard(same, mesh=dm)\n"
        "check(same)\n"
        "same(torch.ones(4, 8)).sum().backward()\n"
        "print('trained', type(same[0].weight).__name__)\n",
        timeout=120,
    )
    assert not r.errors, r.error_text
    assert ranks_showing(r.stdout, "trained DTensor") == {0, 1, 2, 3}, r.stdout


# -- the comparison itself, without a mesh ----------------------------------------------


def _fp(rank: int, *tensors: TensorPrint) -> Fingerprint:
    return Fingerprint(rank=rank, root="m", tensors=tensors, wrapped=("m",))


def _plain(name: str, shape: tuple[int, ...], dtype: str = "float32") -> TensorPrint:
    return TensorPrint(name, TensorKind.PARAMETER, shape, shape, dtype)


def _sharded(
    name: str, whole: tuple[int, ...], local: tuple[int, ...], expected: tuple[int, ...], n: int
) -> TensorPrint:
    return TensorPrint(
        name,
        TensorKind.PARAMETER,
        whole,
        local,
        "float32",
        placements=("Shard(dim=0)",),
        mesh=f"(gpus={n})",
        mesh_ranks=tuple(range(n)),
        expected_local=expected,
    )


def test_compare_is_silent_when_the_ranks_agree_even_with_uneven_shards():
    # 10 rows over 4 ranks: 3, 3, 3, 1; every rank holds the piece it should
    prints = [
        _fp(r, _sharded("m.w", (10, 2), (n, 2), (n, 2), 4)) for r, n in enumerate((3, 3, 3, 1))
    ]
    assert compare(prints) is None


def test_compare_names_a_missing_parameter_a_dtype_and_a_bad_local_piece():
    w, half, extra = (
        _plain("m.w", (4, 4)),
        _plain("m.w", (4, 4), "bfloat16"),
        _plain("m.extra", (2,)),
    )
    good = _sharded("m.s", (4,), (2,), (2,), 2)
    bad = _sharded("m.s", (4,), (3,), (2,), 2)
    text = compare([_fp(0, w, good), _fp(1, w, extra, good), _fp(2, half, bad)])
    assert text is not None
    assert "parameter 'm.extra' exists on rank 1 but not on ranks 0, 2" in text, text
    assert "parameter 'm.w': dtype differs across ranks" in text, text
    assert "rank 2: global (4, 4), local (4, 4), bfloat16, a plain tensor" in text, text
    assert "parameter 'm.s': local shape differs across ranks" in text, text
    assert "rank 2: global (4,), local (3,), float32, (Shard(dim=0),) on mesh (gpus=2) " in text
    assert "[its placements give a local (2,)]" in text, text


class Shard:  # DTensor's placements, by the class name local_shape_at reads
    def __init__(self, dim: int) -> None:
        self.dim = dim


class Replicate:
    pass


def test_local_shapes_follow_torch_chunk():
    shapes = [local_shape_at((10, 3), (4,), [Shard(0)], (i,)) for i in range(4)]
    assert shapes == [(3, 3), (3, 3), (3, 3), (1, 3)]
    # HSDP: replicated over mesh dim 0, sharded over dim 1; a tensor too small for 4 pieces
    assert local_shape_at((8, 8), (2, 2), [Replicate(), Shard(0)], (1, 1)) == (4, 8)
    assert local_shape_at((2,), (4,), [Shard(0)], (3,)) == (0,)


def test_the_stop_button_while_ranks_wait_for_a_late_peer_and_the_model_trains_after(kernel):
    # Ranks 0-2 reach the first forward and wait for rank 3's fingerprint; rank 3 is
    # still busy. The stop button releases them all; nothing of FSDP ran, so the same
    # model then trains on every rank.
    cell = kernel.submit(
        f"%%remote {MESH}\n"
        "import time\n"
        "late = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2))\n"
        "fully_shard(late, mesh=dm)\n"
        "print('forward', flush=True)\n"
        "if RANK == 3:\n"
        "    time.sleep(120)\n"
        "late(torch.ones(4, 8)).sum().backward()\n"
    )
    kernel.wait_for_output(cell, "forward", timeout=60)
    kernel.km.interrupt_kernel()
    r = kernel.collect(cell, timeout=90)
    assert r.errors, r.stdout
    assert "ShardingError" not in r.error_text, r.error_text
    r = kernel.run(
        f"%%remote {MESH}\nlate(torch.ones(4, 8)).sum().backward()\nprint('trained', flush=True)\n",
        timeout=120,
    )
    assert not r.errors, r.error_text
    assert ranks_showing(r.stdout, "trained") == {0, 1, 2, 3}, r.stdout
    after = kernel.run(ALIVE.format(mesh=MESH), timeout=60)
    assert ranks_showing(after.stdout, "alive True 4") == {0, 1, 2, 3}, after.stdout
