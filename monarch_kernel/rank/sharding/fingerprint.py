"""A model's sharding fingerprint, compared across the ranks: errors that name the tensor.

A sharding mistake (a rank that built a different model, a module wrapped by
``fully_shard`` on some ranks only, a replicated buffer sharded by hand) shows up, in
torch, as a collective whose sizes do not match: gloo's "Received data size doesn't match
expected size", NCCL's hang, a wrong result. The *fingerprint* of a model says, for every
parameter and buffer, what each rank believes: its qualified name, global and local
shape, dtype, placements and mesh; and which modules are FSDP-wrapped. The ranks
exchange it before FSDP's first collective (:mod:`.hooks` wraps FSDP2's root lazy
init) and compare it: a difference becomes a :class:`ShardingError` naming the tensor,
its shapes and placements on each rank, and the ranks that disagree.

The exchange goes through the process group's rendezvous store, never the group's own
collectives: a rank that takes part alone (a restarted rank whose peers initialised their
model long ago) can never pair with a peer's FSDP all-gather. Each rank writes a digest
(and its whole fingerprint); only when the digests differ are the fingerprints read.
"""

from __future__ import annotations

import hashlib
import math
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from monarch_kernel.calls.errors import ranks_word
from monarch_kernel.rank import context


class ShardingError(RuntimeError):
    """The ranks disagree on how a model is sharded: the message names each parameter or
    buffer that differs (qualified name), its global and local shapes and placements on
    each rank, and the ranks that disagree."""


class TensorKind(str, Enum):
    """What a fingerprinted tensor is to its module."""

    PARAMETER = "parameter"
    BUFFER = "buffer"


@dataclass(frozen=True)
class TensorPrint:
    """One parameter or buffer as one rank sees it."""

    name: str
    kind: TensorKind
    global_shape: tuple[int, ...]
    local_shape: tuple[int, ...]
    dtype: str
    #: ``()`` for a plain tensor (whole on every rank), else the DTensor's placements.
    placements: tuple[str, ...] = ()
    #: The DTensor's mesh: dim names and sizes, and its ranks (flat, row-major).
    mesh: str = ""
    mesh_ranks: tuple[int, ...] = ()
    #: The local shape this rank should hold for its global shape and placements (a
    #: DTensor built from wrong pieces differs); equal to ``local_shape`` when fine.
    expected_local: tuple[int, ...] | None = None

    def same_everywhere(self) -> tuple[object, ...]:
        """What every rank must agree on (the local shape may differ by rank)."""
        return (
            self.kind,
            self.global_shape,
            self.dtype,
            self.placements,
            self.mesh,  # dims and sizes: a sub-mesh's ranks differ by rank (each host's)
            self.expected_local in (None, self.local_shape),
        )

    def describe(self) -> str:
        """``global (8, 8), local (4, 8), float32, (Replicate(), Shard(dim=0)) on
        (hosts=2, gpus=2)``: the one-line view of this tensor on a rank."""
        text = f"global {_shape(self.global_shape)}, local {_shape(self.local_shape)}"
        text += f", {self.dtype}"
        if self.placements:
            text += f", {_placements(self.placements)} on mesh {self.mesh}"
        else:
            text += ", a plain tensor (whole on every rank)"
        if self.expected_local not in (None, self.local_shape):
            text += f" [its placements give a local {_shape(self.expected_local or ())}]"
        return text


@dataclass(frozen=True)
class Fingerprint:
    """A model's parameters and buffers and its FSDP-wrapped modules, on one rank."""

    rank: int
    #: The model's name in the rank's namespace (``model``), or its class.
    root: str
    tensors: tuple[TensorPrint, ...]
    #: Qualified names of the modules ``fully_shard`` was applied to (``model`` itself
    #: included, as its own name).
    wrapped: tuple[str, ...]
    #: The class of each wrapped module, by name (to say what was wrapped).
    classes: tuple[tuple[str, str], ...] = field(default=())

    def digest(self) -> bytes:
        """32 bytes over everything the ranks must agree on."""
        same = (
            self.root,
            self.wrapped,
            tuple((t.name, t.same_everywhere()) for t in self.tensors),
        )
        return hashlib.sha256(repr(same).encode()).digest()


