"""The data plane: tensors move rank to rank directly, never through the controller.

Inside a rank, :func:`share` keeps a tensor and returns a small picklable
:class:`TensorRef` (in the spirit of Monarch's RDMA buffers). The ref travels through
the controller like any value (an endpoint argument, ``%push``/``%pull``); the receiver
calls :meth:`TensorRef.get` and pulls the bytes straight from the owner.

A rank's host is its host agent (not its machine: two host agents on one box are two
hosts). Between ranks of one host:

* a contiguous CPU tensor of :data:`SHM_MIN_BYTES` or more that owns its whole storage,
  shared on a host with other ranks, has its storage moved into shared memory in place at
  :func:`share` time (torch's ``share_memory_``: one copy; the owner's tensor, and every
  view of it, then lives there), and ``get()`` maps that memory copy-on-write (through
  ``/proc/<owner pid>/fd/N``, mode 0600) without copying it and without asking the owner;
* everything else goes over the owner's data socket, a unix socket (``ipc://``) in the
  host agent's private 0700 directory: no TCP listener for other local users to reach.

Whatever the path, ``get()`` returns the owner's tensor as it is when ``get()`` runs:
the owner's in-place changes made after ``share()`` are seen (never a snapshot taken at
share time), and the receiver's copy is private (its writes never reach the owner).

Between hosts, over TCP, bound to the host's own address (never ``0.0.0.0``); a mesh of
the local backend (one machine, no CURVE) has no TCP listener at all, the ranks of a mesh
started by a multi-machine backend have one (ranks of other meshes on other machines may
fetch from them). Requests are signed with the mesh key like every
control message, and carry a random nonce and a timestamp: a replayed (or stale) request
is refused and counted (``replays_refused`` in :func:`counters`). Bytes moved are counted
per rank for the dashboard.
"""

from __future__ import annotations

