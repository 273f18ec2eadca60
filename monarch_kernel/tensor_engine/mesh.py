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
from monarch_kernel.shape import Shape, grid_table, rename_dims, split_dims
from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.client import (
    Client,
    cells_ended,
    client_for,
    report_all,
    watch_exit,
)
from monarch_kernel.tensor_engine.tensor import ActiveMesh, Tensor, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import RankCoord

#: The one dispatch mode on torch's stack while any mesh is active (and how many
#: activations hold it).
_mode: list[ActiveMesh] = []
_held = [0]


def cuda_as_cpu() -> None:
    """Let ``device="cuda"`` through torch's CUDA check while a mesh is active on a
    controller without CUDA: torch initialises the device before the op reaches the
    dispatch, which reads ``cuda`` as the ranks' device (CPU ranks). Outside an active
    mesh the check stays torch's."""
    cuda = torch.cuda
    if cuda.is_available() or getattr(cuda._lazy_init, "_mesh_aware", False):
        return
    original = cuda._lazy_init

    def lazy_init() -> None:
        if state.active() is None:
            original()

    lazy_init._mesh_aware = True  # type: ignore[attr-defined]
    cuda._lazy_init = lazy_init


class Activation:
    """One activation of a mesh (or of ``no_mesh``): a context manager that ends it."""

    def __init__(self, mesh: DeviceMesh | None):
        self.mesh = mesh
        self._ended = False
        state.stack.append(mesh)
        if mesh is not None:
            if _held[0] == 0:
                cuda_as_cpu()
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

    def rename(self, **names: str) -> DeviceMesh:
        """The same ranks with dims renamed: ``mesh.rename(host="dp", gpu="tp")``."""
        return device_mesh(self.requester, rename_dims(self.shape, names))

    def split(self, **how: Any) -> DeviceMesh:
        """The same ranks with dims split into several: ``split(host=("dp", "pp"),
        pp=2)`` makes ``host`` the dims ``dp`` and ``pp`` (row-major, ``pp`` the inner,
        of size 2; one size per split may be left out and is inferred)."""
        return device_mesh(self.requester, split_dims(self.shape, how))

    def process_group(self, dims: str | Sequence[str]) -> Any:
        """A process group over ``dims`` for remote functions that call
        ``torch.distributed`` (Monarch's ``RemoteProcessGroup``): passed to one, each
        rank gets the group of its peers along ``dims``."""
        from monarch_kernel.tensor_engine.process_groups import process_group

        return process_group(self, dims if isinstance(dims, str) else tuple(dims))

    # -- the process grid ------------------------------------------------------------
    def to_tensor(self) -> torch.Tensor:
        """The mesh's global ranks as a local ``int`` tensor of the mesh's sizes."""
        with Activation(None):
            return torch.tensor(self.rank_tuple, dtype=torch.int).reshape(self.shape.sizes)

    def to_table(self) -> str:
        """The process grid as text: each coordinate's global rank (no values)."""
        return grid_table(self.shape)

    # -- rank tensors ----------------------------------------------------------------
    def rank(self, dims: str | Sequence[str]) -> Tensor:
        """A mesh tensor: on each rank a 0-d ``int64`` holding its coordinate in this
        mesh along ``dims`` (row-major over several). It is made on the active mesh
        (Monarch's rule: ``mesh.rank("gpu")`` under a slice's ``activate()`` lives on
        the slice), which must be within this one; on this mesh when none is active."""
        names = (dims,) if isinstance(dims, str) else tuple(dims)
        for d in names:
            if d not in self.shape.labels:
                raise KeyError(f"{d!r} is not a dim of {self!r} (dims {list(self.names)})")
        where = state.active()
        if where is None or where == self:
            where = self
        elif where.requester is not self.requester or not set(where.rank_tuple) <= set(
            self.rank_tuple
        ):
            raise ValueError(
                f"The current mesh {where!r} is not a subset of the mesh {self!r} whose "
                "rank is asked for"
            )
        with on_fakes():
            fake = torch.empty((), dtype=torch.long)
        t = new_tensor(fake, where)
        where.client.issue(
            where.rank_tuple, RankCoord(where.client.new_seq(), t.ref, self.shape, names)
        )
        return t

    @property
    def ranks(self) -> dict[str, Tensor]:
        """Each rank's coordinate along every dim: ``{dim: mesh.rank(dim)}`` (Monarch's)."""
        return {d: self.rank(d) for d in self.shape.labels}


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
    that nothing fetched. Outside IPython (a script): those errors are shown at the
    interpreter's exit (``client.report_at_exit``)."""
    try:
        from IPython import get_ipython
    except ImportError:
        watch_exit()
        return
    ip = get_ipython()
    if ip is None:
        watch_exit()
        return
    if any(h() is ip for h in _hooked):
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
    cells_ended(isinstance(getattr(result, "error_in_exec", None), KeyboardInterrupt))
    try:
        text = report_all().text()
    except KeyboardInterrupt:  # the stop button while the ranks finish the cell's ops
        cells_ended(True)  # they stop (those the unanswered reports wait behind)
        text = (
            "Interrupted: the tensor-engine ops the ranks still ran are stopped (their "
            "outputs hold the interruption); errors of those that ran show at a later "
            "cell's end.\n"
        )
    if text:
        sys.stderr.write(text)
        sys.stderr.flush()
