"""The out-of-memory report of a rank (``monarch_kernel.rank.oom``), built on CPU: torch's
messages of several versions parsed, the largest tensors of a real traceback (CPU tensors,
the device filter injected), the advice for given memory numbers, and the memory given
back without touching the cell's namespace."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from types import TracebackType

import pytest
import torch

from monarch_kernel.rank import oom
from monarch_kernel.rank.oom import GpuMemory, OomMessage

pytestmark = pytest.mark.unit

GiB = 1 << 30
MiB = 1 << 20

#: torch 2.11-2.13 (CUDACachingAllocator.cpp)
NEW = (
    "CUDA out of memory. Tried to allocate 20.00 GiB. GPU 0 has a total capacity of 79.10 GiB "
    "of which 1.2 GiB is free. Process 1234 has 3 GiB memory in use. Of the allocated memory "
    "70.1 GiB is allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated. If "
    "reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation.  See "
    "documentation for Memory Management  "
    "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)"
)
#: with this process's own line and CUDA graphs' private pools, on GPU 3
NEW_POOLS = (
    "CUDA out of memory. Tried to allocate 512.00 MiB. GPU 3 has a total capacity of 139.80 GiB "
    "of which 100.00 MiB is free. Including non-PyTorch memory, this process has 139.6 GiB "
    "memory in use. Of the allocated memory 130.00 GiB is allocated by PyTorch, with 2.00 GiB "
    "allocated in private pools (e.g., CUDA Graphs), and 8.50 GiB is reserved by PyTorch but "
    "unallocated. If reserved but unallocated memory is large try setting "
    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid fragmentation."
)
#: torch 1.x
OLD = (
    "CUDA out of memory. Tried to allocate 36.00 MiB (GPU 0; 7.93 GiB total capacity; "
    "130.35 MiB already allocated; 47.06 MiB free; 188.00 MiB reserved in total by PyTorch) "
    "If reserved memory is >> allocated memory try setting max_split_size_mb to avoid "
    "fragmentation."
)


def approx(n: int | None, want: float) -> bool:
    return n is not None and abs(n - want) <= 0.01 * want


def test_parses_the_torch_2_11_to_2_13_wording():
    m = oom.parse_oom_message(NEW)
    assert approx(m.tried, 20 * GiB) and m.gpu == 0
    assert approx(m.capacity, 79.10 * GiB) and approx(m.free, 1.2 * GiB)
    assert approx(m.allocated, 70.1 * GiB) and approx(m.reserved_unallocated, 1.3 * GiB)
    assert m.reserved is None


def test_parses_private_pools_and_this_process_line():
    m = oom.parse_oom_message(NEW_POOLS)
    assert approx(m.tried, 512 * MiB) and m.gpu == 3
    assert approx(m.capacity, 139.8 * GiB) and approx(m.free, 100 * MiB)
    assert approx(m.allocated, 130 * GiB) and approx(m.reserved_unallocated, 8.5 * GiB)


def test_parses_the_torch_1_wording():
    m = oom.parse_oom_message(OLD)
    assert approx(m.tried, 36 * MiB) and m.gpu == 0
    assert approx(m.capacity, 7.93 * GiB) and approx(m.free, 47.06 * MiB)
    assert approx(m.allocated, 130.35 * MiB) and approx(m.reserved, 188 * MiB)


def test_a_message_without_numbers_parses_to_nothing():
    assert oom.parse_oom_message("CUDA error: out of memory") == OomMessage()
    assert oom.parse_size("4096.00 GiB") == 4096 * GiB
    assert oom.parse_size("512 bytes") == 512
    assert oom.parse_size("lots") is None


def test_the_headline_the_ranks_are_grouped_by():
    assert oom.headline(NEW) == "CUDA out of memory. Tried to allocate 20.00 GiB."
    assert oom.headline(OLD) == "CUDA out of memory. Tried to allocate 36.00 MiB."
    assert oom.headline("CUDA error: out of memory\nCUDA kernel errors ...") == (
        "CUDA error: out of memory"
    )


def test_the_failure_report_carries_the_headline_and_the_whole_message_in_its_traceback():
    from monarch_kernel.rank.errors import exception_report

    report = exception_report(run_cell({}), "the cell", "Out of GPU memory on rank 0 ...\n")
    assert report["message"] == "CUDA out of memory. Tried to allocate 20.00 GiB."
    assert NEW in report["traceback"]
    assert report["traceback"].endswith(NEW + "\n\nOut of GPU memory on rank 0 ...\n")


def test_which_errors_are_out_of_memory():
    assert oom.is_oom(torch.OutOfMemoryError(NEW))
    assert oom.is_oom(torch.cuda.OutOfMemoryError("CUDA out of memory."))
    assert oom.is_oom(RuntimeError("CUDA error: out of memory\nCUDA kernel errors ..."))
    assert oom.is_oom(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling ..."))
    assert not oom.is_oom(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))
    assert not oom.is_oom(MemoryError())  # host memory: not this report's
    assert not oom.is_oom(ValueError("CUDA out of memory"))
    try:
        try:
            raise torch.OutOfMemoryError(NEW)
        except torch.OutOfMemoryError as inner:
            raise ValueError("the step failed") from inner
    except ValueError as outer:
        found = oom.find_oom(outer)
    assert isinstance(found, torch.OutOfMemoryError)
    assert oom.find_oom(ValueError("x")) is None


# -- the largest tensors of a real traceback ---------------------------------------------

CELL = """\
import torch
keep = torch.ones(1000)
def step(n):
    act = torch.ones(n, 100)
    view = act[:10]                 # the same buffer as act: counted once
    alias = act
    outs = [torch.ones(5), torch.zeros(300, 3)]
    grads = {"w": torch.ones(64, 64, dtype=torch.float64)}
    small = torch.ones(2, dtype=torch.int8)
    raise torch.OutOfMemoryError(MESSAGE)
