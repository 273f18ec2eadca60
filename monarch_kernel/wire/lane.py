"""A same-machine lane: messages between the controller and one rank of its own machine
through shared memory, with no libzmq I/O thread on the way.

Why: on one machine most of a small call's time on ZeroMQ is libzmq's machinery. A
message goes from the sending thread to the sender's I/O thread, through a unix socket,
to the receiver's I/O thread and on to the receiving thread, waking each in turn. A
gathered call is a chain of those wake-ups (``bench/results/call-floor.md``). A lane
copies the message into a ring in shared memory and wakes the reader once, through a
pipe.

Layout. The controller makes one file per rank (0600 in ``/dev/shm``, unlinked at
once: reached by the rank through ``/proc/<controller pid>/fd/<n>``, so nothing is left
if either dies). It holds two :class:`Ring` s: *down* (controller -> rank) and *up*
(rank -> controller). A ring is a byte ring: ``head`` (bytes ever written, the writer's),
``tail`` (bytes ever read, the reader's), each on its own cache line, then the data. A
record is ``u32 total, u32 n, n x u32 frame length, the frames``; records wrap at the
end of the data.

Invariants:

* one writer and one reader per ring at a time (the controller's send lock, the rank's
  outbox lock; the controller's receive token, the rank's inbox reader);
* the writer stores a record's bytes, then ``head``; the reader loads ``head``, then the
  bytes, then stores ``tail``. x86 keeps stores in order and loads in order, which is
  what makes that enough without fences: :func:`supported` is False elsewhere;
* a record is published whole (:meth:`Ring.try_put`) or, when larger than the room left,
  in pieces as the reader frees room (:meth:`Ring.put`, the rank's sends only); the reader
  copies a record that is not all there yet into a buffer of its own, so a record may be
  larger than the ring.

Wake-ups: after every record the writer writes to a pipe the reader polls (beside its
ZeroMQ sockets); the reader drains the pipe before it looks at the ring and blocks, so a
record written after that look always finds a byte in the pipe. Each rank's down ring has
a pipe of its own (a byte each); the up rings share one *doorbell* pipe into which each
rank writes its slot (four bytes, atomic below ``PIPE_BUF``), so the controller reads
only the rings that rang. A full pipe drops the byte: the reader is woken anyway, and a
doorbell read that nearly fills its buffer makes the controller look at every ring.

Trust: the records are the codec's signed messages, verified on receipt as over the
sockets. The file and the pipes are reachable only by processes of the same user.
"""

from __future__ import annotations

import mmap
import os
import platform
import struct
from collections.abc import Callable, Sequence
from typing import Any

from monarch_kernel.wire.arena import SHM_DIR, unlinked_shm_file
from monarch_kernel.wire.chunks import flat_view
from monarch_kernel.wire.codec import MAX_FRAMES

#: ``0`` turns lanes off (every message goes over the sockets, as before).
LANES_ENV = "MONARCH_KERNEL_LANES"
#: Data bytes of one ring (each direction). A record larger than the room left goes over
#: the socket (controller) or in pieces (rank): 256 KiB holds hundreds of small calls.
RING_BYTES = 256 << 10
#: Offsets in a ring: ``head``, ``tail`` (own cache lines), the data.
_HEAD, _TAIL, _DATA = 0, 64, 128
#: A record's first two words: its total size and its frame count.
_WORDS = struct.Struct("<II")
_U64 = struct.Struct("<Q")
#: The most one doorbell read takes; a read of at least :data:`_BELL_FULL` bytes may
#: have missed rings whose bytes the full pipe dropped.
_BELL_READ = 1 << 16
_BELL_FULL = _BELL_READ - 64
_SLOT = struct.Struct("<I")


class LaneError(RuntimeError):
    """A ring holds something that is not a record (its other end wrote past the rules)."""


def supported() -> bool:
    """Whether lanes may be used here: Linux on x86-64 (see the memory-order invariant),
    ``/dev/shm`` present, and not turned off by :data:`LANES_ENV`."""
    return (
        os.environ.get(LANES_ENV) != "0"
        and platform.system() == "Linux"
        and platform.machine() in ("x86_64", "AMD64")
        and os.path.isdir(SHM_DIR)
    )


