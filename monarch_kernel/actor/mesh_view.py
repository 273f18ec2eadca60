r"""What every mesh handle shares, process mesh or actor mesh: a requester, the (sliced)
shape it refers to, the sizes and ranks read off it, and the controller behind it where
there is one (:class:`MeshView`). Its attributes are :class:`mesh_attribute`\ s, which
an endpoint of the same name shadows (see :mod:`.meshes`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast, overload

from monarch_kernel.shape import Extent, Shape, SliceError

if TYPE_CHECKING:
    from monarch_kernel.calls.requester import Requester
    from monarch_kernel.controller.mesh import MeshRuntime

T = TypeVar("T")


class mesh_attribute(Generic[T]):
    """A read-only mesh attribute that an endpoint of the same name shadows.

    Unlike ``property`` it is a non-data descriptor, so an endpoint stored in the
    instance's ``__dict__`` wins. On the class it is callable: ``ActorMesh.name(mesh)``
    reads the shadowed attribute of ``mesh``.
    """

    def __init__(self, fget: Callable[[Any], T]):
        self._fget = fget
        self.__doc__ = fget.__doc__

    @overload
    def __get__(self, obj: None, owner: type) -> mesh_attribute[T]: ...

    @overload
    def __get__(self, obj: object, owner: type | None = None) -> T: ...

    def __get__(self, obj: object, owner: type | None = None) -> T | mesh_attribute[T]:
        if obj is None:
            return self
        return self._fget(obj)

    def __call__(self, obj: object) -> T:
        return self._fget(obj)


def size_of(shape: Shape, dim: str | Sequence[str] | None) -> int:
    """Monarch's ``size()``: all ranks, or the product of the named dims' sizes."""
    if dim is None:
        return len(shape)
    dims = [dim] if isinstance(dim, str) else list(dim)
    extent = shape.extent
    n = 1
    for d in dims:
        if d not in extent:
            raise KeyError(f"mesh has no dimension {d!r} (dimensions: {list(extent)})")
        n *= extent[d]
    return n


class MeshView:
    """What process and actor meshes share: a requester, a shape, slicing."""

    _requester: Requester
    _shape: Shape

    @mesh_attribute
    def shape(self) -> Shape:
        """The (sliced) shape this handle refers to."""
        return self._shape

    @mesh_attribute
    def extent(self) -> Extent:
        """Dimension -> size, in order (Monarch's ``Extent``: ``str()`` is ``{gpus: 4}``)."""
        return Extent(self._shape.labels, self._shape.sizes)

    @property
    def _labels(self) -> list[str]:
        """The dimension names, in order (Monarch's ``MeshTrait._labels``)."""
        return list(self._shape.labels)

    @mesh_attribute
    def sizes(self) -> dict[str, int]:
        """Dimension -> size (Monarch's name)."""
        return self._shape.extent

    @mesh_attribute
    def runtime(self) -> MeshRuntime:
        """The controller's ``MeshRuntime`` of this mesh (in the notebook that owns it)."""
        return self._controller("runtime")

    def __len__(self) -> int:
        return len(self._shape)

    def size(self, dim: str | Sequence[str] | None = None) -> int:
        """Number of ranks: of the whole mesh, or the product of the named dims' sizes."""
        return size_of(self._shape, dim)

    def ranks(self) -> list[int]:
        """Global ranks of this (sliced) mesh, in row-major order."""
        return self._shape.ranks()

    def _flat_shape(self, name: str) -> Shape:
        """This mesh's ranks as one dimension ``name`` (row-major order)."""
        sh = self._shape
        flat = Shape((name,), (len(sh),), (1,), sh.offset)
        if flat.ranks() != sh.ranks():
            raise SliceError(
                f"cannot flatten {sh.describe()}: its ranks are not contiguous "
                "(a slice with a step or over an inner dimension)"
            )
        return flat

    def _controller(self, what: str) -> MeshRuntime:
        """The controller's runtime behind this handle; a clear error in a rank."""
        # Never imported here: a rank has no controller module loaded, so its requester
        # cannot be a MeshRuntime.
        mod = sys.modules.get("monarch_kernel.controller.mesh")
        if mod is not None and isinstance(self._requester, mod.MeshRuntime):
            return cast("MeshRuntime", self._requester)
        raise RuntimeError(
            f"{type(self).__name__}.{what} is only available in the notebook that started "
            f"mesh {self._requester.name!r}; this is a reference to it in a rank (it can "
            "spawn actors, call their endpoints and stop the mesh)"
        )
