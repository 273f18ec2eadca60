"""The records a ``tensor_ops`` message carries (the tensor engine's wire format).

The controller (:mod:`monarch_kernel.tensor_engine`) records every torch operation on a
mesh tensor as a :class:`CallOp`, buffers them, and sends them as one pickled list per
``tensor_ops`` message; the rank (:mod:`monarch_kernel.rank.tensors`) runs the list in
order on its main thread. A mesh tensor is named by an int ref, unique per process mesh;
a ref inside an op's arguments is a :class:`Ref`. Nothing here imports torch: torch ops
travel by name (``"aten.mm.default"``), other functions as a :class:`RemoteFunction`.

Invariant (what makes fetches and errors right): every rank of a mesh gets the ops of
that mesh in the order they were issued, and a :class:`Fetch` goes to *every* rank of the
mesh, so its answers come only once each rank ran everything issued before it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from monarch_kernel.shape import Shape


@dataclass(frozen=True, slots=True)
class Ref:
    """A mesh tensor inside an op's arguments: each rank reads its own local tensor."""

    id: int


@dataclass(frozen=True, slots=True)
class GroupRef:
    """A process group inside an op's arguments (``DeviceMesh.process_group(dims)``):
    each rank reads the ``torch.distributed`` group of the ranks of ``shape`` that
    differ from it only along ``dims`` (made by those members the first time)."""

    shape: Shape
    dims: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class RemoteFunction:
    """A function that is not a torch op: by import path (``"pkg.mod.fn"``), or by
    value (cloudpickled, for functions defined in a notebook or ``__main__``)."""

    path: str | None = None
    pickled: bytes | None = None


@dataclass(frozen=True, slots=True)
class TensorPattern:
    """A tensor an op returned, without its values: what cached propagation (a remote
    function run once for real) brings back to make the controller's fakes from."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  #: as ``torch.<name>`` names it


@dataclass(frozen=True, slots=True)
class CallOp:
    """Run ``func(*args, **kwargs)``; its tensor outputs (pytree leaf order) become
    ``results``; ``mutates``: the refs of inputs it changes in place (poisoned with its
    error if it fails)."""

    seq: int
    func: str | RemoteFunction  #: a torch op's name (``"aten.add.Tensor"``) or a function
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    results: tuple[int, ...]
    mutates: tuple[int, ...] = ()
    #: ``results`` is one ref holding the whole return value (tensors or not): for
    #: ``call_on_shard_and_fetch``, whose value is fetched, not kept as mesh tensors
    whole: bool = False


@dataclass(frozen=True, slots=True)
class RankCoord:
    """``mesh.rank(dims)``: a 0-d int64 tensor holding this rank's coordinate along
    ``dims`` of ``shape`` (the device mesh), linearised row-major over several dims."""

    seq: int
    result: int
    shape: Shape
    dims: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class Reduce:
    """A collective over ``dims`` of ``shape`` (the device mesh): ``reduction`` is one of
    ``sum avg product min max band bor bxor stack``; ``scatter``: reduce-scatter (or
    all-to-all for ``stack``); ``inplace``: the result is written into ``src``."""

    seq: int
    src: int
    result: int
    shape: Shape
    dims: tuple[str, ...]
    reduction: str
    size: tuple[int, ...]  #: the input's shape (a poisoned input joins with zeros)
    dtype: str  #: the input's dtype, as ``torch.<name>`` names it (``"float32"``)
    scatter: bool = False
    inplace: bool = False
    #: ``reduce(..., out=t)``: the result is also written into ``t``'s local tensor
    out: int | None = None


@dataclass(frozen=True, slots=True)
class JoinWorld:
    """Sent to every rank of the process mesh before its first collective or transfer:
    each joins the mesh's default process group (gloo) if it has none yet, so that
    reductions on a slice and transfers between ranks need only their own ranks later."""


@dataclass(frozen=True, slots=True)
class SendTensor:
    """``to_mesh`` between ranks: for each ``(source, destination)`` global rank pair, in
    order, the source's local ``src`` goes to the destination, which keeps it as
    ``result`` (a pair of one rank is a local copy). A poisoned source sends its error
    instead, and the destination's ``result`` holds it."""

    seq: int
    src: int
    result: int
    pairs: tuple[tuple[int, int], ...]
    size: tuple[int, ...]  #: the tensor's shape
    dtype: str  #: as ``torch.<name>`` names it