def _views(frames: Sequence[Any]) -> tuple[list[Any], list[int], int]:
    """``frames`` as bytes or flat views, their sizes, and the bytes of their record."""
    views: list[Any] = [f if f.__class__ is bytes else flat_view(f) for f in frames]
    sizes = [len(v) if v.__class__ is bytes else v.nbytes for v in views]
    return views, sizes, _WORDS.size + 4 * len(views) + sum(sizes)


def record_size(frames: Sequence[Any]) -> int:
    """Bytes of the record of ``frames`` in a ring."""
    return _views(frames)[2]


def ring_span(capacity: int) -> int:
    """Bytes of one ring of ``capacity`` data bytes in the file."""
    return _DATA + capacity


class Ring:
    """One direction of a lane: a byte ring at ``base`` of the shared mapping ``mem``."""

    __slots__ = ("_mem", "_base", "_data", "capacity", "_pos", "_partial", "_filled")

    def __init__(self, mem: mmap.mmap, base: int, capacity: int) -> None:
        self._mem = mem
        self._base = base
        self._data = base + _DATA
        self.capacity = capacity
        #: The writer's ``head`` or the reader's ``tail`` (each end keeps its own copy).
        self._pos = 0
        #: The reader's record that was not all there yet, and how much of it it has.
        self._partial: bytearray | None = None
        self._filled = 0

    # -- the writer ------------------------------------------------------------------
    def attach_writer(self) -> None:
        """Become this ring's writer (from where the ring is now)."""
        self._pos = _U64.unpack_from(self._mem, self._base + _HEAD)[0]

    def attach_reader(self) -> None:
        """Become this ring's reader (from where the ring is now)."""
        self._pos = _U64.unpack_from(self._mem, self._base + _TAIL)[0]

    def room(self) -> int:
        """Bytes the writer may write now."""
        tail: int = _U64.unpack_from(self._mem, self._base + _TAIL)[0]
        return self.capacity - (self._pos - tail)

    def try_put(self, frames: Sequence[Any]) -> bool:
        """Write one record of ``frames`` if it fits whole in the room left (else
        nothing, False)."""
        return self._put(*_views(frames), None)

    def put(self, frames: Sequence[Any], wait: Callable[[], None]) -> None:
        """Write one record of ``frames``, publishing it in pieces when it is larger than
        the room left; ``wait()`` is called while the ring is full (it may raise)."""
        self._put(*_views(frames), wait)

    def _put(
        self, views: list[Any], sizes: list[int], total: int, wait: Callable[[], None] | None
    ) -> bool:
        """Write one record: at once where it fits whole in the room left and does not
        cross the ring's end; else piece by piece where it may (``wait`` given, or it
        fits); else nothing (False)."""
        n = len(views)
        mem, pos, cap = self._mem, self._pos, self.capacity
        fits = total <= cap - (pos - _U64.unpack_from(mem, self._base + _TAIL)[0])
        if not fits and wait is None:
            return False
        at = pos % cap
        if not fits or at + total > cap:  # too large for the room, or across the end
            self._write_record(views, sizes, total, wait)
            return True
        at += self._data
        words = _words(n)
        words.pack_into(mem, at, total, n, *sizes)
        at += words.size
        for v, size in zip(views, sizes):
            mem[at : at + size] = v
            at += size
        self._pos = pos + total
        self._publish()
        return True

    def _write_record(
        self,
        views: Sequence[Any],
        sizes: list[int],
        total: int,
        wait: Callable[[], None] | None,
    ) -> None:
        head = _words(len(views)).pack(total, len(views), *sizes)
        for piece in (memoryview(head), *(memoryview(v) for v in views)):
            while piece.nbytes:
                room = self.room()
                if room <= 0:
                    assert wait is not None  # _put checked the room first
                    self._publish()
                    wait()
                    continue
                n = min(room, piece.nbytes)
                self._copy_in(piece[:n])
                piece = piece[n:]
        self._publish()

    def _copy_in(self, data: memoryview) -> None:
        at = self._pos % self.capacity
        n = data.nbytes
        first = min(n, self.capacity - at)
        mem, start = self._mem, self._data + at
        mem[start : start + first] = data[:first]
        if first < n:
            mem[self._data : self._data + n - first] = data[first:]
        self._pos += n

    def _publish(self) -> None:
        _store(self._mem, self._base + _HEAD, self._pos)

    # -- the reader ------------------------------------------------------------------
    def pending(self) -> bool:
        """Whether bytes wait to be read (no system call)."""
        head: int = _U64.unpack_from(self._mem, self._base + _HEAD)[0]
        return head != self._pos

    def take(self) -> list[bytes] | list[memoryview] | None:
        """The next whole record's frames, or None when it is not all there yet (what is
        there of a large one is moved out, to make room for the rest). Raises
        :class:`LaneError` on a record that breaks the format."""
        mem, pos, cap = self._mem, self._pos, self.capacity
        avail = _U64.unpack_from(mem, self._base + _HEAD)[0] - pos
        if avail < 0 or avail > cap:
            raise LaneError(f"head {pos + avail} is not within a ring of the tail {pos}")
        if self._partial is None:
            if avail < _WORDS.size:
                return None
            at = pos % cap
            if at + _WORDS.size <= cap:
                total, n = _WORDS.unpack_from(mem, self._data + at)
            else:
                total, n = _WORDS.unpack(self._read(pos, _WORDS.size))
            if n < 1 or n > MAX_FRAMES or total < _WORDS.size + 4 * n:
                raise LaneError(f"a record of {total} bytes in {n} frames")
            if avail >= total:  # the common case: all there, read at once
                if at + total <= cap:
                    at += self._data
                    record = mem[at : at + total]
                else:
                    record = self._read(pos, total)
                self._advance(total)
                return _frames(record, total, n)
            self._partial = bytearray(total)
            self._filled = 0
        partial = self._partial
        assert partial is not None
        n = min(avail, len(partial) - self._filled)
        if n:
            partial[self._filled : self._filled + n] = self._read(pos, n)
            self._filled += n
            self._advance(n)
        if self._filled < len(partial):
            return None
        self._partial = None
        total, n = _WORDS.unpack_from(partial, 0)
        return _frames(partial, total, n)

    def _read(self, pos: int, n: int) -> bytes:
        at = pos % self.capacity
        mem, start = self._mem, self._data + at
        if at + n <= self.capacity:
            return mem[start : start + n]
        first = self.capacity - at
        return mem[start : start + first] + mem[self._data : self._data + n - first]

    def _advance(self, n: int) -> None:
        self._pos += n
        _store(self._mem, self._base + _TAIL, self._pos)


