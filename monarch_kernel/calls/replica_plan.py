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
from dataclasses import dataclass, replace

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
    #: The ranks that must hold the same state (this one among them) when it is sharded
    #: (an FSDP2/HSDP model, its optimizer: the replicas of this rank's shards); empty:
    #: every rank (a DDP replica).
    replicas: tuple[int, ...] = ()
    #: Hash of the object's structure only (tensor names, dtypes, global and local
    #: shapes): replicas whose layouts differ were built differently (a rank-dependent
    #: size in the model's code), so no copy can make them the same. '' : not known.
    layout: str = ""
    #: An optimizer whose last ``opt.step()`` on this rank started and did not finish
    #: (the stop came inside it): some parameters and moments hold the new step, the
    #: others the old one. Such a rank is the source only when no replica is whole.
    cut_short: bool = False


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
    #: Sharded objects (FSDP2/HSDP models and their optimizers), compared within each
    #: group of replicas of the same shards.
    shard_names: tuple[str, ...] = ()
    #: ``(rank, source)`` for every rank of a group whose shards differ: the group copies
    #: from its most advanced rank (every rank of the group takes part).
    shard_sources: tuple[tuple[int, int], ...] = ()
    shard_why: str = ""  #: ``rank 1's shards were 1 optimizer step behind rank 3's``
    #: Groups of replicas whose shards are at different optimizer steps (a stop inside
    #: the optimizer step of some and not others): the model mixes two steps.
    shard_warning: str = ""
    #: Objects whose replicas differ in structure, not only in values (left alone: a
    #: copy cannot fit): ``model_a: rank 2 laid out differently from ranks 0-1, 3``.
    misbuilt: tuple[str, ...] = ()
    #: Ranks left holding an optimizer step cut short partway (the stop came inside
    #: ``opt.step()`` on every replica of their state): what that means, or ''.
    torn_warning: str = ""

    @property
    def needed(self) -> bool:
        """Whether anything is copied."""
        return self.source is not None or bool(self.shard_sources)


def plan_sync(digests: Sequence[ReplicaDigest]) -> ReplicaPlan:
    """Compare the ranks' digests; pick the most advanced rank (most optimizer steps;
    then the state most ranks share; then the lowest rank) as the source: for the
    whole (DDP) objects among every rank, for the sharded ones within each group of
    replicas of the same shards."""
    by_rank = {d.rank: {o.name: o for o in d.objects} for d in digests}
    ranks = sorted(by_rank)
    if not ranks:
        return ReplicaPlan(None, (), (), "")
    every = sorted(set.intersection(*(set(objs) for objs in by_rank.values())))
    everywhere = set(every)
    uneven = tuple(
        f"{n}: ranks {format_ranks([r for r in ranks if n in by_rank[r]])}"
        for n in sorted(set().union(*(set(objs) for objs in by_rank.values())) - everywhere)
    )
    sharded = [n for n in every if any(by_rank[r][n].replicas for r in ranks)]
    names = [n for n in every if n not in sharded]
    # a shard held by one rank only (FSDP without replicas) has nothing to compare with
    sharded = [n for n in sharded if any(len(by_rank[r][n].replicas) > 1 for r in ranks)]
    misbuilt = _misbuilt(by_rank, names, sharded)
    names = [n for n in names if n not in misbuilt]
    sharded = [n for n in sharded if n not in misbuilt]
    shard_sources, shard_why = _plan_shards(by_rank, sharded)
    shard_warning = _mixed_steps(by_rank, sharded, dict(shard_sources))
    torn_shards = _left_torn(by_rank, sharded, {r: dict(shard_sources).get(r, r) for r in ranks})
    base = ReplicaPlan(
        None,
        (),
        tuple(names),
        "",
        uneven,
        len(every),
        shard_names=tuple(sharded),
        shard_sources=shard_sources,
        shard_why=shard_why,
        shard_warning=shard_warning,
        misbuilt=tuple(misbuilt.values()),
    )
    state = {r: tuple(by_rank[r][n].digest for n in names) for r in ranks}
    if len(set(state.values())) <= 1:
        torn = torn_shards | _left_torn(by_rank, names, {r: r for r in ranks})
        return replace(base, torn_warning=_torn_text(torn))
    source = _most_advanced(by_rank, names, ranks, state)
    targets = tuple(r for r in ranks if state[r] != state[source])
    why = _why(by_rank, names, source, targets, _steps(by_rank, names, ranks))
    kinds = {by_rank[source][n].kind for n in names}
    words = " and ".join(
        w for k, w in (("model", "parameters"), ("optimizer", "optimizer state")) if k in kinds
    )
    torn = torn_shards | _left_torn(
        by_rank, names, {r: source if r in targets else r for r in ranks}
    )
    return replace(
        base,
        source=source,
        targets=targets,
        why=why,
        kinds=words or "state",
        torn_warning=_torn_text(torn),
    )


