"""Large call arguments and results between the controller and the ranks of its own host
go through shared memory.

A local mesh's ranks are reached over unix sockets. A 1 MiB argument sent on one is
copied into the kernel and out again in socket-buffer-sized pieces, waking both sides'
I/O threads for each piece, and the caller waits until libzmq let go of its memory
(:mod:`monarch_kernel.wire.handoff`): about half the speed of a raw ZeroMQ send over tcp
loopback on this kind of machine. Instead the controller copies the buffers once into
its :class:`Arena` (a file in ``/dev/shm``, unlinked at once, mapped by both sides) and
sends a small message that says where they are (header ``sh``, and ``si``: the first
reader index of this message). The rank copies them into private memory as it decodes
the message (:class:`ArenaReader`), so the endpoint gets the same writable, private
buffers as from the socket, and the caller's tensor may change as soon as the send
returns.

A block: one flag byte per reader (each rank the message goes to), padded to
:data:`ALIGN`, then each buffer at an :data:`ALIGN` boundary. A reader sets its flag once
it has copied the buffers out; the controller reuses a block once every flag is set, or
when a reader is gone (:meth:`Arena.release`: a rank restarted or left the mesh, or one
that died while the arena has no room). Nothing ever waits for room: a message too small
or too large for the arena, or one that finds it full, goes over the socket as before
(:attr:`Arena.fallbacks`).

A block for one reader (a call to one rank with a large tensor, or a state dict: the
common cases) is *lent* instead of copied, while the arena has room to spare
(:data:`LEND_FILL`): the reader's buffers are the block itself, and its flag is set once
all of them are gone (a finalizer on each: the tensors built on them were dropped). The
reader saves a copy on the call's path, and the buffers are still its own: nothing else
reads or writes the block until its flag is set. A block held for long (an endpoint that
keeps the tensor) only makes later large messages take the copying path, then the
socket. A block lent when the reader forks is kept until the reader is released (it
died, or was restarted) or the writer ends: the child shares it.

Results go the other way the same way: a rank of a local mesh (``RankConfig.shm_results``)
puts a large reply's buffers into an arena of its own, made when it first needs one, and
lends them to the controller, the block's one reader (its :class:`ArenaReader` keeps one
mapping per rank, dropped once the rank process is gone; a result still held keeps the
mapping it was lent from, so it stays intact after its rank died). A notebook that keeps
results (gathered weights in a list) so holds at most :data:`LEND_FILL` of each rank's
arena; later results are copied out as before.

Memory: an arena's pages are taken when first used and kept while blocks come and go (a
loop of large calls reuses the same warm pages); once no block was placed for
:data:`TRIM_AFTER` seconds, :meth:`Arena.trim` gives back those above
:data:`KEEP_BYTES` that no block uses.

Trust: the buffers in a block are not signed, as buffer frames on the socket are not
(the signed header carries their sizes and where they are). The file is created 0600
and unlinked; it is reachable only through the controller's ``/proc/<pid>/fd``, i.e. by
processes of the same user, which could read the controller's memory anyway.

The readers' copy-out happens before their flag store in program order; x86's stores
are not reordered with earlier loads, which is what makes a set flag mean "copied".

Size: over the ~450-line habit: the shared-memory arena's writer, readers and the
lending of blocks share one layout and its rules (stated once, above).
"""

from __future__ import annotations

import bisect
import errno
import itertools
import logging
import mmap
import os
import re
import stat
import tempfile
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from monarch_kernel.wire.chunks import flat_view
from monarch_kernel.wire.codec import Buffer, Header, Message

log = logging.getLogger("monarch_kernel.wire")

