"""Named-dimension shapes, points and NumPy-like slicing (Monarch semantics).

A :class:`Shape` is a strided view over the flat ranks of a process mesh:
``rank(coords) = offset + sum(coord_i * stride_i)``. Slicing a dim with an int drops
that dim; slicing with a Python slice keeps it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any


class SliceError(ValueError):
    """A slice named a dimension that does not exist or an index out of range."""


class Extent(Mapping[str, int]):
    """The logical shape of a mesh: an ordered mapping ``dim -> size`` (Monarch's
    ``Extent``), with ``labels``, ``sizes`` and ``nelements``; ``str()`` reads
    ``{gpus: 4}``."""

    __slots__ = ("labels", "sizes")

    def __init__(self, labels: Sequence[str], sizes: Sequence[int]):
        self.labels = list(labels)
        self.sizes = [int(s) for s in sizes]
        if len(self.labels) != len(self.sizes):
            raise ValueError("labels and sizes differ in length")

    def __getitem__(self, dim: str) -> int:
        try:
            return self.sizes[self.labels.index(dim)]
        except ValueError:
            raise KeyError(dim) from None

    def __iter__(self) -> Iterator[str]:
        return iter(self.labels)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def nelements(self) -> int:
        """Number of points (the product of the sizes)."""
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Extent):
            return self.labels == other.labels and self.sizes == other.sizes
        return isinstance(other, Mapping) and dict(self.items()) == dict(other)

    def __hash__(self) -> int:
        return hash((tuple(self.labels), tuple(self.sizes)))

    def __repr__(self) -> str:
        return "{" + ", ".join(f"{k}: {v}" for k, v in zip(self.labels, self.sizes)) + "}"

    def __reduce__(self) -> tuple[type[Extent], tuple[list[str], list[int]]]:
        return Extent, (self.labels, self.sizes)


class Point(Mapping[str, int]):
    """One position in a mesh: a mapping ``dim -> index`` plus ``.rank`` (flat index).

    ``.rank`` is the position's flat index within the mesh it belongs to (for
    :func:`current_rank` that is the whole process mesh, i.e. the global rank);
    ``.extent`` the :class:`Extent` of that mesh (when known). ``str()`` is Monarch's
    ``{'gpus': 3/4}``.
    """

    __slots__ = ("_coords", "rank", "_sizes")

    def __init__(self, coords: Mapping[str, int], rank: int, sizes: Sequence[int] | None = None):
        self._coords = dict(coords)
        self.rank = rank
        self._sizes = None if sizes is None else tuple(int(s) for s in sizes)
        if self._sizes is not None and len(self._sizes) != len(self._coords):
            raise ValueError("a point needs one size per dimension")

    def __getitem__(self, dim: str) -> int:
        return self._coords[dim]

    def __iter__(self) -> Iterator[str]:
        return iter(self._coords)

    def __len__(self) -> int:
        return len(self._coords)

    def __getattr__(self, dim: str) -> int:
        try:
            return self._coords[dim]
        except KeyError:
            raise AttributeError(dim) from None

    @property
    def extent(self) -> Extent:
        """The extent of the mesh this point belongs to (Monarch's ``Point.extent``)."""
        if self._sizes is None:
            if self._coords:
                raise ValueError(f"the extent of {self!r} is not known")
            return Extent([], [])
        return Extent(list(self._coords), self._sizes)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Point):
            return self._coords == other._coords and self.rank == other.rank
        return isinstance(other, Mapping) and self._coords == dict(other)

    def __hash__(self) -> int:
        return hash((tuple(self._coords.items()), self.rank))

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v}" for k, v in self._coords.items())
        return f"Point({inner}; rank={self.rank})"

    def __str__(self) -> str:
        if self._sizes is None:
            return "{" + ", ".join(f"{k!r}: {v}" for k, v in self._coords.items()) + "}"
        parts = zip(self._coords.items(), self._sizes)
        return "{" + ", ".join(f"{k!r}: {v}/{n}" for (k, v), n in parts) + "}"

    def __reduce__(
        self,
    ) -> tuple[type[Point], tuple[dict[str, int], int, tuple[int, ...] | None]]:
        return Point, (self._coords, self.rank, self._sizes)