def _steps(
    by_rank: dict[int, dict[str, ObjectDigest]], names: list[str], ranks: list[int]
) -> dict[int, int]:
    return {r: sum(by_rank[r][n].steps or 0 for n in names) for r in ranks}


def _cut_short(by_rank: dict[int, dict[str, ObjectDigest]], names: list[str], rank: int) -> int:
    """How many of ``names`` on ``rank`` are optimizers whose last step was cut short."""
    return sum(by_rank[rank][n].cut_short for n in names)


def _most_advanced(
    by_rank: dict[int, dict[str, ObjectDigest]],
    names: list[str],
    ranks: list[int],
    state: dict[int, tuple[str, ...]],
) -> int:
    """Most optimizer steps; then whole steps (a rank stopped inside ``opt.step()`` holds
    a half-updated state, while one that had not begun it holds the previous step
    exactly); then the state most ranks share; then the lowest rank."""
    steps = _steps(by_rank, names, ranks)
    shared = Counter(state[r] for r in ranks)
    return max(
        ranks,
        key=lambda r: (steps[r], -_cut_short(by_rank, names, r), shared[state[r]], -r),
    )


def _left_torn(
    by_rank: dict[int, dict[str, ObjectDigest]], names: list[str], sources: dict[int, int]
) -> set[int]:
    """The ranks whose state of ``names`` will be a step cut short: each rank takes its
    ``sources`` rank's (itself when nothing is copied to it)."""
    return {r for r, src in sources.items() if names and _cut_short(by_rank, names, src)}


def _torn_text(ranks: set[int]) -> str:
    if not ranks:
        return ""
    one = len(ranks) == 1
    who = f"rank {min(ranks)} holds" if one else f"ranks {format_ranks(sorted(ranks))} hold"
    return (
        f"WARNING: {who} an optimizer step cut short partway (the stop came inside "
        "opt.step() on every replica of that state: some parameters and optimizer moments "
        "took the step, the others not); load a checkpoint to be exact"
    )


def _misbuilt(
    by_rank: dict[int, dict[str, ObjectDigest]], names: list[str], sharded: list[str]
) -> dict[str, str]:
    """The objects whose replicas differ in layout (names, dtypes or shapes of their
    tensors), each with one line saying which ranks differ from which: among every rank
    for ``names`` (DDP replicas), within each group of replicas for ``sharded``. An
    optimizer's layout is that of the parameters it trains, so it differs with its
    model's; an optimizer of a sharded model that differs only in its buffers is left
    with that model too (the shard copy moves a model with its optimizers)."""
    out: dict[str, str] = {}
    for n in [*names, *sharded]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for r, objs in by_rank.items():
            key = objs[n].replicas if n in sharded else ()
            groups.setdefault(key, []).append(r)
        for members in sorted(groups.values(), key=min):
            members.sort()
            layouts = {r: by_rank[r][n].layout for r in members}
            if "" in layouts.values() or len(set(layouts.values())) <= 1:
                continue
            common = Counter(layouts.values()).most_common(1)[0][0]
            usual = [r for r in members if layouts[r] == common]
            odd = [r for r in members if layouts[r] != common]
            who = f"rank {odd[0]}" if len(odd) == 1 else f"ranks {format_ranks(odd)}"
            than = f"rank {usual[0]}" if len(usual) == 1 else f"ranks {format_ranks(usual)}"
            out[n] = f"{n}: {who} laid out differently from {than}"
            break
    for n in [*names, *sharded]:
        if n in out:
            continue
        trained = [m for m in out if _trains(by_rank, n, m)]
        if trained:
            out[n] = f"{n}: trains {trained[0]}"
    return out


def _trains(by_rank: dict[int, dict[str, ObjectDigest]], name: str, model: str) -> bool:
    """Whether ``name`` is an optimizer (or scheduler) of the sharded model ``model``: the
    same replicas on every rank (what the digests tell)."""
    return any(
        objs[name].kind != "model"
        and objs[model].kind == "model"
        and objs[name].replicas
        and objs[name].replicas == objs[model].replicas
        for objs in by_rank.values()
    )


