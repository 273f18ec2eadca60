"""Out of GPU memory in a rank: one clear report, then the memory given back.

When a ``%%remote`` cell raises ``torch.OutOfMemoryError`` (or an older CUDA "out of
memory" ``RuntimeError``), :func:`explain` builds a short text that the notebook's usual
error (the ``RemoteCellError`` naming the rank) shows under the traceback: the allocation
that failed (parsed from torch's message), the GPU's memory as this rank sees it, the
largest CUDA tensors held by the failing frames, and what to try. :func:`release` then
drops the failing functions' local variables and empties PyTorch's cache, so that the
rank's namespace (the model, the optimizer) survives and the next cell trains on.

The memory numbers come through :data:`MemoryReader` (a :class:`GpuMemory` of given
numbers in the unit tests; :func:`read_cuda_memory` on a rank), so the report is built
and tested on a machine without a GPU.
"""

from __future__ import annotations

import gc
import os
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from types import FrameType, TracebackType
from typing import Any

_GIB = 1 << 30
_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# -- what torch said ----------------------------------------------------------------------

_SIZE = r"([\d.]+\s*(?:bytes|B|KiB|MiB|GiB|TiB))"
_UNITS = {"bytes": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(text: str) -> int | None:
    """Bytes of torch's ``format_size`` text (``20.00 GiB``, ``512 bytes``)."""
    m = re.fullmatch(r"\s*([\d.]+)\s*(bytes|B|KiB|MiB|GiB|TiB)\s*", text, re.I)
    if m is None:
        return None
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclass(frozen=True)
class OomMessage:
    """What torch's out-of-memory message says (``None``: it does not say)."""

    tried: int | None = None  #: bytes of the allocation that failed
    gpu: int | None = None  #: the device index, as this process numbers them
    capacity: int | None = None  #: the GPU's total memory
    free: int | None = None  #: free on the GPU when it failed
    allocated: int | None = None  #: allocated by PyTorch (tensors)
    reserved_unallocated: int | None = None  #: cached by PyTorch but unallocated
    reserved: int | None = None  #: reserved in total by PyTorch (older wording)


def _find(pattern: str, text: str) -> re.Match[str] | None:
    return re.search(pattern, text, re.I | re.S)


def parse_oom_message(text: str) -> OomMessage:
    """Parse torch's wording, from 1.x (``Tried to allocate 20.00 MiB (GPU 0; 7.79 GiB
    total capacity; 6.25 GiB already allocated; 7.56 MiB free; 6.50 GiB reserved in
    total by PyTorch)``) to 2.13 (``Tried to allocate 20.00 GiB. GPU 0 has a total
    capacity of 79.10 GiB of which 1.2 GiB is free. ... Of the allocated memory 70.1 GiB
    is allocated by PyTorch, and 1.3 GiB is reserved by PyTorch but unallocated.``)."""

    def size(pattern: str) -> int | None:
        m = _find(pattern, text)
        return parse_size(m.group(1)) if m else None

    gpu = _find(r"\bGPU\s+(\d+)", text)
    return OomMessage(
        tried=size(r"Tried to allocate\s+" + _SIZE),
        gpu=int(gpu.group(1)) if gpu else None,
        capacity=size(r"total capacity of\s+" + _SIZE) or size(_SIZE + r"\s+total capacity"),
        free=size(r"of which\s+" + _SIZE + r"\s+is free") or size(_SIZE + r"\s+free\b"),
        allocated=size(_SIZE + r"\s+is allocated by PyTorch")
        or size(_SIZE + r"\s+already allocated"),
        reserved_unallocated=size(_SIZE + r"\s+is reserved by PyTorch but unallocated"),
        reserved=size(_SIZE + r"\s+reserved in total by PyTorch"),
    )


def is_oom(exc: BaseException) -> bool:
    """``torch.OutOfMemoryError``, or a CUDA ``RuntimeError`` saying "out of memory"
    (``CUDA error: out of memory``, cuBLAS's ``CUBLAS_STATUS_ALLOC_FAILED``)."""
    torch = sys.modules.get("torch")
    oom_class = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_class is not None and isinstance(exc, oom_class):
        return True
    if not isinstance(exc, RuntimeError):
        return False
    text = str(exc)
    return ("CUDA" in text and "out of memory" in text) or "CUBLAS_STATUS_ALLOC_FAILED" in text


def headline(text: str) -> str:
    """The first words of an out-of-memory message, up to the allocation (``CUDA out of
    memory. Tried to allocate 20.00 GiB.``): the line the notebook groups ranks by, the
    same on ranks whose free memory differed (the whole message stays in the traceback)."""
    m = re.match(r"(.*?Tried to allocate\s+" + _SIZE + r")", text, re.S)
    if m is not None:
        return m.group(1).strip() + "."
    return text.strip().split("\n", 1)[0]


def find_oom(exc: BaseException) -> BaseException | None:
    """``exc`` or the first exception of its chain that ran out of GPU memory."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        if is_oom(cur):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return None


# -- the GPU's memory now ------------------------------------------------------------------


@dataclass(frozen=True)
class GpuMemory:
    """One device's memory, in bytes, as this process sees it."""

    device: int
    allocated: int  #: ``torch.cuda.memory_allocated``: held by tensors
    reserved: int  #: ``torch.cuda.memory_reserved``: held by PyTorch's caching allocator
    free: int  #: ``torch.cuda.mem_get_info``: free on the device (all processes)
    total: int


#: Reads a device's memory (``None``: the current device), or says why it cannot.
MemoryReader = Callable[[int | None], "GpuMemory | str"]


def read_cuda_memory(device: int | None) -> GpuMemory | str:
    """The real reader. Never initialises CUDA in a process that has not (a rank that
    never used it raised the error by hand, or on a machine without a GPU)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_available():
            return "no CUDA here"
        if not torch.cuda.is_initialized():
            return "CUDA is not initialised in this rank"
        if device is None or not 0 <= device < torch.cuda.device_count():
            device = torch.cuda.current_device()
        free, total = torch.cuda.mem_get_info(device)
        return GpuMemory(
            device=device,
            allocated=torch.cuda.memory_allocated(device),
            reserved=torch.cuda.memory_reserved(device),
            free=free,
            total=total,
        )
    except Exception as exc:  # a broken context must not hide the user's error
        return f"could not be read ({type(exc).__name__}: {exc})"


def empty_cache() -> None:
    """``torch.cuda.empty_cache()`` where CUDA is up (nothing otherwise)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


# -- the tensors the failing frames hold ---------------------------------------------------

_LIBRARY_DIRS = tuple(
    os.path.abspath(p) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


def _library_dirs() -> tuple[str, ...]:
    """Where libraries live: the interpreter's, and the directory torch was imported
    from (it may be a ``pip install --target`` directory on no ``sys.path`` default)."""
    torch = sys.modules.get("torch")
    torch_file = getattr(torch, "__file__", None) if torch is not None else None
    if not torch_file:
        return _LIBRARY_DIRS
    return (*_LIBRARY_DIRS, os.path.dirname(os.path.dirname(os.path.abspath(torch_file))) + os.sep)


def _is_user_file(filename: str, libraries: tuple[str, ...]) -> bool:
    """A cell (``<remote cell 3>``) or a file of the user's: not monarch_kernel's, not a
    library's (torch, the standard library, site-packages)."""
    if filename.startswith("<"):
        return not filename.startswith("<frozen")
    path = os.path.abspath(filename)
    return not path.startswith(_PKG_DIR) and not path.startswith(libraries)


def _entries(tb: TracebackType | None) -> list[TracebackType]:
    out = []
    while tb is not None:
        out.append(tb)
        tb = tb.tb_next
    return out


@dataclass(frozen=True)
class TensorInfo:
    name: str
    where: str  #: ``step()``, or ``the cell`` for the cell's own variables
    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def line(self) -> str:
        size = format_bytes(self.nbytes)
        return f"{self.name}: shape {self.shape} {self.dtype}, {size} (in {self.where})"


def _tensors_of(name: str, value: object, torch: Any) -> Iterator[tuple[str, Any]]:
    """A tensor itself, or those one level inside a list, tuple or dict."""
    if isinstance(value, torch.Tensor):
        yield name, value
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value[:64]):
            if isinstance(item, torch.Tensor):
                yield f"{name}[{i}]", item
    elif isinstance(value, dict):
        for i, (key, item) in enumerate(value.items()):
            if i >= 64:
                break
            if isinstance(item, torch.Tensor):
                yield f"{name}[{key!r}]", item


def _is_cuda(t: Any) -> bool:
    return bool(t.is_cuda)


def largest_tensors(
    tb: TracebackType | None,
    limit: int = 5,
    on_device: Callable[[Any], bool] = _is_cuda,
) -> list[TensorInfo]:
    """The ``limit`` largest tensors (``on_device``: CUDA ones) that the local variables
    of the traceback's user frames hold, innermost frame first; a tensor seen under two
    names (or two views of one buffer) counts once, under its first name."""
    torch = sys.modules.get("torch")
    if torch is None:
        return []
    found: dict[object, TensorInfo] = {}
    libraries = _library_dirs()
    for entry in reversed(_entries(tb)):
        frame = entry.tb_frame
        code = frame.f_code
        if not _is_user_file(code.co_filename, libraries):
            continue
        where = "the cell" if code.co_name == "<module>" else f"{code.co_name}()"
        for name, value in list(frame.f_locals.items()):
            if name.startswith("__"):
                continue
            try:
                tensors = list(_tensors_of(name, value, torch))
            except Exception:  # an odd container: leave it out
                continue
            for label, t in tensors:
                try:
                    if not on_device(t):
                        continue
                    key = (t.device, t.untyped_storage().data_ptr()) if t.numel() else id(t)
                    info = TensorInfo(
                        name=label,
                        where=where,
                        shape=tuple(t.shape),
                        dtype=str(t.dtype).removeprefix("torch."),
                        nbytes=t.numel() * t.element_size(),
                    )
                except Exception:  # a tensor subclass that refuses: leave it out
                    continue
                old = found.get(key)
                if old is None:
                    found[key] = info
                elif info.nbytes > old.nbytes:  # a larger view of that buffer
                    found[key] = replace(info, name=old.name, where=old.where)
            del tensors
    return sorted(found.values(), key=lambda i: -i.nbytes)[:limit]


# -- the report -----------------------------------------------------------------------------


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} bytes"


