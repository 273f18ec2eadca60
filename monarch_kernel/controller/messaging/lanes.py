"""The controller's ends of its same-machine lanes (:mod:`monarch_kernel.wire.lane`).

A mesh on unix sockets has all its ranks on this machine. Each rank is offered a lane
when it is ready (:meth:`Lanes.offer`, sent as an ordered ``lane`` message); the rank
maps it, sends ``lane_on`` over its socket as the last message it sends there, and from
then on sends everything to the controller through the lane. The controller starts
reading the lane's up ring, and writing its down ring, when that ``lane_on`` arrives
(:meth:`Lanes.activate`): whatever the rank sent before came over the socket before it,
so nothing a rank sends is reordered.

Down the lane, order is the rank's sequence numbers' (header ``q``): a message that does
not fit the ring's room goes over the socket and the rank puts it back in order, so the
controller's sends never wait (as with the backlogs).

Threads: :meth:`Lanes.send` runs under the transport's send lock; :meth:`Lanes.take`
and the other reads under the receive token, and :meth:`Lanes.drop` may come from either,
so the reading side has a lock of its own.
"""

from __future__ import annotations

import logging
import os
import select
import threading
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import zmq

from monarch_kernel.wire import lane as L

log = logging.getLogger("monarch_kernel.controller")

#: Lanes are offered to the ranks of meshes of at most this many ranks (each lane holds
#: two rings of ``RING_BYTES`` in ``/dev/shm``, which a container may keep small).
MAX_LANES = 256


class _Ident:
    """A routing id as the receive path reads it (``frames[0].bytes``), for messages
    that came through a lane rather than the ROUTER socket."""

    __slots__ = ("bytes",)

    def __init__(self, ident: bytes) -> None:
        self.bytes = ident

    def __len__(self) -> int:
        return len(self.bytes)


@dataclass
class LaneOffer:
    """What the ``lane`` message tells a rank: where to open its lane."""

    path: str  #: the lane file (``/proc/<pid>/fd/<n>``)
    wake: str  #: the pipe that wakes the rank (its down ring's)
    bell: str  #: the doorbell pipe the rank writes its slot to
    capacity: int  #: data bytes of each ring
    pid: int  #: this controller's process


class _Lane:
    """The controller's end of one rank's lane."""

    __slots__ = ("slot", "ident", "file", "keep", "wake_r", "wake_w", "active")

    def __init__(self, slot: int, ident: bytes, capacity: int) -> None:
        self.slot = slot
        self.ident = _Ident(ident)
        self.file, self.keep = L.LaneFile.create(capacity)
        try:
            self.wake_r, self.wake_w = L.pipe()
        except OSError:
            L.close_fds(self.keep)
            self.file.close()
            raise
        self.file.down.attach_writer()
        self.file.up.attach_reader()
        #: The rank took it (``lane_on``): read its up ring, write its down ring.
        self.active = False

    def opened(self) -> None:
        """The rank opened it: only the wake-up pipe's write end is needed from now on."""
        self.active = True
        L.close_fds(self.keep, self.wake_r)
        self.keep = self.wake_r = -1

    def close(self) -> None:
        self.active = False
        L.close_fds(self.keep, self.wake_r, self.wake_w)
        self.keep = self.wake_r = self.wake_w = -1
        self.file.close()