def _plan_shards(
    by_rank: dict[int, dict[str, ObjectDigest]], names: list[str]
) -> tuple[tuple[tuple[int, int], ...], str]:
    """For each group of ranks that hold replicas of the same shards, whose shards
    differ: every rank of the group -> the group's most advanced rank; and why."""
    if not names:
        return (), ""
    groups: dict[tuple[tuple[int, ...], ...], list[int]] = {}
    for r, objs in by_rank.items():  # ranks holding replicas of the same shards, together
        key = tuple(objs[n].replicas or (r,) for n in names)
        groups.setdefault(key, []).append(r)
    sources: list[tuple[int, int]] = []
    whys = []
    for members in sorted(groups.values(), key=min):
        members.sort()
        state = {r: tuple(by_rank[r][n].digest for n in names) for r in members}
        if len(set(state.values())) <= 1:
            continue
        source = _most_advanced(by_rank, names, members, state)
        targets = tuple(r for r in members if state[r] != state[source])
        sources += [(r, source) for r in members]
        whys.append(_why(by_rank, names, source, targets, _steps(by_rank, names, members)))
    return tuple(sources), "; ".join(whys)


def _mixed_steps(
    by_rank: dict[int, dict[str, ObjectDigest]], names: list[str], sources: dict[int, int]
) -> str:
    """Say so when the groups of replicas will hold shards of different optimizer steps
    after the copy (each group takes its most advanced rank's)."""
    if not names:
        return ""
    steps: dict[int, list[int]] = {}
    for r in sorted(by_rank):
        src = sources.get(r, r)
        steps.setdefault(sum(by_rank[src][n].steps or 0 for n in names), []).append(r)
    if len(steps) < 2:
        return ""
    parts = ", ".join(f"ranks {format_ranks(rs)}: {n}" for n, rs in sorted(steps.items()))
    return (
        f"WARNING: the model's shards are at different optimizer steps ({parts} steps): "
        "the stop came inside the optimizer step of some ranks and not others, so the "
        "model now mixes two steps; load a checkpoint to be exact"
    )


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
    calls = ", ".join(f"{n}.step()" for n in optimizers)
    torn = [r for r in targets if _cut_short(by_rank, names, r)]
    if optimizers and torn and behind <= {0, 1}:
        stopped = f"rank {torn[0]}" if len(torn) == 1 else f"ranks {format_ranks(torn)}"
        whole = [r for r in targets if r not in torn]
        text = f"{stopped} stopped inside {calls}"
        if whole:
            others = f"rank {whole[0]}" if len(whole) == 1 else f"ranks {format_ranks(whole)}"
            text += f", {others} had not run it"
        return text
    if optimizers and behind == {1}:
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
    what = IDENTICAL if not plan.shard_names else "replicas identical"
    if not plan.needed:
        # Only the DDP/FSDP models, their optimizers and schedulers are compared: say so.
        compared = [*plan.names, *plan.shard_names]
        if not compared:  # all of them misbuilt: the caller says so (``misbuilt_problem``)
            return ""
        text = f"{what} ({', '.join(compared)} compared"
        text += "; shards compared within each replica group)" if plan.shard_names else ")"
    else:
        done = []
        if plan.source is not None:
            who = format_ranks(list(plan.targets))
            done.append(
                f"{plan.why}; {plan.kinds} of rank {plan.source} copied to "
                f"{'rank' if len(plan.targets) == 1 else 'ranks'} {who}"
            )
        if plan.shard_sources:
            sources = sorted({s for _, s in plan.shard_sources})
            who = f"{'rank' if len(sources) == 1 else 'ranks'} {format_ranks(sources)}"
            done.append(f"shards: {plan.shard_why}; copied from {who} within the replicate dim")
        text = (
            "; ".join(done)
            + f" ({_size(nbytes)}, {seconds * 1000:.0f} ms); "
            + (what if after else what.replace("identical", "STILL DIFFER"))
        )
    if plan.shard_warning:
        text += "; " + plan.shard_warning
    if plan.torn_warning:
        text += "; " + plan.torn_warning
    if plan.uneven:
        text += "; not on every rank, left alone: " + "; ".join(plan.uneven)
    return text


def misbuilt_problem(plan: ReplicaPlan) -> str:
    """What the replica check could not repair, for the cell's ``problem:`` line: the
    objects whose replicas were built differently ('' when none)."""
    if not plan.misbuilt:
        return ""
    return (
        "replicas built differently, left as they are (a rank-dependent size in the "
        "model's code?): " + "; ".join(plan.misbuilt)
    )


def _size(nbytes: int) -> str:
    if nbytes >= 1 << 30:
        return f"{nbytes / (1 << 30):.1f} GB"
    if nbytes >= 1 << 20:
        return f"{nbytes / (1 << 20):.1f} MB"
    return f"{nbytes / 1024:.1f} KB"