def advice(msg: OomMessage, mem: GpuMemory | None, alloc_conf: str = "") -> list[str]:
    """What to try, most likely first (``alloc_conf``: ``PYTORCH_CUDA_ALLOC_CONF``)."""
    out: list[str] = []
    total = mem.total if mem is not None else msg.capacity
    if msg.tried is not None and total and msg.tried > total:
        out.append(
            f"the allocation alone ({format_bytes(msg.tried)}) is larger than the whole GPU "
            f"({format_bytes(total)}): check the tensor's shape and dtype"
        )
    out.append("a smaller batch (gradient accumulation keeps the effective batch size)")
    out.append("activation checkpointing (torch.utils.checkpoint) to keep fewer activations")
    out.append("mixed precision: torch.autocast('cuda', dtype=torch.bfloat16)")
    # torch's numbers are from before it freed its cache to retry; the reader's after:
    # the one with more reserved-but-unallocated memory tells of fragmentation
    said_allocated = msg.allocated or 0
    said_reserved = msg.reserved or said_allocated + (msg.reserved_unallocated or 0)
    allocated, reserved = said_allocated, said_reserved
    if mem is not None and mem.reserved - mem.allocated >= said_reserved - said_allocated:
        allocated, reserved = mem.allocated, mem.reserved
    unallocated = reserved - allocated
    fragmented = unallocated >= _GIB and reserved >= 1.5 * max(allocated, 1)
    if msg.tried is not None and 0 < msg.tried <= unallocated:
        fragmented = True
    if fragmented and "expandable_segments:true" not in alloc_conf.replace(" ", "").lower():
        out.append(
            f"reserved ({format_bytes(reserved)}) is much more than allocated "
            f"({format_bytes(allocated)}): fragmentation; start the mesh with "
            "--env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
        )
    if mem is not None:
        others = mem.total - mem.free - mem.reserved
        if others > mem.total // 2:
            out.append(
                f"{format_bytes(others)} of the GPU is held outside this rank's tensors "
                "(other ranks or processes on this GPU? see nvidia-smi)"
            )
    return out


