"""The owner's side of the data plane: the tensors this rank shared, and the thread that
serves other ranks' signed, nonce'd requests for them."""

from __future__ import annotations

import itertools
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy
import zmq

from monarch_kernel.rank import listener_gate
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.common import (
    ENCRYPT_ENV,
    NONCE_MAX,
    NONCE_WINDOW,
    SHM_DIR,
    SHM_MIN_BYTES,
    counters_,
    host_addr,
    socket_path,
    write_all,
)
from monarch_kernel.rank.dataplane.ref import TensorRef
from monarch_kernel.rank.dataplane.transport import alloc_conf
from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire.codec import Buffer, Header, limit_size
from monarch_kernel.wire.key_gate import guard
from monarch_kernel.wire.limits import CHUNK_SIZE
from monarch_kernel.wire.osutil import pid_gone
from monarch_kernel.wire.peer_address import GATE_DOMAIN
from monarch_kernel.wire.ports import bind_port

_REFUSED = (
    "refused a replayed or stale data-plane request "
    f"(or clocks more than {NONCE_WINDOW:.0f} s apart)"
)


class Nonces:
    """Admits each (nonce, time) once: a request must be recent and its nonce unseen.
    Bounded: when more than ``limit`` are remembered the oldest are forgotten and
    nothing as old as them is admitted any more."""

    def __init__(self, window: float = NONCE_WINDOW, limit: int = NONCE_MAX):
        self.window, self.limit = window, limit
        self.seen: OrderedDict[str, float] = OrderedDict()
        self.floor = 0.0

    def admit(self, nonce: Any, sent: Any) -> bool:
        now = time.time()
        if not isinstance(nonce, str) or len(nonce) < 16 or nonce in self.seen:
            return False
        if not isinstance(sent, (int, float)) or isinstance(sent, bool):
            return False
        if sent <= max(self.floor, now - self.window) or sent > now + self.window:
            return False
        self.seen[nonce] = float(sent)
        while self.seen:
            oldest, t = next(iter(self.seen.items()))
            if len(self.seen) > self.limit:
                self.floor = max(self.floor, t)
            elif t >= now - self.window:
                break
            del self.seen[oldest]
        return True


