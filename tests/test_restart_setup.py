"""A rank restarted between cells (``--on-failure restart``) gets the mesh's ``--setup``
cells again, even when they use collectives: DDP's constructor broadcasts the
parameters, which the other ranks (that keep their state) take no part in. The set-up
runs on the restarted rank with collectives that complete locally; then the survivors'
training state (parameters and optimizer) is copied to it, so the replicas are the same
and the next training cell works on every rank.
"""

from __future__ import annotations

import os
import re
import signal

import pytest
from helpers import wait_until
from kernel_client import Kernel

pytestmark = pytest.mark.local

SETUP = """\
%%remote rs --setup
import hashlib, os, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
RANK = int(os.environ["RANK"])
torch.manual_seed(100 + RANK)  # other parameters on each rank: DDP's broadcast equalises
ddp = DDP(torch.nn.Linear(8, 4))
opt = torch.optim.Adam(ddp.parameters(), lr=0.01)
dist.barrier()

def digest():
    h = hashlib.sha256()
    for t in [*ddp.parameters(), *[v for s in opt.state.values() for v in s.values()]]:
        h.update(t.detach().reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]

def train(steps):
    for _ in range(steps):
        opt.zero_grad()
        ddp(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
"""


def _values(r) -> list[str]:
    return re.findall(r"'([0-9a-f]{16})'", r.text)


def _pids(k: Kernel) -> list[int]:
    r = k.run("%remote rs __import__('os').getpid()")
    assert not r.errors, r.error_text
    return [int(p) for p in re.findall(r": (\d+)", r.text)]


def test_setup_cells_with_collectives_run_again_on_a_restarted_rank_alone():
    k = Kernel()
    try:
        r = k.run("%mesh rs --gpus 3 --dist --on-failure restart", timeout=120)
        assert "ready" in r.stdout, r.stdout + r.error_text
        r = k.run(SETUP, timeout=60)
        assert not r.errors, r.error_text
        r = k.run("%%remote rs\ntrain(5)\ndigest()", timeout=60)
        assert not r.errors, r.error_text
        before = _values(r)
        assert len(before) == 3 and len(set(before)) == 1, r.text
        pids = _pids(k)
        os.kill(pids[2], signal.SIGKILL)

        def restarted() -> list[int] | None:
            r = k.run("%remote rs __import__('os').getpid()", timeout=150)
            if r.errors:  # the death not noticed yet, or the restart under way
                return None
            now = [int(p) for p in re.findall(r": (\d+)", r.text)]
            return now if len(now) == 3 and now[2] != pids[2] else None

        after = wait_until(restarted, timeout=150, what="rank 2 to be restarted")
        assert after[:2] == pids[:2], (pids, after)  # the survivors kept their processes
        # the restarted rank has the survivors' parameters and optimizer state
        r = k.run("%remote rs digest()", timeout=60)
        assert not r.errors, r.error_text
        assert _values(r) == before, (before, r.text)
        # and trains with them in step: the replicas stay the same
        r = k.run("%%remote rs\ntrain(3)\ndigest()", timeout=60)
        assert not r.errors, r.error_text
        trained = _values(r)
        assert len(trained) == 3 and len(set(trained)) == 1 and trained != before, r.text
        r = k.run("%mesh")
        assert "3/3" in r.text, r.text
        k.run("%mesh stop rs", timeout=60)
    finally:
        k.shutdown_and_check()
