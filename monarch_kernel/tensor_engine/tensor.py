"""Mesh tensors: :class:`Tensor` (one local tensor per rank of a mesh, described on the
controller by a FakeTensor) and :func:`dispatch`, which every torch op on them, or issued
while a mesh is active, goes through.

Dispatch, per op: check the arguments with Monarch's codes (mesh tensors of one mesh,
``WRONG_MESH``, and of the active stream, ``WRONG_STREAM``; nothing dropped, ``DROPPED``;
no local tensor but a 0-d constant, ``LOCAL_TENSOR``; none lent mutably to another
stream, ``BORROWED``); run the op on the FakeTensors under the controller's
``FakeTensorMode`` (shapes and dtypes: a bad shape raises here, in the cell, and nothing
is sent); find the inputs it writes (by its schema; ``MUTATING_BORROW`` for one a borrow
made read-only); wrap each fake output in a new mesh tensor of the active stream with a
fresh ref (an output that *is* an input stays that input); queue one
:class:`~monarch_kernel.wire.tensor_ops.CallOp` on the mesh's client (what it mutates:
the inputs it writes and every alias of their storages, which a failure poisons). Each tensor
registers with its storage's :class:`~.streams.StorageAliases` (views share one: what
a borrow allows holds for all of them).

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
from monarch_kernel.tensor_engine.streams import (
    DropLocation,
    StorageAliases,
    Stream,
    drop_location,
)
from monarch_kernel.wire.tensor_ops import CallOp, Ref


class _QuietMetaErrors(logging.Filter):
    """A bad shape is reported to the user as the op's exception; torch's fake mode also
    logs it at ERROR with a traceback, which would repeat it in the cell: drop that."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("failed while attempting to run meta")


logging.getLogger("torch._subclasses.fake_tensor").addFilter(_QuietMetaErrors())

#: The controller's fake mode (:func:`fake_mode`) owns every mesh tensor's ``_fake``.
_fake_modes: list[FakeTensorMode] = []


def fake_mode() -> FakeTensorMode:
    """The controller's fake mode, made on first use (making one imports torch._dynamo,
    seconds: a rank importing a module that defines remote functions never pays it)."""
    if not _fake_modes:
        _fake_modes.append(FakeTensorMode(allow_non_fake_inputs=True))
    return _fake_modes[0]


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
    stream: Stream
    _aliases: StorageAliases
    _drop_location: DropLocation | None

    @staticmethod
    def __new__(
        cls, fake: torch.Tensor, mesh: Any, ref: int, stream: Stream | None = None
    ) -> Tensor:
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
        r._drop_location = None
        r.stream = state.active_stream() if stream is None else stream
        aliases = mesh.client.aliases
        storage = fake.untyped_storage()
        found = aliases.get(storage)
        if found is None:
            found = aliases[storage] = StorageAliases()
        found.aliases.add(r)
        r._aliases = found
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
        """Free the tensor, and every view of its storage, on its ranks now; using one
        afterwards raises ``TypeError`` (``DROPPED``, naming where it was dropped)."""
        if self._dropped:
            return
        where = drop_location(self.ref)
        for alias in [*self._aliases.aliases, self]:
            alias._drop_ref(where)

    def _drop_ref(self, where: DropLocation | None) -> None:
        if not self._dropped:
            self._dropped = True
            self._drop_location = where
            self._mesh.client.drop(self._mesh.rank_tuple, self.ref)

    @property
    def _access_permissions(self) -> str:
        return self._aliases.access

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
            f"monarch_kernel.Tensor(mesh={self._mesh!r}, stream={self.stream!r}, "
            f"shape={tuple(self.shape)}, dtype={self.dtype}{grad})"
        )

    def _repr_html_(self) -> str:
        """The notebook's view: a table of each rank's shape and dtype and, for a small
        tensor, its values there (fetched from every rank; an error shows as such)."""
        return html_table(self)

    def backward(self, *args: Any, **kwargs: Any) -> None:
        """Autograd's backward, each op on its forward op's mesh and stream (whatever
        mesh or stream is active now)."""
        with inputs_stream():
            super().backward(*args, **kwargs)

    def cuda(self, *args: Any, **kwargs: Any) -> Tensor:
        """This tensor: ``cuda`` is read as the ranks' device (CPU ranks), where it is."""
        return self

    def slice_mesh(self, **dims: Any) -> Any:
        """This tensor on the ranks at ``dims`` of its mesh (same local values there)."""
        return state.reducers["slice_mesh"](self, **dims)

    def to_mesh(self, mesh: Any, stream: Any = None) -> Any:
        """An independent copy of this tensor on ``mesh`` (see :func:`monarch_kernel.to_mesh`)."""
        return state.reducers["to_mesh"](self, mesh, stream)

    def reduce(
        self,
        dims: Any,
        reduction: str = "sum",
        scatter: bool = False,
        mesh: Any = None,
        out: Any = None,
    ) -> Any:
        """A new mesh tensor: this one reduced across ``dims`` of its mesh (see
        :func:`monarch_kernel.reduce`)."""
        return state.reducers["reduce"](self, dims, reduction, scatter, mesh, out)

    def reduce_(
        self, dims: Any, reduction: str = "sum", scatter: bool = False, mesh: Any = None
    ) -> Any:
        """Reduce in place across ``dims`` (see :func:`monarch_kernel.reduce_`)."""
        return state.reducers["reduce_"](self, dims, reduction, scatter, mesh)


