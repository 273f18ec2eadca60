"""Device meshes: the tensor engine's view of a process mesh (or a slice of one), and
activation (``mesh.activate()``, ``no_mesh``, ``get_active_mesh``).

``ProcMesh.activate()`` activates the :class:`DeviceMesh` of its ranks. Activation
happens when ``activate()`` is *called* (Monarch's rule), not at ``with``; the returned
object ends it at the end of a ``with`` block or by ``.deactivate()``. While any mesh is
active one :class:`~.tensor.ActiveMesh` dispatch mode is on torch's mode stack (pushed by
the first activation, popped by the last), so ops without mesh-tensor inputs are created
on the innermost active mesh.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from monarch_kernel.calls.requester import Requester
from monarch_kernel.shape import Shape
from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.client import Client, client_for, report_all
from monarch_kernel.tensor_engine.tensor import ActiveMesh, Tensor, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import RankCoord

#: The one dispatch mode on torch's stack while any mesh is active (and how many
#: activations hold it).
_mode: list[ActiveMesh] = []
_held = [0]


class Activation:
    """One activation of a mesh (or of ``no_mesh``): a context manager that ends it."""

    def __init__(self, mesh: DeviceMesh | None):
        self.mesh = mesh
        self._ended = False
        state.stack.append(mesh)
        if mesh is not None:
            if _held[0] == 0:
                mode = ActiveMesh()
                mode.__enter__()
                _mode.append(mode)
            _held[0] += 1

    def deactivate(self) -> None:
        """End this activation (the innermost one); sends the buffered ops."""
        if self._ended:
            return
        if not state.stack or state.stack[-1] is not self.mesh:
            raise RuntimeError("activations must end in reverse order of their start")
        self._ended = True
        state.stack.pop()
        if self.mesh is not None:
            _held[0] -= 1
            if _held[0] == 0:
                _mode.pop().__exit__(None, None, None)
            try:
                self.mesh.client.flush()
            except Exception:  # a dead or stopped mesh: the next fetch says so
                pass

    def __enter__(self) -> DeviceMesh | None:
        return self.mesh

    def __exit__(self, *exc: object) -> None:
        self.deactivate()


class DeviceMesh:
    """The ranks of a process mesh (or a slice) as the tensor engine sees them: where
    mesh tensors live. Equal when they name the same ranks of the same process mesh."""

    def __init__(self, requester: Requester, shape: Shape):
        self.requester = requester
        self.shape = shape
        self.client: Client = client_for(requester)
        watch_cells()
        #: the mesh's global ranks, row-major (where its ops are sent)
        self.rank_tuple: tuple[int, ...] = tuple(shape.ranks())

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, DeviceMesh)
            and other.requester is self.requester
            and other.shape == self.shape
        )

    def __hash__(self) -> int:
        return hash((id(self.requester), self.shape))

    def __repr__(self) -> str:
        return f"<DeviceMesh {self.requester.name} {self.shape.describe()}>"

    # -- activation ------------------------------------------------------------------
    def activate(self) -> Activation:
        """Make this the active mesh now (until the ``with`` block ends or
        ``.deactivate()``): ops without mesh-tensor inputs create tensors here."""
        return Activation(self)

    # -- shape -----------------------------------------------------------------------
    @property
    def names(self) -> tuple[str, ...]:
        """The dims' names."""
        return self.shape.labels

    @property
    def sizes(self) -> dict[str, int]:
        """``{dim: size}``."""
        return self.shape.extent

    def size(self, dims: str | Sequence[str] | None = None) -> int:
        """The number of ranks along ``dims`` (all of them by default)."""
        if dims is None:
            return len(self.shape)
        if isinstance(dims, str):
            dims = (dims,)
        n = 1
        for d in dims:
            n *= self.shape.extent[d]
        return n

    def slice(self, **dims: Any) -> DeviceMesh:
        """The ranks at ``dims`` (ints drop a dim, slices keep it)."""
        return DeviceMesh(self.requester, self.shape.slice(**dims))

    def flatten(self, name: str) -> DeviceMesh:
        """The same ranks as one dim ``name`` (they must be contiguous)."""
        sh = self.shape
        flat = Shape((name,), (len(sh),), (1,), sh.offset)
        if flat.ranks() != sh.ranks():
            raise ValueError(f"cannot flatten {sh.describe()}: its ranks are not contiguous")
        return DeviceMesh(self.requester, flat)

    def exit(self) -> None:
        """Send what is buffered for this mesh (the process mesh keeps running)."""
        self.client.flush()

    # -- rank tensors ----------------------------------------------------------------
    def rank(self, dims: str | Sequence[str]) -> Tensor:
        """A mesh tensor: on each rank a 0-d ``int64`` holding its coordinate along
        ``dims`` (row-major over several)."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in names:
            if d not in self.shape.labels:
                raise KeyError(f"{d!r} is not a dim of {self!r} (dims {list(self.names)})")
        with on_fakes():
            fake = torch.empty((), dtype=torch.long)
        t = new_tensor(fake, self)
        self.client.issue(
            self.rank_tuple, RankCoord(self.client.new_seq(), t.ref, self.shape, names)
        )
        return t

    @property
    def ranks(self) -> Tensor:
        """Each rank's position in the mesh (all dims, row-major), as a mesh tensor."""
        return self.rank(self.shape.labels)


