"""The floor: raw pyzmq DEALER/ROUTER between processes over tcp loopback, no framing,
no signing, no pickling; plus a plain memcpy (torch clone) for the tensor rows.

Each "rank" is a tiny server process (``python -m bench.raw_zmq``) with a ROUTER that
understands five one-byte commands: ``p`` ping (echo), ``n`` count silently (fire and
forget), ``c`` reply with the count, ``d`` reply with the size of the data frame, ``g``
reply with as many bytes as the next frame says (zero-copy, from a buffer made once).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
import time

import zmq

from bench.common import (
    MiB,
    Recorder,
    Settings,
    measure_calls,
    median,
    p99,
    sample,
    tensor_iters,
)
from bench.server_procs import ServerProcs
from monarch_kernel.wire.spin import SpinWait


def serve(addr: str = "127.0.0.1", curve_secret: bytes | None = None, spin: float = 0.0) -> None:
    """Print the port (or, for an ``ipc://`` address, the address again), then answer
    commands until ``q``. ``curve_secret`` (Z85): be a CURVE server with that key (no
    ZAP handler: any client key is admitted). ``spin``: seconds to spin before each
    receive blocks, as our ranks do (``monarch_kernel.wire.spin``)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    if curve_secret is not None:
        sock.curve_server = True
        sock.curve_secretkey = curve_secret
    if addr.startswith("ipc://"):
        sock.bind(addr)
        print(addr, flush=True)
    else:
        print(sock.bind_to_random_port(f"tcp://{addr}"), flush=True)
    count = 0
    blobs: dict[int, bytes] = {}
    waiter = SpinWait(spin)
    while True:
        waiter.until_readable(sock)
        ident, cmd, *rest = sock.recv_multipart(copy=False)
        op = cmd.bytes
        if op == b"n":
            count += 1
        elif op == b"p":
            sock.send_multipart([ident, b"p"])
        elif op == b"c":
            sock.send_multipart([ident, str(count).encode()])
            count = 0
        elif op == b"d":
            sock.send_multipart([ident, str(len(rest[0])).encode()])
        elif op == b"g":
            size = int(rest[0].bytes)
            blob = blobs.get(size)
            if blob is None:
                blob = blobs[size] = b"\x01" * size
            sock.send_multipart([ident, blob], copy=False)
        elif op == b"q":
            return


class Servers:
    """``n`` server processes, one DEALER to each: over tcp loopback, or with
    ``ipc=True`` over unix sockets (what a local mesh's ranks and controller use)."""

    def __init__(self, n: int, ipc: bool = False, spin: float = 0.0):
        """``spin``: seconds the servers and :meth:`ping` spin before a receive blocks
        (``monarch_kernel.wire.spin``, what our controller and ranks do); 0: block."""
        self._spin = SpinWait(spin)
        self._dir = tempfile.mkdtemp(prefix="bench-raw-") if ipc else None
        where = [f"ipc://{self._dir}/s{i}" if self._dir else "127.0.0.1" for i in range(n)]
        try:
            self._servers = ServerProcs("bench.raw_zmq", [[addr, str(spin)] for addr in where])
        except BaseException:
            self._remove_dir()
            raise
        self.procs = self._servers.procs
        self.socks = self._servers.socks

    def ping(self, socks: list[zmq.Socket]) -> None:
        for s in socks:
            s.send(b"p")
        for s in socks:
            self._spin.until_readable(s)
            s.recv()

    def close(self) -> None:
        self._servers.close([b"q"])
        self._remove_dir()

    def _remove_dir(self) -> None:
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)


def run(s: Settings, rec: Recorder) -> None:
    servers = Servers(max([*s.call_ns, s.bcast_ranks]))
    try:
        one = servers.socks[:1]
        if s.wants("rtt"):
            with rec.guard("rtt", "rtt_p99"):
                xs = sample(lambda: servers.ping(one), s.rtt_iters, s.warmup, s.loop_budget_s)
                rec.value("rtt", median(xs))
                rec.value("rtt_p99", p99(xs))
        if s.wants("calln"):
            measure_calls(s, rec, s.call_ns, lambda n: lambda: servers.ping(servers.socks[:n]))
        if s.wants("bcast"):
            with rec.guard("bcast"):
                rec.value("bcast", broadcast_rate(servers.socks[: s.bcast_ranks], s.bcast_k))
        if s.wants("tensor"):
            for mib in s.tensor_mib:
                with rec.guard(f"tensor_{mib}", f"memcpy_{mib}"):
                    rec.value(f"tensor_{mib}", one_way_rate(servers.socks[0], mib))
                    rec.value(f"memcpy_{mib}", memcpy_rate(mib))
    finally:
        servers.close()


def floor_rtt(iters: int = 1000) -> float:
    """A short raw round-trip measurement, taken next to each peer as a noise check."""
    servers = Servers(1)
    try:
        return median(sample(lambda: servers.ping(servers.socks), iters, iters // 10, 2.0))
    finally:
        servers.close()


def broadcast_rate(socks: list[zmq.Socket], k: int) -> float:
    """Messages delivered per second: ``k`` sends to every server, then one counted round trip."""
    for sock in socks:  # warm the connections
        sock.send(b"c")
        sock.recv()
    t0 = time.perf_counter()
    for _ in range(k):
        for sock in socks:
            sock.send(b"n")
    for sock in socks:
        sock.send(b"c")
    counts = [int(sock.recv()) for sock in socks]
    dt = time.perf_counter() - t0
    assert counts == [k] * len(socks), counts
    return k * len(socks) / dt


def one_way_rate(sock: zmq.Socket, mib: int) -> float:
    """MiB/s of one zero-copy send of ``mib`` MiB plus a tiny ack (as a call would)."""
    import torch

    t = torch.ones(mib * MiB // 4)
    data = t.numpy().data.cast("B")

    def send() -> None:
        sock.send_multipart([b"d", data], copy=False)
        assert int(sock.recv()) == len(data)

    iters, warmup = tensor_iters(mib)
    return mib / median(sample(send, iters, warmup, 30.0))


def memcpy_rate(mib: int) -> float:
    """MiB/s of ``torch.clone`` of the same bytes in this process (the memory-copy bound).

    One intra-op thread, like a plain memcpy: on a loaded 2-core box torch's thread pool
    would otherwise measure scheduling, not copying.
    """
    import torch

    torch.set_num_threads(1)

    t = torch.ones(mib * MiB // 4)
    iters, warmup = tensor_iters(mib)
    return mib / median(sample(t.clone, iters * 2, warmup, 10.0))


if __name__ == "__main__":
    # ``python -m bench.raw_zmq [ADDR [SPIN_SECONDS]]``; a CURVE secret key comes in
    # $BENCH_CURVE_SECRET (bench/crosshost.py), never on the command line.
    import os

    secret = os.environ.get("BENCH_CURVE_SECRET")
    addr = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    spin = float(sys.argv[2]) if len(sys.argv) > 2 else 0.0
    serve(addr, curve_secret=secret.encode() if secret else None, spin=spin)