@contextlib.contextmanager
def inputs_stream() -> Iterator[None]:
    """Ops issued on this thread run on the stream of their inputs meanwhile (a backward
    pass: as the forward ops they differentiate did), not the active one."""
    here = state.this_thread
    here.follow_inputs += 1
    try:
        yield
    finally:
        here.follow_inputs -= 1


@contextlib.contextmanager
def on_fakes() -> Iterator[None]:
    """Run torch on the controller's fakes: every dispatch mode off (ours included:
    torch runs user modes before an infra mode such as the fake one), the fake mode on."""
    with _disable_current_modes(), fake_mode():
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


def dropped_error(what: Any, t: Tensor) -> TypeError:
    """``DROPPED``: ``t`` (or a view of its storage) was dropped; says where."""
    where = f"\n{t._drop_location}" if t._drop_location is not None else ""
    return bad_arguments(
        "DROPPED",
        f"{what}: this tensor, or a view of it, was dropped with t.drop() (or its borrow "
        f"was dropped) and is no longer usable{where}",
    )


def check_stream(what: Any, tensors: Any, stream: Any) -> Any:
    """The stream ``tensors`` run on: the active one (``WRONG_STREAM`` for a tensor of
    another), or, in a backward pass (autograd's, or ``grad_generator``'s), their own:
    a backward op runs where its forward op did."""
    for i, t in enumerate(tensors):
        if t.stream is stream:
            continue
        if i == 0 and (
            state.this_thread.follow_inputs or torch._C._current_autograd_node() is not None
        ):
            stream = t.stream
            continue
        if t.stream is not stream:
            raise bad_arguments(
                "WRONG_STREAM",
                f"{what}: a tensor of {t.stream} while {stream} is active (use "
                "`with stream.activate():`, or move it to this stream with borrow)",
            )
    return stream


def check_access(what: Any, read: Any, written: Any = ()) -> None:
    """``BORROWED`` for a tensor of ``read`` lent mutably to another stream;
    ``MUTATING_BORROW`` for one of ``written`` that a borrow makes read-only."""
    for t in read:
        if "r" not in t._aliases.access:
            raise bad_arguments(
                "BORROWED",
                f"{what}: this tensor cannot be read because it is borrowed mutably by "
                "another stream (until that borrow is dropped)",
            )
    for t in written:
        if "w" not in t._aliases.access:
            raise bad_arguments(
                "MUTATING_BORROW",
                f"{what}: this tensor would be mutated by this operator but it is read "
                "only because it is being borrowed (until the borrow is dropped)",
            )


#: op -> the positions and names of the arguments it writes (from its schema)
_WRITES: dict[Any, tuple[tuple[int, str], ...]] = {}