def _shape(shape: Sequence[int]) -> str:
    return str(tuple(int(s) for s in shape))


def _placements(placements: Sequence[str]) -> str:
    return "(" + ", ".join(placements) + ("," if len(placements) == 1 else "") + ")"


def _dtensor_type() -> Any:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None


def describe_mesh(mesh: Any) -> str:
    """``(hosts=2, gpus=2)`` for a DeviceMesh (``(2, 2)`` when its dims have no names)."""
    names = getattr(mesh, "mesh_dim_names", None) or ()
    sizes = tuple(int(s) for s in mesh.mesh.shape)
    if names:
        return "(" + ", ".join(f"{n}={s}" for n, s in zip(names, sizes)) + ")"
    return _shape(sizes)


def mesh_ranks(mesh: Any) -> tuple[int, ...]:
    """The global ranks of a DeviceMesh, row-major."""
    return tuple(int(r) for r in mesh.mesh.flatten().tolist())


def local_shape_at(
    global_shape: Sequence[int],
    sizes: Sequence[int],
    placements: Sequence[Any],
    coord: Sequence[int],
) -> tuple[int, ...]:
    """The local shape a DTensor of ``global_shape`` has at mesh coordinate ``coord``:
    ``torch.chunk``'s split along each ``Shard`` dim, in mesh-dim order (DTensor's own
    rule, computed here for any coordinate so that a note can show every rank's)."""
    shape = [int(s) for s in global_shape]
    for placement, size, index in zip(placements, sizes, coord):
        dim = getattr(placement, "dim", None)
        if type(placement).__name__ not in ("Shard", "_StridedShard") or dim is None:
            continue
        whole = shape[dim]
        chunk = math.ceil(whole / size) if size else whole
        start = min(whole, chunk * index)
        shape[dim] = max(0, min(whole, start + chunk) - start)
    return tuple(shape)


def tensor_print(name: str, kind: TensorKind, value: Any) -> TensorPrint:
    """The fingerprint of one parameter or buffer."""
    dtensor = _dtensor_type()
    dtype = str(value.dtype).removeprefix("torch.")
    if dtensor is not None and isinstance(value, dtensor):
        mesh = value.device_mesh
        local = tuple(int(s) for s in value._local_tensor.shape)
        coord = mesh.get_coordinate()
        expected = (
            local_shape_at(value.shape, mesh.mesh.shape, value.placements, coord)
            if coord is not None
            else None
        )
        return TensorPrint(
            name=name,
            kind=kind,
            global_shape=tuple(int(s) for s in value.shape),
            local_shape=local,
            dtype=dtype,
            placements=tuple(repr(p) for p in value.placements),
            mesh=describe_mesh(mesh),
            mesh_ranks=mesh_ranks(mesh),
            expected_local=expected,
        )
    shape = tuple(int(s) for s in value.shape)
    return TensorPrint(name, kind, shape, shape, dtype)


def fsdp_modules(model: Any) -> list[tuple[str, Any]]:
    """``(qualified name, module)`` of every module of ``model`` that ``fully_shard``
    was applied to (none when FSDP2 was never imported)."""
    fsdp = sys.modules.get("torch.distributed.fsdp._fully_shard._fully_shard")
    cls = getattr(fsdp, "FSDPModule", None)
    if cls is None:
        return []
    return [(n, m) for n, m in model.named_modules() if isinstance(m, cls)]


def name_in_namespace(model: Any) -> str | None:
    """The name ``model`` has in the cell namespace this thread is running in
    (``model``, or ``net.blocks.0`` for a submodule of a namespace module)."""
    namespace = cell_namespace()
    if namespace is None:
        return None
    for key, value in list(namespace.items()):
        if value is model and not key.startswith("_"):
            return key
    nn = sys.modules.get("torch.nn")
    module_type = getattr(nn, "Module", None)
    if module_type is None:
        return None
    for key, value in list(namespace.items()):
        if key.startswith("_") or not isinstance(value, module_type):
            continue
        for sub_name, sub in value.named_modules():
            if sub is model and sub_name:
                return f"{key}.{sub_name}"
    return None