@dataclass(frozen=True, slots=True)
class BorrowCreate:
    """``stream.borrow(t)``: ``result`` names the same local tensor as ``src``."""

    seq: int
    src: int
    result: int


@dataclass(frozen=True, slots=True)
class BorrowDrop:
    """``borrow.drop()``: the ranks forget ``borrowed`` (the borrowed tensor and its
    views); a ``mutable`` borrow whose tensors hold an error passes it to ``origin``
    (the lender's tensors of that storage)."""

    seq: int
    borrowed: tuple[int, ...]
    origin: tuple[int, ...]
    mutable: bool


@dataclass(frozen=True, slots=True)
class Resume:
    """After the stop button interrupted the ranks' ops: a rank interrupted in one
    skips the ops sent before this record (their outputs hold the interruption) and
    runs those after it. ``through``: the seq of the last op sent before it (that of
    the ``tensor_stop`` told beside it; -1: none)."""

    through: int = -1


@dataclass(frozen=True, slots=True)
class Drop:
    """The controller dropped these mesh tensors: the ranks forget them."""

    refs: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Fetch:
    """The last record of a request: every rank answers a :class:`FetchReply` with the
    errors it holds for ``refs``; rank ``shard`` (global) also sends their values (every
    rank does when ``shard`` is :data:`ALL_SHARDS`)."""

    refs: tuple[int, ...]
    shard: int


#: ``Fetch.shard`` when every rank sends its values (the notebook's per-rank table).
ALL_SHARDS = -1


@dataclass(frozen=True, slots=True)
class Report:
    """The last (only) record of the request a notebook cell's end sends: every rank
    answers a :class:`ReportReply` with the errors of the ops that failed there since
    its last report, once it ran everything sent before."""


#: One record of a ``tensor_ops`` payload.
Record = (
    CallOp | RankCoord | Reduce | JoinWorld | SendTensor | BorrowCreate | BorrowDrop | Resume
    | Drop | Fetch | Report
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class RankError:
    """An op failed on a rank: stored in its outputs (and the outputs of every op that
    read them), reported by the fetches that read one. ``seq`` is the failed op's."""

    seq: int
    rank: int
    error_type: str  #: the exception's class name
    message: str  #: ``str(exception)``
    traceback: str  #: the worker's formatted traceback


@dataclass(frozen=True, slots=True)
class FetchReply:
    """A rank's answer to a :class:`Fetch`: ``values`` (the shard only, else None) and,
    for each fetched ref that holds an error here, ``(its index in refs, the error)``."""

    values: list[Any] | None
    errors: list[tuple[int, RankError]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ReportReply:
    """A rank's answer to a :class:`Report`: the *root* errors (ops that raised there,
    not those that only read a poisoned input) since its last report, oldest first, at
    most ``MAX_UNREPORTED``; ``more``: how many failed beyond those."""

    failed: tuple[RankError, ...]
    more: int = 0


#: Root errors a rank keeps for its next :class:`Report` (the oldest are kept).
MAX_UNREPORTED = 64


# -- mesh tensors as arguments of actor endpoints ------------------------------------------

#: How a rank reads its local tensor of a ref: installed by the rank's tensor worker
#: (:mod:`monarch_kernel.rank.tensors`) when it starts; the wire layer imports no rank.
shard_lookup: list[Any] = []


@dataclass(frozen=True, slots=True)
class LocalShard:
    """A mesh tensor passed to an actor endpoint on its own process mesh: unpickled on
    each rank as that rank's local tensor of ref ``id`` (Monarch's rule). The call is
    sent after every op issued before it, so the tensor is the one those ops left."""

    id: int

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _local_shard, (self.id,)


def _local_shard(ref: int) -> Any:
    """The local tensor of ``ref`` on this rank (the endpoint call's argument)."""
    if not shard_lookup:
        raise LookupError(
            f"mesh tensor ref {ref} was passed to an endpoint, but this rank holds no "
            "mesh tensors (was it restarted after the tensor was made?)"
        )
    return shard_lookup[0](ref)
