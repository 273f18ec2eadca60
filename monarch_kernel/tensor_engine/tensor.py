"""Mesh tensors: :class:`Tensor` (one local tensor per rank of a mesh, described on the
controller by a FakeTensor) and :func:`dispatch`, which every torch op on them, or issued
while a mesh is active, goes through.

Dispatch, per op: check the arguments (mesh tensors of one mesh, nothing dropped, no large
local tensors); run the op on the FakeTensors under the controller's ``FakeTensorMode``
(shapes and dtypes: a bad shape raises here, in the cell, and nothing is sent); find the
inputs it mutated (their fake's ``_version`` moved); wrap each fake output in a new mesh
tensor with a fresh ref (an output that *is* an input stays that input); queue one
:class:`~monarch_kernel.wire.tensor_ops.CallOp` on the mesh's client.

Autograd runs here on the controller: a mesh tensor is a wrapper subclass, so autograd
records above dispatch and its backward ops come through :func:`dispatch` as aten ops.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.wire.tensor_ops import CallOp, Ref


class _QuietMetaErrors(logging.Filter):
    """A bad shape is reported to the user as the op's exception; torch's fake mode also
    logs it at ERROR with a traceback, which would repeat it in the cell: drop that."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietMetaErrors())

#: The controller's fake mode: every mesh tensor's ``_fake`` belongs to it.
fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

#: Local tensors up to this many elements may appear in an op on mesh tensors: they
#: travel by value inside the op (``torch.tensor([1, 2])`` under ``activate()``).
MAX_CONSTANT_NUMEL = 64

_CPU = torch.device("cpu")

#: Namespaces of the ops an active mesh takes without mesh-tensor inputs (factories);
#: others (``profiler._record_function_enter_new`` ...) run on the controller.
_MESH_NAMESPACES = frozenset({"aten", "prims"})

#: ``torch.tensor(data)`` under an active mesh: the local data becomes a mesh tensor.
_LIFTS = frozenset({torch.ops.aten.lift_fresh.default, torch.ops.aten.lift_fresh_copy.default})


class Tensor(torch.Tensor):
    """A mesh tensor: one local tensor per rank of ``mesh``, all of the same shape, dtype
    and strides (values may differ). Torch ops on it run on every rank of its mesh;
    ``monarch_kernel.fetch_shard`` / ``inspect`` bring a rank's value back."""

    _fake: torch.Tensor
    _mesh: Any
    ref: int
    _dropped: bool

    @staticmethod
    def __new__(cls, fake: torch.Tensor, mesh: Any, ref: int) -> Tensor:
        r = torch.Tensor._make_wrapper_subclass(
            cls,
            fake.size(),
            strides=fake.stride(),
            storage_offset=fake.storage_offset(),
            dtype=fake.dtype,
            device=fake.device,
            layout=fake.layout,
            requires_grad=False,
        )
        r._fake = fake
        r._mesh = mesh
        r.ref = ref
        r._dropped = False
        return r

    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    @classmethod
    def __torch_dispatch__(  # type: ignore[override]
        cls, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, args, kwargs or {})

    @property
    def mesh(self) -> Any:
        """The device mesh the tensor lives on."""
        return self._mesh

    @property
    def dropped(self) -> bool:
        """Whether :meth:`drop` was called."""
        return self._dropped

    def drop(self) -> None:
        """Free the tensor on its ranks now; using it afterwards raises ``TypeError``."""
        if not self._dropped:
            self._dropped = True
            self._mesh.client.drop(self._mesh.rank_tuple, self.ref)

    def __del__(self) -> None:
        try:
            if not self._dropped:
                self._dropped = True
                self._mesh.client.drop(self._mesh.rank_tuple, self.ref)
        except AttributeError:  # a half-made tensor
            pass

    def __repr__(self, *, tensor_contents: Any = None) -> str:  # type: ignore[override]
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (
            f"monarch_kernel.Tensor(mesh={self._mesh!r}, shape={tuple(self.shape)}, "
            f"dtype={self.dtype}{grad})"
        )

    def _repr_html_(self) -> str:
        """The notebook's view: a table of each rank's shape and dtype and, for a small
        tensor, its values there (fetched from every rank; an error shows as such)."""
        return html_table(self)

    def slice_mesh(self, **dims: Any) -> Any:
        """This tensor on the ranks at ``dims`` of its mesh (same local values there)."""
        return state.reducers["slice_mesh"](self, **dims)

    def to_mesh(self, mesh: Any, stream: Any = None) -> Any:
        """An independent copy of this tensor on ``mesh`` (see :func:`monarch_kernel.to_mesh`)."""
        return state.reducers["to_mesh"](self, mesh, stream)

    def reduce(
        self, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None
    ) -> Any:
        """A new mesh tensor: this one reduced across ``dims`` of its mesh (see
        :func:`monarch_kernel.reduce`)."""
        return state.reducers["reduce"](self, dims, reduction, scatter, mesh)

    def reduce_(
        self, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None
    ) -> Any:
        """Reduce in place across ``dims`` (see :func:`monarch_kernel.reduce_`)."""
        return state.reducers["reduce_"](self, dims, reduction, scatter, mesh)


