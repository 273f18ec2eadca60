"""Typed shapes of the reports that travel pickled inside messages.

A :class:`FailureReport` is what a rank sends (pickled, in a ``res`` message with
``ok=0`` or in a ``fault`` message) when user code raised; ``rank`` and ``host`` are
filled in by whoever knows them. :class:`RankStats` is the once-a-second ``stats``
payload (with its GPU's :class:`GpuStats`, which the host agent adds in ``host_stats``).
:class:`AskRequest` and :class:`StopRequest` are what a rank asks of its controller
(``ask``, ``stop_mesh``). All are plain dicts on the wire (cheap to pickle, nothing to
import on the other side); these ``TypedDict`` s say which keys they carry.
"""

from __future__ import annotations

from typing import TypedDict


class SourceLine(TypedDict, total=False):
    """The user-code line an exception was raised at (innermost frame of user code)."""

    file: str
    line: int
    func: str
    code: str | None


class FailureReport(TypedDict, total=False):
    """An exception raised by user code on one rank."""

    type: str  #: the exception class name, e.g. ``ValueError``
    qualname: str  #: ``module.Class`` of the exception
    message: str
    traceback: str  #: formatted remote traceback (user frames only)
    line: SourceLine | None  #: where in the user's code it was raised
    tensors: list[str]  #: ``name: shape dtype device`` for tensors in the failing frame
    where: str  #: ``Class.endpoint``, ``cell 5``, ``spawn counters`` ...
    exception: bytes | None  #: the pickled exception, when it pickles
    host: str  #: the rank's hostname
    rank: int  #: the global rank (set by the controller on receipt)
    #: the exceptions before this one in its chain (``raise X from Y``, or raised while
    #: handling another), root cause first: ``{"type": ..., "message": ...}`` each
    causes: list[dict[str, str]]
    actor: str  #: the actor whose failure nobody waited for (``fault`` reports)
    #: ``mesh/actor[rank]`` of the actor that failed first, as a failure goes up through
    #: owners that did not handle it (``fault`` reports; see ``MeshFailure``)
    origin: str
    #: the call failed because its actor no longer runs there: ``stopped``, or
    #: ``failed`` (it aborted, its constructor raised); the caller raises
    #: ``SupervisionError``
    gone: str
    #: the owners a failure went up through that did not handle it, innermost first
    #: (``fault`` reports that reach the controller; see ``MeshFailure.path``)
    path: list[str]


class GpuStats(TypedDict, total=False):
    """What the rank's host agent adds to its stats of the GPU the rank is on (NVML:
    ``host.gpu_stats``); a key is absent where the device does not give it, and all are
    on hosts without a GPU (or without ``nvidia-ml-py``)."""

    gpu: int  #: NVML's index of the GPU
    gpu_util: float  #: percent of the last period a kernel ran on it (the whole GPU)
    gpu_used: int  #: its memory in use, bytes (all its processes)
    gpu_total: int  #: its memory, bytes
    gpu_power: float  #: watts
    gpu_proc: int  #: this rank's own memory on it, bytes (NVML's process list)
    pcie_tx: float  #: PCIe bytes/s from the GPU (GPM: Hopper and later)
    pcie_rx: float  #: PCIe bytes/s to the GPU
    nvlink_tx: float  #: NVLink bytes/s, all links (GPM)
    nvlink_rx: float


class RankStats(GpuStats, total=False):
    """A rank's once-a-second report (with its GPU's, :class:`GpuStats`, when its host
    agent sent it on: ``host_stats``)."""

    rss: int  #: resident memory in bytes
    gpu_mem: int | None  #: CUDA memory allocated in bytes (None without CUDA)
    bytes_in: int  #: data-plane bytes received (rank-to-rank tensors)
    bytes_out: int  #: data-plane bytes sent
    time: float  #: ``time.time()`` on the rank
    pg: str  #: backend of the last torch process group initialised on the rank, if any
    te_ops: int  #: tensor-engine ops the rank ran (once it was sent any)


class AskRequest(TypedDict):
    """The payload of ``ask``: an operation of the actor API a rank asks of its
    controller (``get_or_spawn_controller``)."""

    op: str  #: which operation (a key of ``controller.messaging.asks.ASK_HANDLERS``)
    id: str  #: the request id to answer
    rt: list[str]  #: the asking rank's reply socket (``PeerAddress.encode``)
    call: bytes  #: the operation's arguments, pickled


class StopRequest(TypedDict, total=False):
    """The payload of ``stop_mesh`` (see ``wire.kinds``); a rank may leave keys out."""

    mesh: str  #: the process mesh to stop
    key: str  #: its key, hex: only a holder of a reference may stop it
    grace: float
    rt: list[str]  #: the asking rank's reply socket (``PeerAddress.encode``)
    id: str  #: the request id to answer
