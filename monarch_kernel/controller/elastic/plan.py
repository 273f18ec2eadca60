"""What a ``%mesh grow``/``shrink`` changes: the new shape, the ranks and hosts added or
removed, and the words that say what happened. Pure (no mesh is touched here).

New ranks come after the last one (a grow never renumbers). A shrink by count
(``--ranks N``, ``--hosts K``) removes ranks (or whole hosts) from the end: survivors
keep their flat rank, only ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE`` and the shape change. A
shrink that *drops* given ranks or hosts (``--drop-ranks 1,3``, ``--drop-hosts 1``, and
the failure policy ``shrink`` for a dead rank or host anywhere) renumbers the survivors
contiguously in their old order (hosts too): :attr:`ResizePlan.renumbering` says each
survivor's new rank. See :mod:`.renumber` for what that changes and its rules.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_kernel.controller.training.rounds import size_text
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
    """From ``before`` to ``after``: ``added``/``removed`` ranks, hosts too. ``drop``
    (and ``drop_hosts``, the hosts they make up): the ranks a dropping shrink removes,
    anywhere (old numbers, sorted); empty: a grow, or a shrink from the end."""

    name: str
    before: MeshSize
    after: MeshSize
    drop: tuple[int, ...] = ()
    drop_hosts: tuple[int, ...] = ()

    @property
    def added(self) -> list[int]:
        return list(range(self.before.world, self.after.world))

    @property
    def removed(self) -> list[int]:
        if self.drop:
            return list(self.drop)
        return list(range(self.after.world, self.before.world))

    @property
    def added_hosts(self) -> list[int]:
        return list(range(self.before.hosts, self.after.hosts))

    @property
    def removed_hosts(self) -> list[int]:
        if self.drop:
            return list(self.drop_hosts)
        return list(range(self.after.hosts, self.before.hosts))

    @property
    def renumbering(self) -> dict[int, int]:
        """Old rank -> new rank of every rank the mesh keeps (the survivors, in order)."""
        gone = set(self.removed)
        kept = [r for r in range(self.before.world) if r not in gone]
        return {old: new for new, old in enumerate(kept)}

    @property
    def host_renumbering(self) -> dict[int, int]:
        """Old host -> new host of every host the mesh keeps."""
        gone = set(self.removed_hosts)
        kept = [h for h in range(self.before.hosts) if h not in gone]
        return {old: new for new, old in enumerate(kept)}

    @property
    def moved(self) -> list[tuple[int, int]]:
        """(old, new) of the survivors whose rank changes."""
        return [(o, n) for o, n in self.renumbering.items() if o != n]

    def report(
        self,
        step: int | None,
        seconds: float,
        nbytes: int = 0,
        copy_seconds: float = 0.0,
        note: str = "",
    ) -> ResizeReport:
        """What this plan did (see :class:`ResizeReport`)."""
        return ResizeReport(
            self.name,
            self.before.world,
            self.after.world,
            tuple(self.added),
            tuple(self.removed),
            step,
            nbytes,
            copy_seconds,
            seconds,
            note,
            dropped=bool(self.drop),
            dropped_hosts=tuple(self.drop_hosts) if self.before.hosts > 1 else (),
            moved=tuple(self.moved),
        )


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


def plan_shrink(
    name: str, size: MeshSize, ranks: str | None, hosts: str | None, minimum: int = 1
) -> ResizePlan:
    """``shrink --ranks N`` (keep N ranks: 0..N-1) or ``--hosts K`` (keep hosts 0..K-1);
    not below ``minimum`` ranks (the mesh's ``--on-failure shrink:N``)."""
    plan = _plan_shrink(name, size, ranks, hosts)
    if plan.after.world < minimum:
        option = f"--ranks {ranks}" if ranks is not None else f"--hosts {hosts}"
        raise ResizeError(
            f"shrink {name} {option}: that leaves {plan.after.world} rank(s), below the "
            f"mesh's minimum of {minimum} (--on-failure shrink:{minimum}); keep more"
        )
    return plan


def _plan_shrink(name: str, size: MeshSize, ranks: str | None, hosts: str | None) -> ResizePlan:
    if (ranks is None) == (hosts is None):
        raise ResizeError(
            f"shrink {name}: give one of --ranks N or --hosts K (what to keep), or "
            "--drop-ranks R,R / --drop-hosts H (what to drop)"
        )
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


def parse_numbers(value: str, what: str) -> list[int]:
    """``"1,3"``, ``"2-4"``, ``"1, 5-6"`` -> sorted distinct numbers (ResizeError if bad)."""
    out: set[int] = set()
    for part in str(value).replace(" ", "").split(","):
        lo, dash, hi = part.partition("-")
        try:
            if not part or (dash and not (lo and hi)):
                raise ValueError(part)
            first, last = int(lo), int(hi) if dash else int(lo)
        except ValueError:
            raise ResizeError(
                f"{what} takes numbers separated by commas, like 1,3 or 2-4 (got {value!r})"
            ) from None
        if first < 0 or last < first:
            raise ResizeError(f"{what} {value}: give numbers from 0 up, like 1,3 or 2-4")
        out.update(range(first, last + 1))
    return sorted(out)


def plan_drop(
    name: str,
    size: MeshSize,
    drop_ranks: str | None,
    drop_hosts: str | None,
    minimum: int = 1,
) -> ResizePlan:
    """``shrink --drop-ranks 1,3`` or ``--drop-hosts 1``: remove those, anywhere; the
    survivors are renumbered in their old order. A multi-host mesh drops whole hosts
    (``--drop-ranks`` there must name every rank of the hosts it drops)."""
    if (drop_ranks is None) == (drop_hosts is None):
        raise ResizeError(f"shrink {name}: give one of --drop-ranks R,R or --drop-hosts H,H")
    if drop_hosts is not None:
        hosts = parse_numbers(drop_hosts, "--drop-hosts")
        bad = [h for h in hosts if h >= size.hosts]
        if bad:
            raise ResizeError(
                f"shrink {name} --drop-hosts {drop_hosts}: mesh {name!r} has no host "
                f"{format_numbers(bad)} (its hosts are {_range_text(size.hosts)}); give "
                "hosts among them (%mesh shows the mesh)"
            )
        ranks = [h * size.per_host + i for h in hosts for i in range(size.per_host)]
        option = f"--drop-hosts {drop_hosts}"
    else:
        assert drop_ranks is not None
        ranks = parse_numbers(drop_ranks, "--drop-ranks")
        option = f"--drop-ranks {drop_ranks}"
        bad = [r for r in ranks if r >= size.world]
        if bad:
            raise ResizeError(
                f"shrink {name} {option}: mesh {name!r} has no rank {format_numbers(bad)} "
                f"(its ranks are {_range_text(size.world)}); give ranks among them"
            )
        hosts = sorted({r // size.per_host for r in ranks})
        if size.hosts > 1:
            whole = [h * size.per_host + i for h in hosts for i in range(size.per_host)]
            if whole != ranks:
                held = format_numbers([r for r in whole if r not in ranks])
                raise ResizeError(
                    f"mesh {name!r} spans {size.hosts} hosts of {size.per_host} ranks: drop "
                    f"whole hosts (--drop-hosts {format_numbers(hosts)}), or name every rank "
                    f"of the hosts you drop (rank(s) {held} are on them too)"
                )
    left = size.world - len(ranks)
    if left < 1:
        raise ResizeError(
            f"shrink {name} {option}: that drops every rank; a mesh keeps at least 1 rank: "
            f"drop fewer, or end it with %mesh stop {name}"
        )
    if left < minimum:
        raise ResizeError(
            f"shrink {name} {option}: that leaves {left} rank(s), below the mesh's minimum "
            f"of {minimum} (--on-failure shrink:{minimum}); drop fewer"
        )
    if size.hosts > 1:
        after = MeshSize(size.hosts - len(hosts), size.per_host, size.dim)
        return ResizePlan(name, size, after, tuple(ranks), tuple(hosts))
    return ResizePlan(name, size, MeshSize(1, left, size.dim), tuple(ranks))


def format_numbers(numbers: list[int]) -> str:
    """``[1]`` -> ``1``, ``[1, 2, 3, 5]`` -> ``1-3, 5``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}-{r[-1]}" for r in runs)


def _range_text(n: int) -> str:
    return "0" if n == 1 else f"0-{n - 1}"


def _span(ranks: list[int]) -> str:
    if not ranks:
        return ""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks[0]}-{ranks[-1]}"


def _many(what: str, numbers: list[int]) -> str:
    """``rank 1``, ``ranks 1, 3``."""
    return f"{what}{'s' if len(numbers) > 1 else ''} {format_numbers(numbers)}"


def _moves(moved: list[tuple[int, int]]) -> str:
    """``rank 2 → 1``, ``ranks 2-3 → 1-2``, ``ranks 2 → 1, 4-5 → 2-3``."""
    runs: list[list[tuple[int, int]]] = []
    for old, new in moved:
        if runs and old == runs[-1][-1][0] + 1 and new == runs[-1][-1][1] + 1:
            runs[-1].append((old, new))
        else:
            runs.append([(old, new)])
    parts = [
        f"{r[0][0]} → {r[0][1]}" if len(r) == 1 else f"{r[0][0]}-{r[-1][0]} → {r[0][1]}-{r[-1][1]}"
        for r in runs
    ]
    return f"{'ranks' if len(moved) > 1 else 'rank'} {', '.join(parts)}"


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
    #: a dropping shrink: the hosts it dropped (old numbers) and the survivors it
    #: renumbered, (old, new); ``dropped``: it dropped ranks (not from the end)
    dropped: bool = False
    dropped_hosts: tuple[int, ...] = ()
    moved: tuple[tuple[int, int], ...] = ()

    @property
    def renumbered(self) -> dict[int, int]:
        """Old -> new rank of the survivors whose rank changed."""
        return dict(self.moved)

    def describe(self) -> str:
        """``world size 4 → 6 at step 1,200; state copied to ranks 4-5 in 0.40 s ...``;
        ``world size 3 → 2 at step 40; host 1 (rank 1) dropped; rank 2 → 1 renumbered``."""
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
        if self.removed and self.dropped:
            ranks = _many("rank", list(self.removed))
            if self.dropped_hosts:
                text += f"; {_many('host', list(self.dropped_hosts))} ({ranks}) dropped"
            else:
                text += f"; {ranks} dropped"
            if self.moved:
                text += f"; {_moves(list(self.moved))} renumbered"
        elif self.removed:
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