#: Set to ``0`` in the controller's environment to send every argument and result over
#: the socket (``MONARCH_KERNEL_SHM_ARGS=0``, its earlier name, does the same).
SHM_ENV = "MONARCH_KERNEL_SHM"
SHM_ARGS_ENV = "MONARCH_KERNEL_SHM_ARGS"
#: Where the arena's file is made (tmpfs: its pages are plain shared memory).
SHM_DIR = "/dev/shm"
#: Virtual size of one mesh's arena. Only the pages blocks have used take memory (blocks
#: are placed lowest first and reused as soon as read: what a mesh holds is about the
#: most it had in flight at once); all of it goes when the mesh stops.
ARENA_BYTES = 256 << 20
#: A message whose buffers total less than this goes over the socket (a copy in and out
#: of shared memory saves little there); ...
MIN_BYTES = 64 << 10
#: ... and so does one above this (it would hold too much of the arena).
MAX_BYTES = 64 << 20
#: Readers of one block at most (its flag bytes): larger fan-outs take the socket.
MAX_READERS = 4096
#: A block for one reader is lent (header ``sh``'s ``l``) while, with it, at most this
#: share of the arena is in use: a reader that keeps lent buffers can hold no more than
#: that, and copied blocks keep the rest.
LEND_FILL = 0.5
#: Blocks, flags and buffers start at multiples of this (a cache line).
ALIGN = 64
#: :meth:`Arena.trim` keeps this much of an idle arena's memory (the pages a loop of
#: calls of up to a few MiB keeps reusing) ...
KEEP_BYTES = 8 << 20
#: ... and gives back the rest once no block was placed for this long (seconds).
TRIM_AFTER = 2.0
_PROC_FD = re.compile(r"/proc/[0-9]+/fd/[0-9]+")


def _align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


def enabled() -> bool:
    """Whether meshes started now use shared memory for large arguments and results
    (neither ``$MONARCH_KERNEL_SHM`` nor ``$MONARCH_KERNEL_SHM_ARGS`` is ``0``, and
    ``/dev/shm`` exists)."""
    env = os.environ
    off = env.get(SHM_ENV) == "0" or env.get(SHM_ARGS_ENV) == "0"
    return not off and os.path.isdir(SHM_DIR)


class SharedArgumentsError(RuntimeError):
    """A rank could not read the arguments the controller put in shared memory."""


class SharedResultError(RuntimeError):
    """The controller could not read a result that a rank put in its shared memory."""


def cannot_map_result(exc: OSError) -> str:
    """Why a result is lost: the controller's :class:`ArenaReader` could not map the
    rank's arena."""
    return (
        f"the controller could not map the rank's shared memory that holds its result "
        f"({exc}); set {SHM_ENV}=0 in the notebook kernel's environment (and start the "
        "mesh again) to send results over the socket"
    )


@dataclass
class _Block:
    offset: int
    span: int
    #: Each flag's reader, in flag order: a rank's wire id (its slot).
    readers: tuple[int, ...]


def _offset(block: _Block) -> int:
    return block.offset


def unlinked_shm_file(size: int) -> int:
    """A descriptor of a fresh 0600 file of ``size`` bytes in :data:`SHM_DIR` that has no
    name (nothing to leak if this process is killed)."""
    tmpfile = getattr(os, "O_TMPFILE", 0)
    fd = -1
    if tmpfile:
        try:
            fd = os.open(SHM_DIR, tmpfile | os.O_RDWR, 0o600)
        except OSError:
            fd = -1
    if fd < 0:  # no O_TMPFILE on this file system: a name, removed at once
        fd, path = tempfile.mkstemp(prefix="mk-arena-", dir=SHM_DIR)
        os.unlink(path)
    try:
        os.ftruncate(fd, size)
    except OSError:
        os.close(fd)
        raise
    return fd


