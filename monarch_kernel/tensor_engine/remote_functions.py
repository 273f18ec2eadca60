"""``remote``: a function run on every rank of a mesh on mesh tensors (each rank its
local ones), returning mesh tensors whose shapes come from a *propagator* run here."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.calls.future import Future
from monarch_kernel.calls.value_mesh import ValueMesh
from monarch_kernel.tensor_engine import state
from monarch_kernel.tensor_engine.errors import bad_arguments
from monarch_kernel.tensor_engine.fetch import shard_rank
from monarch_kernel.tensor_engine.tensor import Tensor, new_tensor, on_fakes
from monarch_kernel.wire.tensor_ops import ALL_SHARDS, CallOp, Ref, RemoteFunction


class Remote:
    """A function that runs on the ranks (see :func:`remote`). Calling it issues one op
    on the mesh of its mesh-tensor arguments (else on the active mesh) and returns mesh
    tensors shaped as ``propagate`` says."""

    def __init__(self, fn: Callable[..., Any] | str, propagate: Any = None):
        self._fn = fn
        self._propagate = propagate
        self._wire: RemoteFunction | None = None
        self.__name__ = fn if isinstance(fn, str) else getattr(fn, "__name__", "remote")
        self.__doc__ = None if isinstance(fn, str) else fn.__doc__

    def _function(self) -> RemoteFunction:
        if self._wire is None:
            if isinstance(self._fn, str):
                self._wire = RemoteFunction(path=self._fn)
            else:
                import cloudpickle

                self._wire = RemoteFunction(pickled=cloudpickle.dumps(self._fn))
        return self._wire

    def _propagator(self) -> Callable[..., Any] | None:
        p = self._propagate
        if p == "inspect":
            return None
        if callable(p):
            return p  # type: ignore[no-any-return]
        if p in (None, "cached", "mocked") and callable(self._fn):
            return self._fn  # run on the fakes (pure torch functions)
        if isinstance(self._fn, str) and p in (None, "cached"):
            return _import(self._fn)
        raise ValueError(f"remote({self.__name__!r}): unknown propagate={p!r}")

    def _mesh_of(self, flat: list[Any]) -> Any:
        mesh = None
        for x in flat:
            if isinstance(x, Tensor):
                if x._dropped:
                    raise bad_arguments("DROPPED", f"{self.__name__}: a dropped mesh tensor")
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
        return mesh

    def call_on_shard_and_fetch(
        self, *args: Any, shard: dict[str, int] | None = None, **kwargs: Any
    ) -> Future[Any]:
        """Run on the one rank at ``shard`` (coordinates of the mesh; none: its first
        rank) and fetch what it returns, any picklable value."""
        flat, spec = tree_flatten((args, kwargs))
        mesh = self._mesh_of(flat)
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
        mesh = self._mesh_of(flat)
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

    def call_one(self, *args: Any, **kwargs: Any) -> Future[Any]:
        """:meth:`call` on a mesh of one rank: a future of its value."""
        mesh = self._mesh_of(tree_flatten((args, kwargs))[0])
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
        mesh = self._mesh_of(flat)
        client = mesh.client
        wire = [Ref(x.ref) if isinstance(x, Tensor) else x for x in flat]
        wargs, wkwargs = tree_unflatten(wire, spec)
        client.issue(
            mesh.rank_tuple, CallOp(client.new_seq(), self._function(), tuple(wargs), wkwargs, ())
        )

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        flat, spec = tree_flatten((args, kwargs))
        mesh = self._mesh_of(flat)
        propagate = self._propagator()
        out: Any = None
        inputs = [x for x in flat if isinstance(x, Tensor)]
        versions = [x._fake._version for x in inputs]
        if propagate is not None:
            fakes = [x._fake if isinstance(x, Tensor) else x for x in flat]
            fargs, fkwargs = tree_unflatten(fakes, spec)
            with on_fakes():
                out = propagate(*fargs, **fkwargs)
        # what the propagator wrote in place, the function writes on the ranks
        mutates = tuple(x.ref for x, v in zip(inputs, versions) if x._fake._version != v)
        client = mesh.client
        results: list[int] = []
        out_flat, out_spec = tree_flatten(out)
        wrapped = []
        for f in out_flat:
            if isinstance(f, torch.Tensor):
                t = new_tensor(f, mesh)
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
