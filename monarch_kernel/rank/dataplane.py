"""The data plane: tensors move rank to rank directly, never through the controller.

Inside a rank, :func:`share` keeps a tensor where it is and returns a small picklable
:class:`TensorRef` (in the spirit of Monarch's RDMA buffers). The ref travels through
the controller like any value (an endpoint argument, ``%push``/``%pull``); the receiver
calls :meth:`TensorRef.get` and pulls the bytes straight from the owner:

* same machine: through a shared-memory file the owner fills once (``/dev/shm``);
* another machine: over the owner's ZeroMQ data socket, zero-copy on both ends.

Requests to a data socket are signed with the mesh key like every control message.
Bytes moved are counted per rank (:func:`counters`) for the dashboard.
"""

from __future__ import annotations

import itertools
import mmap
import os
import socket
import threading
from dataclasses import dataclass
from typing import Any

import zmq

from monarch_kernel.wire import Codec, WireError

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None
#: Below this size a shared-memory file costs more than it saves: ``auto`` uses TCP.
SHM_MIN_BYTES = 4 * 1024 * 1024
_counters = {"bytes_out": 0, "bytes_in": 0}


def counters() -> dict[str, int]:
    """Bytes this rank served to and pulled from other ranks over the data plane."""
    return dict(_counters)


def _machine_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


@dataclass(frozen=True)
class TensorRef:
    """A handle on a tensor held by another rank. ``get()`` pulls a copy of it."""

    owner: int
    address: str
    machine: str
    key_id: str
    id: int
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    cuda: bool

    def get(self, transport: str = "auto") -> Any:
        """A new tensor with the owner's data (on this rank's CUDA device if it has one
        and the source was on CUDA). ``transport``: ``auto``, ``shm`` or ``tcp``."""
        import torch

        dtype = getattr(torch, self.dtype)
        use_shm = transport == "shm" or (transport == "auto" and self.nbytes >= SHM_MIN_BYTES)
        if self.nbytes and use_shm and self._local(transport):
            # Same machine: map the owner's shared-memory copy privately (copy-on-write),
            # no second copy. The mapping outlives the owner's release of the file.
            raw = _client().map_shm(self)
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
        if transport not in ("auto", "shm", "tcp"):
            raise ValueError(f"transport must be auto, shm or tcp, not {transport!r}")
        local = self._local(transport)
        target = dst if dst.device.type == "cpu" else torch.empty_like(dst, device="cpu")
        raw = target.view(-1).view(torch.uint8) if self.nbytes else None
        if raw is not None:
            if transport == "shm" or (
                transport == "auto" and local and self.nbytes >= SHM_MIN_BYTES
            ):
                _client().read_shm(self, raw)
            else:
                _client().read_tcp(self, raw)
            _counters["bytes_in"] += self.nbytes
        if target is not dst:
            dst.copy_(target)
        return dst

    def _local(self, transport: str) -> bool:
        """Whether shared memory can be used (same machine); an error if it was asked
        for and cannot be."""
        local = self.machine == _machine_id() and SHM_DIR is not None
        if transport == "shm" and not local:
            raise ValueError(
                f"rank {self.owner} is on another machine; shared memory is not "
                "possible, use transport='tcp'"
            )
        return local

    def release(self) -> None:
        """Tell the owner it may drop the tensor (and its shared-memory copy)."""
        _client().request(self, {"op": "release", "id": self.id})


