"""Row 4 (rank -> rank): tensors pulled straight from the owning rank, from a rank of
the same host (shared memory) and from a rank of another host (TCP), in one mesh of two
local host agents (two hosts on this machine, as a host is a host agent)."""

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

        t = torch.ones(mib * MiB // 4)
        t0 = time.perf_counter()
        ref = monarch_kernel.share(t)
        return ref, time.perf_counter() - t0

    @endpoint
    def pull_timed(self, ref, transport: str) -> float:
        t0 = time.perf_counter()
        t = ref.get(transport)
        took = time.perf_counter() - t0
        assert t.numel() * 4 == ref.nbytes
        ref.release()
        return took


def ours(s: Settings, rec: Recorder) -> None:
    from monarch_kernel.actor import host_mesh

    procs = host_mesh(hosts=2).spawn_procs(per_host={"gpus": 2})
    try:
        holders = procs.spawn("holders", Holder)
        owner = holders.slice(hosts=0, gpus=0)
        readers = {"shm": holders.slice(hosts=0, gpus=1), "tcp": holders.slice(hosts=1, gpus=0)}
        for mib in s.tensor_mib:
            iters, warm = tensor_iters(mib)
            shares = []
            for transport in ("shm", "tcp"):
                key = f"r2r_{transport}_{mib}"
                with rec.guard(key):
                    xs = []
                    for i in range(iters + warm):
                        ref, shared = owner.share_fresh.call_one(mib).get()
                        took = readers[transport].pull_timed.call_one(ref, transport).get()
                        if i >= warm:
                            xs.append(took)
                            shares.append(shared)
                    rec.value(key, mib * MiB / median(xs) / MiB)
            with rec.guard(f"r2r_share_{mib}"):
                rec.value(f"r2r_share_{mib}", mib * MiB / median(shares) / MiB)
    finally:
        procs.stop()