def _store(mem: mmap.mmap, at: int, value: int) -> None:
    """Store ``head`` or ``tail`` in one 8-byte write, never through ``pack_into``:
    CPython's ``struct.pack_into`` zero-fills its target before it writes the value, so
    the other end could read 0 meanwhile (a reader that saw ``head`` go to 0 took it for
    a negative count of bytes and wrote the rest of a large record over its start)."""
    mem[at : at + 8] = _U64.pack(value)


_WORDS_BY_COUNT: dict[int, struct.Struct] = {}


def _words(n: int) -> struct.Struct:
    """The struct of a record's words for ``n`` frames (total, count, the sizes)."""
    words = _WORDS_BY_COUNT.get(n)
    if words is None:
        words = _WORDS_BY_COUNT[n] = struct.Struct(f"<II{n}I")
    return words


def _frames(record: bytes | bytearray, total: int, n: int) -> list[Any]:
    """The frames of a whole record: bytes where it came as bytes and has one frame
    (most messages), else views of it."""
    words = _words(n)
    sizes = words.unpack_from(record, 0)[2:]
    at = words.size
    if sum(sizes) != total - at or len(record) != total:
        raise LaneError(f"frame sizes {sizes} do not add up to {total}")
    if n == 1 and record.__class__ is bytes:
        return [record[at:]]
    view = memoryview(record)
    frames = []
    for size in sizes:
        frames.append(view[at : at + size])
        at += size
    return frames


