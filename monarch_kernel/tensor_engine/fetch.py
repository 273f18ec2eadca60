"""Values back to the controller: :func:`fetch_shard` and :func:`inspect`."""

from __future__ import annotations

from typing import Any

from torch.utils._pytree import tree_flatten, tree_unflatten

from monarch_kernel.calls.future import Future
from monarch_kernel.tensor_engine.client import Fetched
from monarch_kernel.tensor_engine.tensor import Tensor, check_access, dropped_error


def shard_rank(mesh: Any, shard: dict[str, int] | None, coords: dict[str, int]) -> int:
    """The global rank at ``shard`` / ``coords`` of ``mesh`` (every dim; none: its first)."""
    where = dict(shard or {}, **coords)
    if not where:
        return int(mesh.rank_tuple[0])
    labels = mesh.shape.labels
    missing = [d for d in labels if d not in where]
    if missing:
        raise ValueError(f"Missing key(s) {missing}: need all of {list(labels)} to pick a shard")
    extra = [d for d in where if d not in labels]
    if extra:
        raise ValueError(f"{extra} are not dims of {mesh!r} (dims {list(labels)})")
    return int(mesh.rank_tuple[mesh.shape.index_of(where)])


def fetch_shard(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Future[Any]:
    """A :class:`~monarch_kernel.calls.future.Future` of ``tree`` with each mesh tensor
    replaced by its value (a CPU tensor) on the rank at ``coords`` (every dim of the mesh;
    none: its first rank). It completes once every rank of the mesh ran every op issued
    before it; it fails with ``RemoteException`` if any rank holds an error for one of the
    fetched tensors."""
    flat, spec = tree_flatten(tree)
    mesh = None
    refs: list[int] = []
    for x in flat:
        if isinstance(x, Tensor):
            if x._dropped:
                raise dropped_error("fetch_shard", x)
            check_access("fetch_shard", (x,))
            if mesh is None:
                mesh = x._mesh
            elif x._mesh != mesh:
                raise ValueError(f"fetch_shard: tensors on {mesh!r} and {x._mesh!r}")
            refs.append(x.ref)
    if mesh is None:
        return Future._resolved(tree)
    rank = shard_rank(mesh, shard, coords)
    fut = mesh.client.fetch(mesh.rank_tuple, tuple(refs), rank)

    def build(fetched: Fetched) -> Any:
        values = iter(fetched.values)
        return tree_unflatten([next(values) if isinstance(x, Tensor) else x for x in flat], spec)

    out: Future[Any] = Future(lambda _: build(fut.get()), mesh.requester.waiter)
    fut.add_done_callback(lambda _: _complete(out))
    return out


def _complete(fut: Future[Any]) -> None:
    fut.set_result(None)


def inspect(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """``fetch_shard(tree, shard, **coords).result()``: the values, now."""
    return fetch_shard(tree, shard, **coords).result()


def show(tree: Any, shard: dict[str, int] | None = None, **coords: int) -> Any:
    """Monarch's ``show``: :func:`inspect` the value at ``coords`` and show it here, as
    an image through ``torchshow`` when it is installed (Monarch needs it), else as text
    (IPython's display in a notebook, ``print`` in a script). Runs under ``no_mesh``,
    so it works inside an active region."""
    from monarch_kernel.tensor_engine.mesh import no_mesh

    value = inspect(tree, shard, **coords)
    with no_mesh.activate():
        try:
            import torchshow  # type: ignore[import-not-found]
        except ImportError:
            torchshow = None
        if torchshow is not None:
            return torchshow.show(value)
        try:
            from IPython import get_ipython
        except ImportError:
            get_ipython = None
        if get_ipython is not None and get_ipython() is not None:
            from IPython.display import display

            display(value)
        else:
            print(value)
    return None