import atexit
import itertools
import mmap
import os
import shutil
import socket
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch_kernel.wire import Codec, WireError
from monarch_kernel.wire.codec import limit_size
from monarch_kernel.wire.netaddr import is_loopback, route_source
from monarch_kernel.wire.ports import bind_port

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: CPU tensors this size or larger are placed in shared memory at ``share()`` time (when
#: the host has other ranks) and ``auto`` gets them through it; smaller ones go over the
#: data socket (a shared-memory file costs more than it saves there).
SHM_MIN_BYTES = 1024 * 1024
#: Set to 1 in the ranks' environment (``%mesh ... --env MONARCH_KERNEL_ENCRYPT_DATA=1``)
#: to encrypt rank-to-rank tensors between hosts with CurveZMQ (2-3x slower for big
#: tensors on this kind of machine). Requests are signed and carry a nonce either way.
ENCRYPT_ENV = "MONARCH_KERNEL_ENCRYPT_DATA"
#: A request older than this (by the sender's clock) is refused; its nonce is remembered
#: this long, and at most :data:`NONCE_MAX` nonces are.
NONCE_WINDOW = 120.0
NONCE_MAX = 65536
_REFUSED = (
    "refused a replayed or stale data-plane request "
    f"(or clocks more than {NONCE_WINDOW:.0f} s apart)"
)
_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
_counters = {"bytes_out": 0, "bytes_in": 0, "replays_refused": 0}


def counters() -> dict[str, int]:
    """Bytes this rank served to and pulled from other ranks over the data plane, and
    how many replayed or stale requests it refused."""
    return dict(_counters)


@dataclass(frozen=True)
class TensorRef:
    """A handle on a tensor held by another rank. ``get()`` pulls a copy of it.

    ``address`` is the owner's TCP data socket (empty in a mesh of one host), ``ipc``
    its unix socket for ranks of its own host, ``shm`` the path of the shared memory the
    owner's tensor lives in (empty unless it was moved there at share time) and
    ``shm_ino`` its inode (the path is a file descriptor of the owner's, which is closed
    at release: a reused descriptor is told apart by its inode)."""

    owner: int
    host: int
    address: str
    ipc: str
    shm: str
    key_id: str
    id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cuda: bool
    shm_ino: int = 0
    #: The owner's CURVE public key (z85) when its TCP data socket is encrypted.
    curve_key: str = ""
    #: The owner's machine (hostname) and its mesh's key (hex), so that a rank of
    #: another mesh of that machine can ask it (over its unix socket) too. The key
    #: travels like a mesh reference's (inside signed control messages); not shown.
    machine: str = ""
    mesh_key: str = field(default="", repr=False)

    def get(self, transport: str = "auto") -> Any:
        """A new tensor with the owner's data as it is now (on this rank's CUDA device if
        it has one and the source was on CUDA); a private copy. ``transport``: ``auto``,
        ``shm`` (ranks of one host only) or ``tcp`` (the owner's data socket: unix socket
        on the same host, TCP from another)."""
        import torch

        dtype = getattr(torch, self.dtype)
        raw = None
        if self.nbytes and self._use_shm(transport):
            # Same host: map the owner's shared memory privately (copy-on-write), no
            # copy. The mapping outlives the owner's release of it.
            try:
                raw = _client().map_shm(self)
            except PermissionError:
                if transport == "shm":
                    raise
                # /proc/<pid>/fd of the owner not openable here: its socket, same data
        if raw is not None:
            dst = raw.view(dtype).reshape(self.shape)
            _counters["bytes_in"] += self.nbytes
        else:
            dst = torch.empty(self.shape, dtype=dtype)
            self.read_into(dst, transport)
        if self.cuda and torch.cuda.is_available():
            return dst.to(torch.device("cuda", torch.cuda.current_device()))
        return dst

    def read_into(self, dst: Any, transport: str = "auto") -> Any:
        """Copy the owner's data into ``dst`` (a contiguous tensor of the same size)."""
        import torch

        if dst.numel() * dst.element_size() != self.nbytes or not dst.is_contiguous():
            raise ValueError(
                f"read_into needs a contiguous tensor of {self.nbytes} bytes "
                f"(shape {self.shape}, {self.dtype}); got {tuple(dst.shape)} {dst.dtype}"
            )
        use_shm = self._use_shm(transport)
        target = dst if dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
        raw = target.view(-1).view(torch.uint8) if self.nbytes else None
        if raw is not None:
            if use_shm:
                try:
                    _client().read_shm(self, raw)
                except PermissionError:
                    if transport == "shm":
                        raise
                    use_shm = False  # the owner's socket then: the same data
            if not use_shm:
                _client().read_socket(self, raw)
            _counters["bytes_in"] += self.nbytes
        if target is not dst:
            dst.copy_(target)
        return dst

    def same_host(self) -> bool:
        """Whether the owner is a rank of this rank's host (host agent), or a rank of
        another mesh on this machine (reached over its unix socket as well)."""
        cfg = _cfg()
        if self.key_id == cfg["run_id"]:
            return self.host == int(cfg.get("host", 0))
        return bool(self.machine) and self.machine == cfg.get("hostname")

    def _use_shm(self, transport: str) -> bool:
        """Whether to go through shared memory; an error if it was asked for and cannot."""
        if transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"transport must be auto, shm or tcp, not {transport!r}")
        if transport == "tcp":
            return False
        local = SHM_DIR is not None and self.same_host()
        if transport == "shm" and not local:
            raise ValueError(
                f"rank {self.owner} is on another host (host {self.host}); shared memory "
                "is only used between ranks of one host, use transport='tcp'"
            )
        # auto: only where the owner's tensor lives in shared memory (else its socket)
        return local and (transport == "shm" or bool(self.shm))

    def release(self) -> None:
        """Tell the owner it may drop the tensor (its shared memory is no longer offered;
        the owner's tensor itself stays where it is)."""
        _client().request(self, {"op": "release", "id": self.id})


class _Nonces:
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


def private_dir(cfg: dict[str, Any]) -> str:
    """The host agent's private 0700 directory (where rank logs live), else our own
    (made once, removed at exit)."""
    global _own_dir
    log = cfg.get("log")
    if log:
        d = os.path.dirname(log)
        st = os.stat(d)
        if st.st_uid == os.getuid() and st.st_mode & 0o077 == 0:
            return d
    if _own_dir is None:
        _own_dir = tempfile.mkdtemp(prefix="mk-dp-")  # mode 0700
        atexit.register(shutil.rmtree, _own_dir, True)
    return _own_dir


_own_dir: str | None = None