class LaneFile:
    """The shared file of one lane: its two rings (down: controller -> rank; up: rank ->
    controller)."""

    def __init__(self, fd: int, capacity: int) -> None:
        """Map ``fd`` (a file of :func:`file_size` bytes); the caller gives up ``fd``."""
        try:
            self.mem = mmap.mmap(fd, file_size(capacity), mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.capacity = capacity
        self.down = Ring(self.mem, 0, capacity)
        self.up = Ring(self.mem, ring_span(capacity), capacity)

    @classmethod
    def create(cls, capacity: int = RING_BYTES) -> tuple[LaneFile, int]:
        """A new lane file (all of it reserved: a tmpfs page that cannot be had is a
        SIGBUS when first written) and a descriptor of it kept open, for the other end
        to open through ``/proc``; raises OSError where shared memory cannot be had."""
        size = file_size(capacity)
        fd = unlinked_shm_file(size)
        try:
            os.posix_fallocate(fd, 0, size)
            keep = os.dup(fd)
        except OSError:
            os.close(fd)
            raise
        try:
            return cls(fd, capacity), keep
        except OSError:
            os.close(keep)
            raise

    @classmethod
    def open(cls, path: str, capacity: int) -> LaneFile:
        """Map the lane file the other end made (``/proc/<pid>/fd/<n>``)."""
        fd = os.open(path, os.O_RDWR)
        if os.fstat(fd).st_size != file_size(capacity):
            os.close(fd)
            raise OSError(f"{path} is not a lane of {capacity} bytes a ring")
        return cls(fd, capacity)

    def close(self) -> None:
        """Unmap (a ring used after this raises ValueError)."""
        try:
            self.mem.close()
        except (BufferError, ValueError):
            pass  # still exported (a frame being read): dropped with the last reference


def file_size(capacity: int) -> int:
    """Bytes of a lane file whose rings hold ``capacity`` data bytes each."""
    return 2 * ring_span(capacity)


# -- wake-up pipes -------------------------------------------------------------------------
def pipe() -> tuple[int, int]:
    """A non-blocking pipe (read end, write end), not inherited by children."""
    r, w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    return r, w


def open_pipe(path: str) -> int:
    """Open a pipe of another process through ``/proc/<pid>/fd/<n>`` (non-blocking, both
    ends: so a write never fails for want of a reader)."""
    return os.open(path, os.O_RDWR | os.O_NONBLOCK | os.O_CLOEXEC)


def ring_bell(fd: int, data: bytes) -> None:
    """Write ``data`` (at most ``PIPE_BUF`` bytes: atomic) to a wake-up pipe; a full
    pipe drops it (its reader has a wake-up waiting already), and so does one whose
    reader is gone (a rank that died: nobody to wake)."""
    try:
        os.write(fd, data)
    except (BlockingIOError, InterruptedError, BrokenPipeError):
        pass


def close_fds(*fds: int) -> None:
    """Close the descriptors of ``fds`` that are open (>= 0), whatever happens to one."""
    for fd in fds:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass


def drain(fd: int) -> bytes:
    """Everything a wake-up pipe holds now (up to :data:`_BELL_READ` bytes)."""
    try:
        return os.read(fd, _BELL_READ)
    except (BlockingIOError, InterruptedError):
        return b""


def bell_slots(data: bytes) -> tuple[set[int], bool]:
    """The slots named in a doorbell read ``data``, and whether the read may have missed
    some (the pipe was full: look at every ring)."""
    n = len(data) - len(data) % _SLOT.size
    slots = {s for (s,) in _SLOT.iter_unpack(data[:n])}
    return slots, len(data) >= _BELL_FULL


def slot_bytes(slot: int) -> bytes:
    """What a rank writes to the doorbell."""
    return _SLOT.pack(slot)


def proc_path(fd: int) -> str:
    """The path through which another process of this user opens ``fd`` of this one."""
    return f"/proc/{os.getpid()}/fd/{fd}"
