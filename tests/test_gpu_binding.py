"""On a host with a GPU, each rank's CUDA device is GPU ``local_rank % device_count``,
made current only when the rank first uses CUDA: a rank that never touches CUDA holds no
CUDA context (no GPU memory), so many CPU-only ranks can share a GPU host.

Needs CUDA: skipped on machines without a GPU (CI). Run on a GPU machine with
``python -m pytest tests/test_gpu_binding.py``."""

from __future__ import annotations

import pytest
import torch

from monarch_kernel.actor import Actor, endpoint, this_host

pytestmark = [pytest.mark.local, pytest.mark.gpu]

RANKS = 4


class Probe(Actor):
    @endpoint
    def cuda_initialised(self) -> bool:
        return torch.cuda.is_initialized()

    @endpoint
    def use_cuda(self) -> tuple[int, str, int]:
        """(current device, a new tensor's device, bytes this process allocated)."""
        t = torch.ones(1024, device="cuda")
        return torch.cuda.current_device(), str(t.device), torch.cuda.memory_allocated()


def test_ranks_bind_their_gpu_only_when_they_use_cuda() -> None:
    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        probes = procs.spawn("probe", Probe)
        assert list(probes.cuda_initialised.call().get().values()) == [False] * RANKS
        count = torch.cuda.device_count()
        expected = [f"cuda:{r % count}" for r in range(RANKS)]
        assert [info.device for info in procs.runtime.ranks] == expected
        used = list(probes.use_cuda.call().get().values())
        assert [f"cuda:{current}" for current, _, _ in used] == expected
        assert [device for _, device, _ in used] == expected
        assert all(allocated >= 4096 for _, _, allocated in used)
    finally:
        procs.stop()