def host_addr(cfg: dict[str, Any]) -> str:
    """The address this host is reached at by the others: the one it advertised, else
    the local address of the route to the controller (loopback if it is on this box)."""
    for key in ("advertise", "host_addr"):
        if cfg.get(key):
            return str(cfg[key])
    peer = ""
    recv = str(cfg.get("recv", ""))
    if recv.startswith("tcp://"):
        peer = recv[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    elif cfg.get("master_addr"):
        peer = str(cfg["master_addr"])
    if not peer or is_loopback(peer):
        return "127.0.0.1"
    return route_source(peer)


class _Server:
    """The owner's side: a registry of shared tensors and a thread serving requests."""

    def __init__(self, cfg: dict[str, Any]):
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.key_id = cfg["run_id"]
        self.key_hex = str(cfg["key"])
        self.machine = str(cfg.get("hostname") or socket.gethostname())
        self.rank = cfg["rank"]
        self.host = int(cfg.get("host", 0))
        world = int(cfg.get("world_size", 1))
        per_host = int(cfg.get("local_world_size", world))
        # Other ranks on this host: large tensors move to shared memory at share time.
        self.shm_at_share = SHM_DIR is not None and per_host > 1
        self.tensors: dict[int, Any] = {}
        self.shm_fds: dict[int, int] = {}  # our own descriptor of a tensor's shared memory
        self.seq = itertools.count(1)
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.nonces = _Nonces()
        self._replays_seen = 0  # the codec's count of replays, already counted by us
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        limit_size(self.sock)
        name = f"dp{self.rank}-{os.getpid()}"
        path = os.path.join(private_dir(cfg), name)
        if len(path) > 100:  # a unix socket path is at most 107 bytes
            path = os.path.join(tempfile.mkdtemp(prefix="mk-dp-", dir="/tmp"), name)
        self.ipc = f"ipc://{path}"
        self.sock.bind(self.ipc)
        self.address = ""
        self.curve_public = ""
        self.tcp: zmq.Socket[bytes] | None = None
        # Other hosts of this mesh, or ranks of other meshes on other machines (a mesh
        # whose sockets use CURVE may be called from them): TCP on this host's address.
        if world > per_host or cfg.get("curve_secret"):
            addr = host_addr(cfg)
            tcp = self.sock
            if os.environ.get(ENCRYPT_ENV, "").lower() in ("1", "true", "yes"):
                # A socket of its own: ranks of this host keep the unencrypted ipc one.
                # The keypair is this process's; admission stays the signed, nonce'd
                # request (any key may connect and ask, only the mesh key is answered).
                tcp = self.tcp = self.ctx.socket(zmq.ROUTER)
                tcp.setsockopt(zmq.LINGER, 0)
                limit_size(tcp)
                public, secret = zmq.curve_keypair()
                tcp.setsockopt(zmq.CURVE_SERVER, 1)
                tcp.setsockopt(zmq.CURVE_SECRETKEY, secret)
                self.curve_public = public.decode()
            port = bind_port(tcp, addr)
            self.address = f"tcp://{addr}:{port}"
        self.shm_prefix = f"mk-{cfg['run_id']}-r{self.rank}-"
        threading.Thread(target=self._serve, name="mk-dataplane", daemon=True).start()

    def share(self, tensor: Any) -> TensorRef:
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
        with self.lock:
            self.tensors[ident] = t
            if fd >= 0:
                self.shm_fds[ident] = fd
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

    def _raw(self, ident: int) -> Any:
        """The tensor's bytes as they are now (copied to the CPU and made contiguous
        first if it is not already so)."""
        import torch

        t = self.tensors.get(ident)
        if t is None:
            raise KeyError(f"tensor {ident} was released or never shared by rank {self.rank}")
        if not t.numel():
            return b""
        if t.device.type != "cpu" or not t.is_contiguous():
            t = t.cpu().contiguous()
        return t.view(-1).view(torch.uint8).numpy()

    def _shm_copy(self, ident: int) -> str:
        """A fresh shared-memory file with the tensor's bytes as they are now, for a
        tensor not in shared memory asked for with ``transport='shm'``; the receiver
        unlinks it once opened (the host agent removes any left at mesh stop)."""
        assert SHM_DIR is not None  # only asked for when shared memory is usable
        raw = self._raw(ident)
        path = os.path.join(SHM_DIR, f"{self.shm_prefix}{ident}-{next(self.seq)}")
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
        try:
            _write_all(fd, memoryview(raw).cast("B"))
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        _counters["bytes_out"] += len(raw)
        return path

    def release(self, ident: int) -> None:
        with self.lock:
            self.tensors.pop(ident, None)
            fd = self.shm_fds.pop(ident, None)
        if fd is not None:
            os.close(fd)  # the path in the ref no longer opens (torch keeps its own fd)

    def _serve(self) -> None:
        socks = [self.sock] + ([self.tcp] if self.tcp is not None else [])
        poller = zmq.Poller()
        for sock in socks:
            poller.register(sock, zmq.POLLIN)
        while True:
            for sock, _ in poller.poll():
                self._serve_one(sock)

    def _serve_one(self, sock: zmq.Socket[bytes]) -> None:
        """Answer one request waiting on ``sock``."""
        ident, *frames = sock.recv_multipart(copy=False)
        try:
            msg = self.codec.decode(frames)
        except WireError:  # forged, malformed or replayed: dropped, counted by the codec
            if self.codec.replayed != self._replays_seen:  # a byte-for-byte replay
                _counters["replays_refused"] += self.codec.replayed - self._replays_seen
                self._replays_seen = self.codec.replayed
            return
        h = msg.header
        if not self.nonces.admit(h.get("n"), h.get("t")):
            _counters["replays_refused"] += 1
            reply: tuple[dict[str, Any], tuple] = ({"k": "err", "error": _REFUSED}, ())
        else:
            try:
                reply = self._handle(h)
            except Exception as exc:  # goes back to the requester
                reply = ({"k": "err", "error": str(exc)}, ())
        header, buffers = reply
        sock.send_multipart([ident, *self.codec.encode(header, b"", buffers)], copy=False)

    def _handle(self, h: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
        op, ident = h.get("op"), int(h.get("id", 0))
        if op == "fetch":
            raw = self._raw(ident)
            _counters["bytes_out"] += len(raw)
            return {"k": "data"}, (raw,) if len(raw) else ()
        if op == "shm":
            return {"k": "shm", "path": self._shm_copy(ident)}, ()
        if op == "release":
            self.release(ident)
            return {"k": "ok"}, ()
        raise ValueError(f"unknown data-plane request {op!r}")


class _Client:
    """The receiver's side: one socket per owner address and thread."""

    def __init__(self, cfg: dict[str, Any]):
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.run_id = cfg["run_id"]
        self.others: dict[str, Codec] = {}  # other meshes' keys -> their codecs
        self.local = threading.local()

    def _socket(self, address: str, curve_key: str = "") -> zmq.Socket:
        """This thread's socket to ``address`` (a CURVE client of ``curve_key`` if set,
        with a throw-away keypair)."""
        socks = self.local.__dict__.setdefault("socks", {})
        sock = socks.get((address, curve_key))
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            limit_size(sock)
            if curve_key:
                public, secret = zmq.curve_keypair()
                sock.setsockopt(zmq.CURVE_SERVERKEY, curve_key.encode())
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.connect(address)
            socks[(address, curve_key)] = sock
        return sock

    def codec_for(self, ref: TensorRef) -> Codec:
        """The key requests to ``ref``'s owner are signed with: its mesh's."""
        if ref.key_id == self.run_id or not ref.mesh_key:
            return self.codec
        codec = self.others.get(ref.mesh_key)
        if codec is None:
            codec = self.others[ref.mesh_key] = Codec(bytes.fromhex(ref.mesh_key))
        return codec

    def frames(self, header: dict[str, Any], codec: Codec | None = None) -> list[Any]:
        """A signed request: a fresh nonce and the time make it good for one use."""
        header = dict(header, k="req", n=os.urandom(16).hex(), t=time.time())
        return (codec or self.codec).encode(header)

    def request(self, ref: TensorRef, header: dict[str, Any], timeout: float = 60.0) -> Any:
        if ref.same_host():
            address, curve_key = ref.ipc, ""
        elif ref.address:
            address, curve_key = ref.address, ref.curve_key
        else:
            raise RuntimeError(
                f"rank {ref.owner} is on machine {ref.machine!r} and has no TCP data socket "
                "(its mesh was started by the local backend, reachable from its own machine "
                "only); start it with a multi-machine backend (join, ray, slurm, lightning)"
            )
        sock = self._socket(address, curve_key)
        codec = self.codec_for(ref)
        sock.send_multipart(self.frames(header, codec))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(
                f"rank {ref.owner} did not answer a data-plane request in {timeout}s "
                "(is it alive and its mesh still running?)"
            )
        msg = codec.decode(sock.recv_multipart(copy=False))
        if msg.header.get("k") == "err":
            raise RuntimeError(f"rank {ref.owner}: {msg.header['error']}")
        return msg

    def read_socket(self, ref: TensorRef, raw: Any) -> None:
        import torch

        msg = self.request(ref, {"op": "fetch", "id": ref.id})
        raw.copy_(torch.frombuffer(msg.buffers[0], dtype=torch.uint8))

    def _open_shm(self, ref: TensorRef) -> int:
        """A read-only descriptor of the owner's shared memory holding the tensor: the
        one it lives in, else a copy made now for this request."""
        released = RuntimeError(
            f"rank {ref.owner}: tensor {ref.id} was released or never shared by rank {ref.owner}"
        )
        if ref.shm:
            try:
                fd = os.open(ref.shm, os.O_RDONLY)
            except FileNotFoundError:
                raise released from None
            st = os.fstat(fd)
            if st.st_ino != ref.shm_ino or st.st_size < ref.nbytes:
                os.close(fd)  # the owner's descriptor was closed and its number reused
                raise released
            return fd
        path = self.request(ref, {"op": "shm", "id": ref.id}).header["path"]
        try:
            return os.open(path, os.O_RDONLY)
        finally:
            os.unlink(path)  # a copy for this request only

    def map_shm(self, ref: TensorRef) -> Any:
        """A uint8 tensor over a private (copy-on-write) mapping of the owner's shared
        memory; its page tables are filled without copying the pages (a page is copied
        here once either side writes it; until then it shows the owner's data)."""
        import torch

        fd = self._open_shm(ref)
        try:
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            m = mmap.mmap(fd, ref.nbytes, flags=mmap.MAP_PRIVATE, prot=prot)
        finally:
            os.close(fd)
        try:
            m.madvise(_MADV_POPULATE_READ)  # map the shared pages now; a write copies one
        except OSError:
            pass  # older kernel: pages are mapped on first touch
        return torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive

    def read_shm(self, ref: TensorRef, raw: Any) -> None:
        fd = self._open_shm(ref)
        try:
            # One kernel copy from the shared pages straight into the destination.
            _read_all(fd, memoryview(raw.numpy()).cast("B"))
        finally:
            os.close(fd)


def _write_all(fd: int, data: memoryview) -> None:
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])


