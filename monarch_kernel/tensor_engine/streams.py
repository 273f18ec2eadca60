"""Streams (Monarch's ``Stream``): named lanes of ops, and what a storage allows.

Every mesh tensor belongs to a stream (the active one when it was made; ``main`` unless
``stream.activate()`` says otherwise) and an op takes only tensors of the active stream
(``WRONG_STREAM`` otherwise). ``stream.borrow(t)`` hands a tensor to another stream
(:mod:`.borrows`): :class:`StorageAliases` records, per storage, which of reading and
writing its tensors allow meanwhile (``BORROWED`` / ``MUTATING_BORROW`` otherwise).

On CPU ranks a stream is a logical ordering domain: the ranks run every stream's ops in
the one order they were issued, on their main thread (Monarch runs a thread per stream;
the borrow rules here are the same, so a program that is correct with Monarch's
parallel streams is correct here, and the reverse).
"""

from __future__ import annotations

import traceback
import weakref
from dataclasses import dataclass
from typing import Any

from monarch_kernel.tensor_engine import state


class Stream:
    """A named lane of ops on every rank of a mesh (see the module docstring)."""

    def __init__(self, name: str, _default: bool = False):
        self.name = name
        self.default = _default

    def __repr__(self) -> str:
        return f"<Stream({self.name!r}) at {hex(id(self))}>"

    def __str__(self) -> str:
        return f"stream {self.name!r}"

    def activate(self) -> StreamActivation:
        """Make this the active stream now (Monarch's rule: at the call, not at
        ``with``), until the ``with`` block ends or ``.deactivate()``: ops issued
        meanwhile take and make tensors of this stream."""
        return StreamActivation(self)

    def borrow(self, t: Any, mutable: bool = False) -> tuple[Any, Any]:
        """``(borrowed, borrow)``: ``t`` lent to this stream. Until ``borrow.drop()``,
        ``t``'s stream may read ``t`` but neither side write it; with ``mutable``,
        this stream may write it and ``t``'s stream may not use it at all. The borrowed
        tensor (and its views) are dropped with the borrow."""
        return state.reducers["borrow"](self, t, mutable)  # type: ignore[no-any-return]


class StreamActivation:
    """One activation of a stream: a context manager that ends it."""

    def __init__(self, stream: Stream):
        self.stream = stream
        self._ended = False
        state.streams.append(stream)

    def deactivate(self) -> None:
        """End this activation (the innermost one)."""
        if self._ended:
            return
        if not state.streams or state.streams[-1] is not self.stream:
            raise RuntimeError("stream activations must end in reverse order of their start")
        self._ended = True
        state.streams.pop()

    def __enter__(self) -> Stream:
        return self.stream

    def __exit__(self, *exc: object) -> None:
        self.deactivate()


#: The stream active when no other is.
main = Stream("main", _default=True)
state.default_stream = main


def get_active_stream() -> Stream:
    """The active stream (``main`` unless a ``stream.activate()`` is in effect)."""
    s: Stream = state.active_stream()
    return s


class StorageAliases:
    """The mesh tensors of one storage on one stream, and what they may do: ``access``
    holds ``r`` (may be read) and ``w`` (may be written). A borrow's tensors have a
    storage of their own, ``borrowed_from`` the lender's."""

    __slots__ = ("access", "granted", "aliases", "borrowed_from", "live_borrows", "__weakref__")

    def __init__(self) -> None:
        self.access = "rw"
        #: what ``access`` comes back to when the last borrow of it is dropped
        self.granted = "rw"
        self.aliases: weakref.WeakSet[Any] = weakref.WeakSet()
        self.borrowed_from: StorageAliases | None = None
        #: the borrows of this storage not yet dropped
        self.live_borrows: weakref.WeakSet[Any] = weakref.WeakSet()


@dataclass(frozen=True)
class DropLocation:
    """Where mesh tensor ``ref`` was dropped (shown when it is used after)."""

    ref: int
    frames: list[traceback.FrameSummary]

    def __str__(self) -> str:
        return f"tensor {self.ref} is dropped at: \n" + "".join(traceback.format_list(self.frames))


#: Frames of the stack a drop location keeps (the innermost).
DROP_FRAMES = 8


def drop_location(ref: int) -> DropLocation:
    """The caller's stack (its innermost frames), for a tensor dropped now."""
    return DropLocation(ref, traceback.extract_stack()[:-2][-DROP_FRAMES:])
