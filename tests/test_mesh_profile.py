"""``%mesh profile``: torch.profiler on 2 ranks of a running ``--bg`` DDP loop for a
few steps, their traces merged into one Chrome trace file (a process per rank, one time
axis) and a summary under the cell; armed on an idle mesh, it profiles the next cell's
steps. Real kernel, real ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from kernel_client import Kernel

pytestmark = pytest.mark.local

MESH = "mp"

SETUP = f"""\
%%remote {MESH}
import os, torch
from torch.nn.parallel import DistributedDataParallel as DDP
torch.manual_seed(0)
ddp = DDP(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
STOP = False

def step():
    opt.zero_grad()
    ddp(torch.randn(16, 32)).pow(2).mean().backward()
    opt.step()

def stopped():
    # every rank must leave the loop at the same step (a rank that left alone would
    # leave the others waiting in the next all_reduce): they agree on STOP, pushed to
    # each at its own moment
    flag = torch.tensor([float(STOP)])
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
    return bool(flag.item())

def train(steps=None):
    n = 0
    while not stopped() and (steps is None or n < steps):
        step()
        n += 1
    return n
"""


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    out = tmp_path_factory.mktemp("traces")
    k = Kernel(env={"MONARCH_KERNEL_PROFILE_DIR": str(out)})
    k.out = out  # type: ignore[attr-defined]
    r = k.run(f"%mesh {MESH} --gpus 2 --dist", timeout=120)
    assert "process group initialised" in r.stdout, r.stdout + r.error_text
    r = k.run(SETUP, timeout=60)
    assert not r.errors, r.error_text
    yield k
    k.shutdown_and_check()


def _trace(text: str) -> dict:
    m = re.search(r"trace: (\S+\.json)", text)
    assert m, text
    path = Path(m.group(1))
    assert path.exists()
    return json.loads(path.read_text())


def _check_merged(trace: dict) -> None:
    events = trace["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert set(names) == {0, 1}, names
    assert names[0].startswith("rank 0 (") and names[1].startswith("rank 1 ("), names
    # both ranks profiled the same steps of their loop
    labels = {e["pid"]: e["args"]["labels"] for e in events if e.get("name") == "process_labels"}
    assert set(labels) == {0, 1} and labels[0] == labels[1], labels
    spans = {}
    for rank in (0, 1):
        ts = [e["ts"] for e in events if e["pid"] == rank and e.get("ph") == "X"]
        assert len(ts) > 10, f"rank {rank} has {len(ts)} events"
        spans[rank] = (min(ts), max(ts))
    # one time axis: the ranks profiled the same steps at the same time, so their
    # spans overlap (on separate clocks they would lie seconds or hours apart)
    (a0, a1), (b0, b1) = spans[0], spans[1]
    overlap = min(a1, b1) - max(a0, b0)
    assert overlap > 0.5 * min(a1 - a0, b1 - b0), spans
    assert min(a0, b0) >= 0 and min(a0, b0) < 1e6, spans  # from the earliest event on
    ops = {e["name"] for e in events if e.get("ph") == "X"}
    assert any("allreduce" in n or "all_reduce" in n for n in ops) or any(
        "addmm" in n for n in ops
    ), sorted(ops)[:40]


def test_profile_of_a_running_bg_loop(kernel):
    bg = kernel.submit(f"%%remote {MESH} --bg\ntrain()")
    kernel.collect(bg, timeout=30)
    r = kernel.run(f"%mesh profile {MESH} --steps 3", timeout=120)
    kernel.run(f"%push {MESH} STOP=True")
    kernel.wait_for_output(bg, "done in", timeout=60)  # the --bg loop ended
    assert not r.errors, r.error_text
    assert "profiling ranks 0, 1 for 3 steps of the running loop" in r.stdout, r.stdout
    assert "top ops by self CPU time" in r.stdout and "waited most" in r.stdout, r.stdout
    assert "chrome://tracing" in r.stdout
    m = re.search(r"\(2 ranks, steps (\d+)-(\d+), \d+ ms\)", r.stdout)
    assert m and int(m.group(2)) - int(m.group(1)) == 2, r.stdout
    _check_merged(_trace(r.stdout))
    assert any("FileLink" in d["data"].get("text/plain", "") or "href" in
               d["data"].get("text/html", "") for d in r.displays), r.displays  # fmt: skip


def test_profile_armed_for_the_next_cell(kernel):
    kernel.run(f"%push {MESH} STOP=False")
    r = kernel.run(f"%mesh profile {MESH} --steps 2 --ranks 0,1", timeout=30)
    assert "profiling armed on ranks 0, 1" in r.stdout, r.stdout + r.error_text
    msg = kernel.submit(f"%%remote {MESH}\ntrain(60)")
    kernel.wait_for_output(msg, "trace: ", timeout=60)  # under the cell that ran the steps
    r = kernel.collect(msg, timeout=60)
    assert not r.errors, r.error_text
    assert "(2 ranks, steps 2-3, " in r.stdout, r.stdout  # from the first step boundary
    _check_merged(_trace(r.stdout))
