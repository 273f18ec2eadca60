"""``ValueMesh``: one value per point of a (sliced) mesh."""

from __future__ import annotations

import pprint
import textwrap
from collections.abc import Iterator, Sequence
from typing import Any, Generic, TypeVar

from monarch_kernel.shape import Extent, Point, Shape

T = TypeVar("T")


class ValueMesh(Generic[T]):
    """Values gathered from a mesh, addressable by coordinates.

    Iterating (and ``items()``) yields ``(Point, value)``; ``values()`` the values in
    rank order; ``item(**coords)`` one value; ``len()`` the number of points.
    """

    def __init__(self, shape: Shape, values: list[T]):
        if len(values) != len(shape):
            raise ValueError("a ValueMesh needs one value per point")
        self._shape = shape
        self._values = list(values)

    @property
    def shape(self) -> Shape:
        return self._shape

    @property
    def extent(self) -> dict[str, int]:
        return self._shape.extent

    def __len__(self) -> int:
        return len(self._values)

    def items(self) -> Iterator[tuple[Point, T]]:
        return zip(self._shape.points(), self._values)

    __iter__ = items

    def values(self) -> list[T]:
        return list(self._values)

    def item(self, **coords: int) -> T:
        """The value at ``coords`` (all dims must be given; none for a 0-dim mesh)."""
        return self._values[self._shape.index_of(coords)]

    def __getitem__(self, index: int) -> T:
        return self._values[index]

    def get(self, rank: int) -> T:
        """The value at linear position ``rank`` (0 .. len-1), as Monarch's."""
        return self._values[rank]

    @property
    def sizes(self) -> dict[str, int]:
        return self._shape.extent

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of values: all, or the product of the named dims' sizes."""
        if dim is None:
            return len(self._values)
        n = 1
        for d in [dim] if isinstance(dim, str) else dim:
            n *= self._shape.extent[d]
        return n

    def slice(self, **dims: Any) -> ValueMesh[T]:
        """The values of a slice (ints drop a dim, Python slices keep it)."""
        index = {r: i for i, r in enumerate(self._shape.ranks())}
        sub = self._shape.slice(**dims)
        return ValueMesh(sub, [self._values[index[r]] for r in sub.ranks()])

    def flatten(self, name: str) -> ValueMesh[T]:
        """The same values along one dimension ``name``."""
        return ValueMesh(Shape((name,), (len(self._values),)), self._values)

    def rename(self, **names: str) -> ValueMesh[T]:
        """Rename dims: ``vm.rename(gpus="tp")``."""
        sh = self._shape
        for old in names:
            if old not in sh.labels:
                raise KeyError(f"no dimension {old!r} (dimensions: {list(sh.labels)})")
        labels = tuple(names.get(label, label) for label in sh.labels)
        return ValueMesh(Shape(labels, sh.sizes, sh.strides, sh.offset), self._values)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ValueMesh)
            and self._shape.extent == other._shape.extent
            and self._values == other._values
        )

    def __repr__(self) -> str:
        """Monarch's form: the extent, then the ``(point, value)`` pairs, pretty-printed::

        ValueMesh({gpus: 2}):
          (({'gpus': 0/2}, 1), ({'gpus': 1/2}, 11))
        """
        pairs = tuple((_Shown(str(p)), v) for p, v in self.items())
        extent = Extent(self._shape.labels, self._shape.sizes)
        return f"ValueMesh({extent}):\n{textwrap.indent(pprint.pformat(pairs), '  ')}"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        """IPython's text form (a cell's result in the notebook): one compact line,
        ``ValueMesh(gpus=2; {gpus=0}: 1, {gpus=1}: 11)``."""
        body = ", ".join(f"{_coords(pt)}: {v!r}" for pt, v in self.items())
        p.text(f"ValueMesh({self._shape.describe()}; {body})")

    def _repr_html_(self) -> str:
        import html

        labels = self._shape.labels
        head = "".join(f"<th>{html.escape(label)}</th>" for label in labels)
        rows = []
        for p, v in self.items():
            cells = "".join(f"<td>{p[label]}</td>" for label in labels)
            rows.append(
                f"<tr>{cells}<td style='text-align:left'><code>"
                f"{html.escape(repr(v))[:500]}</code></td></tr>"
            )
        return (
            f"<table class='monarch-valuemesh'><thead><tr>{head}<th>value</th></tr></thead>"
            f"<tbody>{''.join(rows)}</tbody></table>"
        )


def _coords(p: Point) -> str:
    return "{" + ", ".join(f"{k}={v}" for k, v in p.items()) + "}" if len(p) else "{}"


class _Shown:
    """Prints as the text it was given (a Point inside a pretty-printed tuple)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __repr__(self) -> str:
        return self.text