@contextlib.contextmanager
def on_fakes() -> Iterator[None]:
    """Run torch on the controller's fakes: every dispatch mode off (ours included:
    torch runs user modes before an infra mode such as the fake one), the fake mode on."""
    with _disable_current_modes(), fake_mode:
        yield


#: Tensors up to this many elements show their values in the notebook's table.
TABLE_MAX_NUMEL = 16


def html_table(t: Tensor) -> str:
    """A mesh tensor as an HTML table: one row per rank (its coordinates, shape, dtype,
    and values when the tensor is small)."""
    import html

    from monarch_kernel.tensor_engine.errors import RemoteException
    from monarch_kernel.wire.tensor_ops import ALL_SHARDS

    mesh = t._mesh
    shape, dtype = tuple(t.shape), str(t.dtype).removeprefix("torch.")
    values: list[Any] | None = None
    error = ""
    if not t._dropped and t.numel() <= TABLE_MAX_NUMEL:
        try:
            fetched = mesh.client.fetch(mesh.rank_tuple, (t.ref,), ALL_SHARDS).get()
            values = [v[0] for v in fetched.every or []]
        except RemoteException as exc:
            error = f"rank {exc.rank}: {exc.error_type}: {exc.message}"
    head = "".join(f"<th>{html.escape(d)}</th>" for d in mesh.shape.labels)
    rows = []
    for i, point in enumerate(mesh.shape.points()):
        coords = "".join(f"<td>{point[d]}</td>" for d in mesh.shape.labels)
        shown = "" if values is None else html.escape(str(values[i].tolist()))
        rows.append(f"<tr>{coords}<td>{shape}</td><td>{dtype}</td><td>{shown}</td></tr>")
    note = f"<p>error: {html.escape(error)}</p>" if error else ""
    title = html.escape(f"mesh tensor on {mesh!r}")
    return (
        f"<div><b>{title}</b>{note}<table><tr>{head}<th>shape</th><th>dtype</th>"
        f"<th>values</th></tr>{''.join(rows)}</table></div>"
    )


