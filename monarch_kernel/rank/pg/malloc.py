"""glibc's mmap threshold, pinned where the process-group path runs (rank and worker).

glibc serves an allocation at or above its *mmap threshold* with its own ``mmap`` and
returns it to the system when freed; smaller ones come from the heap. The threshold
starts at 128 KiB and, by default, rises to the size of any mmapped block freed (up to
32 MiB), so that from then on multi-megabyte buffers come from the heap. Measured with
FSDP2/HSDP on this process group (a 2×2 mesh, 8 layers of 1024²): the rank's anonymous
memory grew by about 25 MB every step, without end (1 GB after 24 steps, plain gloo
steady at 600 MB), because the all-gather and reduce-scatter buffers that FSDP2
allocates afresh every step, freed by other threads than the ones that allocated them,
fragment the heap. With the threshold pinned at its initial value it stays flat
(282 MB over 24 steps). Setting it explicitly (``mallopt``) is what turns the dynamic
rise off. The user's choice wins: ``MALLOC_MMAP_THRESHOLD_`` in the rank's environment
(``%mesh ... --env``) is the threshold pinned (glibc reads it only when a process starts,
and a rank is forked from a warm template that started without it); the other
``MALLOC_*_`` variables leave glibc alone.

Pinned only once a process runs a collective of the kind FSDP2 makes those buffers for
(:data:`SHARDING_METHODS`: all-gather into a tensor, reduce-scatter of a tensor), not when
the group is formed: the pin has a price. Every allocation above 128 KiB is then a fresh
mapping whose pages fault in (and are zeroed) on first touch, every step: a training
loop's per-step temporaries (activations, gradients, the optimizer's intermediates) pay
it on every step. Measured (issue 57, the GPT-style DDP workload of ``bench/train.py`` on
4 ranks, 2 cores): pinned from the start, 1.44-2.02 steps/s; glibc's own behaviour,
2.13-2.58 steps/s in the same alternating runs, which is what torchrun's processes have.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

#: ``M_MMAP_THRESHOLD`` of glibc's ``mallopt``.
M_MMAP_THRESHOLD = -3
#: glibc's initial threshold (``DEFAULT_MMAP_THRESHOLD_MIN``).
THRESHOLD = 128 * 1024
#: The user's own threshold (bytes), pinned instead of :data:`THRESHOLD`.
USER_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
#: Environment variables with which the user already chose (each turns the rise off).
USER_CHOICE = (
    USER_THRESHOLD,
    "MALLOC_TRIM_THRESHOLD_",
    "MALLOC_TOP_PAD_",
    "MALLOC_MMAP_MAX_",
)

#: Collectives (torch's ``ProcessGroup`` method names, the worker's too) after whose first
#: use a process pins the threshold: FSDP2 allocates their buffers afresh every step.
SHARDING_METHODS = frozenset(
    {"_allgather_base", "_reduce_scatter_base", "each:_allgather_base", "each:_reduce_scatter_base"}
)

#: Whether this process pinned the threshold: None until it tried (once; every
#: sharding collective asks, so a refusal is remembered too).
_pinned: bool | None = None


def pin_mmap_threshold() -> bool:
    """Pin glibc's mmap threshold at :data:`THRESHOLD` (or the user's
    :data:`USER_THRESHOLD`) in this process and the processes it forks later, once; False
    where there is no glibc, the user's threshold is not a size in bytes, or the user
    set another of :data:`USER_CHOICE`."""
    global _pinned
    if _pinned is None:
        _pinned = _pin()
    return _pinned


def _pin() -> bool:
    threshold = THRESHOLD
    if USER_THRESHOLD in os.environ:
        try:
            threshold = int(os.environ[USER_THRESHOLD])
        except ValueError:
            return False
    elif any(v in os.environ for v in USER_CHOICE):
        return False
    if not sys.platform.startswith("linux") or threshold < 0:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others: no mallopt
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, threshold))
