"""What a rank and its process-group worker say to each other (one Unix SOCK_SEQPACKET
socket per worker: one message per send, file descriptors ride along with SCM_RIGHTS).

The rank sends :class:`Configure` (join a rendezvous), :class:`OpRequest` (run one
collective on tensors laid out in a shared-memory slot) and :class:`Unmap` (a slot is
gone); the worker answers :class:`Ready` / :class:`ConfigFailed` once, then
:class:`Done` / :class:`Failed` per op, in the order ops complete. Messages are pickled
NamedTuples: both ends run the same code (the worker is forked from the rank).

Tensors never travel in a message: they lie in shared-memory regions, an op's own slot
(:mod:`.shm`) or a user storage used in place (:mod:`.adopt`), or, for CUDA tensors, in
the rank's GPU memory mapped by CUDA IPC (:mod:`.cuda_regions`), named by
:class:`TensorRef`; options objects travel as
``(class name, {field: value})`` with reduce ops by name (:func:`encode_options`).
"""

from __future__ import annotations

import datetime
from typing import Any, NamedTuple

#: Largest message either side sends (op descriptions are small: tensors are in slots).
MAX_MESSAGE = 1 << 16
#: Most file descriptors that ride along with one message.
MAX_FDS = 64
#: Slot offsets are aligned to this many bytes.
ALIGN = 64
#: The most characters of an error's text a worker sends (gloo's can carry a C++ stack
#: trace of many kilobytes): at most 4 bytes each in UTF-8, so a message that carries
#: one stays under :data:`MAX_MESSAGE`.
MAX_ERROR = 8 * 1024


class TensorRef(NamedTuple):
    """A contiguous tensor inside a shared-memory region (an op's slot, or a user
    storage the worker uses in place) at byte ``offset``."""

    region: int
    offset: int
    dtype: str  #: ``float32`` (a ``torch`` attribute name)
    shape: tuple[int, ...]


class Configure(NamedTuple):
    """Join the rendezvous at ``host:port`` (a TCPStore) under ``prefix`` as ``rank`` of
    ``size``; ``env`` is set first (``GLOO_SOCKET_IFNAME`` ...)."""

    host: str
    port: int
    prefix: str
    rank: int
    size: int
    timeout_s: float
    env: dict[str, str]
    #: ``gloo``: one gloo group. ``nccl``: an NCCL group on CUDA device ``device`` for
    #: CUDA tensors and a gloo group beside it for CPU tensors (object collectives),
    #: as torch's ``cpu:gloo,cuda:nccl``.
    backend: str = "gloo"
    device: int = -1


class OpRequest(NamedTuple):
    """Run ``method`` of the worker's group with ``args`` (TensorRef leaves resolved in
    their regions) and the options ``options``; ``new_regions`` are ``(id, size)`` of the
    regions whose descriptors come with this message, in order."""

    op_id: int
    method: str
    args: tuple[Any, ...]
    options: tuple[str, dict[str, Any]] | None
    new_regions: tuple[tuple[int, int], ...]
    #: ``(id, pickled CUDA IPC description)`` of CUDA storages new to the worker
    #: (:mod:`.cuda_regions`): they are used in place, in the rank's GPU memory.
    new_cuda: tuple[tuple[int, bytes], ...] = ()


class Unmap(NamedTuple):
    """Region ``region`` is gone on the rank's side: unmap it."""

    region: int


class Ready(NamedTuple):
    """The worker's group is formed."""


class ConfigFailed(NamedTuple):
    """The worker could not form its group."""

    error: str


class Done(NamedTuple):
    """Op ``op_id`` completed; its outputs are in its slot."""

    op_id: int


class Failed(NamedTuple):
    """Op ``op_id`` failed in the worker (``error``: ``Type: message``)."""

    op_id: int
    error: str


def encode_options(opts: object) -> tuple[str, dict[str, Any]] | None:
    """``(class name, fields)`` of a torch.distributed options object (None for None)."""
    if opts is None:
        return None
    fields: dict[str, Any] = {}
    for name in dir(opts):
        if name.startswith("_"):
            continue
        value = getattr(opts, name)
        if value is None or callable(value):
            continue
        if name == "reduceOp":
            value = _op_name(value)
        elif isinstance(value, datetime.timedelta) and value.total_seconds() <= 0:
            continue  # "no timeout": the group's own default applies
        elif not isinstance(value, (int, float, str, bool, list, tuple, datetime.timedelta)):
            if name == "device":
                value = str(value)
            else:
                continue  # tensors (rootTensor index is an int), opaque objects
        fields[name] = value
    return type(opts).__name__, fields


def _op_name(op: object) -> str:
    """``SUM`` for ``ReduceOp.SUM``, ``ReduceOp(ReduceOp.SUM)`` and its RedOpType."""
    inner = getattr(op, "op", op)
    name = getattr(inner, "name", None)
    if not isinstance(name, str):
        raise ValueError(f"unsupported reduce op {op!r}")
    if name == "PREMUL_SUM":
        raise ValueError("ReduceOp.PREMUL_SUM is not supported by the gloo process group")
    return name


def decode_options(spec: tuple[str, dict[str, Any]] | None) -> object:
    """The options object :func:`encode_options` described (in the worker)."""
    if spec is None:
        return None
    import torch
    import torch.distributed as dist

    cls_name, fields = spec
    cls = getattr(dist, cls_name, None) or getattr(torch._C._distributed_c10d, cls_name)
    opts = cls()
    for name, value in fields.items():
        if name == "reduceOp":
            value = dist.ReduceOp(getattr(dist.ReduceOp, value))
        elif name == "device":
            value = torch.device(value)
        setattr(opts, name, value)
    return opts


def aligned(n: int) -> int:
    """``n`` rounded up to :data:`ALIGN`."""
    return (n + ALIGN - 1) // ALIGN * ALIGN


def error_text(exc: BaseException) -> str:
    """``Type: message`` of ``exc``, as a worker sends it: at most :data:`MAX_ERROR`
    characters (:func:`clip_middle`), so that its message always fits one read."""
    return clip_middle(f"{type(exc).__name__}: {exc}".strip(), MAX_ERROR)


def clip_middle(text: str, limit: int) -> str:
    """``text`` if it has at most ``limit`` characters, else its start and its end (where
    errors say where and why) around a marker naming how many characters were left out:
    ``limit`` characters in all (a ``limit`` shorter than the marker keeps only it)."""
    if len(text) <= limit:
        return text
    # digits of len(text) bound those of the count left out: the marker only gets shorter
    keep = max(0, limit - len(_marker(len(text))))
    head = (keep + 1) // 2
    tail = keep - head
    return text[:head] + _marker(len(text) - keep) + text[len(text) - tail :]


def _marker(left_out: int) -> str:
    return f" [... {left_out:,} characters left out ...] "
