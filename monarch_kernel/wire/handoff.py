"""Value semantics for zero-copy sends: a value goes as it was when it was sent.

Tensor and array data travel zero-copy: libzmq keeps a reference to the sender's own
memory and reads it later, from its I/O thread, when it writes the message to the
socket. Had the sender changed the tensor meanwhile (``t.fill_(0)`` right after
``broadcast(t)``, an optimizer step on the rank right after an endpoint returned its
weights), the other side would get the new bytes, or a mix of old and new: a silent
inconsistency. So a send of user values runs inside :func:`values`: every zero-copy
frame sent in it (:func:`.codec.send`) is tracked, and leaving the
block waits until libzmq has let go of them all, i.e. until the bytes are in the
kernel's socket buffer or the peer's queue (normally well before the call's reply). A
message that cannot go yet (a busy peer's full queue: ``controller.messaging.backlog``) is
:func:`owned`: its large frames copied, as the user's memory cannot be held for an
unknown time. MPI's blocking send makes the same promise: when it returns, the buffer
may be reused.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import zmq

_local = threading.local()

T = TypeVar("T")


class Handoff:
    """The zero-copy frames sent in one :func:`values` block (their trackers)."""

    __slots__ = ("trackers",)

    def __init__(self) -> None:
        self.trackers: list[zmq.MessageTracker] = []

    def wait(self) -> None:
        """Until libzmq let go of every frame (an interrupt stops the wait)."""
        for tracker in self.trackers:
            tracker.wait()
        self.trackers.clear()


def current() -> Handoff | None:
    """The block this thread's zero-copy sends are tracked for (None: untracked)."""
    return getattr(_local, "handoff", None)


@contextmanager
def values() -> Iterator[Handoff]:
    """Track the zero-copy frames sent in this block, and on leaving it normally, wait
    until libzmq let go of them. Enter it outside any lock the sending holds: the wait
    comes after them. Nested blocks belong to the outermost one."""
    outer = current()
    if outer is not None:
        yield outer
        return
    mine = _local.handoff = Handoff()
    try:
        yield mine
    finally:
        _local.handoff = None
    mine.wait()


def sending(buffers: Sequence[Any], send: Callable[..., T], *args: Any) -> T:
    """``send(*args)`` (what it returns), inside :func:`values` when ``buffers`` (the
    message's out-of-band buffers) are not empty: only those can be the caller's memory
    (a payload is immutable ``bytes``), and a message without them, most messages, pays
    nothing."""
    if not buffers:
        return send(*args)
    with values():
        return send(*args)


def owned(frames: list[Any], threshold: int) -> list[Any]:
    """``frames`` with every frame that would go zero-copy (``threshold`` bytes or
    more, not immutable ``bytes``) replaced by a copy: for a message kept back."""
    out = frames
    for i, f in enumerate(frames):
        if f.__class__ is bytes:
            continue
        view = memoryview(f)
        if view.nbytes >= threshold:
            if out is frames:
                out = list(frames)
            out[i] = view.tobytes()
    return out