def written(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Tensor]:
    """The mesh tensors ``func`` writes in place (``add_``'s self, an ``out=``), by its
    schema (inside a dispatch no version counter moves)."""
    where = _WRITES.get(func)
    if where is None:
        where = _WRITES[func] = tuple(
            (i, a.name)
            for i, a in enumerate(func._schema.arguments)
            if a.alias_info is not None and a.alias_info.is_write
        )
    out: list[Tensor] = []
    for i, name in where:
        value = args[i] if i < len(args) else kwargs.get(name)
        for x in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(x, Tensor) and all(x is not o for o in out):
                out.append(x)
    return out


def mutated_refs(written: list[Tensor], mesh: Any) -> tuple[int, ...]:
    """The refs an op writing ``written`` on ``mesh`` mutates: theirs and those of every
    other live tensor of ``mesh`` on their storages (views, aliases): when the op fails
    on a rank, they all hold its error there, as what they read is unknown."""
    refs: dict[int, None] = {}
    for t in written:
        refs[t.ref] = None
        for alias in list(t._aliases.aliases):
            if not alias._dropped and alias._mesh == mesh:
                refs[alias.ref] = None
    return tuple(refs)


def dispatch(func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """Run ``func`` on mesh tensors (see the module docstring); plain local torch when no
    argument is a mesh tensor and no mesh is active."""
    cancel = state.this_thread.cancel
    if cancel is not None and cancel.is_set():
        raise state.Cancelled(f"{func}: the backward pass of a stopped grad_generator")
    flat, spec = tree_flatten((args, kwargs))
    mesh = None
    local = False
    tensors: list[Tensor] = []
    for x in flat:
        if isinstance(x, Tensor):
            if x._dropped:
                raise dropped_error(func, x)
            if mesh is None:
                mesh = x._mesh
            elif x._mesh != mesh:
                raise bad_arguments(
                    "WRONG_MESH", f"{func}: tensors on {mesh!r} and {x._mesh!r} (use to_mesh)"
                )
            tensors.append(x)
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
    elif local:
        for x in flat:
            if isinstance(x, torch.Tensor) and not isinstance(x, Tensor) and x.dim() > 0:
                raise bad_arguments(
                    "LOCAL_TENSOR",
                    f"{func}: a local tensor of shape {tuple(x.shape)} in an op on {mesh!r}: "
                    "a local (non-distributed) tensor used while a device mesh is active "
                    "(make it under the mesh's activate(), or use `with no_mesh.activate():` "
                    "for local compute)",
                )
    stream = check_stream(func, tensors, state.active_stream())
    check_access(func, tensors)
    # -- shapes and dtypes on the controller --------------------------------------------
    fakes: list[Any] = []
    inputs: dict[int, Tensor] = {}
    for x in flat:
        if isinstance(x, Tensor):
            fakes.append(x._fake)
            inputs[id(x._fake)] = x
        elif isinstance(x, torch.Tensor):
            with _disable_current_modes():
                fakes.append(fake_mode().from_tensor(x))
        else:
            fakes.append(_device(x))
    fargs, fkwargs = tree_unflatten(fakes, spec)
    try:
        with on_fakes():
            fout = func(*fargs, **fkwargs)
    except DataDependentOutputException as exc:
        raise RuntimeError(
            f"{func} needs the values of a mesh tensor, which live on the ranks: "
            "fetch them with monarch_kernel.inspect(t) / fetch_shard(t)"
        ) from exc
    mutated = written(func, args, kwargs)
    if mutated:
        check_access(func, (), mutated)
    # -- outputs -----------------------------------------------------------------------
    client = mesh.client
    results: list[int] = []
    out_flat, out_spec = tree_flatten(fout)
    wrapped: list[Any] = []
    for f in out_flat:
        if isinstance(f, torch.Tensor):
            same = inputs.get(id(f))
            if same is None:
                same = Tensor(f, mesh, client.new_ref(), stream)
            results.append(same.ref)
            wrapped.append(same)
        else:
            wrapped.append(f)
    mutates = mutated_refs(mutated, mesh)
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


def new_tensor(fake: torch.Tensor, mesh: Any, stream: Stream | None = None) -> Tensor:
    """A mesh tensor on ``mesh`` (and ``stream``: the active one by default) for
    ``fake`` with a fresh ref (its op is the caller's)."""
    return Tensor(fake, mesh, mesh.client.new_ref(), stream)