def cell_namespace() -> dict[str, Any] | None:
    """The globals of the cell (``%%remote``) this thread runs, found on the stack: the
    innermost ``<module>`` frame of user code."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_code.co_filename.startswith("<"):
            return frame.f_globals
        frame = frame.f_back  # type: ignore[assignment]
    return None


def take(model: Any, root: str | None = None) -> Fingerprint:
    """This rank's fingerprint of ``model``: every parameter and buffer (qualified by
    ``root``, the model's name in the namespace when not given) and its wrapped modules."""
    root = root or name_in_namespace(model) or type(model).__name__

    def qualified(name: str) -> str:
        return f"{root}.{name}" if name else root

    tensors = [
        tensor_print(qualified(n), TensorKind.PARAMETER, p)
        for n, p in model.named_parameters(remove_duplicate=True)
    ]
    tensors += [
        tensor_print(qualified(n), TensorKind.BUFFER, b)
        for n, b in model.named_buffers(remove_duplicate=True)
        if b is not None
    ]
    wrapped = fsdp_modules(model)
    return Fingerprint(
        rank=_rank(),
        root=root,
        tensors=tuple(tensors),
        wrapped=tuple(qualified(n) for n, _ in wrapped),
        classes=tuple((qualified(n), _class_name(m)) for n, m in wrapped),
    )


def _class_name(module: Any) -> str:
    name = type(module).__name__
    # fully_shard swaps the class for "FSDP<Class>": show the user's class
    return name.removeprefix("FSDP") if name.startswith("FSDP") else name


def _rank() -> int:
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_initialized():
        return int(dist.get_rank())
    return int(context.current_rank().rank) if context.in_rank() else 0


# -- comparing ---------------------------------------------------------------------------


def compare(
    prints: Sequence[Fingerprint], limit: int = 6, when: str = "before FSDP's first collective"
) -> str | None:
    """The text of a :class:`ShardingError` when the ranks' fingerprints disagree, None
    when they agree. Deterministic in its input, so every rank builds the same text."""
    prints = sorted(prints, key=lambda p: p.rank)
    if len({p.digest() for p in prints}) <= 1:
        return None
    ranks = [p.rank for p in prints]
    problems: list[str] = []
    roots = _by_value({p.rank: p.root for p in prints})
    if len(roots) > 1:
        problems.append(
            "the model each rank runs differs: "
            + "; ".join(f"{v!r} on {ranks_word(r)}" for v, r in roots)
            + " (fully_shard's root module, the first one to run forward, is not the same)"
        )
    problems += _wrapped_differences(prints)
    problems += _tensor_differences(prints)
    if not problems:  # digests differ but nothing we describe does: say so plainly
        problems.append("the ranks' parameters and buffers differ (no single tensor to name)")
    shown = problems[:limit]
    if len(problems) > limit:
        shown.append(f"... and {len(problems) - limit} more difference(s)")
    disagree = _disagreeing(prints)
    head = (
        f"the ranks disagree on how {prints[0].root!r} is sharded "
        f"(compared across {ranks_word(ranks)} {when})"
    )
    if disagree:
        verb = "differs" if len(disagree) == 1 else "differ"
        head += f"; {ranks_word(disagree)} {verb} from the others"
    return head + ":\n" + "\n".join(shown)


def _by_value(values: dict[int, Any]) -> list[tuple[Any, list[int]]]:
    """``[(value, ranks)]``, the most common value first."""
    groups: dict[Any, list[int]] = {}
    for rank, value in values.items():
        groups.setdefault(value, []).append(rank)
    return sorted(groups.items(), key=lambda item: (-len(item[1]), item[1]))


def _disagreeing(prints: Sequence[Fingerprint]) -> list[int]:
    """The ranks outside the largest group of equal digests (none when tied all round)."""
    groups = _by_value({p.rank: p.digest() for p in prints})
    if len(groups) < 2 or len(groups[0][1]) == len(groups[1][1]):
        return [] if len(groups) < 2 else sorted(r for _, rs in groups[1:] for r in rs)
    return sorted(r for _, rs in groups[1:] for r in rs)