class _Server:
    """The owner's side: a registry of shared tensors and a thread serving requests."""

    def __init__(self, cfg: dict[str, Any]):
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.key_id = cfg["run_id"]
        self.rank = cfg["rank"]
        self.tensors: dict[int, Any] = {}
        self.shm: dict[int, str] = {}
        self.ids = itertools.count(1)
        self.lock = threading.Lock()
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        local = cfg.get("master_addr", "127.0.0.1").startswith("127.")
        host = "127.0.0.1" if local else "0.0.0.0"
        port = self.sock.bind_to_random_port(f"tcp://{host}")
        advertise = "127.0.0.1" if local else socket.gethostbyname(socket.gethostname())
        self.address = f"tcp://{advertise}:{port}"
        self.shm_prefix = f"mk-{cfg['run_id']}-r{self.rank}-"
        threading.Thread(target=self._serve, name="mk-dataplane", daemon=True).start()

    def share(self, tensor: Any) -> TensorRef:
        t = tensor.detach()
        cuda = t.is_cuda
        if cuda or not t.is_contiguous():
            t = t.cpu().contiguous()
        with self.lock:
            ident = next(self.ids)
            self.tensors[ident] = t
        dtype = str(t.dtype).removeprefix("torch.")
        nbytes = t.numel() * t.element_size()
        return TensorRef(
            self.rank,
            self.address,
            _machine_id(),
            self.key_id,
            ident,
            dtype,
            tuple(t.shape),
            nbytes,
            cuda,
        )

    def _raw(self, ident: int) -> Any:
        import torch

        t = self.tensors.get(ident)
        if t is None:
            raise KeyError(f"tensor {ident} was released or never shared by rank {self.rank}")
        return t.view(-1).view(torch.uint8).numpy() if t.numel() else b""

    def _shm_path(self, ident: int) -> str:
        assert SHM_DIR is not None  # only asked for when shared memory is usable
        with self.lock:
            name = self.shm.get(ident)
            if name is None:
                raw = self._raw(ident)
                name = f"{self.shm_prefix}{ident}"
                path = os.path.join(SHM_DIR, name)
                fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
                try:
                    _write_all(fd, memoryview(raw).cast("B"))
                finally:
                    os.close(fd)
                self.shm[ident] = name
                _counters["bytes_out"] += len(raw)
        return os.path.join(SHM_DIR, name)

    def release(self, ident: int) -> None:
        with self.lock:
            self.tensors.pop(ident, None)
            name = self.shm.pop(ident, None)
        if name and SHM_DIR is not None:
            try:
                os.unlink(os.path.join(SHM_DIR, name))
            except OSError:
                pass

    def _serve(self) -> None:
        while True:
            ident, *frames = self.sock.recv_multipart(copy=False)
            try:
                msg = self.codec.decode(frames)
            except WireError:
                continue  # forged or malformed: dropped, counted by the codec
            try:
                reply = self._handle(msg.header)
            except Exception as exc:  # goes back to the requester
                reply = ({"k": "err", "error": str(exc)}, ())
            header, buffers = reply
            self.sock.send_multipart([ident, *self.codec.encode(header, b"", buffers)], copy=False)

    def _handle(self, h: dict[str, Any]) -> tuple[dict[str, Any], tuple]:
        op, ident = h.get("op"), int(h.get("id", 0))
        if op == "fetch":
            raw = self._raw(ident)
            _counters["bytes_out"] += len(raw)
            return {"k": "data"}, (raw,) if len(raw) else ()
        if op == "shm":
            return {"k": "shm", "path": self._shm_path(ident)}, ()
        if op == "release":
            self.release(ident)
            return {"k": "ok"}, ()
        raise ValueError(f"unknown data-plane request {op!r}")


class _Client:
    """The receiver's side: one socket per owner address and thread."""

    def __init__(self, cfg: dict[str, Any]):
        self.codec = Codec(bytes.fromhex(cfg["key"]))
        self.local = threading.local()

    def _socket(self, address: str) -> zmq.Socket:
        socks = self.local.__dict__.setdefault("socks", {})
        sock = socks.get(address)
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(address)
            socks[address] = sock
        return sock

    def request(self, ref: TensorRef, header: dict[str, Any], timeout: float = 60.0) -> Any:
        header = dict(header, k="req")
        sock = self._socket(ref.address)
        sock.send_multipart(self.codec.encode(header))
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError(
                f"rank {ref.owner} did not answer a data-plane request in {timeout}s "
                "(is it alive and its mesh still running?)"
            )
        msg = self.codec.decode(sock.recv_multipart(copy=False))
        if msg.header.get("k") == "err":
            raise RuntimeError(f"rank {ref.owner}: {msg.header['error']}")
        return msg

    def read_tcp(self, ref: TensorRef, raw: Any) -> None:
        import torch

        msg = self.request(ref, {"op": "fetch", "id": ref.id})
        raw.copy_(torch.frombuffer(msg.buffers[0], dtype=torch.uint8))

    def map_shm(self, ref: TensorRef) -> Any:
        """A uint8 tensor over a private, pre-faulted mapping of the owner's shm copy."""
        import torch

        path = self.request(ref, {"op": "shm", "id": ref.id}).header["path"]
        fd = os.open(path, os.O_RDONLY)
        try:
            flags = mmap.MAP_PRIVATE | getattr(mmap, "MAP_POPULATE", 0)
            m = mmap.mmap(fd, ref.nbytes, flags=flags, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        return torch.frombuffer(m, dtype=torch.uint8)  # keeps the mapping alive

    def read_shm(self, ref: TensorRef, raw: Any) -> None:

        path = self.request(ref, {"op": "shm", "id": ref.id}).header["path"]
        fd = os.open(path, os.O_RDONLY)
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
    """Keep ``tensor`` in this rank and return a handle other ranks can ``get()``."""
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
