"""Which mesh, and which of its ranks, a magic line means.

A magic names its mesh as ``NAME`` or as an expression of the notebook's
(``NAME.slice(gpus=0)``, an actor mesh); ``--ranks`` then picks flat positions of it.
Every way this can go wrong is a one-line ``UsageError`` that says what to do.
"""

from __future__ import annotations

from dataclasses import dataclass

from IPython.core.error import UsageError

from monarch_kernel.actor import ActorMesh, ProcMesh
from monarch_kernel.actor.meshes import procs_of
from monarch_kernel.controller.detach.release import released_why
from monarch_kernel.controller.mesh import registry
from monarch_kernel.rank.context import UserNamespace
from monarch_kernel.shape import Shape, SliceError, parse_ranks


def live_hint() -> str:
    """The end of a "no such mesh" message: the live meshes, or how to make one."""
    live = registry.names()
    if live:
        return f"live meshes: {', '.join(live)}"
    return "create one with %mesh NAME --gpus 4"


def stopped_error(name: str) -> UsageError:
    """The error for a magic on the stopped mesh ``name`` (or one another kernel took)."""
    why = released_why(name)
    if why is not None:
        return UsageError(f"mesh {name!r} {why}; it runs on there, not in this kernel")
    return UsageError(f"mesh {name!r} is stopped; create it again with %mesh {name} --gpus N")


def resolve(ns: UserNamespace, target: str) -> ProcMesh:
    """``NAME`` or an expression such as ``NAME.slice(gpus=0)``, evaluated in the
    notebook's namespace ``ns`` -> a ProcMesh view (an actor mesh gives its procs)."""
    if target.isidentifier() and target not in ns:
        raise UsageError(f"no mesh named {target!r}; {live_hint()}")
    try:
        obj = eval(target, ns)  # the user's own expression
    except SliceError as exc:
        raise UsageError(f"bad slice {target!r}: {exc}") from None
    except Exception as exc:
        raise UsageError(f"cannot evaluate mesh {target!r}: {exc}") from None
    if isinstance(obj, ActorMesh):
        obj = procs_of(obj)
    if not isinstance(obj, ProcMesh):
        raise UsageError(f"{target!r} is a {type(obj).__name__}, not a mesh; {live_hint()}")
    if obj.runtime.state in ("stopped", "stopping"):
        raise stopped_error(obj.name)
    return obj


def existing(name: str) -> ProcMesh:
    """The live mesh registered as ``name`` (not an expression: ``%mesh stop NAME``...)."""
    runtime = registry.get(name)
    if runtime is None:
        if registry.stopped(name) is not None:
            raise stopped_error(name)
        raise UsageError(f"no mesh named {name!r}; {live_hint()}")
    return ProcMesh(runtime)


def ranks_option(spec: str | None, size: int) -> list[int] | None:
    """A ``--ranks`` value as flat positions ``< size`` (None when not given); a bad one is
    a one-line UsageError."""
    if spec is None:
        return None
    try:
        return parse_ranks(spec, size)
    except SliceError as exc:
        raise UsageError(str(exc)) from None


@dataclass(frozen=True)
class Selection:
    """The ranks a cell runs on: a mesh view, its ranks, and the shape its values get."""

    procs: ProcMesh
    ranks: list[int]
    shape: Shape

    @classmethod
    def whole(cls, procs: ProcMesh) -> Selection:
        """Every rank of ``procs``, in its own shape."""
        return cls(procs, procs.ranks(), procs.shape)

    def pick(self, picked: list[int]) -> Selection:
        """The ranks at flat positions ``picked``, as a slice where possible.

        An evenly spaced pick of a one-dim mesh stays a slice (values keep their
        coordinates); anything else becomes a ``ranks`` dim over the picked ranks.
        """
        procs = self.procs
        step = picked[1] - picked[0] if len(picked) > 1 else 1
        regular = all(b - a == step for a, b in zip(picked, picked[1:]))
        if len(procs.shape.labels) == 1 and regular:
            view = procs.slice(**{procs.shape.labels[0]: slice(picked[0], picked[-1] + 1, step)})
            return Selection.whole(view)
        ranks = [procs.ranks()[i] for i in picked]
        return Selection(procs, ranks, Shape(("ranks",), (len(ranks),)))