class Lanes:
    """The lanes of one mesh's controller."""

    def __init__(self, capacity: int = L.RING_BYTES) -> None:
        """Raises OSError where the doorbell pipe cannot be made."""
        self.capacity = capacity
        self.bell_r, self.bell_w = L.pipe()
        self._bell_poll = select.poll()
        self._bell_poll.register(self.bell_r, select.POLLIN)
        self._lanes: dict[int, _Lane] = {}  # slot -> lane, offered or active
        self._read_lock = threading.Lock()
        #: Messages read from the up rings, not handled yet: ``[ident, *frames]``.
        self._ready: deque[list[Any]] = deque()
        #: Slots whose up ring must be read whether or not their doorbell rang (just
        #: activated; the doorbell read overflowed).
        self._look: set[int] = set()
        self.closed = False
        #: Statistics (tests, benchmarks): messages sent down lanes, sent over the
        #: socket because a ring had no room, and read from lanes.
        self.sent = 0
        self.fallbacks = 0
        self.received = 0

    @property
    def active(self) -> bool:
        """Whether some lane is in use (else the receive path need not look)."""
        return bool(self._lanes)

    # -- offering, opening, dropping ----------------------------------------------------
    def offer(self, slot: int, ident: bytes) -> LaneOffer | None:
        """Make a lane for the rank of ``slot`` (routing id ``ident``), replacing one
        an earlier incarnation had; None (logged) where shared memory cannot be had."""
        self.drop(slot)
        if len(self._lanes) >= MAX_LANES or self.closed:
            return None
        try:
            lane = _Lane(slot, ident, self.capacity)
        except OSError as exc:
            log.info("rank slot %s: no same-machine lane (%s)", slot, exc)
            return None
        self._lanes[slot] = lane
        return LaneOffer(
            path=L.proc_path(lane.keep),
            wake=L.proc_path(lane.wake_r),
            bell=L.proc_path(self.bell_w),
            capacity=self.capacity,
            pid=os.getpid(),
        )

    def activate(self, slot: int) -> bool:
        """The rank of ``slot`` opened its lane (``lane_on``): use it both ways. The
        descriptors it opened through ``/proc`` are closed here (it has its own)."""
        lane = self._lanes.get(slot)
        if lane is None:
            return False
        lane.opened()
        with self._read_lock:
            self._look.add(slot)  # it may have written before its doorbell was heard
        return True

    def drop(self, slot: int) -> None:
        """Stop using the lane of ``slot`` (its rank restarts, or leaves the mesh): what
        its rank wrote up to now is read first, then the lane is closed."""
        lane = self._lanes.pop(slot, None)
        if lane is None:
            return
        with self._read_lock:
            if lane.active:
                self._read_ring(lane)
            lane.close()

    def close(self) -> None:
        """Close every lane and the doorbell (the mesh stops)."""
        self.closed = True
        with self._read_lock:
            for lane in self._lanes.values():
                lane.close()
            self._lanes.clear()
            L.close_fds(self.bell_r, self.bell_w)

    # -- down: controller -> rank (send lock held) --------------------------------------
    def send(self, slot: int, parts: Sequence[Sequence[Any]]) -> bool:
        """Write a message (``parts``: one, or a stream's start and chunks) down the lane
        of ``slot``: False when it has none in use, or the ring's room does not hold all
        of it (then nothing of it was written: it goes over the socket)."""
        lane = self._lanes.get(slot)
        if lane is None or not lane.active:
            return False
        ring = lane.file.down
        try:
            if len(parts) == 1:
                if not ring.try_put(parts[0]):
                    self.fallbacks += 1
                    return False
            else:
                if sum(L.record_size(frames) for frames in parts) > ring.room():
                    self.fallbacks += 1
                    return False
                for frames in parts:
                    ring.try_put(frames)
        except ValueError:  # closed meanwhile by a drop on another thread
            return False
        L.ring_bell(lane.wake_w, b"\0")
        self.sent += 1
        return True

    # -- up: rank -> controller (receive token held) ------------------------------------
    def pending(self) -> bool:
        """Whether a message may be waiting in a lane (a system call, no read)."""
        return bool(self._ready or self._look or self._bell_poll.poll(0))

    def take(self) -> list[Any] | None:
        """The next message read from a lane, ``[ident, *frames]`` as the ROUTER socket
        gives them; None when none is there (no blocking)."""
        ready = self._ready
        if not ready:
            self._collect()
            if not ready:
                return None
        return ready.popleft()

    def take_all(self, slot: int) -> list[list[Any]]:
        """Every message read from the lanes and not handled yet, and all that the
        rank of ``slot`` wrote to its lane since (its death is handled after them)."""
        with self._read_lock:
            lane = self._lanes.get(slot)
            if lane is not None and lane.active:
                self._read_ring(lane)
            out = list(self._ready)
            self._ready.clear()
        return out

    def _collect(self) -> None:
        """Read the doorbell and every ring it named (one system call when nothing rang)."""
        data = L.drain(self.bell_r)
        with self._read_lock:
            look = self._look
            if not data and not look:
                return
            slots, overflow = L.bell_slots(data)
            if overflow:
                slots = set(self._lanes)
            if look:
                slots |= look
                look.clear()
            lanes = self._lanes
            for slot in slots:
                lane = lanes.get(slot)
                if lane is not None and lane.active:
                    self._read_ring(lane)

    def _read_ring(self, lane: _Lane) -> None:
        """Move every whole record of ``lane``'s up ring to the ready messages (read
        lock held)."""
        ring = lane.file.up
        ready = self._ready
        try:
            while ring.pending():
                frames = ring.take()
                if frames is None:
                    return  # a large record, part-way: its writer rings again
                ready.append([lane.ident, *frames])
                self.received += 1
        except L.LaneError as exc:
            log.warning("rank slot %s: its lane is dropped: %s", lane.slot, exc)
            lane.active = False
        except ValueError:
            pass  # closed meanwhile

    def register(self, poller: zmq.Poller) -> None:
        """Wait for the doorbell in ``poller`` too."""
        poller.register(self.bell_r, zmq.POLLIN)
