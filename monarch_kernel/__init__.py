"""monarch_kernel: a Jupyter kernel that is the single controller of a cluster of ranks.

The public actor API lives in :mod:`monarch_kernel.actor`. Inside a rank,
:func:`report` sends metrics (``step``, ``loss`` ...) to the controller.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.1.0"


def report(**metrics: float) -> None:
    """Send metrics from inside a rank to the controller (and its dashboard).

    Outside a rank this is a no-op, so the same training code runs in a plain script.
    """
    from monarch_kernel.rank import context

    context.report(metrics)


def share(tensor: Any) -> Any:  # torch is imported lazily (a TensorRef)
    """Inside a rank: keep ``tensor`` here and return a :class:`TensorRef` that another
    rank turns into a copy with ``ref.get()``, pulled directly from this rank (shared
    memory on the same machine, ZeroMQ across machines).

    ``get()`` returns the owner's tensor as it is when ``get()`` runs, whatever the path:
    this rank's in-place changes after ``share()`` are seen (``share`` keeps the tensor
    itself, not a snapshot; a large CPU tensor has its storage moved into shared memory
    in place). The receiver's tensor is a private copy: its writes never reach here."""
    from monarch_kernel.rank.dataplane.plane import share as _share

    return _share(tensor)


def attach(name: str | None = None, *, force: bool = False, path: str | None = None) -> Any:
    """Take over the ``--detachable`` mesh ``name`` that another kernel (since gone, or
    with ``force``: still there, and told) left running: returns its ``ProcMesh``,
    with the ranks' namespaces, failure policy and ``--setup`` cells as they were.
    ``%mesh attach NAME`` does the same in a notebook and binds ``NAME``."""
    from monarch_kernel.actor.attach import attach as _attach

    return _attach(name, force=force, path=path)


# -- the tensor engine (Monarch's top-level names; torch is imported on first use) ------