class Shape:
    """Named dims over a strided set of global ranks."""

    __slots__ = ("labels", "sizes", "strides", "offset")

    def __init__(
        self,
        labels: tuple[str, ...],
        sizes: tuple[int, ...],
        strides: tuple[int, ...] | None = None,
        offset: int = 0,
    ):
        self.labels = tuple(labels)
        self.sizes = tuple(int(s) for s in sizes)
        if len(self.labels) != len(self.sizes):
            raise ValueError("labels and sizes differ in length")
        if len(set(self.labels)) != len(self.labels):
            raise ValueError(f"duplicate dimension names in {self.labels}")
        if strides is None:
            acc, rev = 1, []
            for s in reversed(self.sizes):
                rev.append(acc)
                acc *= s
            strides = tuple(reversed(rev))
        self.strides = tuple(strides)
        self.offset = offset

    @classmethod
    def from_extent(cls, extent: Mapping[str, int]) -> Shape:
        for dim, size in extent.items():
            if not isinstance(size, int) or size < 1:
                raise ValueError(f"dimension {dim!r} must be a positive int, got {size!r}")
        return cls(tuple(extent), tuple(extent.values()))

    @property
    def extent(self) -> dict[str, int]:
        return dict(zip(self.labels, self.sizes))

    def __len__(self) -> int:
        n = 1
        for s in self.sizes:
            n *= s
        return n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Shape) and (
            self.labels,
            self.sizes,
            self.strides,
            self.offset,
        ) == (other.labels, other.sizes, other.strides, other.offset)

    def __hash__(self) -> int:
        return hash((self.labels, self.sizes, self.strides, self.offset))

    def __repr__(self) -> str:
        return "Shape(" + ", ".join(f"{k}={v}" for k, v in self.extent.items()) + ")"

    def describe(self) -> str:
        """``hosts=2 × gpus=4`` style text."""
        return " × ".join(f"{k}={v}" for k, v in self.extent.items()) or "single rank"

    def ranks(self) -> list[int]:
        """Global ranks in row-major order of this shape's coordinates."""
        out = [self.offset]
        for size, stride in zip(self.sizes, self.strides):
            out = [base + i * stride for base in out for i in range(size)]
        return out

    def points(self) -> list[Point]:
        pts = []
        for i, coords in enumerate(self._coords()):
            pts.append(Point(dict(zip(self.labels, coords)), i, self.sizes))
        return pts

    def _coords(self) -> list[tuple[int, ...]]:
        out: list[tuple[int, ...]] = [()]
        for size in self.sizes:
            out = [c + (i,) for c in out for i in range(size)]
        return out

    def index_of(self, coords: Mapping[str, int]) -> int:
        """Flat index (within this shape) of the point at ``coords``."""
        missing = set(self.labels) - set(coords)
        extra = set(coords) - set(self.labels)
        if missing or extra:
            raise SliceError(
                f"point needs exactly the dims {list(self.labels)}, got {sorted(coords)}"
            )
        idx = 0
        for label, size in zip(self.labels, self.sizes):
            c = coords[label]
            if not isinstance(c, int) or not 0 <= c < size:
                raise SliceError(f"index {c!r} out of range for dim {label!r} of size {size}")
            idx = idx * size + c
        return idx

    def slice(self, **dims: Any) -> Shape:
        """NumPy-like slice: ints drop a dim, Python slices keep it."""
        for dim in dims:
            if dim not in self.labels:
                raise SliceError(
                    f"mesh has no dimension {dim!r}; its dimensions are {list(self.labels)}"
                )
        labels, sizes, strides, offset = [], [], [], self.offset
        for label, size, stride in zip(self.labels, self.sizes, self.strides):
            if label not in dims:
                labels.append(label)
                sizes.append(size)
                strides.append(stride)
                continue
            sel = dims[label]
            if isinstance(sel, bool) or not isinstance(sel, (int, slice)):
                raise SliceError(f"dim {label!r} takes an int or a slice such as 0:2, got {sel!r}")
            if isinstance(sel, int):
                i = sel + size if sel < 0 else sel
                if not 0 <= i < size:
                    raise SliceError(f"index {sel} out of range for dim {label!r} of size {size}")
                offset += i * stride
                continue
            start, stop, step = sel.indices(size)
            if step <= 0:
                raise SliceError(f"slice step must be positive for dim {label!r}")
            n = len(range(start, stop, step))
            if n == 0:
                raise SliceError(f"slice {_fmt_slice(sel)} of dim {label!r} (size {size}) is empty")
            offset += start * stride
            labels.append(label)
            sizes.append(n)
            strides.append(stride * step)
        return Shape(tuple(labels), tuple(sizes), tuple(strides), offset)


