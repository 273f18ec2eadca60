"""A note under a failed DTensor operation that names its DTensors.

DTensor's own errors name no tensor: "Cross device mesh comm not supported yet!", "got
mixed torch.Tensor and DTensor", "DTensor does not support cross-mesh operation". The
traceback's frames still hold the DTensors (``self`` of ``redistribute``, the ``args`` of
the dispatch) and the meshes asked for; :func:`note` finds them there, maps each to its
qualified name in the rank's namespace (``model.blocks.0.attn.weight``, a parameter; or a
variable's name) and says, for each, its global shape, placements, mesh and the local
shape on every rank of that mesh, then what the error means. ``rank.errors`` adds the note
to the exception (``add_note``), so it shows under the traceback in the notebook.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

from monarch_kernel.calls.errors import format_ranks
from monarch_kernel.rank.sharding.fingerprint import describe_mesh, local_shape_at, mesh_ranks

#: Frames of these torch packages mark an error as a sharding one worth a note.
_DISTRIBUTED = os.sep + os.path.join("torch", "distributed") + os.sep
_DTENSOR = _DISTRIBUTED + "tensor" + os.sep


@dataclass(frozen=True)
class Named:
    """A DTensor of the failing operation and what the namespace calls it."""

    value: Any
    #: ``parameter 'model.0.weight'``, ``buffer 'model.mask'``, ``variable 'w'``, or where
    #: it was found (``'self' in redistribute()``).
    label: str


def _frames(exc: BaseException) -> list[FrameType]:
    """The frames of ``exc``'s traceback, then those of the exceptions it was raised from
    or while handling (DTensor re-raises its dispatch's errors with the user's line)."""
    frames: list[FrameType] = []
    seen: set[int] = set()
    cur: BaseException | None = exc
    while cur is not None and id(cur) not in seen and len(seen) < 8:
        seen.add(id(cur))
        tb = cur.__traceback__
        while tb is not None:
            frames.append(tb.tb_frame)
            tb = tb.tb_next
        cur = cur.__cause__ or cur.__context__
    return frames


def _chained(exc: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    cur: BaseException | None = exc
    while cur is not None and cur not in out and len(out) < 8:
        out.append(cur)
        cur = cur.__cause__ or cur.__context__
    return out


def _values(value: Any, depth: int = 2) -> Iterator[Any]:
    """``value`` and what is inside it (tuples, lists, dict values; a module's own
    parameters and buffers: ``self.mask`` in a forward), ``depth`` levels."""
    yield value
    if depth <= 0:
        return
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.nn.Module):
        yield from value._parameters.values()
        yield from value._buffers.values()
    elif isinstance(value, (tuple, list)):
        for item in value[:32]:
            yield from _values(item, depth - 1)
    elif isinstance(value, dict):
        for item in itertools.islice(value.values(), 32):
            yield from _values(item, depth - 1)


def _namespace(frames: list[FrameType]) -> dict[str, Any]:
    """The cell's globals: the outermost ``<module>`` frame of code run from a string."""
    for frame in frames:
        if frame.f_code.co_name == "<module>" and frame.f_code.co_filename.startswith("<"):
            return frame.f_globals
    return {}


def _names(namespace: dict[str, Any]) -> dict[int, str]:
    """id of a tensor -> its label: parameters and buffers of the namespace's modules
    (qualified), then the namespace's own tensor variables."""
    torch = sys.modules.get("torch")
    if torch is None:
        return {}
    out: dict[int, str] = {}
    for key, value in list(namespace.items()):
        if key.startswith("_") or not isinstance(value, torch.nn.Module):
            continue
        for name, p in value.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), f"parameter {key}.{name!s}")
        for name, b in value.named_buffers(remove_duplicate=False):
            out.setdefault(id(b), f"buffer {key}.{name!s}")
    for key, value in list(namespace.items()):
        if not key.startswith("_") and isinstance(value, torch.Tensor):
            out.setdefault(id(value), f"variable {key}")
    return out


def _label(kind_and_name: str) -> str:
    kind, _, name = kind_and_name.partition(" ")
    return f"{kind} {name!r}"


def find_dtensors(exc: BaseException) -> tuple[list[Named], list[Any]]:
    """The DTensors in the frames of ``exc``'s traceback (each once, named) and the
    DeviceMeshes there that none of them lives on (a mesh asked for)."""
    tensor_api = sys.modules.get("torch.distributed.tensor")
    mesh_api = sys.modules.get("torch.distributed.device_mesh")
    dtensor = getattr(tensor_api, "DTensor", None)
    mesh_type = getattr(mesh_api, "DeviceMesh", None)
    if dtensor is None:
        return [], []
    frames = _frames(exc)
    names = _names(_namespace(frames))
    found: dict[int, Named] = {}
    meshes: dict[int, Any] = {}
    for frame in frames:
        if frame.f_code.co_name == "<module>":  # the namespace itself: not the operation's
            continue
        # a mesh asked for is an argument of DTensor's own code (redistribute, from_local)
        in_dtensor = _DTENSOR in frame.f_code.co_filename
        for local, value in list(frame.f_locals.items()):
            for item in _values(value):
                if isinstance(item, dtensor) and id(item) not in found:
                    name = names.get(id(item))
                    label = (
                        _label(name)
                        if name
                        else f"a DTensor ({local!r} in {frame.f_code.co_name}())"
                    )
                    found[id(item)] = Named(item, label)
                elif mesh_type is not None and isinstance(item, mesh_type) and in_dtensor:
                    meshes.setdefault(id(item), item)
    own = {id(n.value.device_mesh) for n in found.values()}
    others = [m for k, m in meshes.items() if k not in own]
    # Named ones first: they are what the user knows
    ordered = sorted(found.values(), key=lambda n: n.label.startswith("a DTensor"))
    return ordered, others


