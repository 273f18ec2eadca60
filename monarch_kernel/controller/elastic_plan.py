"""What a ``%mesh grow``/``shrink`` changes: the new shape, the ranks and hosts added or
removed, and the words that say what happened. Pure (no mesh is touched here).

Survivors keep their flat rank: new ranks come after the last one, and a shrink removes
ranks (or whole hosts) from the end. So a rank's ``RANK`` never changes under it; only
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and the mesh's shape do.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.controller.peer_round import size_text
from monarch_kernel.shape import Shape


class ResizeError(ValueError):
    """A grow or shrink that cannot be done: the message says why and what to do."""


class ResizeInterrupted(ResizeError):
    """The user interrupted a grow before its new ranks took part in anything: they and
    their host agents were taken back (a join token shown is void); the mesh and its
    training are as they were."""


@dataclass(frozen=True)
class MeshSize:
    """A mesh's shape as a resize sees it: ``hosts`` host agents of ``per_host`` ranks,
    the ranks of a host along the one dim ``dim``."""

    hosts: int
    per_host: int
    dim: str

    @property
    def world(self) -> int:
        return self.hosts * self.per_host

    @property
    def extent(self) -> dict[str, int]:
        """``{"hosts": 2, "gpus": 4}``, or ``{"gpus": 4}`` on one host."""
        return ({"hosts": self.hosts} if self.hosts > 1 else {}) | {self.dim: self.per_host}

    @property
    def shape(self) -> Shape:
        return Shape.from_extent(self.extent)


@dataclass(frozen=True)
class ResizePlan:
    """From ``before`` to ``after``: ``added``/``removed`` ranks, hosts too."""

    name: str
    before: MeshSize
    after: MeshSize

    @property
    def added(self) -> list[int]:
        return list(range(self.before.world, self.after.world))

    @property
    def removed(self) -> list[int]:
        return list(range(self.after.world, self.before.world))

    @property
    def added_hosts(self) -> list[int]:
        return list(range(self.before.hosts, self.after.hosts))

    @property
    def removed_hosts(self) -> list[int]:
        return list(range(self.after.hosts, self.before.hosts))


def size_of(name: str, extent: dict[str, int], hosts: int) -> MeshSize:
    """The :class:`MeshSize` of a mesh of ``extent`` over ``hosts`` host agents."""
    dims = [d for d in extent if not (d == "hosts" and hosts > 1)]
    if len(dims) != 1:
        raise ResizeError(
            f"mesh {name!r} has {len(dims)} dims per host ({', '.join(dims)}): only a mesh "
            "with one dim per host (--gpus N) can grow or shrink"
        )
    return MeshSize(hosts, extent[dims[0]], dims[0])


def _count(value: str, what: str, signed: bool) -> int:
    text = value.strip()
    try:
        n = int(text)
    except ValueError:
        raise ResizeError(f"{what} takes a whole number, got {value!r}") from None
    if signed and not text.startswith("+"):
        raise ResizeError(f"grow {what} takes a count to add, like +2 (got {value!r})")
    return n


def plan_grow(name: str, size: MeshSize, ranks: str | None, hosts: str | None) -> ResizePlan:
    """``grow --ranks +N`` (also ``--gpus``) or ``--hosts +K``."""
    if (ranks is None) == (hosts is None):
        raise ResizeError(f"grow {name}: give one of --ranks +N, --gpus +N or --hosts +K")
    if hosts is not None:
        k = _count(hosts, "--hosts", signed=True)
        if k < 1:
            raise ResizeError(f"grow {name} --hosts {hosts}: add at least one host (+1)")
        return ResizePlan(name, size, MeshSize(size.hosts + k, size.per_host, size.dim))
    assert ranks is not None
    n = _count(ranks, "--ranks", signed=True)
    if n < 1:
        raise ResizeError(f"grow {name} --ranks {ranks}: add at least one rank (+1)")
    if size.hosts > 1:
        raise ResizeError(
            f"mesh {name!r} spans {size.hosts} hosts of {size.per_host} ranks: grow it by whole "
            "hosts (%mesh grow NAME --hosts +1)"
        )
    return ResizePlan(name, size, MeshSize(1, size.per_host + n, size.dim))


def plan_shrink(name: str, size: MeshSize, ranks: str | None, hosts: str | None) -> ResizePlan:
    """``shrink --ranks N`` (keep N ranks: 0..N-1) or ``--hosts K`` (keep hosts 0..K-1)."""
    if (ranks is None) == (hosts is None):
        raise ResizeError(f"shrink {name}: give one of --ranks N or --hosts K (what to keep)")
    if hosts is not None:
        k = _count(hosts, "--hosts", signed=False)
        if k < 1:
            raise ResizeError(
                f"shrink {name} --hosts {hosts}: a mesh keeps at least 1 host; to end it, "
                f"%mesh stop {name}"
            )
        if k >= size.hosts:
            raise ResizeError(
                f"shrink {name} --hosts {k}: the mesh has {size.hosts} host(s); give fewer"
            )
        return ResizePlan(name, size, MeshSize(k, size.per_host, size.dim))
    assert ranks is not None
    n = _count(ranks, "--ranks", signed=False)
    if n < 1:
        raise ResizeError(
            f"shrink {name} --ranks {ranks}: a mesh keeps at least 1 rank; to end it, "
            f"%mesh stop {name}"
        )
    if n >= size.world:
        raise ResizeError(
            f"shrink {name} --ranks {n}: the mesh has {size.world} rank(s); give fewer to keep"
        )
    if size.hosts > 1:
        if n % size.per_host:
            raise ResizeError(
                f"mesh {name!r} spans {size.hosts} hosts of {size.per_host} ranks: shrink it by "
                f"whole hosts (--hosts K, or --ranks a multiple of {size.per_host})"
            )
        return ResizePlan(name, size, MeshSize(n // size.per_host, size.per_host, size.dim))
    return ResizePlan(name, size, MeshSize(1, n, size.dim))


def _span(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


@dataclass(frozen=True)
class ResizeReport:
    """What a grow or shrink did (``describe()`` says it in one line)."""

    name: str
    before: int
    after: int
    added: tuple[int, ...]
    removed: tuple[int, ...]
    #: the training step it happened at (None: no training loop was running)
    step: int | None
    #: state copied to the new ranks: bytes (each) and seconds (the slowest)
    nbytes: int
    copy_seconds: float
    #: seconds the training loop (or the mesh) was paused
    seconds: float
    #: what the new ranks got instead of a training state, when not from a loop
    note: str = ""

    def describe(self) -> str:
        """``world size 4 → 6 at step 1,200; state copied to ranks 4-5 in 0.40 s ...``"""
        text = f"mesh {self.name!r}: world size {self.before} → {self.after}"
        if self.step is not None:
            text += f" at step {self.step:,}"
        if self.added and self.nbytes:
            text += (
                f"; state of {size_text(self.nbytes)} copied to {_span(list(self.added))} in "
                f"{self.copy_seconds:.2f} s"
            )
        elif self.added:
            text += f"; {_span(list(self.added))} started"
        if self.removed:
            text += f"; {_span(list(self.removed))} stopped"
        text += f"; paused {self.seconds:.2f} s, no survivor restarted"
        if self.note:
            text += f" ({self.note})"
        return text


def interrupted_text(plan: ResizePlan) -> str:
    """What a grow interrupted before its new ranks took part left: nothing of it."""
    void = " (the join command shown is void now)" if plan.added_hosts else ""
    return (
        f"grow interrupted; its new ranks and host agents were stopped{void}; the mesh "
        f"keeps its {plan.before.world} rank(s)"
    )