def explain(
    exc: BaseException,
    rank: int | None,
    read: MemoryReader = read_cuda_memory,
    on_device: Callable[[Any], bool] = _is_cuda,
    alloc_conf: str | None = None,
) -> str | None:
    """The report for an out-of-memory ``exc`` (None for any other error): at most
    about 15 lines. Read it before :func:`release` clears the frames."""
    oom = find_oom(exc)
    if oom is None:
        return None
    msg = parse_oom_message(str(oom))
    who = f"rank {rank}" if rank is not None else "this rank"
    mem = read(msg.gpu)
    gpu = mem.device if isinstance(mem, GpuMemory) else msg.gpu
    on = f" (GPU {gpu})" if gpu is not None else ""
    head = f"Out of GPU memory on {who}{on}: "
    if msg.tried is not None:
        head += f"tried to allocate {format_bytes(msg.tried)}"
        if msg.free is not None and msg.capacity is not None:
            head += f" with {format_bytes(msg.free)} free of {format_bytes(msg.capacity)}"
    else:
        head += "the allocation's size is not in the message"
    lines = [head + "."]
    if isinstance(mem, GpuMemory):
        lines.append(
            f"GPU memory now: {format_bytes(mem.allocated)} allocated by tensors, "
            f"{format_bytes(mem.reserved)} reserved by PyTorch's cache, "
            f"{format_bytes(mem.free)} free of {format_bytes(mem.total)}."
        )
    else:
        lines.append(f"GPU memory now: {mem}.")
    tensors = largest_tensors(oom.__traceback__, 5, on_device)
    if tensors:
        lines.append("Largest CUDA tensors in the failing frames:")
        lines += ["  " + t.line() for t in tensors]
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "") if alloc_conf is None else alloc_conf
    lines.append(
        "Released on this rank: the failing functions' local variables, then "
        "torch.cuda.empty_cache(); your variables are kept."
    )
    lines.append("What to try:")
    lines += ["  - " + a for a in advice(msg, mem if isinstance(mem, GpuMemory) else None, conf)]
    return "\n".join(lines) + "\n"


