"""Out of GPU memory on one rank, in a real kernel: ``torch.OutOfMemoryError`` raised by
hand in a ``%%remote`` cell (on CPU: torch's class, torch's wording) is the usual
``RemoteCellError`` naming the rank, with the out-of-memory report (the allocation, the
GPU's memory: "no CUDA here" on a machine without a GPU, what to try); the other rank is
released as for any exception; the rank's namespace survives and the next cell runs on
every rank. The same on a real GPU: ``tests/test_gpu_oom.py``."""

from __future__ import annotations

import re
import time

import pytest
from kernel_client import Kernel, kernel_with_mesh

pytestmark = pytest.mark.local

MESH = "om"

MESSAGE = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 1.2 GiB is free. Process 1234 has 3 GiB memory in use. Of the allocated memory "
    "70.1 GiB is allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)


@pytest.fixture(scope="module")
def kernel():
    k = kernel_with_mesh(MESH, 2)
    yield k
    k.shutdown_and_check()


def test_out_of_memory_on_one_rank_is_one_clear_error_and_the_rank_trains_on(kernel: Kernel):
    r = kernel.run(
        f"%%remote {MESH}\nimport os, time, torch\nRANK = int(os.environ['RANK'])\n"
        "weights = torch.ones(8) * RANK\nmine = f'rank {RANK} state'",
        timeout=60,
    )
    assert not r.errors, r.error_text
    t0 = time.monotonic()
    r = kernel.run(
        f"%%remote {MESH}\n"
        "def step():\n"
        "    activations = torch.ones(256, 256)\n"
        f"    raise torch.OutOfMemoryError({MESSAGE!r})\n"
        "if RANK == 1:\n"
        "    step()\n"
        "else:\n"
        "    time.sleep(60)  # released as for any exception on another rank\n",
        timeout=60,
    )
    took = time.monotonic() - t0
    text = r.error_text
    assert r.reply["status"] == "error"
    assert "RemoteCellError" in text, text
    # one line naming the rank and the allocation (torch's whole text is in the traceback)
    assert re.search(
        r"OutOfMemoryError in the cell on rank 1 of 2( on \S+)?: CUDA out of memory\. "
        r"Tried to allocate 20\.00 GiB\.\n",
        text,
    ), text
    assert text.count("OutOfMemoryError in the cell") == 1, text
    assert "Out of GPU memory on rank 1 (GPU 0): tried to allocate 20.00 GiB" in text, text
    assert "GPU memory now:" in text  # "no CUDA here" on a machine without a GPU
    assert "What to try:" in text and "smaller batch" in text, text
    assert "torch.cuda.empty_cache()" in text, text
    assert "line 4, in step" in text  # the traceback is still there, cell lines
    assert "rank 0" in text or "ranks 0" in text  # what was done to the other rank
    assert took < 30, took
    # the namespace of the rank that ran out of memory survives; the next cell runs
    # on every rank
    r = kernel.run(f"%%remote {MESH}\n(mine, float(weights.sum()))", timeout=60)
    assert not r.errors, r.error_text
    assert "{gpus=0}: ('rank 0 state', 0.0)" in r.text, r.text
    assert "{gpus=1}: ('rank 1 state', 8.0)" in r.text, r.text


def test_an_ordinary_error_has_no_memory_report(kernel: Kernel):
    r = kernel.run(f"%%remote {MESH} --ranks 1\nraise RuntimeError('mat1 and mat2 shapes')")
    assert "RuntimeError in the cell on rank 1" in r.error_text, r.error_text
    assert "Out of GPU memory" not in r.error_text