def fetch_shard(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """A future of ``tree`` with each mesh tensor replaced by its value on the rank at
    ``coords`` (every dim of its mesh; none: the mesh's first rank). It completes once
    every rank of the mesh ran every op issued before it, and fails with
    ``monarch_kernel.mesh_controller.RemoteException`` if any rank holds an error for a
    fetched tensor. ``.get()`` / ``.result()`` wait for it."""
    from monarch_kernel.tensor_engine.fetch import fetch_shard as _fetch_shard

    return _fetch_shard(tree, shard, **coords)


def inspect(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """The values of ``tree``'s mesh tensors on the rank at ``coords``, now:
    ``fetch_shard(tree, shard, **coords).result()``."""
    from monarch_kernel.tensor_engine.fetch import inspect as _inspect

    return _inspect(tree, shard, **coords)


def show(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """Show the values of ``tree``'s mesh tensors on the rank at ``coords``: as an image
    through ``torchshow`` when installed (Monarch's ``show``), else as text."""
    from monarch_kernel.tensor_engine.fetch import show as _show

    return _show(tree, shard, **coords)


def reduce(
    tensors: Any,
    dims: Any = (),
    reduction: str = "sum",
    scatter: bool = False,
    mesh: Any = None,
    out: Any = None,
) -> Any:
    """Mesh tensors combined across the named ``dims`` of their mesh (all by default):
    ``sum``, ``avg``, ``product``, ``min``, ``max``, ``band``, ``bor``, ``bxor`` (an
    all-reduce), ``stack`` (an all-gather into a new leading dim); ``scatter=True``
    reduce-scatters (``stack``: all-to-all) along dim 0, whose size is the dim's.
    ``out``: a mesh tensor to write the result into. Runs over gloo on CPU ranks."""
    from monarch_kernel.tensor_engine.reductions import reduce as _reduce

    return _reduce(tensors, dims, reduction, scatter, mesh, out)


def reduce_(
    tensors: Any, dims: Any = (), reduction: str = "sum", scatter: bool = False, mesh: Any = None
) -> Any:
    """``reduce`` in place: each mesh tensor is overwritten with its result."""
    from monarch_kernel.tensor_engine.reductions import reduce_ as _reduce_

    return _reduce_(tensors, dims, reduction, scatter, mesh)


def remote(fn: Any = None, *, propagate: Any = None) -> Any:
    """A function (or ``"module.path"`` of one) that runs on every rank of a mesh on mesh
    tensors and returns mesh tensors; ``propagate`` says what it returns (a function run
    on FakeTensors on the controller, ``None`` for ``fn`` itself, ``"inspect"`` for
    nothing). Usable as ``@remote`` and ``@remote(propagate=...)``."""
    from monarch_kernel.tensor_engine.remote_functions import remote as _remote

    return _remote(fn, propagate=propagate)


def slice_mesh(tree: Any, **dims: Any) -> Any:
    """Each mesh tensor of ``tree`` on the ranks at ``dims`` of its mesh (the same local
    tensors there)."""
    from monarch_kernel.tensor_engine.moves import slice_mesh as _slice_mesh

    return _slice_mesh(tree, **dims)


def to_mesh(tree: Any, mesh: Any, stream: Any = None) -> Any:
    """Each mesh tensor of ``tree`` copied onto ``mesh`` (a mesh of the same process
    mesh): dims matched by name, those the source lacks broadcast; data moves between
    ranks over the mesh's process group."""
    from monarch_kernel.tensor_engine.moves import to_mesh as _to_mesh

    return _to_mesh(tree, mesh, stream)


def call_on_shard_and_fetch(
    fn: Any, *args: Any, shard: dict[str, int] | None = None, **kwargs: Any
) -> Any:
    """Run ``fn`` (a remote function, a function or an import path) on the one rank at
    ``shard`` and return a future of its value (mesh-tensor arguments read as that
    rank's local tensors)."""
    from monarch_kernel.tensor_engine.remote_functions import (
        call_on_shard_and_fetch as _call_on_shard_and_fetch,
    )

    return _call_on_shard_and_fetch(fn, *args, shard=shard, **kwargs)


def get_active_mesh() -> Any:
    """The innermost active device mesh (``ValueError`` when none is active)."""
    from monarch_kernel.tensor_engine.mesh import get_active_mesh as _get_active_mesh

    return _get_active_mesh()


#: Monarch's top-level names served by the tensor engine (torch loads on first use);
#: ``monarch_kernel.random`` is Monarch's ``monarch.random``.
_TENSOR_ENGINE = frozenset(
    {
        "no_mesh",
        "Tensor",
        "DeviceMesh",
        "Stream",
        "get_active_stream",
        "grad_generator",
        "grad_function",
        "OpaqueRef",
        "OpaqueObject",
        "opaque_method",
        "OpaqueModule",
        "remote_autograd_function",
    }
)


def __getattr__(name: str) -> Any:
    # ``no_mesh``, ``Tensor`` and ``mesh_controller`` load torch: on first use only.
    if name in _TENSOR_ENGINE:
        from monarch_kernel import tensor_engine

        return getattr(tensor_engine, name)
    if name in ("builtins", "random"):  # Monarch's monarch.builtins, monarch.random
        import importlib

        path = (
            "monarch_kernel.builtins"
            if name == "builtins"
            else "monarch_kernel.tensor_engine.random"
        )
        return importlib.import_module(path)
    if name == "mesh_controller":
        import importlib

        return importlib.import_module("monarch_kernel.mesh_controller")
    raise AttributeError(f"module 'monarch_kernel' has no attribute {name!r}")


def load_ipython_extension(ipython: Any) -> None:  # pragma: no cover - thin shim
    """``%load_ext monarch_kernel``: register the magics in a plain IPython kernel."""
    from monarch_kernel.kernel.magics import load_ipython_extension as _load

    _load(ipython)
