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


def load_ipython_extension(ipython: Any) -> None:  # pragma: no cover - thin shim
    """``%load_ext monarch_kernel``: register the magics in a plain IPython kernel."""
    from monarch_kernel.kernel.magics import load_ipython_extension as _load

    _load(ipython)
