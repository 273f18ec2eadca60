"""``remote``: a function run on every rank of a mesh on mesh tensors (each rank its
local ones), returning mesh tensors whose shapes come from a *propagator* run here."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.calls.future import Future, check_port, forward_to_port
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.fetch import shard_rank
from monarch_kernel.tensor_engine.process_groups import RemoteProcessGroup
from monarch_kernel.tensor_engine.tensor import (
    Tensor,
    check_access,
    check_stream,
    dropped_error,
    mutated_refs,
    new_tensor,
    on_fakes,
)
from monarch_kernel.wire import serialize
from monarch_kernel.wire.output_patterns import OutputPattern, StorageOwner
from monarch_kernel.wire.tensor_ops import ALL_SHARDS, CallOp, Ref, RemoteFunction


class Remote:
    """A function that runs on the ranks (see :func:`remote`). Calling it issues one op
    on the mesh of its mesh-tensor arguments (else on the active mesh) and returns mesh
    tensors shaped as ``propagate`` says."""

    def __init__(self, fn: Callable[..., Any] | str, propagate: Any = None):
        self._fn = fn
        #: the function a rank runs when it imports this remote by its path
        self.remote_impl = fn
        self._propagate = propagate
        self._wire: RemoteFunction | None = None
        #: cached propagation: argument signature -> the outputs' pattern
        self._patterns: dict[Any, Any] = {}
        self.__name__ = fn if isinstance(fn, str) else getattr(fn, "__name__", "remote")
        self.__doc__ = None if isinstance(fn, str) else fn.__doc__

    def _function(self) -> RemoteFunction:
        """How the function travels: by import path when the ranks can import it (a
        path, or a module-level function this remote decorates), else by value."""
        if self._wire is None:
            fn = self._fn
            path = fn if isinstance(fn, str) else _importable_path(self)
            if path is not None:
                self._wire = RemoteFunction(path=path)
            else:
                # by value, keeping the file it was defined in (the ranks' tracebacks
                # show its source lines)
                payload, buffers = serialize.dumps(fn, f"remote function {self.__name__}")
                if buffers:  # large tensors in its closure: all in the one payload
                    import cloudpickle

                    payload = cloudpickle.dumps(fn)
                self._wire = RemoteFunction(pickled=payload)
        return self._wire

    def _propagator(self) -> Callable[..., Any] | str | None:
        """What gives the outputs' shapes: a function run on the fakes, ``"cached"``
        (one real run on the mesh's first rank, remembered per argument signature), or
        None (no mesh tensors out)."""
        p = self._propagate
        if p == "inspect":
            return None
        if callable(p):
            return p  # type: ignore[no-any-return]
        if p == "mocked" and callable(self._fn):
            return self._fn  # run on the fakes (a pure torch function)
        if p in (None, "cached"):
            return "cached"
        raise ValueError(f"remote({self.__name__!r}): unknown propagate={p!r}")

    def _cached(self, mesh: Any, flat: list[Any], spec: Any) -> Any:
        """Monarch's cached propagation: the function's outputs as fakes, from one real
        run on the mesh's first rank per signature of the arguments (tensors by shape,
        dtype, strides, storage offset and which of them share a storage; other values
        by ``repr``). An output that is a view of an argument (or of an earlier output)
        on that run is a view of its fake here, at the same offset: the mesh tensors
        made of them are its aliases."""
        key = (str(spec), _signature(flat))
        if any(isinstance(x, RemoteProcessGroup) for x in flat):
            raise ValueError(
                f"remote({self.__name__!r}) takes a process group: give it a propagate "
                "function (e.g. propagate=lambda t, pg: t) or propagate='inspect'; cached "
                "propagation runs it on one rank, where its collectives would wait forever"
            )
        global _hit
        pattern = self._patterns.get(key, _NOT_CACHED)
        if pattern is not _NOT_CACHED:
            _hit += 1
        else:
            args, kwargs = tree_unflatten(flat, spec)
            runner = Remote(_PATTERN_RUNNER, "inspect")
            pattern = runner.call_on_shard_and_fetch(self._function(), *args, **kwargs).get()
            self._patterns[key] = pattern
        return _fakes_of(pattern, flat)

    def _mesh_of(self, flat: list[Any]) -> tuple[Any, Any]:
        """The mesh and stream the call runs on: those of its mesh-tensor arguments
        (checked as any op's), else the active ones."""
        mesh = None
        for x in flat:
            if isinstance(x, Tensor):
                if x._dropped:
                    raise dropped_error(self.__name__, x)
                if mesh is None:
                    mesh = x._mesh
                elif x._mesh != mesh:
                    raise bad_arguments("WRONG_MESH", f"{self.__name__}: tensors on two meshes")
        if mesh is None:
            mesh = state.active()
            if mesh is None:
                raise ValueError(
                    "Calling a 'remote' monarch function requires an active proc_mesh "
                    "(with procs.activate(): ...)"
                )
        tensors = [x for x in flat if isinstance(x, Tensor)]
        stream = check_stream(self.__name__, tensors, state.active_stream())
        check_access(self.__name__, tensors)
        return mesh, stream

    def call_on_shard_and_fetch(
        self, *args: Any, shard: dict[str, int] | None = None, **kwargs: Any
    ) -> Future[Any]:
        """Run on the one rank at ``shard`` (coordinates of the mesh; none: its first
        rank) and fetch what it returns, any picklable value."""
        flat, spec = tree_flatten((args, kwargs))
        mesh, stream = self._mesh_of(flat)
        rank = shard_rank(mesh, shard, {})
        client = mesh.client
        ref = client.new_ref()
        wire = [Ref(x.ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = tree_unflatten(wire, spec)
        op = CallOp(client.new_seq(), self._function(), tuple(wargs), wkwargs, (ref,), whole=True)
        client.issue((rank,), op)
        fetched = client.fetch((rank,), (ref,), rank)
        client.drop((rank,), ref)  # forgotten with the next batch
        out: Future[Any] = Future(lambda _: fetched.get().values[0], mesh.requester.waiter)
        fetched.add_done_callback(lambda _: _complete(out))
        return out

    # -- the endpoint adverbs (plain values back, no mesh tensors) ---------------------
    def call(self, *args: Any, **kwargs: Any) -> Future[ValueMesh[Any]]:
        """Run on every rank of the mesh; a future of a ``ValueMesh`` of what each
        returned (mesh-tensor arguments read as each rank's local tensors)."""
        flat, spec = tree_flatten((args, kwargs))
        mesh, stream = self._mesh_of(flat)
        client = mesh.client
        ref = client.new_ref()
        wire = [Ref(x.ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = tree_unflatten(wire, spec)
        op = CallOp(client.new_seq(), self._function(), tuple(wargs), wkwargs, (ref,), whole=True)
        client.issue(mesh.rank_tuple, op)
        fetched = client.fetch(mesh.rank_tuple, (ref,), ALL_SHARDS)
        client.drop(mesh.rank_tuple, ref)
        shape = mesh.shape

        def finish(_: Any) -> ValueMesh[Any]:
            every = fetched.get().every or []
            return ValueMesh(shape, [values[0] for values in every])

        out: Future[ValueMesh[Any]] = Future(finish, mesh.requester.waiter)
        fetched.add_done_callback(lambda _: _complete(out))
        return out

    def stream(self, *args: Any, **kwargs: Any) -> Iterator[Future[Any]]:
        """Run on every rank of the mesh; one future per rank of what it returned, in
        the mesh's rank order (they complete together: a fetch waits for every rank)."""
        mesh, _ = self._mesh_of(tree_flatten((args, kwargs))[0])
        values = self.call(*args, **kwargs)
        futures = [_nth(values, i, mesh.requester.waiter) for i in range(len(mesh.rank_tuple))]
        return iter(futures)

    def rref(self, *args: Any, **kwargs: Any) -> Any:
        """Mesh tensors of what the function returns (as calling it does)."""
        return self(*args, **kwargs)

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """:meth:`call` on a mesh of one rank: a future of its value."""
        mesh, _ = self._mesh_of(tree_flatten((args, kwargs))[0])
        if len(mesh.rank_tuple) != 1:
            raise ValueError(
                f"call_one needs a mesh of one rank; {mesh!r} has {len(mesh.rank_tuple)}"
            )
        return self.call_on_shard_and_fetch(*args, **kwargs)

    def choose(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """Run on one rank of the mesh (its first) and return a future of its value."""
        return self.call_on_shard_and_fetch(*args, **kwargs)

    def broadcast(self, *args: Any, **kwargs: Any) -> None:
        """Run on every rank of the mesh; nothing comes back (in order with other ops)."""
        flat, spec = tree_flatten((args, kwargs))
        mesh, stream = self._mesh_of(flat)
        client = mesh.client
        wire = [Ref(x.ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = tree_unflatten(wire, spec)
        client.issue(
            mesh.rank_tuple, CallOp(client.new_seq(), self._function(), tuple(wargs), wkwargs, ())
        )

    def _send(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any] | None = None,
        port: Any = None,
        selection: str = "all",
    ) -> None:
        """Monarch's ``send(remote_fn, args, kwargs, port=None, selection="all")``: run
        without waiting, on every rank of the mesh (``"all"``) or on its first
        (``"choose"``). Without ``port`` nothing comes back (as :meth:`broadcast`); with
        a :class:`~monarch_kernel.actor.channels.Port`, each rank's return value is sent
        to it (``port.exception`` with the error when the function failed or read a
        failed tensor), once every rank ran it."""
        if selection not in ("all", "choose"):
            raise ValueError(f"selection must be 'all' or 'choose', got {selection!r}")
        args, kwargs = tuple(args), dict(kwargs or {})
        if port is None:
            if selection == "all":
                self.broadcast(*args, **kwargs)
            else:
                self.call_on_shard_and_fetch(*args, **kwargs)
            return
        check_port(port)
        if selection == "choose":
            futures = [self.call_on_shard_and_fetch(*args, **kwargs)]
        else:
            futures = list(self.stream(*args, **kwargs))
        forward_to_port(futures, port)

    send = _send

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        mesh, stream = self._mesh_of(flat)
        propagate = self._propagator()
        out: Any = None
        inputs = [x for x in flat if isinstance(x, Tensor)]
        versions = [x._fake._version for x in inputs]
        if propagate == "cached":
            out = self._cached(mesh, flat, spec)
        elif propagate is not None:
            assert callable(propagate)
            fakes = [x._fake if isinstance(x, Tensor) else x for x in flat]
            fargs, fkwargs = tree_unflatten(fakes, spec)
            with on_fakes():
                out = propagate(*fargs, **fkwargs)
        # what the propagator wrote in place, the function writes on the ranks
        mutated = [x for x, v in zip(inputs, versions) if x._fake._version != v]
        check_access(self.__name__, (), mutated)
        mutates = mutated_refs(mutated, mesh)
        client = mesh.client
        results: list[int] = []
        out_flat, out_spec = tree_flatten(out)
        wrapped = []
        given = {id(x._fake) for x in inputs}
        for f in out_flat:
            if isinstance(f, torch.Tensor):
                if id(f) in given:  # an argument itself: a new mesh tensor aliasing it
                    with on_fakes():
                        f = torch.ops.aten.alias.default(f)
                t = new_tensor(f, mesh, stream)
                results.append(t.ref)
                wrapped.append(t)
            else:
                wrapped.append(f)
        wire = [Ref(x.ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = tree_unflatten(wire, spec)
        op = CallOp(
            client.new_seq(), self._function(), tuple(wargs), wkwargs, tuple(results), mutates
        )
        client.issue(mesh.rank_tuple, op)
        return tree_unflatten(wrapped, out_spec)

    def __repr__(self) -> str:
        return f"<remote {self.__name__}>"


#: The rank-side function of cached propagation (named by path: the ranks import it).
_PATTERN_RUNNER = "monarch_kernel.rank.tensors.propagation.output_patterns"
_NOT_CACHED = object()
#: How many calls cached propagation answered from its cache (Monarch's counter).
_hit = 0


def _signature(flat: list[Any]) -> tuple[Any, ...]:
    """The arguments as cached propagation tells calls apart: a mesh tensor by its shape,
    dtype, strides, storage offset and the first argument sharing its storage (the
    outputs' patterns name the arguments whose storage they use); others by ``repr``."""
    first: dict[Any, int] = {}
    out: list[Any] = []
    for i, x in enumerate(flat):
        if isinstance(x, Tensor):
            fake = x._fake
            owner = first.setdefault(fake.untyped_storage(), i)
            out.append((tuple(x.shape), x.dtype, x.stride(), fake.storage_offset(), owner))
        else:
            out.append(repr(x))
    return tuple(out)


def _fakes_of(pattern: Any, flat: list[Any]) -> Any:
    """The fakes of a cached call's outputs: ``pattern`` with each
    :class:`OutputPattern` replaced by a fake on its storage: a new one, or that of the
    argument of ``flat`` or the earlier output it names."""
    leaves, spec = tree_flatten(pattern, is_leaf=lambda x: isinstance(x, OutputPattern))
    made: list[torch.Tensor] = []
    out: list[Any] = []
    with on_fakes():
        for p in leaves:
            if not isinstance(p, OutputPattern):
                out.append(p)
                continue
            dtype = getattr(torch, p.dtype)
            base: Any = None
            if p.owner is StorageOwner.ARGUMENT:
                arg = flat[p.index]
                base = arg._fake if isinstance(arg, Tensor) else None
            elif p.owner is StorageOwner.OUTPUT:
                base = made[p.index]
            if base is not None and not _fits(base, p, dtype):
                base = None  # that storage differs here (a rank's own layout): a copy
            if base is None:  # its own storage (or a local constant's: a copy here)
                base = torch.empty((p.storage_numel,), dtype=dtype)
            made.append(_view(base, p, dtype))
            out.append(made[-1])
    return tree_unflatten(out, spec)


def _fits(base: torch.Tensor, p: OutputPattern, dtype: torch.dtype) -> bool:
    """Whether ``p``'s elements lie inside ``base``'s storage."""
    if any(n == 0 for n in p.size):
        return True
    last = p.storage_offset + sum((n - 1) * st for n, st in zip(p.size, p.stride))
    return last < base.untyped_storage().nbytes() // dtype.itemsize


def _view(base: torch.Tensor, p: OutputPattern, dtype: torch.dtype) -> torch.Tensor:
    """A fake of ``p``'s shape on ``base``'s storage at ``p``'s offset (a view when the
    dtypes agree; else a tensor set on that storage)."""
    if base.dtype == dtype:
        return base.as_strided(p.size, p.stride, p.storage_offset)
    return torch.empty((0,), dtype=dtype).set_(
        base.untyped_storage(), p.storage_offset, p.size, p.stride
    )


def _importable_path(r: Remote) -> str | None:
    """``module.name`` of the function ``r`` decorates when that name is ``r`` in an
    importable module (not ``__main__``, not a notebook cell), else None."""
    import sys

    fn = r._fn
    module = getattr(fn, "__module__", None)
    name = getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or "<" in name or "." in name:
        return None
    mod = sys.modules.get(module)
    if mod is None or getattr(mod, "__file__", None) is None or getattr(mod, name, None) is not r:
        return None
    return f"{module}.{name}"


def _nth(values: Future[ValueMesh[Any]], i: int, waiter: Any) -> Future[Any]:
    """A future of the ``i``-th value of ``values`` (done when it is)."""

    def get(_: Any) -> Any:
        return values.get().values()[i]

    one: Future[Any] = Future(get, waiter)
    values.add_done_callback(lambda _: _complete(one))
    return one


def _complete(fut: Future[Any]) -> None:
    fut.set_result(None)


def call_on_shard_and_fetch(
    fn: Any, *args: Any, shard: dict[str, int] | None = None, **kwargs: Any
) -> Future[Any]:
    """Run ``fn`` (a :class:`Remote`, a function or an import path) on the one rank at
    ``shard`` of the mesh of its mesh-tensor arguments (else the active mesh), its mesh
    tensors read as that rank's local tensors, and return a future of its value."""
    remote_fn = fn if isinstance(fn, Remote) else Remote(fn, "inspect")
    return remote_fn.call_on_shard_and_fetch(*args, shard=shard, **kwargs)


def _import(path: str) -> Callable[..., Any]:
    import importlib

    module, _, attr = path.rpartition(".")
    fn: Callable[..., Any] = getattr(importlib.import_module(module), attr)
    return fn


def remote(fn: Any = None, *, propagate: Any = None) -> Any:
    """A :class:`Remote` of ``fn`` (a function, or the import path of one on the ranks).
    As a decorator: ``@remote`` or ``@remote(propagate=lambda x: x)``. ``propagate``
    says what it returns, run on FakeTensors here: a function of the same arguments;
    ``None``/``"cached"``: ``fn`` itself on the fakes (a pure torch function);
    ``"inspect"``: no mesh tensors (it returns None here)."""
    if fn is None:
        return lambda f: Remote(f, propagate)
    return Remote(fn, propagate)