def _wrapped_differences(prints: Sequence[Fingerprint]) -> list[str]:
    out = []
    everywhere = [set(p.wrapped) for p in prints]
    names = sorted(set().union(*everywhere))
    tensors = {p.rank: {t.name: t for t in p.tensors} for p in prints}
    for name in names:
        on = [p.rank for p in prints if name in p.wrapped]
        off = [p.rank for p in prints if name not in p.wrapped]
        if not off:
            continue
        own = sorted(
            t
            for t in tensors[on[0]]
            if t.startswith(name + ".") and t.count(".") == name.count(".") + 1
        )
        text = (
            f"module {name!r} is wrapped by fully_shard on {ranks_word(on)} but not on "
            f"{ranks_word(off)}"
        )
        if own:
            listed = ", ".join(repr(t) for t in own[:4]) + (", ..." if len(own) > 4 else "")
            text += (
                f": its parameters ({listed}) would be all-gathered in a group of their own "
                f"on {ranks_word(on)} and with their parent's on {ranks_word(off)}"
            )
        out.append(text)
    return out


def _tensor_differences(prints: Sequence[Fingerprint]) -> list[str]:
    out = []
    per_rank = {p.rank: {t.name: t for t in p.tensors} for p in prints}
    order: list[str] = []
    for p in prints:
        order += [t.name for t in p.tensors if t.name not in order]
    ranks = [p.rank for p in prints]
    for name in order:
        have = {r: per_rank[r][name] for r in ranks if name in per_rank[r]}
        missing = [r for r in ranks if r not in have]
        kind = next(iter(have.values())).kind.value
        if missing:
            out.append(
                f"{kind} {name!r} exists on {ranks_word(have)} but not on "
                f"{ranks_word(missing)} (the ranks built different models)"
            )
            continue
        same = _by_value({r: t.same_everywhere() for r, t in have.items()})
        if len(same) == 1:
            continue
        what = _what_differs([have[rs[0]] for _, rs in same])
        verb = "differ" if "," in what else "differs"
        lines = [f"{kind} {name!r}: {what} {verb} across ranks"]
        rows = _by_value({r: have[r].describe() for r in have})
        for text, rs in sorted(rows, key=lambda item: item[1]):
            lines.append(f"    {ranks_word(rs)}: {text}")
        hint = _hint(have)
        if hint:
            lines.append(f"    {hint}")
        out.append("\n".join(lines))
    return out


def _what_differs(variants: Sequence[TensorPrint]) -> str:
    fields = []
    if len({v.global_shape for v in variants}) > 1:
        fields.append("global shape")
    if len({v.placements for v in variants}) > 1:
        fields.append("placements")
    if len({v.mesh for v in variants}) > 1:
        fields.append("mesh")
    if len({v.dtype for v in variants}) > 1:
        fields.append("dtype")
    if any(v.expected_local not in (None, v.local_shape) for v in variants):
        fields.append("local shape")
    return ", ".join(fields) or "its description"


def _hint(have: dict[int, TensorPrint]) -> str:
    """Why such a difference happens, for the common cases."""
    values = list(have.values())
    plain = [t for t in values if not t.placements]
    sharded = [t for t in values if t.placements]
    if values[0].kind is TensorKind.BUFFER and plain and len({t.global_shape for t in plain}) > 1:
        return (
            "a buffer is not sharded by FSDP: every rank should hold it whole; was it made "
            "from a shard (e.g. from a parameter's local shape after fully_shard, or sliced "
            "by rank)?"
        )
    if values[0].kind is TensorKind.BUFFER and plain and sharded:
        return (
            "a buffer stays whole under FSDP (it is not all-gathered): it is sharded on some "
            "ranks only"
        )
    if len({t.global_shape for t in values}) > 1:
        return "the ranks built different models (a rank-dependent size in the model's code?)"
    return ""


# -- exchanging --------------------------------------------------------------------------

_PREFIX = "mk-shard-fp"
#: (request id, participants) -> how many exchanges this rank made for them.
_ordinals: dict[tuple[str, tuple[int, ...]], int] = {}