def _fmt_slice(s: slice) -> str:
    text = f"{'' if s.start is None else s.start}:{'' if s.stop is None else s.stop}"
    return text + (f":{s.step}" if s.step not in (None, 1) else "")


_RANKS_FORMS = "a rank (2), a slice (0:2, ::2) or a list of them (1,3)"


def _valid_ranks(size: int, from_end: bool = False) -> str:
    """``the mesh has 4 ranks (0-3)``: what a --ranks value may name."""
    span = "0" if size == 1 else f"0-{size - 1}"
    if from_end:
        span += f", or -{size} to -1 counting from the end" if size > 1 else ", or -1"
    return f"the mesh has {size} rank{'s' if size != 1 else ''} ({span})"


def _rank_int(text: str, spec: str, what: str = "rank") -> int:
    try:
        return int(text)
    except ValueError:
        pass
    hint = ""
    lo, sep, hi = text.partition("-")
    if sep and lo.strip().isdigit() and hi.strip().isdigit():
        lo_i, hi_i = int(lo), int(hi)
        hint = (
            f" (for ranks {lo_i} to {hi_i} write {lo_i}:{hi_i + 1}; a slice stops before its end)"
        )
    raise SliceError(
        f"bad --ranks {spec!r}: {what} {text.strip()!r} is not an integer{hint}; use {_RANKS_FORMS}"
    )


def parse_ranks(spec: str, size: int) -> list[int]:
    """Parse a ``--ranks`` value into sorted, distinct flat indices ``< size``.

    Accepted: an index (``"2"``; negative counts from the end, ``"-1"`` is the last
    rank), a slice with Python semantics (``"0:2"``, ``"::2"``, ``"1:"``; bounds past the
    end are clipped, as in ``mesh.slice``) and comma-separated lists of those
    (``"1,3"``, ``"0,2:4"``). Anything else raises :class:`SliceError` saying what was
    wrong and what is valid: a non-integer, an index out of range, an empty item, a
    slice that selects no rank, a step of 0 or more than three slice parts.
    """
    if not isinstance(size, int) or size < 1:
        raise ValueError(f"a mesh has at least one rank, got size {size!r}")
    if not isinstance(spec, str) or not spec.strip():
        raise SliceError(f"empty --ranks; use {_RANKS_FORMS}: {_valid_ranks(size)}")
    out: list[int] = []
    for part in spec.split(","):
        item = part.strip()
        if not item:
            raise SliceError(
                f"bad --ranks {spec!r}: it has an empty item (two commas, or one at an end); "
                f"use {_RANKS_FORMS}"
            )
        if ":" in item:
            out.extend(_parse_slice(item, spec, size))
            continue
        i = _rank_int(item, spec)
        if not -size <= i < size:
            raise SliceError(f"rank {i} is out of range: {_valid_ranks(size, from_end=i < 0)}")
        out.append(i % size)
    return sorted(set(out))


def _parse_slice(item: str, spec: str, size: int) -> range:
    bits = item.split(":")
    if len(bits) > 3:
        raise SliceError(
            f"bad --ranks {spec!r}: slice {item!r} has {len(bits)} parts; "
            "a slice is start:stop or start:stop:step (e.g. 0:2 or ::2)"
        )
    nums = [_rank_int(b, spec, "slice part") if b.strip() else None for b in bits]
    if len(nums) == 3 and nums[2] == 0:
        raise SliceError(
            f"bad --ranks {spec!r}: slice {item!r} has a step of 0; "
            "use e.g. ::2 for every second rank"
        )
    picked = range(size)[slice(*nums)]
    if not picked:
        raise SliceError(f"slice {item!r} of --ranks selects no rank: {_valid_ranks(size)}")
    return picked