def _read_all(fd: int, out: memoryview) -> None:
    done = 0
    while done < len(out):
        n = os.readv(fd, [out[done:]])
        if n == 0:
            raise EOFError("shared-memory copy is shorter than the tensor")
        done += n


_server: _Server | None = None
_client_: _Client | None = None
_init_lock = threading.Lock()


def _cfg() -> dict[str, Any]:
    from monarch_kernel.rank import context

    if context._runtime is None:
        raise RuntimeError("the data plane is used inside ranks (in %%remote cells or actors)")
    return context._runtime.cfg


def _client() -> _Client:
    global _client_
    with _init_lock:
        if _client_ is None:
            _client_ = _Client(_cfg())
        return _client_


def share(tensor: Any) -> TensorRef:
    """Keep ``tensor`` in this rank and return a handle other ranks can ``get()``.

    The tensor itself is kept, not a copy: ``get()`` returns the owner's tensor as it is
    when ``get()`` runs (in-place changes made here after this call are seen, on every
    path), as a private copy. On a host with other ranks, a contiguous CPU tensor of
    :data:`SHM_MIN_BYTES` or more that owns its whole storage has that storage moved into
    shared memory now, in place (one copy; this tensor and its views then live there, and
    the storage can no longer be resized), so that ranks of this host map it without a
    copy. Other tensors are sent when asked for."""
    global _server
    import torch

    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"share() takes a torch.Tensor, got {type(tensor).__name__}")
    with _init_lock:
        if _server is None:
            _server = _Server(_cfg())
    return _server.share(tensor)


def cleanup_shm(run_id: str) -> None:
    """Remove shared-memory files a mesh's ranks left behind (called by the host agent)."""
    if SHM_DIR is None:
        return
    prefix = f"mk-{run_id}-"
    for name in os.listdir(SHM_DIR):
        if name.startswith(prefix):
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass
