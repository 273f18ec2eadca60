"""Row 4 (rank -> rank): tensors pulled straight from the owning rank, on the same
machine (shared memory) and over TCP, against raw ZeroMQ and memcpy in the same run."""

from __future__ import annotations

import time

from bench.common import MiB, Recorder, Settings, median, tensor_iters
from monarch_kernel.actor import Actor, endpoint


class Holder(Actor):
    """Owns tensors (shares fresh ones) and pulls others' (timed inside the rank)."""

    @endpoint
    def share_fresh(self, mib: int):
        import torch

        import monarch_kernel

        return monarch_kernel.share(torch.ones(mib * MiB // 4))

    @endpoint
    def pull_timed(self, ref, transport: str) -> float:
        t0 = time.perf_counter()
        t = ref.get(transport)
        took = time.perf_counter() - t0
        assert t.numel() * 4 == ref.nbytes
        ref.release()
        return took


def ours(s: Settings, rec: Recorder) -> None:
    from monarch_kernel.actor import this_host

    procs = this_host().spawn_procs(per_host={"gpus": 2})
    try:
        holders = procs.spawn("holders", Holder)
        owner, reader = holders.slice(gpus=0), holders.slice(gpus=1)
        for mib in s.tensor_mib:
            iters, warm = tensor_iters(mib)
            for transport in ("shm", "tcp"):
                key = f"r2r_{transport}_{mib}"
                with rec.guard(key):
                    xs = []
                    for i in range(iters + warm):
                        ref = owner.share_fresh.call_one(mib).get()
                        took = reader.pull_timed.call_one(ref, transport).get()
                        if i >= warm:
                            xs.append(took)
                    rec.value(key, mib * MiB / median(xs) / MiB)
    finally:
        procs.stop()