# -- giving the memory back -----------------------------------------------------------------


def _inner_frames(exc: BaseException, namespace: dict[str, Any]) -> Iterator[FrameType]:
    """The frames of ``exc``'s traceback (and of its chain's) that ran below the cell:
    every frame after the first one whose locals are the namespace (the cell's own
    ``<module>`` frame), never that frame nor the ones above it (still running)."""
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        below = False
        for entry in _entries(cur.__traceback__):
            frame = entry.tb_frame
            if below and frame.f_locals is not namespace and frame.f_globals is not frame.f_locals:
                yield frame
            elif frame.f_globals is namespace and frame.f_code.co_name == "<module>":
                below = True
        cur = cur.__cause__ or cur.__context__


def release(exc: BaseException, namespace: dict[str, Any]) -> None:
    """Give the failing cell's GPU memory back without touching the namespace.

    A traceback keeps every frame it passed through alive, and with them their local
    variables: the activations and temporaries of the step that ran out of memory
    (pytorch #37726: Jupyter's saved traceback keeps tensors alive; here the rank keeps
    the last failure for ``%debug_remote``). So the locals of the frames *below* the
    cell's own frame (the functions it called, which have all returned by now) are
    cleared with ``frame.clear()``; the cell's frame, whose locals are the rank's
    namespace, is never cleared, so the model and optimizer survive. Then a garbage
    collection (frames and tracebacks form cycles) and ``torch.cuda.empty_cache()``
    return the cached blocks to the driver, for this rank's next cell and for other
    processes on the GPU. A post-mortem of this failure shows those frames' locals empty.
    """
    for frame in list(_inner_frames(exc, namespace)):
        try:
            frame.clear()
            # Python < 3.13: reading f_locals (the report did) left a snapshot dict on
            # the frame that still holds the values; reading it again syncs it (empty).
            _ = frame.f_locals
        except RuntimeError:  # still running (not below the cell after all): keep it
            pass
    gc.collect()
    empty_cache()
