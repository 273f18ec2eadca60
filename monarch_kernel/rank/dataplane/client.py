"""The receiver's side of the data plane: signed requests to a tensor's owner, over its
socket or through the shared memory the tensor lives in."""

from __future__ import annotations

import mmap
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from monarch_kernel.rank.config import RankConfig
from monarch_kernel.rank.dataplane import cuda_ipc
from monarch_kernel.rank.dataplane.common import SharedTensor, counters_, read_all
from monarch_kernel.wire import Codec, peer_address
from monarch_kernel.wire.codec import Header, limit_size
from monarch_kernel.wire.limits import CHUNK_SIZE
from monarch_kernel.wire.osutil import pid_gone

_MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)  # Linux >= 5.14
#: How often a request waiting for an owner on this machine checks that it still lives.
_DEATH_CHECK = 0.2


class OwnerDiedError(ConnectionError):
    """The rank that owns a shared tensor or RDMA buffer died before it answered."""


def _poll_ms(deadline: float) -> int:
    """Milliseconds to wait for an answer before looking at the owner again."""
    return int(min(_DEATH_CHECK, max(0.0, deadline - time.monotonic())) * 1000)


def owner_dead(ref: SharedTensor, machine: str) -> bool:
    """Whether the owner's process is known to be gone (on this machine only)."""
    if not ref.pid or ref.machine != machine:
        return False
    return pid_gone(ref.pid)


