"""What cached propagation brings back from its one real run of a remote function: each
tensor output's shape, strides and dtype, and its *storage*: its own, or that of one of
the call's arguments or of an earlier output (a view, ``x.chunk(4)``), at an offset. The
controller makes its fakes from it, views of the inputs' fakes where the outputs are
views of the inputs, so the mesh tensors it makes are known as their aliases.

Made on a rank by :func:`monarch_kernel.rank.tensors.propagation.output_patterns`, read
by :mod:`monarch_kernel.tensor_engine.remote_functions`. Nothing here imports torch.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class StorageOwner(enum.Enum):
    """Whose storage a tensor output uses."""

    #: its own (none of the arguments' nor an earlier output's)
    NEW = "new"
    #: that of an argument: ``index`` is its position among the call's pytree leaves
    ARGUMENT = "argument"
    #: that of an earlier tensor output: ``index`` is its position among the outputs'
    #: patterns (pytree leaf order)
    OUTPUT = "output"


@dataclass(frozen=True, slots=True)
class OutputPattern:
    """One tensor output of a remote function, without its values."""

    size: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str  #: as ``torch.<name>`` names it
    #: where it starts in its storage, in elements of ``dtype``
    storage_offset: int
    owner: StorageOwner
    #: see :class:`StorageOwner` (0 for ``NEW``)
    index: int
    #: the storage's size in elements of ``dtype`` (for ``NEW``: the fake's storage)
    storage_numel: int