step(2000)
"""


def run_cell(namespace: dict[str, object]) -> BaseException:
    """Run CELL as a rank runs a cell (``exec`` in a namespace, under a cell's file
    name) and return what it raised, with its traceback."""
    namespace["MESSAGE"] = NEW
    try:
        exec(compile(CELL, "<remote cell 1>", "exec"), namespace)
    except torch.OutOfMemoryError as exc:
        return exc
    raise AssertionError("the cell did not raise")


def test_largest_tensors_of_the_failing_frames_top_five():
    exc = run_cell({})
    found = oom.largest_tensors(exc.__traceback__, 5, on_device=lambda t: True)
    assert [t.line() for t in found] == [
        "act: shape (2000, 100) float32, 781.25 KiB (in step())",
        "grads['w']: shape (64, 64) float64, 32.00 KiB (in step())",
        "keep: shape (1000,) float32, 3.91 KiB (in the cell)",
        "outs[1]: shape (300, 3) float32, 3.52 KiB (in step())",
        "outs[0]: shape (5,) float32, 20 bytes (in step())",
    ]


def test_only_tensors_on_the_device_are_listed():
    exc = run_cell({})
    assert oom.largest_tensors(exc.__traceback__) == []  # CPU tensors, default: CUDA only
    wide = oom.largest_tensors(exc.__traceback__, 2, on_device=lambda t: t.dtype.is_floating_point)
    assert [t.name for t in wide] == ["act", "grads['w']"]


# -- advice ----------------------------------------------------------------------------------


def test_the_usual_advice():
    tips = oom.advice(oom.parse_oom_message(NEW), GpuMemory(0, 70 * GiB, 72 * GiB, GiB, 80 * GiB))
    text = "\n".join(tips)
    assert "smaller batch" in text and "checkpoint" in text and "autocast" in text
    assert "expandable_segments" not in text  # reserved is not much more than allocated
    assert "larger than the whole GPU" not in text and "other ranks" not in text


def test_fragmentation_advice_when_reserved_is_much_more_than_allocated():
    mem = GpuMemory(0, allocated=10 * GiB, reserved=30 * GiB, free=GiB, total=80 * GiB)
    tips = oom.advice(oom.parse_oom_message(NEW), mem)
    assert any("expandable_segments:True" in t and "fragmentation" in t for t in tips)
    # already set: not suggested again
    tips = oom.advice(oom.parse_oom_message(NEW), mem, "expandable_segments:True")
    assert not any("expandable_segments" in t for t in tips)
    # from the message alone (no reader): the cache could hold the allocation
    msg = OomMessage(tried=GiB, allocated=4 * GiB, reserved_unallocated=3 * GiB)
    assert any("fragmentation" in t for t in oom.advice(msg, None))


def test_fragmentation_told_by_torch_s_numbers_after_it_freed_its_cache():
    # 512 MiB did not fit though 8.5 GiB were reserved but unallocated; by the time the
    # rank reads its memory, torch has given the cache back (reserved == allocated)
    mem = GpuMemory(3, allocated=130 * GiB, reserved=130 * GiB, free=9 * GiB, total=140 * GiB)
    tips = oom.advice(oom.parse_oom_message(NEW_POOLS), mem)
    assert any("reserved (138.50 GiB)" in t and "expandable_segments:True" in t for t in tips)


def test_an_allocation_larger_than_the_gpu_and_memory_held_elsewhere():
    msg = OomMessage(tried=4096 * GiB, gpu=0, capacity=80 * GiB, free=40 * GiB)
    mem = GpuMemory(0, allocated=2 * GiB, reserved=2 * GiB, free=30 * GiB, total=80 * GiB)
    tips = oom.advice(msg, mem)
    assert tips[0].startswith("the allocation alone (4096.00 GiB) is larger than the whole GPU")
    assert any("48.00 GiB of the GPU is held outside this rank" in t for t in tips)


# -- the whole report --------------------------------------------------------------------------


def test_report_names_the_rank_the_allocation_and_the_memory():
    exc = run_cell({})
    mem = GpuMemory(0, allocated=70 * GiB, reserved=72 * GiB, free=GiB, total=80 * GiB)
    text = oom.explain(exc, 2, read=lambda device: mem, on_device=lambda t: True, alloc_conf="")
    assert text is not None
    lines = text.splitlines()
    assert lines[0] == (
        "Out of GPU memory on rank 2 (GPU 0): tried to allocate 20.00 GiB with 1.20 GiB free "
        "of 79.10 GiB."
    )
    assert lines[1] == (
        "GPU memory now: 70.00 GiB allocated by tensors, 72.00 GiB reserved by PyTorch's "
        "cache, 1.00 GiB free of 80.00 GiB."
    )
    assert "Largest CUDA tensors in the failing frames:" in lines
    assert "  act: shape (2000, 100) float32, 781.25 KiB (in step())" in lines
    assert any("torch.cuda.empty_cache()" in line for line in lines)
    assert "What to try:" in lines
    assert len(lines) <= 16


def test_report_without_cuda_says_so_and_asks_the_device_in_the_message():
    asked: list[int | None] = []

    def read(device: int | None) -> GpuMemory | str:
        asked.append(device)
        return "no CUDA here"

    exc = run_cell({})
    text = oom.explain(exc, 1, read=read)
    assert text is not None and asked == [0]
    assert "GPU memory now: no CUDA here." in text
    assert "Largest CUDA tensors" not in text  # CPU tensors only
    # the real reader, on this machine without a GPU, never raises
    assert isinstance(oom.read_cuda_memory(None), (str, GpuMemory))


def test_report_of_an_old_cuda_error_and_of_other_errors():
    text = oom.explain(RuntimeError("CUDA error: out of memory"), 0, read=lambda d: "no CUDA here")
    assert text is not None
    assert text.startswith("Out of GPU memory on rank 0: the allocation's size is not in")
    assert oom.explain(ValueError("bad"), 0) is None


# -- giving the memory back ---------------------------------------------------------------------


def test_release_clears_the_functions_locals_and_keeps_the_namespace():
    namespace: dict[str, object] = {}
    exc = run_cell(namespace)
    oom.explain(exc, 0, read=lambda d: "no CUDA here", on_device=lambda t: True)  # reads locals
    frames = [e for e in _entries(exc.__traceback__) if e.tb_frame.f_code.co_name == "step"]
    act = weakref.ref(frames[0].tb_frame.f_locals["act"])
    keep = namespace["keep"]
    del frames
    oom.release(exc, namespace)
    assert act() is None  # the activation the traceback held is gone
    assert namespace["keep"] is keep and callable(namespace["step"])
    # the cell's own frame still sees the namespace
    cell = [e for e in _entries(exc.__traceback__) if e.tb_frame.f_code.co_name == "<module>"]
    assert cell[0].tb_frame.f_globals is namespace and "keep" in cell[0].tb_frame.f_locals


def _entries(tb: TracebackType | None) -> Iterator[TracebackType]:
    while tb is not None:
        yield tb
        tb = tb.tb_next
