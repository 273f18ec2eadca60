"""``ValueMesh``: one value per point of a (sliced) mesh."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Generic, TypeVar

from monarch_kernel.shape import Point, Shape

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

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, ValueMesh)
            and self._shape.extent == other._shape.extent
            and self._values == other._values
        )

    def __repr__(self) -> str:
        body = ", ".join(f"{_coords(p)}: {v!r}" for p, v in self.items())
        return f"ValueMesh({self._shape.describe()}; {body})"

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