# -- mesh algebra: the same ranks under other dims (Monarch's ``rename`` / ``split``) --


def split_dims(shape: Shape, how: Mapping[str, Any]) -> Shape:
    """The same ranks with some dims split into several, row-major (the last part is
    the innermost): ``split_dims(s, {"host": ("dp", "pp"), "pp": 2})``. A key that is a
    dim of ``shape`` names its parts (a tuple or list of new names); any other key is
    the size of a new part. Each split may leave one part's size out (inferred)."""
    parts: dict[str, tuple[str, ...]] = {}
    sizes_given: dict[str, int] = {}
    for key, value in how.items():
        if key in shape.labels:
            if isinstance(value, str) or not isinstance(value, (tuple, list)):
                raise SliceError(
                    f"split: {key}={value!r} must be a tuple of new dim names, "
                    f"e.g. {key}=({value!r},) or {key}=('dp', 'pp')"
                )
            parts[key] = tuple(value)
        elif isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SliceError(
                f"split: {key!r} is not a dim of the mesh (dims {list(shape.labels)}); "
                f"as a new dim it takes a positive int size, got {value!r}"
            )
        else:
            sizes_given[key] = value
    labels: list[str] = []
    sizes: list[int] = []
    strides: list[int] = []
    for label, size, stride in zip(shape.labels, shape.sizes, shape.strides):
        names = parts.get(label, (label,))
        known = [sizes_given.pop(n, None) for n in names]
        missing = [n for n, k in zip(names, known) if k is None]
        product = 1
        for k in known:
            product *= k or 1
        if len(missing) > 1:
            raise SliceError(
                f"split of {label!r}: the sizes of {missing} are unknown; give all but "
                f"one, e.g. {missing[0]}=2"
            )
        if size % product or (not missing and product != size):
            given = tuple("?" if k is None else k for k in known)
            raise SliceError(
                f"split: dim {label!r} of size {size} is not {names} with sizes {given}"
            )
        full = [size // product if k is None else k for k in known]
        inner = stride
        part_strides: list[int] = []
        for k in reversed(full):
            part_strides.append(inner)
            inner *= k
        labels.extend(names)
        sizes.extend(full)
        strides.extend(reversed(part_strides))
    if sizes_given:
        raise SliceError(f"split: sizes given for {sorted(sizes_given)}, which no split names")
    if len(set(labels)) != len(labels):
        raise SliceError(f"split: duplicate dim names in {labels}")
    return Shape(tuple(labels), tuple(sizes), tuple(strides), shape.offset)


def rename_dims(shape: Shape, names: Mapping[str, str]) -> Shape:
    """The same ranks with dims renamed: ``rename_dims(s, {"host": "dp"})``."""
    for old, new in names.items():
        if old not in shape.labels:
            raise SliceError(
                f"rename: {old!r} is not a dim of the mesh (dims {list(shape.labels)})"
            )
        if not isinstance(new, str):
            raise SliceError(f"rename: {old}={new!r} must be the new name, a str")
    return split_dims(shape, {old: (new,) for old, new in names.items()})


def grid_table(shape: Shape) -> str:
    """The global ranks of ``shape`` as a text grid: the last dim across, one row per
    coordinate of the others (Monarch's ``to_table`` of a mesh)."""
    head = f"ranks of {shape.describe()}"
    if not shape.labels:
        return f"{head}\n{shape.offset}"
    ranks = shape.ranks()
    last, n = shape.labels[-1], shape.sizes[-1]
    columns = [f"{last} {i}" for i in range(n)]
    outer = Shape(shape.labels[:-1], shape.sizes[:-1])
    rows = []
    for r, coords in enumerate(outer._coords()):
        label = ", ".join(f"{d} {c}" for d, c in zip(outer.labels, coords))
        rows.append([label] + [str(x) for x in ranks[r * n : (r + 1) * n]])
    table = [[""] + columns] + rows
    widths = [max(len(row[i]) for row in table) for i in range(n + 1)]
    lines = [
        "  ".join(
            cell.ljust(w) if i == 0 else cell.rjust(w)
            for i, (cell, w) in enumerate(zip(row, widths))
        )
        for row in table
    ]
    return "\n".join([head] + [ln.rstrip() for ln in lines])