def _local_shapes(value: Any) -> str:
    """``(4, 8) on ranks 0-3`` or ``(3, 8) on ranks 0, 1; (2, 8) on ranks 2, 3``."""
    mesh = value.device_mesh
    sizes = tuple(int(s) for s in mesh.mesh.shape)
    ranks = mesh.mesh.tolist()
    groups: dict[tuple[int, ...], list[int]] = {}
    for coord in itertools.product(*(range(s) for s in sizes)):
        rank = ranks
        for c in coord:
            rank = rank[c]
        shape = local_shape_at(value.shape, sizes, value.placements, coord)
        groups.setdefault(shape, []).append(int(rank))
    return "; ".join(
        f"{shape} on {'rank' if len(rs) == 1 else 'ranks'} {format_ranks(rs)}"
        for shape, rs in groups.items()
    )


def describe(named: Named) -> str:
    """One DTensor: its name, global shape, placements, mesh and every rank's local
    shape."""
    v = named.value
    placements = tuple(repr(p) for p in v.placements)
    mesh = v.device_mesh
    ranks = format_ranks(list(mesh_ranks(mesh)))
    return (
        f"{named.label}: global {tuple(v.shape)}, {str(v.dtype).removeprefix('torch.')}, "
        f"placements ({', '.join(placements)}{',' if len(placements) == 1 else ''}) on mesh "
        f"{describe_mesh(mesh)} of ranks {ranks}; local shape {_local_shapes(v)}"
    )


def _hint(message: str, named: list[Named], others: list[Any]) -> str:
    if "Cross device mesh" in message or (others and "redistribute" in message.lower()):
        src = describe_mesh(named[0].value.device_mesh) if named else "its mesh"
        dst = ", ".join(
            f"{describe_mesh(m)} of ranks {format_ranks(list(mesh_ranks(m)))}" for m in others
        )
        return (
            f"redistribute() changes a DTensor's placements on its own mesh; it cannot move it "
            f"to another DeviceMesh (here from {src} to {dst or 'another mesh'}; a mesh made "
            "by another call is another mesh, even over the same ranks). On the same ranks, "
            "DTensor.from_local(t.to_local(), new_mesh, placements) reuses the pieces; else "
            "gather it (t.full_tensor()) and distribute_tensor() it on the new mesh."
        )
    lowered = message.lower()
    if "cross-mesh" in message or "different mesh" in lowered or "different device mesh" in lowered:
        return (
            "an operation's DTensors must all live on one DeviceMesh; the ones above do not "
            "(a mesh made by another call is another mesh, even over the same ranks). Build "
            "both on one mesh, or move one: DTensor.from_local(t.to_local(), mesh, "
            "t.placements) when the ranks match."
        )
    if "mixed torch.Tensor and DTensor" in message:
        buffers = [n.label for n in named if n.label.startswith("buffer")]
        text = (
            "a plain tensor met a DTensor in one operation. Under fully_shard, a module's "
            "parameters are plain (all-gathered) tensors during forward, but its buffers stay "
            "as they are"
        )
        if buffers:
            text += (
                f": {', '.join(buffers)} is a DTensor, so it stays sharded in forward; keep "
                "it a plain tensor, whole on every rank (FSDP never shards buffers)"
            )
        return text + "."
    return ""


def note(exc: BaseException) -> str | None:
    """The note for ``exc`` when it failed inside torch.distributed with DTensors in its
    frames: each DTensor named, with its shapes and placements on every rank, and what
    the error means. None for any other failure."""
    if "torch.distributed.tensor" not in sys.modules:
        return None
    frames = _frames(exc)
    message = "\n".join(str(e) for e in _chained(exc))
    # DTensor's dispatch raises from C++ (no torch.distributed frame): its messages say so
    if not any(_DISTRIBUTED in f.f_code.co_filename for f in frames) and not (
        "DTensor" in message or "mesh" in message.lower()
    ):
        return None
    named, others = find_dtensors(exc)
    if not named:
        return None
    lines = ["The DTensors in the failing operation:"]
    lines += [f"  {describe(n)}" for n in named[:6]]
    for mesh in others[:3]:
        lines.append(
            f"  the mesh asked for: {describe_mesh(mesh)} of ranks "
            f"{format_ranks(list(mesh_ranks(mesh)))}, not the DTensor's own"
        )
    hint = _hint(message, named, others)
    if hint:
        lines.append(hint)
    return "\n".join(lines)
