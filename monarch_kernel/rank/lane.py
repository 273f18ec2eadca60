"""A rank's end of its same-machine lane to the controller (:mod:`monarch_kernel.wire.lane`).

The controller offers the lane with an ordered ``lane`` message once the rank is ready
(:func:`open_lane`, its handler). The rank maps it and, under the outbox's lock, sends
``lane_on`` over its socket and switches the outbox to the lane: every message sent
before came over the socket before ``lane_on``, every one after comes through the lane,
so the controller sees one order. The inbox then reads the lane's down ring beside its
socket; the sequence numbers put the two in order.

A child forked from the rank (``os.fork`` in user code) must not write the rank's rings
(one writer each): the lane is dropped in the child, which sends over the socket as
before.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

from monarch_kernel.wire import headers as H
from monarch_kernel.wire import lane as L
from monarch_kernel.wire.osutil import pid_gone

log = logging.getLogger("monarch_kernel.rank")

#: While the up ring is full, the writer sleeps this long at first, doubling up to
#: :data:`_WAIT_MAX` (a full ring is rare: the controller reads as it waits) ...
_WAIT_MIN, _WAIT_MAX = 50e-6, 5e-3
#: ... and looks this often whether the controller is still there.
_ALIVE_EVERY = 0.2


class LaneGone(RuntimeError):
    """The controller went away while the rank waited for room in its lane."""


class RankLane:
    """The rank's end of its lane: reads the down ring, writes the up ring."""

    def __init__(self, hdr: H.Lane, slot: int) -> None:
        """Open what ``hdr`` names; raises OSError where this process cannot (another
        machine, another user, the controller gone)."""
        self.file = L.LaneFile.open(hdr.path, hdr.capacity)
        try:
            self.wake = L.open_pipe(hdr.wake)
            try:
                self.bell = L.open_pipe(hdr.bell)
            except OSError:
                L.close_fds(self.wake)
                raise
        except OSError:
            self.file.close()
            raise
        self.down = self.file.down
        self.up = self.file.up
        self.down.attach_reader()
        self.up.attach_writer()
        self.controller = hdr.controller
        self._slot = L.slot_bytes(slot)
        self.closed = False
        self._delay = _WAIT_MIN  # the next sleep while the up ring is full
        self._looked = time.monotonic()  # when the controller was last seen alive

    # -- the down ring (the inbox's reader) -------------------------------------------
    def pending(self) -> bool:
        """Whether a message waits in the down ring (no system call)."""
        return self.down.pending()

    def take(self) -> Sequence[Any] | None:
        """The next message of the down ring, or None."""
        return self.down.take()

    def drain_wake(self) -> None:
        """Empty the wake-up pipe (before looking at the ring and blocking)."""
        L.drain(self.wake)

    # -- the up ring (the outbox's lock held) ---------------------------------------
    def send(self, frames: Sequence[Any]) -> None:
        """Write one message up the lane and ring the controller's doorbell; waits for
        room while the ring is full. Raises :class:`LaneGone` when the controller went
        away meanwhile."""
        self.up.put(frames, self._wait_for_room)
        L.ring_bell(self.bell, self._slot)
        self._delay = _WAIT_MIN

    def _wait_for_room(self) -> None:
        """Called by ``Ring.put`` while the ring is full: what is written so far is
        published; wake the controller, sleep a little, look whether it is alive."""
        L.ring_bell(self.bell, self._slot)
        time.sleep(self._delay)
        if self.up.room() > 0:
            # The controller keeps up: wait as little the next time. (Kept growing over
            # the pieces of one large record, the sleep reached _WAIT_MAX for each ring's
            # worth of it: a 2 GiB result came up at 50 MB/s.)
            self._delay = _WAIT_MIN
        else:
            self._delay = min(self._delay * 2, _WAIT_MAX)
        now = time.monotonic()
        if now - self._looked >= _ALIVE_EVERY:
            self._looked = now
            if pid_gone(self.controller):
                raise LaneGone(f"the controller (pid {self.controller}) is gone")

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        L.close_fds(self.wake, self.bell)
        self.file.close()


class LaneOutbox(Protocol):
    """What :func:`open_lane` switches (``rank.outbox.Outbox``)."""

    lock: threading.Lock

    def switch_to_lane(self, lane: RankLane) -> bool: ...


class LaneInbox(Protocol):
    """What reads the lane's down ring (``rank.inbox.Inbox``)."""

    def read_lane(self, lane: RankLane) -> None: ...


_forked_child_hook = False


def open_lane(hdr: H.Lane, slot: int, outbox: LaneOutbox, inbox: LaneInbox) -> None:
    """The ``lane`` message's handler: open the lane and use it both ways; or leave
    everything on the socket (logged) where it cannot be opened, or the outbox does not
    take it (a detachable mesh's rank)."""
    try:
        lane = RankLane(hdr, slot)
    except OSError as exc:
        log.info("rank slot %s: no same-machine lane: %s", slot, exc)
        return
    if not outbox.switch_to_lane(lane):
        lane.close()
        return
    inbox.read_lane(lane)
    global _forked_child_hook
    if not _forked_child_hook:
        _forked_child_hook = True
        os.register_at_fork(after_in_child=lambda: _drop_in_child(outbox, inbox))


def _drop_in_child(outbox: Any, inbox: Any) -> None:
    """In a child forked from the rank: its lane is its parent's."""
    outbox.lane = None
    inbox.lane = None