class _NoMesh:
    """``no_mesh.activate()``: plain local torch inside an active mesh."""

    def activate(self) -> Activation:
        """Run plain local torch until the ``with`` block ends (mesh tensors still run
        on their meshes)."""
        return Activation(None)

    def __repr__(self) -> str:
        return "no_mesh"


#: Plain local torch inside an active region: ``with no_mesh.activate(): ...``.
no_mesh = _NoMesh()


def get_active_mesh() -> DeviceMesh:
    """The innermost active mesh; ``ValueError`` when none is."""
    mesh = state.active()
    if mesh is None:
        raise ValueError("no device mesh is active")
    result: DeviceMesh = mesh
    return result


_meshes: dict[tuple[int, Shape], DeviceMesh] = {}


def device_mesh(requester: Requester, shape: Shape) -> DeviceMesh:
    """The :class:`DeviceMesh` of ``shape``'s ranks of ``requester``'s process mesh."""
    key = (id(requester), shape)
    mesh = _meshes.get(key)
    if mesh is None or mesh.requester is not requester:
        mesh = _meshes[key] = DeviceMesh(requester, shape)
    return mesh


# -- the notebook's cells -------------------------------------------------------------

_hooked: list[weakref.ref[Any]] = []


def watch_cells() -> None:
    """In IPython, when each cell ends: send the buffered ops (else they wait for the
    next fetch or a full batch) and show under the cell the errors of its failed ops
    that nothing fetched."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    ip = get_ipython()
    if ip is None or any(h() is ip for h in _hooked):
        return
    ip.events.register("post_run_cell", lambda result=None: _after_cell(ip, result))
    _hooked.append(weakref.ref(ip))


def _after_cell(ip: Any, result: Any) -> None:
    """A cell ended: send the buffered ops, show the errors of failed ops that nothing
    fetched (a warning on stderr, under the cell; the cell does not fail), and keep mesh
    tensors out of IPython's output cache (``Out[n]``, ``_n``, ``_``, the display hook's
    and the execution result's copies): a bare ``t`` ending a cell would otherwise hold
    its memory on every rank for the rest of the session."""
    # the display hook pushes ``_``, ``__``, ``___`` and ``_n`` into the namespace and
    # into ``user_ns_hidden`` too
    spaces = [ip.user_ns, getattr(ip, "user_ns_hidden", {})]
    cache = getattr(getattr(ip, "history_manager", None), "output_hist", None) or {}
    for n in [n for n, v in cache.items() if isinstance(v, Tensor)]:
        del cache[n]
        for ns in spaces:
            if isinstance(ns.get(f"_{n}"), Tensor):
                del ns[f"_{n}"]
    hook = getattr(ip, "displayhook", None)
    for name in ("_", "__", "___"):
        for ns in spaces:
            if isinstance(ns.get(name), Tensor):
                ns[name] = ""
        if isinstance(getattr(hook, name, None), Tensor):
            setattr(hook, name, "")
    if isinstance(getattr(result, "result", None), Tensor):
        result.result = None
    try:
        text = report_all().text()
    except KeyboardInterrupt:  # the stop button while the ranks finish the cell's ops
        text = "Interrupted: errors of this cell's tensor-engine ops show at a later cell's end.\n"
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