@dataclass(frozen=True)
class Exchange:
    """Where the fingerprints of one comparison meet in the rendezvous store."""

    store: Any
    key: str
    ranks: tuple[int, ...]


def exchange_for(ranks: Sequence[int], purpose: str) -> Exchange | None:
    """The exchange of this rank's ``purpose``-th comparison among ``ranks`` in the
    current request, or None when there is no store (no process group)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        return None
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:
        return None
    request = context.current_request or "-"
    participants = tuple(sorted(int(r) for r in ranks))
    slot = (f"{purpose}/{request}", participants)
    ordinal = _ordinals.get(slot, 0)
    _ordinals[slot] = ordinal + 1
    group = hashlib.sha1(repr(participants).encode()).hexdigest()[:12]
    return Exchange(store, f"{_PREFIX}/{purpose}/{request}/{group}/{ordinal}", participants)


def gather(ex: Exchange, mine: Fingerprint, wait: float) -> list[Fingerprint] | None:
    """Every participant's fingerprint when some digest differs from the others', ``[]``
    when all agree, None when not all participants came within ``wait`` seconds (the
    comparison is then left to the ones that did). Polls the store in short steps, so that
    the stop button (KeyboardInterrupt) lands at once."""
    store = ex.store
    store.set(f"{ex.key}/fp/{mine.rank}", pickle.dumps(mine))
    store.set(f"{ex.key}/d/{mine.rank}", mine.digest())
    keys = [f"{ex.key}/d/{r}" for r in ex.ranks]
    deadline = time.monotonic() + wait
    pause = 0.001
    while not store.check(keys):
        if time.monotonic() >= deadline:
            return None
        time.sleep(pause)
        pause = min(pause * 2, 0.02)
    digests = {bytes(store.get(k)) for k in keys}
    if _ABSTAIN in digests:
        return None  # a rank could not take its fingerprint: nothing to compare
    if len(digests) == 1:
        return []
    return [pickle.loads(store.get(f"{ex.key}/fp/{r}")) for r in ex.ranks]


_ABSTAIN = b"abstain"


def abstain(ex: Exchange) -> None:
    """Tell the peers of ``ex`` that this rank takes no part (they stop waiting)."""
    rank = _rank()
    ex.store.set(f"{ex.key}/d/{rank}", _ABSTAIN)


def participants(model: Any) -> tuple[int, ...]:
    """The ranks that must agree on ``model``: those of the meshes its DTensors live on,
    or the whole world for a model without any."""
    ranks: set[int] = set()
    dtensor = _dtensor_type()
    if dtensor is not None:
        for value in [*model.parameters(), *model.buffers()]:
            if isinstance(value, dtensor):
                ranks.update(mesh_ranks(value.device_mesh))
    if not ranks:
        dist = sys.modules["torch.distributed"]
        ranks = set(range(dist.get_world_size()))
    return tuple(sorted(ranks))


def check(model: Any, *, name: str | None = None, timeout: float = 60.0) -> None:
    """Compare ``model``'s sharding across the ranks that hold it and raise
    :class:`ShardingError` naming every parameter or buffer that differs: its qualified
    name, global and local shapes, placements and mesh on each rank, and the ranks that
    disagree; and every module wrapped by ``fully_shard`` on some ranks only.

    Call it on every rank of the model's mesh (in a ``%%remote`` cell), before or after
    ``fully_shard``. It uses the process group's rendezvous store, not a collective; it
    waits at most ``timeout`` seconds for the other ranks. ``name``: how to call the
    model in the error (its name in the cell's namespace by default). FSDP2 models are
    also checked automatically before their first forward."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_initialized():
        raise ShardingError(
            "check(model) compares the ranks' models through the mesh's process group: "
            "start the mesh with --dist"
        )
    mine = take(model, name)
    ex = exchange_for(participants(model), "check")
    if ex is None:
        return
    prints = gather(ex, mine, timeout)
    if prints is None:
        raise ShardingError(
            f"check({mine.root}): not every rank of {ranks_word(ex.ranks)} called check() "
            f"within {timeout:g}s"
        )
    text = compare(prints, when="by check()") if prints else None
    if text:
        raise ShardingError(text)