class Arena:
    """Shared memory for large messages of one writer (see the module docstring): the
    controller's for one mesh's arguments, or a rank's for its results. Not thread-safe:
    its owner calls it under its send lock. Only the process that made it places
    blocks (a child forked from it sends over the socket)."""

    def __init__(self, size: int | None = None, lend: bool = False) -> None:
        """``size``: the arena's bytes (default :data:`ARENA_BYTES`); ``lend``: offer
        one-reader blocks to be lent (see the module docstring). Raises OSError where
        shared memory cannot be made or reached by path."""
        size = ARENA_BYTES if size is None else size
        self._lend = lend
        fd = unlinked_shm_file(size)
        try:
            self.path = f"/proc/{os.getpid()}/fd/{fd}"
            st = os.stat(self.path)  # /proc is there, and the path names this file
            self.ino = st.st_ino
            self._map = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            raise
        self._fd = fd
        self._pid = os.getpid()
        self._view = memoryview(self._map)
        #: Blocks in use, by offset.
        self._blocks: list[_Block] = []
        #: Bytes from the start that are backed by memory (posix_fallocate): a page of a
        #: sparse tmpfs file that cannot be had when first written is a SIGBUS, so every
        #: byte is reserved before it is used, and an arena that cannot grow stops there.
        self._backed = 0
        self._limit = size
        #: Messages whose buffers went through the arena / over the socket because it
        #: was full (statistics, tests).
        self.placed = 0
        self.fallbacks = 0
        #: Of the blocks placed, those offered to be lent.
        self.lent = 0
        self.closed = False
        self._placed_at = 0.0  # time.monotonic() of the last place

    @classmethod
    def create(cls, lend: bool = False) -> Arena | None:
        """An arena, or None (logged) where this machine cannot give one."""
        try:
            return cls(lend=lend)
        except OSError as exc:
            log.info("large arguments go over the socket: no shared memory (%s)", exc)
            return None

    def unread(self) -> int:
        """Blocks that some reader has not copied out of yet (the others are freed)."""
        self._reclaim()
        return len(self._blocks)

    def place(
        self,
        buffers: Sequence[Buffer],
        readers: Sequence[int],
        gone: Callable[[], Sequence[int]] | None = None,
    ) -> Header | None:
        """Copy ``buffers`` into a block read by ``readers`` (wire ids, in flag order);
        the header value ``sh`` that says where, or None: send them over the socket.
        ``gone``: when there is no room, the readers that died since (they will never
        read theirs): their blocks are released and the room looked for again."""
        if self.closed or not 1 <= len(readers) <= MAX_READERS or os.getpid() != self._pid:
            return None
        views = [flat_view(b) for b in buffers]
        sizes = [v.nbytes for v in views]
        total = sum(sizes)
        if total < MIN_BYTES or total > MAX_BYTES:
            return None
        flags = _align(len(readers))
        span = flags + sum(_align(n) for n in sizes)
        if self._blocks:
            # At once, not when full: the block just read is reused while its bytes are
            # still in the caches, and the arena's pages in use stay few.
            self._reclaim()
        offset = self._find(span)
        if offset is None and gone is not None and self._blocks:
            dead = gone()
            if dead:
                self.release(dead)
                self._reclaim()
                offset = self._find(span)
        if offset is None:
            self.fallbacks += 1
            return None
        view = self._view
        view[offset : offset + len(readers)] = bytes(len(readers))
        pos = offset + flags
        for v, n in zip(views, sizes):
            view[pos : pos + n] = v
            pos += _align(n)
        bisect.insort(self._blocks, _Block(offset, span, tuple(readers)), key=_offset)
        self.placed += 1
        self._placed_at = time.monotonic()
        where = {"p": self.path, "i": self.ino, "o": offset, "n": len(readers), "z": sizes}
        lendable = self._lend and len(readers) == 1
        if lendable and sum(b.span for b in self._blocks) <= self._limit * LEND_FILL:
            where["l"] = 1
            self.lent += 1
        return where

    def release(self, readers: Sequence[int]) -> None:
        """These readers will not read what was put here for them (they died, were
        restarted or left the mesh): count their blocks as read."""
        gone = set(readers)
        view = self._view
        for block in self._blocks:
            for i, reader in enumerate(block.readers):
                if reader in gone:
                    view[block.offset + i] = 1

    def backed(self) -> int:
        """Bytes of the arena that hold memory now (from its start)."""
        return self._backed

    def trim(self, now: float | None = None) -> int:
        """Give back the memory above :data:`KEEP_BYTES` that no block uses, once no
        block was placed for :data:`TRIM_AFTER` seconds (``now``: ``time.monotonic()``);
        the bytes given back. Cheap when there is nothing to give back (called about
        once a second)."""
        if self.closed or self._backed <= KEEP_BYTES:
            return 0
        now = time.monotonic() if now is None else now
        if now - self._placed_at < TRIM_AFTER:
            return 0
        self._reclaim()
        top = max((b.offset + b.span for b in self._blocks), default=0)
        start = -(-max(top, KEEP_BYTES) // mmap.PAGESIZE) * mmap.PAGESIZE
        if start >= self._backed:
            return 0
        freed = self._backed - start
        try:
            self._map.madvise(mmap.MADV_REMOVE, start, freed)  # punch the pages out
        except (OSError, AttributeError, ValueError) as exc:
            log.info("shared-memory arena keeps its pages: %s", exc)
            return 0
        self._backed = start  # reserved again (posix_fallocate) before their next use
        return freed

    def close(self) -> None:
        """Unmap and close (the readers keep their own mappings)."""
        if self.closed:
            return
        self.closed = True
        self._blocks.clear()
        self._view.release()
        self._map.close()
        os.close(self._fd)

    def _find(self, span: int) -> int | None:
        """The lowest offset with ``span`` free bytes (low offsets first: the pages in use
        stay few), backed by memory; None if there is none."""
        start = 0
        for block in self._blocks:
            if block.offset - start >= span:
                break
            start = block.offset + block.span
        end = start + span
        if end > self._limit:
            return None
        if end > self._backed:
            try:
                os.posix_fallocate(self._fd, self._backed, end - self._backed)
            except OSError as exc:
                # /dev/shm is full (a container's small one): use what we have
                self._limit = self._backed
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    log.info("shared-memory arena stops growing: %s", exc)
                return None
            self._backed = end
        return start

    def _reclaim(self) -> None:
        """Forget the blocks every reader has copied out of."""
        find = self._map.find
        self._blocks = [
            b for b in self._blocks if find(b"\x00", b.offset, b.offset + len(b.readers)) >= 0
        ]


def _private(n: int) -> memoryview:
    """Writable private memory of ``n`` bytes, not zeroed first where numpy is there
    (it is about to be overwritten)."""
    try:
        import numpy
    except ImportError:  # pragma: no cover - ranks have torch, and torch numpy
        return memoryview(bytearray(n))
    return numpy.empty(n, dtype=numpy.uint8).data


#: Forks of this process so far (:func:`_forked`). A child forked while a buffer is lent
#: shares that shared memory (it is not copied on write as private memory is) and may
#: go on using it after this process dropped it: such a block is never given back (the
#: writer frees it when this reader dies or restarts, see :meth:`Arena.release`, or when
#: the writer itself ends).
_forks = 0


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(before=_forked)


def _give_back(view: memoryview, flag: int, forks: int) -> None:
    if _forks == forks:
        view[flag] = 1  # one byte: whichever thread drops the last reference stores it


class _Loan:
    """Several buffers lent out of one block: its flag is set once every one of them is
    gone. Their finalizers may run in any thread, and inside a garbage collection that
    another one started: the count is one C call (``next`` of ``itertools.count``, atomic
    under the GIL), not a lock that a finalizer run within it could wait on forever."""

    __slots__ = ("_view", "_flag", "_forks", "_count", "_dropped")

    def __init__(self, view: memoryview, flag: int, count: int) -> None:
        self._view, self._flag, self._forks = view, flag, _forks
        self._count = count
        self._dropped = itertools.count(1)

    def drop(self) -> None:
        if next(self._dropped) == self._count:
            _give_back(self._view, self._flag, self._forks)


def _lent(view: memoryview, pos: int, sizes: Sequence[int], flag: int) -> list[Any]:
    """The block's buffers, from ``pos``, as the reader's own, in place; the block's
    ``flag`` is set once they, and everything built on them, are gone."""
    import numpy

    arrays = []
    for n in sizes:
        arrays.append(numpy.frombuffer(view, dtype=numpy.uint8, count=n, offset=pos))
        pos += _align(n)
    if len(arrays) == 1:  # the common case, without a shared count; the finalizer holds
        weakref.finalize(arrays[0], _give_back, view, flag, _forks)  # the mapping, not array
    else:
        loan = _Loan(view, flag, len(arrays))
        for array in arrays:
            weakref.finalize(array, loan.drop)
    return [array.data for array in arrays]


def _cannot_map_arguments(exc: OSError) -> str:
    return (
        f"this rank could not map the controller's shared memory for the call's "
        f"arguments ({exc}); set {SHM_ENV}=0 in the notebook kernel's "
        "environment to send them over the socket"
    )


class ArenaReader:
    """The reading side: maps writers' arenas and copies a message's buffers out (a
    rank reading the controller's, or the controller reading its ranks')."""

    def __init__(
        self,
        keep: int = 2,
        cannot_map: Callable[[OSError], str] = _cannot_map_arguments,
        lend: bool = False,
    ) -> None:
        """``keep``: arenas kept mapped at once, least recently used dropped first (a
        rank: 2, as a detachable mesh's controllers come one after another; the
        controller: one per rank). ``cannot_map(exc)``: the error told when a
        writer's arena cannot be mapped. ``lend``: take blocks the writer offers to
        lend in place instead of copying them out."""
        self._lend = lend
        self._maps: OrderedDict[tuple[str, int], memoryview] = OrderedDict()
        self._keep = keep
        self._cannot_map = cannot_map

    def forget(self, pid: int) -> None:
        """Drop the mappings of process ``pid``'s arenas (it died: its memory goes
        once nothing maps it)."""
        prefix = f"/proc/{pid}/"
        for key in [k for k in self._maps if k[0].startswith(prefix)]:
            del self._maps[key]

    def mapped(self) -> int:
        """Arenas mapped now."""
        return len(self._maps)

    def prune(self) -> int:
        """Drop the mappings of arenas whose writer is gone: its ``/proc/<pid>/fd/<n>``
        no longer names the file (the process exited, or its pid now belongs to
        another); how many were dropped. A ``stat`` per mapping."""
        gone = []
        for path, ino in self._maps:
            try:
                if os.stat(path).st_ino == ino:
                    continue
            except OSError:
                pass
            gone.append((path, ino))
        for key in gone:
            del self._maps[key]
        return len(gone)

    def close(self) -> None:
        """Drop every mapping (the reader's mesh stopped)."""
        self._maps.clear()

    def take(self, msg: Message, slot: int) -> Message:
        """``msg`` with its buffers read out of the arena (header ``sh``), or with
        :attr:`Message.lost` saying why they could not be: the arena cannot be mapped, or
        the reference is malformed (the header verified, so that is a bug, not an attack;
        the message is still answered, so that the ones after it are not held back)."""
        h = msg.header
        where = h.pop("sh")
        first = h.pop("si", 0)
        try:
            path, ino, offset, readers, sizes = (
                where["p"],
                where["i"],
                where["o"],
                where["n"],
                where["z"],
            )
            # one message for several readers (a fan-out, or a group's over lanes)
            # names them in ``d``: each reads its own flag
            targets = h.get("d")
            index = first + (targets.index(slot) if targets is not None else 0)
            if (
                type(path) is not str
                or not _PROC_FD.fullmatch(path)
                or not all(type(v) is int and v >= 0 for v in (ino, offset, readers, index))
                or index >= readers
                or type(sizes) is not list
                or not all(type(n) is int and n >= 0 for n in sizes)
            ):
                raise ValueError(where)
        except (KeyError, TypeError, ValueError) as exc:
            return Message(h, msg.payload, [], f"malformed shared-memory reference: {exc!r}")
        try:
            view = self._open(path, ino)
        except OSError as exc:
            return Message(h, msg.payload, [], self._cannot_map(exc))
        pos = offset + _align(readers)
        if pos + sum(_align(n) for n in sizes) > len(view):
            return Message(h, msg.payload, [], "shared-memory reference beyond the arena")
        if self._lend and where.get("l") == 1 and readers == 1:
            return Message(h, msg.payload, _lent(view, pos, sizes, offset + index))
        buffers: list[Any] = []
        for n in sizes:
            out = _private(n)
            out[:] = view[pos : pos + n]
            buffers.append(out)
            pos += _align(n)
        view[offset + index] = 1  # copied out: the writer may reuse the block
        return Message(h, msg.payload, buffers)

    def _open(self, path: str, ino: int) -> memoryview:
        key = (path, ino)
        view = self._maps.get(key)
        if view is not None:
            self._maps.move_to_end(key)
            return view
        fd = os.open(path, os.O_RDWR)
        try:
            st = os.fstat(fd)
            if st.st_ino != ino or not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(errno.EPERM, f"{path} is not the writer's arena")
            m = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        view = self._maps[key] = memoryview(m)
        while len(self._maps) > self._keep:
            self._maps.popitem(last=False)  # the mmap goes when nothing views it
        return view
