"""The GPU a rank uses, chosen without touching the GPU.

A rank on a host with GPUs uses GPU ``local_rank % device_count`` (torchrun's rule: rank
``i`` of a host on its ``i``-th GPU), and reports ``cuda:N`` in its ``ready`` message.

Making that GPU current with ``torch.cuda.set_device`` at start-up would create a CUDA
context in every rank: hundreds of MiB of GPU memory and a second or more each, paid even
by ranks that never use CUDA. Measured on an H200 machine (16 cores), eager vs lazy: 16
ranks ready in 6.1 vs 4.5 s, 64 in 19.1 vs 6.1 s, and a mesh of 128 CPU-only ranks failed
to start eagerly ("CUDA error: out of memory" in ``set_device``). So the choice is queued
on torch's lazy CUDA initialisation instead: it takes effect the moment the rank first
uses CUDA (a tensor ``.cuda()``, ``current_device()``, an NCCL process group), before
anything is allocated.
"""

from __future__ import annotations

import functools
import sys


def bind_gpu(local_rank: int) -> str:
    """Make GPU ``local_rank % device_count`` this rank's CUDA device once CUDA is first
    used; return the device's name (``"cpu"`` without torch or without a GPU)."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_available():
        return "cpu"
    index = local_rank % torch.cuda.device_count()
    select = functools.partial(torch.cuda.set_device, index)
    # torch.cuda._lazy_call runs ``select`` now if CUDA is initialised, else right after
    # torch's lazy initialisation. It is private: without it, select now (costly, correct).
    lazy_call = getattr(torch.cuda, "_lazy_call", None)
    if lazy_call is None:
        select()
    else:
        lazy_call(select)
    return f"cuda:{index}"
