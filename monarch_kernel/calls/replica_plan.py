"""Are the data-parallel replicas still the same, and if not, which rank's state wins.

Pure data and decisions (no torch): each rank reports a :class:`ReplicaDigest` of its
training objects (``monarch_kernel.rank.replicas.replicas`` makes it); the controller calls
:func:`plan_sync` on all of them and, when they differ, has every rank run the
broadcast from :attr:`ReplicaPlan.source`; :func:`describe` says in one line what was
done, for the cell's output.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from monarch_kernel.calls.errors import format_ranks

#: What the replica check says when the replicas' compared state is the same: only the
#: data-parallel objects (DDP models, their optimizers and schedulers) are compared,
#: not the rest of a rank's namespace.
IDENTICAL = "DDP replicas identical"


@dataclass(frozen=True)
class ObjectDigest:
    """One training object of one rank: a model (DDP) or an optimizer (or scheduler)."""

    name: str  #: where it is in the rank's namespace: ``opt``, ``trainer.model``
    kind: str  #: ``model``, ``optimizer`` or ``scheduler``
    digest: str  #: hash of its state (parameters and buffers, or its state dict)
    nbytes: int  #: bytes of tensor state
    steps: int | None = None  #: ``opt.step()`` calls seen on this rank (optimizers)


@dataclass(frozen=True)
class ReplicaDigest:
    """One rank's training objects."""

    rank: int
    objects: tuple[ObjectDigest, ...]


@dataclass(frozen=True)
class SyncReport:
    """What copying the replicas' state did on one rank."""

    nbytes: int  #: tensor bytes broadcast
    seconds: float
    after: ReplicaDigest  #: the rank's digest afterwards


@dataclass(frozen=True)
class ReplicaPlan:
    """What to do: nothing (``source`` None), or copy ``names`` from ``source``."""

    source: int | None
    targets: tuple[int, ...]
    names: tuple[str, ...]  #: objects to copy (present on every rank), in order
    why: str  #: ``ranks 2-3 had not run opt.step() of the interrupted step``
    #: Objects not on every rank (left alone): ``name: ranks that have it``.
    uneven: tuple[str, ...] = ()
    checked: int = 0  #: objects compared
    kinds: str = "state"  #: what the copy covers: ``parameters and optimizer state``


def plan_sync(digests: Sequence[ReplicaDigest]) -> ReplicaPlan:
    """Compare the ranks' digests; pick the most advanced rank (most optimizer steps;
    then the state most ranks share; then the lowest rank) as the source."""
    by_rank = {d.rank: {o.name: o for o in d.objects} for d in digests}
    ranks = sorted(by_rank)
    if not ranks:
        return ReplicaPlan(None, (), (), "")
    names = sorted(set.intersection(*(set(objs) for objs in by_rank.values())))
    everywhere = set(names)
    uneven = tuple(
        f"{n}: ranks {format_ranks([r for r in ranks if n in by_rank[r]])}"
        for n in sorted(set().union(*(set(objs) for objs in by_rank.values())) - everywhere)
    )
    state = {r: tuple(by_rank[r][n].digest for n in names) for r in ranks}
    if len(set(state.values())) <= 1:
        return ReplicaPlan(None, (), tuple(names), "", uneven, len(names))
    steps = {r: sum(by_rank[r][n].steps or 0 for n in names) for r in ranks}
    shared = Counter(state.values())
    source = max(ranks, key=lambda r: (steps[r], shared[state[r]], -r))
    targets = tuple(r for r in ranks if state[r] != state[source])
    why = _why(by_rank, names, source, targets, steps)
    kinds = {by_rank[source][n].kind for n in names}
    words = " and ".join(
        w for k, w in (("model", "parameters"), ("optimizer", "optimizer state")) if k in kinds
    )
    return ReplicaPlan(source, targets, tuple(names), why, uneven, len(names), words or "state")


def _why(
    by_rank: dict[int, dict[str, ObjectDigest]],
    names: list[str],
    source: int,
    targets: tuple[int, ...],
    steps: dict[int, int],
) -> str:
    who = f"rank {targets[0]}" if len(targets) == 1 else f"ranks {format_ranks(list(targets))}"
    optimizers = [n for n in names if by_rank[source][n].kind == "optimizer"]
    behind = {steps[source] - steps[r] for r in targets}
    if optimizers and behind == {1}:
        calls = ", ".join(f"{n}.step()" for n in optimizers)
        return f"{who} had not run {calls} of the interrupted step"
    if optimizers and min(behind) > 0:
        most = max(behind)
        verb = "was" if len(targets) == 1 else "were"
        return f"{who} {verb} up to {most} optimizer steps behind rank {source}"
    return f"{who} held different state than rank {source} (not explained by optimizer steps)"


def describe(plan: ReplicaPlan, nbytes: int = 0, seconds: float = 0.0, after: bool = True) -> str:
    """One line for the cell: what differed, what was copied, and whether the replicas
    are identical now (``after``); empty when there was nothing to compare."""
    if not plan.checked:
        return ""
    if plan.source is None:
        # Only the DDP models, their optimizers and schedulers are compared: say so.
        text = f"{IDENTICAL} ({', '.join(plan.names)} compared)"
    else:
        who = format_ranks(list(plan.targets))
        text = (
            f"{plan.why}; {plan.kinds} of rank {plan.source} copied to "
            f"{'rank' if len(plan.targets) == 1 else 'ranks'} {who} "
            f"({_size(nbytes)}, {seconds * 1000:.0f} ms); "
            + (IDENTICAL if after else "DDP replicas STILL DIFFER")
        )
    if plan.uneven:
        text += "; not on every rank, left alone: " + "; ".join(plan.uneven)
    return text


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    return f"{nbytes / 1024:.1f} KB"