class Client:
    """The receiver's side: one socket per owner address and thread."""

    def __init__(self, cfg: RankConfig):
        self.codec = Codec(bytes.fromhex(cfg.key))
        self.run_id = cfg.run_id
        self.machine = cfg.hostname or socket.gethostname()
        self.others: dict[str, Codec] = {}  # other meshes' keys -> their codecs
        self.local = threading.local()

    def _socket(self, address: str, curve_key: str = "") -> zmq.Socket:
        """This thread's socket to ``address`` (a CURVE client of ``curve_key`` if set,
        with this process's listener keypair: the one a CURVE mesh's listeners admit)."""
        socks = self.local.__dict__.setdefault("socks", {})
        sock = socks.get((address, curve_key))
        if sock is None:
            sock = zmq.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            limit_size(sock)
            if curve_key:
                public, secret = peer_address.client_keys()
                sock.setsockopt(zmq.CURVE_SERVERKEY, curve_key.encode())
                sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
                sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
            sock.connect(address)
            socks[(address, curve_key)] = sock
        found: zmq.Socket[bytes] = sock
        return found

    def codec_for(self, ref: SharedTensor) -> Codec:
        """The key requests to ``ref``'s owner are signed with: its mesh's."""
        if ref.key_id == self.run_id or not ref.mesh_key:
            return self.codec
        codec = self.others.get(ref.mesh_key)
        if codec is None:
            codec = self.others[ref.mesh_key] = Codec(bytes.fromhex(ref.mesh_key))
        return codec

    def frames(self, header: Header, codec: Codec | None = None) -> list[Any]:
        """A signed request: a fresh nonce and the time make it good for one use."""
        header = dict(header, k="req", n=os.urandom(16).hex(), t=time.time())
        return (codec or self.codec).encode(header)

    def _address(self, ref: SharedTensor) -> tuple[str, str]:
        """Where ``ref``'s owner listens: (address, CURVE server key or '')."""
        if ref.same_host():
            return ref.ipc, ""
        if ref.address:
            return ref.address, ref.curve_key
        raise RuntimeError(
            f"rank {ref.owner} is on machine {ref.machine!r} and has no TCP data socket "
            "(its mesh was started by the local backend, reachable from its own machine "
            "only); start it with a multi-machine backend (join, ray, slurm, lightning)"
        )

    def notify(self, ref: SharedTensor, header: Header) -> None:
        """Send ``ref``'s owner a request it does not answer (``server.ONE_WAY``): queued
        on this thread's socket, no wait."""
        address, curve_key = self._address(ref)
        header = dict(header, k="req", n=os.urandom(16).hex(), t=time.time())
        frames = self.codec_for(ref).encode(header, b"", ())
        # (never blocks: a socket whose queue is full drops it, as a lost one is dropped)
        self._socket(address, curve_key).send_multipart(frames, flags=zmq.NOBLOCK, copy=False)

    def request(
        self,
        ref: SharedTensor,
        header: Header,
        timeout: float = 60.0,
        buffers: tuple[Any, ...] = (),
    ) -> Any:
        address, curve_key = self._address(ref)
        sock = self._socket(address, curve_key)
        codec = self.codec_for(ref)
        nonce = os.urandom(16).hex()
        header = dict(header, k="req", n=nonce, t=time.time())
        sock.send_multipart(codec.encode(header, b"", buffers), copy=False)
        deadline = time.monotonic() + timeout
        while True:
            # In slices: an owner on this machine that died is noticed at once (its pid).
            while not sock.poll(_poll_ms(deadline)):
                if owner_dead(ref, self.machine):
                    self._forget(address, curve_key)  # a late answer must not reach another
                    raise OwnerDiedError(
                        f"rank {ref.owner} (pid {ref.pid} on {ref.machine}), the owner, died "
                        "before answering a data-plane request"
                    )
                if time.monotonic() >= deadline:
                    self._forget(address, curve_key)
                    raise TimeoutError(
                        f"rank {ref.owner} did not answer a data-plane request in {timeout}s "
                        "(is it alive and its mesh still running?)"
                    )
            msg = codec.decode(sock.recv_multipart(copy=False))
            if msg.header.get("re") == nonce:
                break
            # an answer to another request (one this thread gave up on): not ours
        if msg.header.get("k") == "err":
            raise RuntimeError(f"rank {ref.owner}: {msg.header['error']}")
        return msg

    def forget(self, ref: SharedTensor) -> None:
        """Close this thread's socket to ``ref``'s owner (gone: nothing is sent there)."""
        self._forget(*self._address(ref))

    def _forget(self, address: str, curve_key: str) -> None:
        sock = self.local.__dict__.get("socks", {}).pop((address, curve_key), None)
        if sock is not None:
            sock.close(0)

    def read_socket(self, ref: SharedTensor, raw: Any, timeout: float = 60.0) -> None:
        """Fill ``raw`` (a contiguous uint8 CPU tensor of ``ref.nbytes``) from the owner's
        socket, one chunk per request: every frame stays small (``wire.limits``)."""
        view = memoryview(raw.numpy()).cast("B")
        for off in range(0, ref.nbytes, CHUNK_SIZE):
            n = min(CHUNK_SIZE, ref.nbytes - off)
            msg = self.request(ref, {"op": "fetch", "id": ref.id, "off": off, "len": n}, timeout)
            data = memoryview(msg.buffers[0]).cast("B") if msg.buffers else memoryview(b"")
            if data.nbytes != n:
                raise RuntimeError(
                    f"rank {ref.owner}: tensor {ref.id} sent {data.nbytes} bytes at offset "
                    f"{off}, not {n} (was it resized?)"
                )
            view[off : off + n] = data

    def write_socket(self, ref: SharedTensor, data: memoryview, timeout: float = 60.0) -> None:
        """Write ``data`` into the start of the owner's buffer over its socket, one chunk
        per request."""
        for off in range(0, max(len(data), 1), CHUNK_SIZE):
            part = data[off : off + CHUNK_SIZE]
            self.request(ref, {"op": "write", "id": ref.id, "off": off}, timeout, (part,))

    def ipc_copy(
        self,
        ref: SharedTensor,
        dtype: Any,
        use: Callable[[Any], None],
        timeout: float = 60.0,
        one_sided: bool = False,
    ) -> None:
        """Run ``use(mapped)`` (a device-to-device copy into or out of it) on the owner's
        CUDA tensor mapped here by CUDA IPC (``dataplane.cuda_ipc``); the mapping is kept
        for the next time. ``one_sided`` (RDMA buffers): no message to the owner while it
        offers the buffer on its board.
        :class:`~monarch_kernel.rank.dataplane.cuda_ipc.IpcUnavailable` when the handle
        does not open here (staging is then safe); OwnerDiedError when the owner died
        before or during the copy."""
        import torch

        if ref.pid == os.getpid() and cuda_ipc.local_tensor is not None:
            try:
                t = cuda_ipc.local_tensor(ref.id)  # our own tensor: no handle to open
            except KeyError as exc:
                raise RuntimeError(f"rank {ref.owner}: {exc.args[0]}") from None
            settled = cuda_ipc.local_settled is not None and cuda_ipc.local_settled(ref.id)
            if settled:  # a finished copy: wait for our own copy out of it alone
                use(t)
                torch.cuda.current_stream(t.device).synchronize()
            else:
                torch.cuda.synchronize(t.device)
                use(t)
                torch.cuda.synchronize(t.device)
            counters_["bytes_ipc"] += ref.nbytes
            return
        cuda_ipc.mappings.idle_limit()  # a bad setting is an error before any lease
        key: cuda_ipc.MappingKey = (ref.key_id, ref.pid, ref.id, str(dtype))
        found = cuda_ipc.mappings.get(key)
        kept, mapped = found if found is not None else (None, None)
        if one_sided and kept is not None and kept.one_sided(time.monotonic()):
            if owner_dead(ref, self.machine):
                cuda_ipc.mappings.drop(key, tell=False, mapping=kept)
                raise OwnerDiedError(
                    f"rank {ref.owner} (pid {ref.pid} on {ref.machine}), the owner, died"
                )
            self._copy(ref, key, kept, mapped, use)
            counters_["ipc_one_sided"] += 1
            return
        header: dict[str, Any] = {"op": "ipc", "id": ref.id, "p": os.getpid()}
        if kept is not None:
            header["have"] = kept.lease  # the owner renews it instead of describing again
        try:
            h = self.request(ref, header, timeout).header
        except BaseException as exc:
            if kept is not None:  # released, or the owner is gone
                tell = not isinstance(exc, OwnerDiedError)
                cuda_ipc.mappings.drop(key, tell=tell, mapping=kept)
            raise
        if kept is not None and h.get("same") is True and h.get("lease") == kept.lease:
            kept.renewed = time.monotonic()
        else:
            if kept is not None:  # the owner let that lease go (the tensor's memory moved)
                cuda_ipc.mappings.drop(key, tell=False, mapping=kept)
            lease = h["lease"]
            try:
                kept = cuda_ipc.map_tensor(key, h, dtype, ref.pid, lambda n: self._done(ref, n))
            except BaseException:
                self._done(ref, lease)
                raise
            mapped = kept.tensor
            cuda_ipc.mappings.put(kept)
        self._copy(ref, key, kept, mapped, use)

    def _copy(
        self,
        ref: SharedTensor,
        key: cuda_ipc.MappingKey,
        kept: cuda_ipc.Mapping,
        mapped: Any,
        use: Callable[[Any], None],
    ) -> None:
        try:
            cuda_ipc.copy_with(kept, mapped, use)
        except RuntimeError as exc:
            dead = owner_dead(ref, self.machine)
            cuda_ipc.mappings.drop(key, tell=not dead, mapping=kept)
            if dead:
                raise OwnerDiedError(
                    f"rank {ref.owner} (pid {ref.pid} on {ref.machine}), the owner, died "
                    f"during a CUDA IPC copy: {exc}"
                ) from exc
            raise
        counters_["bytes_ipc"] += ref.nbytes

    def _done(self, ref: SharedTensor, lease: int) -> None:
        """Tell ``ref``'s owner this process dropped its mapping (lease ``lease``); no
        answer awaited, nothing depends on it."""
        try:
            self.notify(ref, {"op": "ipc_done", "lease": lease})
        except (zmq.ZMQError, RuntimeError):
            pass  # the owner lets the lease go on its own (death, deadline)

    def _gone(self, ref: SharedTensor) -> Exception:
        """Why the shared memory of ``ref`` is not there: its owner died, or let it go."""
        if owner_dead(ref, self.machine):
            return OwnerDiedError(
                f"rank {ref.owner} (pid {ref.pid} on {ref.machine}), the owner, died before "
                f"its tensor {ref.id} was read"
            )
        return RuntimeError(
            f"rank {ref.owner}: tensor {ref.id} was released or never shared by rank {ref.owner}"
        )

    def _open_shm(self, ref: SharedTensor) -> int:
        """A read-only descriptor of the owner's shared memory holding the tensor: the
        one it lives in, else a copy made now for this request."""
        if ref.shm:
            try:
                fd = os.open(ref.shm, os.O_RDONLY)
            except FileNotFoundError:
                raise self._gone(ref) from None
            st = os.fstat(fd)
            if st.st_ino != ref.shm_ino or st.st_size < ref.nbytes:
                os.close(fd)  # the owner's descriptor was closed and its number reused
                raise self._gone(ref)
            return fd
        path = self.request(ref, {"op": "shm", "id": ref.id}).header["path"]
        try:
            return os.open(path, os.O_RDONLY)
        finally:
            os.unlink(path)  # a copy for this request only

    def map_shm(self, ref: SharedTensor) -> Any:
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

    def write_shm(self, ref: SharedTensor, data: memoryview) -> bool:
        """Write ``data`` into the start of the owner's shared memory (an RDMA buffer that
        lives there); False when it does not (then the owner's socket is used)."""
        if not ref.shm:
            return False
        try:
            fd = os.open(ref.shm, os.O_WRONLY)
        except FileNotFoundError:
            raise self._gone(ref) from None
        try:
            if os.fstat(fd).st_ino != ref.shm_ino:
                raise self._gone(ref)
            done = 0
            while done < len(data):
                done += os.pwrite(fd, data[done:], done)
        finally:
            os.close(fd)
        return True

    def read_shm(self, ref: SharedTensor, raw: Any) -> None:
        fd = self._open_shm(ref)
        try:
            # One kernel copy from the shared pages straight into the destination.
            read_all(fd, memoryview(raw.numpy()).cast("B"))
        finally:
            os.close(fd)