class Server:
    """The owner's side: a registry of shared tensors and a thread serving requests."""

    def __init__(self, cfg: RankConfig):
        self.codec = Codec(bytes.fromhex(cfg.key))
        self.key_id = cfg.run_id
        self.key_hex = cfg.key
        self.machine = cfg.hostname or socket.gethostname()
        self.rank = cfg.slot  # the process (its wire id): names stay unique after a shrink
        self.host = cfg.host
        world = cfg.world_size
        per_host = cfg.local_world_size
        # Other ranks on this host: large tensors move to shared memory at share time.
        self.shm_at_share = SHM_DIR is not None and per_host > 1
        self.tensors: dict[int, Any] = {}
        self.writable: set[int] = set()  # RDMA buffers (``monarch_kernel.rdma``)
        #: RDMA buffers whose receivers may read and write them without a message once
        #: mapped (``one_sided=True``; ``cuda_ipc.Board``)
        self.one_sided: set[int] = set()
        self.shm_fds: dict[int, int] = {}  # our own descriptor of a tensor's shared memory
        #: Tensors shared to be read a known number of times (a call's CUDA arguments,
        #: ``dataplane.cuda_args``): reads still to come; released at the last one. They
        #: are copies nothing writes, waited for when made: described without a device
        #: synchronize (``cuda_ipc.describe``'s ``settled``)
        self.reads_left: dict[int, int] = {}
        #: Tensors kept for one process of this machine (a result's CUDA tensors kept for
        #: the rank that called, ``dataplane.cuda_results``): its pid; released when it
        #: is gone, if it did not read them first
        self.holders: dict[int, int] = {}
        #: CPU copies of tensors that are not contiguous CPU tensors, while a reader
        #: fetches them range by range (see ``_raw``)
        self.staged: dict[int, Any] = {}
        #: CUDA tensors mapped by receivers of this host (``op`` ``ipc``), kept until
        #: they say ``ipc_done``, die, or the lease's deadline passes
        self.leases = cuda_ipc.Leases()
        cuda_ipc.local_tensor = self.local  # a reader in this process takes it directly
        cuda_ipc.local_settled = self.settled
        self.seq = itertools.count(1)
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.nonces = Nonces()
        self._replays_seen = 0  # the codec's count of replays, already counted by us
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.sock)
        name = f"dp{self.rank}-{os.getpid()}"
        self.ipc = f"ipc://{socket_path(cfg, name)}"
        self.sock.bind(self.ipc)
        self.address = ""
        self.curve_public = ""
        self.tcp: zmq.Socket[bytes] | None = None
        # Other hosts of this mesh, or ranks of other meshes on other machines (a mesh
        # whose sockets use CURVE may be called from them): TCP on this host's address.
        if world > per_host or cfg.curve_secret:
            addr = host_addr(cfg)
            tcp = self.sock
            if os.environ.get(ENCRYPT_ENV, "").lower() in ("1", "true", "yes"):
                # A socket of its own: ranks of this host keep the unencrypted ipc one.
                # The server keypair is this process's; in a CURVE mesh only the mesh's
                # listener key may connect (``rank.listener_gate``), and every request is still
                # signed and nonce'd.
                tcp = self.tcp = self.ctx.socket(zmq.ROUTER)
                tcp.setsockopt(zmq.LINGER, 0)
                limit_size(tcp)
                public, secret = zmq.curve_keypair()
                gate = listener_gate.gate()
                if gate is not None:
                    guard(tcp, secret.decode(), gate, GATE_DOMAIN)
                else:
                    tcp.setsockopt(zmq.CURVE_SERVER, 1)
                    tcp.setsockopt(zmq.CURVE_SECRETKEY, secret)
                self.curve_public = public.decode()
            port = bind_port(tcp, addr)
            self.address = f"tcp://{addr}:{port}"
        self.shm_prefix = f"mk-{cfg.run_id}-r{self.rank}-"
        # Wakes the serving thread out of an unbounded wait when a holder is added (it
        # then looks at the holders once a second); a pipe: any thread may write to it.
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        threading.Thread(target=self._serve, name="mk-dataplane", daemon=True).start()

    def share(
        self,
        tensor: Any,
        writable: bool = False,
        one_sided: bool = False,
        reads: int = 0,
        holder: int = 0,
    ) -> TensorRef:
        """Offer ``tensor`` to other ranks (``writable``: an RDMA buffer, which they may
        also write into; ``one_sided``: receivers of this host that mapped it by CUDA IPC
        use it without asking again, ``dataplane.cuda_ipc``; ``reads``: released once that
        many readers said ``read_done``, ``dataplane.cuda_args``; ``holder``: released
        at the latest when that process of this machine is gone,
        ``dataplane.cuda_results``)."""
        # The owner's tensor itself is kept (never a copy): get() sees it as it is then.
        t = tensor.detach()
        nbytes = t.numel() * t.element_size()
        with self.lock:
            ident = next(self.ids)
        shm, ino, fd = "", 0, -1
        if self.shm_at_share and nbytes >= SHM_MIN_BYTES:
            placed = self._move_to_shm(t, nbytes)
            if placed is not None:
                fd, ino = placed
                shm = f"/proc/{os.getpid()}/fd/{fd}"
        watched = True  # (the serving thread already looks at holders, or needs not)
        with self.lock:
            self.tensors[ident] = t
            if writable:
                self.writable.add(ident)
            if one_sided:
                self.one_sided.add(ident)
            if reads > 0:
                self.reads_left[ident] = reads
            if holder > 0:
                watched = bool(self.holders)
                self.holders[ident] = holder
            if fd >= 0:
                self.shm_fds[ident] = fd
        if holder > 0 and not watched:
            try:
                os.write(self._wake_w, b"h")  # start looking at holders
            except BlockingIOError:
                pass  # (the pipe is full of wake-ups already)
        dtype = str(t.dtype).removeprefix("torch.")
        return TensorRef(
            self.rank,
            self.host,
            self.address,
            self.ipc,
            shm,
            self.key_id,
            ident,
            dtype,
            tuple(t.shape),
            nbytes,
            t.is_cuda,
            ino,
            self.curve_public,
            self.machine,
            self.key_hex,
            os.getpid(),
            alloc_conf() if t.is_cuda else "",
        )

    @staticmethod
    def _move_to_shm(t: Any, nbytes: int) -> tuple[int, int] | None:
        """Move ``t``'s storage into shared memory in place (every tensor over that
        storage follows); our own descriptor of it and its inode, or None where it
        cannot be (not CPU, not contiguous, a part of a bigger storage, shared memory
        short): such a tensor is served over the socket, as it is at get() time."""
        if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0:
            return None
        storage = t.untyped_storage()
        if storage.nbytes() != nbytes:
            return None
        assert SHM_DIR is not None
        if not storage.is_shared():
            free = os.statvfs(SHM_DIR)
            if free.f_bavail * free.f_frsize < 2 * nbytes:
                return None  # leave room for others
        try:
            # torch's share_memory_ with the file-descriptor strategy: the data is
            # copied once into an unlinked shm file (0600) and the storage's data pointer
            # swapped to it; a no-op for a storage already there.
            torch_fd, _size = storage._share_fd_cpu_()
            fd = os.dup(torch_fd)
        except (RuntimeError, OSError, AttributeError):
            return None
        return fd, os.fstat(fd).st_ino

    def _raw(self, ident: int, staged: bool = False) -> Any:
        """The tensor's bytes as they are now. One that is not a contiguous CPU tensor is
        copied there first, once per reader: the copy is kept (``staged``) for the
        reader's further ranges, until its last one."""
        import torch

        t = self.tensors.get(ident)
        if t is None:
            raise KeyError(f"tensor {ident} was released or never shared by rank {self.rank}")
        if not t.numel():
            return b""
        if t.device.type == "cpu" and t.is_contiguous():
            return t.view(-1).view(torch.uint8).numpy()
        copy = self.staged.get(ident) if staged else None
        if copy is None:
            if t.is_cuda:  # once into pinned host memory (counted as staged)
                copy = cuda_ipc.stage_to_host(t).numpy()
            else:
                copy = t.contiguous().view(-1).view(torch.uint8).numpy()
            self.staged[ident] = copy
        return copy

    def local(self, ident: int) -> Any:
        """The tensor ``ident`` itself (a reader in this very process)."""
        t = self.tensors.get(ident)
        if t is None:
            raise KeyError(f"tensor {ident} was released or never shared by rank {self.rank}")
        return t

    def _ipc(self, ident: int, pid: int, have: int = 0) -> Header:
        """A CUDA IPC description of tensor ``ident`` for process ``pid`` of this host,
        and a lease that keeps the tensor until it is done (``dataplane.cuda_ipc``). A
        receiver that still maps it (``have``: its lease) gets the lease renewed and
        ``same`` instead: the device synchronized, nothing described again."""
        settled = self.settled(ident)  # (first: a release after it fails local() below)
        t = self.local(ident)
        device = cuda_ipc.device
        if not device.shareable(t):
            raise ValueError(f"tensor {ident} of rank {self.rank} is not on CUDA")
        if have and self.leases.renew(have, ident, pid, cuda_ipc.layout(t)):
            t0 = time.perf_counter()
            if not settled:
                device.synchronize(t)
            cuda_ipc._timed("renew", t0)
            return {"k": "ipc", "lease": have, "same": True}
        t0 = time.perf_counter()
        desc = device.describe(t, settled)
        cuda_ipc._timed("describe", t0)
        deadline = time.monotonic() + cuda_ipc.LEASE_SECONDS
        where = cuda_ipc.layout(t)  # (after describe: as it is when the receiver maps it)
        lease = cuda_ipc.Lease(t, pid, deadline, (desc["rch"], desc["rco"]), ident, where)
        header: Header = {"k": "ipc", "lease": self.leases.add(lease), **desc}
        board = self._board() if ident in self.one_sided else None
        if board is not None:  # offered for one-sided use
            slot = board.claim(ident)
            if slot >= 0:
                header.update(board=board.path, bino=board.ino, slot=slot)
        return header

    def _board(self) -> cuda_ipc.Board | None:
        """This process's board of RDMA buffers offered one-sided (made on first use;
        None where memfds are not available: every use then asks)."""
        if cuda_ipc.board is None:
            try:
                cuda_ipc.board = cuda_ipc.Board()
            except (OSError, AttributeError):
                return None
        return cuda_ipc.board

    def _shm_copy(self, ident: int) -> str:
        """A fresh shared-memory file with the tensor's bytes as they are now, for a
        tensor not in shared memory asked for with ``transport='shm'``; the receiver
        unlinks it once opened (the host agent removes any left at mesh stop)."""
        assert SHM_DIR is not None  # only asked for when shared memory is usable
        raw = self._raw(ident)
        path = os.path.join(SHM_DIR, f"{self.shm_prefix}{ident}-{next(self.seq)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            write_all(fd, memoryview(raw).cast("B"))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        counters_["bytes_out"] += len(raw)
        return path

    def release(self, ident: int) -> None:
        if cuda_ipc.board is not None:
            cuda_ipc.board.clear(ident)  # one-sided readers and writers refuse it from now
        with self.lock:
            self.tensors.pop(ident, None)
            self.staged.pop(ident, None)
            self.writable.discard(ident)
            self.one_sided.discard(ident)
            self.reads_left.pop(ident, None)
            self.holders.pop(ident, None)
            fd = self.shm_fds.pop(ident, None)
        if fd is not None:
            os.close(fd)  # the path in the ref no longer opens (torch keeps its own fd)

    def settled(self, ident: int) -> bool:
        """Whether tensor ``ident`` is a call's argument (``dataplane.cuda_args``): a
        copy waited for when it was made, that nothing writes."""
        with self.lock:
            return ident in self.reads_left

    def read_done(self, ident: int) -> None:
        """A reader of tensor ``ident`` shared for a number of reads has its copy: the
        last one releases it. Tensors shared without a count are left alone."""
        with self.lock:
            left = self.reads_left.get(ident)
            if left is None:
                return
            self.reads_left[ident] = left - 1
        if left <= 1:
            self.release(ident)

    def gone_holders(self) -> int:
        """Release the tensors kept for processes that are gone; how many."""
        with self.lock:
            held = list(self.holders.items())
        dead = {pid for pid in {pid for _, pid in held} if pid_gone(pid)}
        gone = [ident for ident, pid in held if pid in dead]
        for ident in gone:
            self.release(ident)
        return len(gone)

    def _serve(self) -> None:
        socks = [self.sock] + ([self.tcp] if self.tcp is not None else [])
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_expiry = 0.0
        while True:
            # While receivers map tensors, or tensors are kept for other processes, wake
            # up now and then to let go of the leases of those that died or took too
            # long, and of what was kept for the dead: once a second, not after every
            # request (each check reads /proc, a tenth of a request's time).
            watching = self.leases.held or self.holders
            for sock, _ in poller.poll(1000 if watching else None):
                if sock == self._wake_r:
                    os.read(self._wake_r, 4096)
                else:
                    self._serve_one(sock)
            if watching:
                now = time.monotonic()
                if now >= next_expiry:
                    if self.leases.held:
                        self.leases.expire(now)
                    if self.holders:
                        self.gone_holders()
                    next_expiry = now + EXPIRY_PERIOD

    def _serve_one(self, sock: zmq.Socket[bytes]) -> None:
        """Answer one request waiting on ``sock``."""
        ident, *frames = sock.recv_multipart(copy=False)
        try:
            msg = self.codec.decode(frames)
        except WireError:  # forged, malformed or replayed: dropped, counted by the codec
            if self.codec.replayed != self._replays_seen:  # a byte-for-byte replay
                counters_["replays_refused"] += self.codec.replayed - self._replays_seen
                self._replays_seen = self.codec.replayed
            else:
                counters_["requests_rejected"] += 1
            return
        h = msg.header
        if h.get("op") in ONE_WAY:  # no answer, not even an error: nobody waits for one
            if self.nonces.admit(h.get("n"), h.get("t")):
                try:
                    self._handle(h, msg.buffers)
                except Exception:
                    counters_["requests_rejected"] += 1
            else:
                counters_["replays_refused"] += 1
            return
        if not self.nonces.admit(h.get("n"), h.get("t")):
            counters_["replays_refused"] += 1
            reply: tuple[Header, tuple[Buffer, ...]] = ({"k": "err", "error": _REFUSED}, ())
        else:
            try:
                reply = self._handle(h, msg.buffers)
            except Exception as exc:  # goes back to the requester
                reply = ({"k": "err", "error": str(exc)}, ())
        header, buffers = reply
        header = dict(header, re=h.get("n"))  # (the reader matches it to its request)
        sock.send_multipart([ident, *self.codec.encode(header, b"", buffers)], copy=False)

    def write(self, ident: int, data: Any, off: int = 0) -> None:
        """Copy ``data`` (bytes-like) into RDMA buffer ``ident`` at byte ``off``, in place."""
        import torch

        with self.lock:
            t = self.tensors.get(ident)
            writable = ident in self.writable
        if t is None:
            raise KeyError(f"tensor {ident} was released or never shared by rank {self.rank}")
        if not writable:
            raise PermissionError(f"tensor {ident} of rank {self.rank} is read-only (share())")
        src = memoryview(data).cast("B")
        if off < 0 or off + len(src) > t.numel() * t.element_size():
            raise ValueError(
                f"{len(src)} bytes at offset {off} do not fit in buffer {ident} of rank {self.rank}"
            )
        if len(src):
            dst = t.view(-1).view(torch.uint8)[off : off + len(src)]
            data = numpy.frombuffer(src, dtype=numpy.uint8)
            if dst.device.type == "cpu":
                dst.numpy()[:] = data
            else:
                dst.copy_(torch.from_numpy(data.copy()))
                counters_["bytes_staged"] += len(src)
        counters_["bytes_in"] += len(src)

    def _handle(self, h: Header, buffers: Any = ()) -> tuple[Header, tuple[Buffer, ...]]:
        op, ident = h.get("op"), int(h.get("id", 0))
        if op == "write":
            self.write(ident, buffers[0] if buffers else b"", _int(h, "off", 0))
            return {"k": "ok"}, ()
        if op == "fetch":
            off = _int(h, "off", 0)
            raw = self._raw(ident, staged=off > 0)
            n = _int(h, "len", len(raw) - off)
            if not (0 <= off <= len(raw) and 0 <= n <= CHUNK_SIZE and off + n <= len(raw)):
                raise ValueError(
                    f"bad range: {n} bytes at offset {off} of tensor {ident} "
                    f"({len(raw)} bytes; at most {CHUNK_SIZE} per request)"
                )
            if off + n == len(raw):
                self.staged.pop(ident, None)  # the last range: the reader is done
            part = raw[off : off + n]
            counters_["bytes_out"] += len(part)
            return {"k": "data"}, (part,) if len(part) else ()
        if op == "shm":
            return {"k": "shm", "path": self._shm_copy(ident)}, ()
        if op == "release":
            self.release(ident)
            return {"k": "ok"}, ()
        if op == "ipc":
            return self._ipc(ident, _int(h, "p", 0), _int(h, "have", 0)), ()
        if op == "ipc_done":
            self.leases.done(_int(h, "lease", 0))
            return {"k": "ok"}, ()
        if op == "read_done":
            self.read_done(ident)
            return {"k": "ok"}, ()
        raise ValueError(f"unknown data-plane request {op!r}")


#: Seconds between the owner's looks at its leases (dead or late receivers) and holders.
EXPIRY_PERIOD = 1.0
#: Requests the owner does not answer (:meth:`Client.notify` sends them): ``ipc_done``,
#: a receiver's word that it dropped its mapping, saves a round trip on every CUDA IPC
#: read; if it is lost, the lease ends at the receiver's death or its deadline.
#: ``read_done``: a receiver of a call's CUDA argument has its copy; if it is lost, the
#: caller releases the argument when the call is over.
ONE_WAY = frozenset({"ipc_done", "read_done"})


def _int(h: Header, key: str, default: int) -> int:
    """Header ``key`` as an int (``default`` when absent); ValueError if not one."""
    value = h.get(key, default)
    if type(value) is not int:
        raise ValueError(f"data-plane request key {key!r} must be an int, not {value!r}")
    return value