def _device(x: Any) -> Any:
    """Devices read as the ranks' device: ``cuda`` is ``cpu`` here (CPU ranks)."""
    if type(x) is torch.device and x.type != "cpu":
        return _CPU
    return x


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on mesh tensors (see the module docstring); plain local torch when no
    argument is a mesh tensor and no mesh is active."""
    flat, spec = tree_flatten((args, kwargs))
    mesh = None
    local = False
    for x in flat:
        if isinstance(x, Tensor):
            if x._dropped:
                raise bad_arguments("DROPPED", f"{func}: a mesh tensor that was dropped")
            if mesh is None:
                mesh = x._mesh
            elif x._mesh != mesh:
                raise bad_arguments(
                    "WRONG_MESH", f"{func}: tensors on {mesh!r} and {x._mesh!r} (use to_mesh)"
                )
        elif isinstance(x, torch.Tensor):
            local = True
    if mesh is None:
        mesh = state.active()
        if mesh is None:  # no_mesh, or a mode left behind: plain torch
            return func(*args, **kwargs)
        if func.namespace not in _MESH_NAMESPACES:
            # no tensor in, none to make: profiler marks, custom ops run here
            return func(*args, **kwargs)
        if local and func not in _LIFTS:
            # Only local tensors (a fetched value): plain torch, where Monarch raises
            # LOCAL_TENSOR; ``torch.tensor(...)`` (a lift) makes a mesh tensor.
            return func(*args, **kwargs)
    if local:
        for x in flat:
            if (
                isinstance(x, torch.Tensor)
                and not isinstance(x, Tensor)
                and x.numel() > MAX_CONSTANT_NUMEL
            ):
                raise bad_arguments(
                    "LOCAL_TENSOR",
                    f"{func}: a local tensor of shape {tuple(x.shape)} in an op on {mesh!r} "
                    "(make it under the mesh's activate(), or run it under no_mesh)",
                )
    # -- shapes and dtypes on the controller --------------------------------------------
    fakes: list[Any] = []
    inputs: dict[int, Tensor] = {}
    for x in flat:
        if isinstance(x, Tensor):
            fakes.append(x._fake)
            inputs[id(x._fake)] = x
        elif isinstance(x, torch.Tensor):
            with _disable_current_modes():
                fakes.append(fake_mode.from_tensor(x))
        else:
            fakes.append(_device(x))
    versions = [(t, t._fake._version) for t in inputs.values()]
    fargs, fkwargs = tree_unflatten(fakes, spec)
    try:
        with on_fakes():
            fout = func(*fargs, **fkwargs)
    except DataDependentOutputException as exc:
        raise RuntimeError(
            f"{func} needs the values of a mesh tensor, which live on the ranks: "
            "fetch them with monarch_kernel.inspect(t) / fetch_shard(t)"
        ) from exc
    # -- outputs -----------------------------------------------------------------------
    client = mesh.client
    results: list[int] = []
    out_flat, out_spec = tree_flatten(fout)
    wrapped: list[Any] = []
    for f in out_flat:
        if isinstance(f, torch.Tensor):
            same = inputs.get(id(f))
            if same is None:
                same = Tensor(f, mesh, client.new_ref())
            results.append(same.ref)
            wrapped.append(same)
        else:
            wrapped.append(f)
    mutates = tuple(t.ref for t, v in versions if t._fake._version != v)
    wire = [
        Ref(x.ref)
        if isinstance(x, Tensor)
        else (x.detach().clone() if isinstance(x, torch.Tensor) else _device(x))
        for x in flat
    ]
    wargs, wkwargs = tree_unflatten(wire, spec)
    op = CallOp(client.new_seq(), str(func), tuple(wargs), wkwargs, tuple(results), mutates)
    client.issue(mesh.rank_tuple, op)
    return tree_unflatten(wrapped, out_spec)


class ActiveMesh(TorchDispatchMode):
    """The dispatch mode pushed while any mesh is active: ops without mesh-tensor
    inputs (``torch.rand``, ``torch.tensor``) are created on the active mesh."""

    def __torch_dispatch__(
        self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None
    ) -> Any:
        return dispatch(func, args, kwargs or {})


def new_tensor(fake: torch.Tensor, mesh: Any) -> Tensor:
    """A mesh tensor on ``mesh`` for ``fake`` with a fresh ref (its op is the caller's)."""
    return Tensor(fake, mesh, mesh.client.new_ref())