_client: Client | None = None
_init_lock = threading.Lock()


def rank_config() -> RankConfig:
    """The configuration of the rank this runs in (the data plane is used in ranks; the
    controller's process joins it for RDMA buffers, :func:`join_as_controller`)."""
    from monarch_kernel.rank import context

    runtime = context.services()
    if runtime is None:
        if _controller_config is not None:
            return _controller_config
        raise RuntimeError("the data plane is used inside ranks (in %%remote cells or actors)")
    return runtime.config


_controller_config: RankConfig | None = None


def join_as_controller() -> RankConfig:
    """Let this process (not a rank: the controller) use the data plane, with a key of
    its own: RDMA buffers it makes are reached over a unix socket (and shared memory)
    by ranks of its machine."""
    global _controller_config
    with _init_lock:
        if _controller_config is None:
            _controller_config = RankConfig(
                rank=-1,
                local_world_size=2,  # other processes of this machine map its buffers
                run_id=f"controller-{os.getpid()}-{os.urandom(4).hex()}",
                key=os.urandom(32).hex(),
                hostname=socket.gethostname(),
            )
        return _controller_config


def client() -> Client:
    """This rank's data-plane client (made on first use)."""
    global _client
    with _init_lock:
        if _client is None:
            _client = Client(rank_config())
        return _client
