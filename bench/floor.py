"""The raw ZeroMQ floor measured under the same conditions as our calls.

The raw round trip on this (virtual, shared) machine depends on how idle its CPUs are:
a process that blocks lets its vCPU halt, and waking a halted vCPU costs more than the
whole round trip of a busy one. Measured in a process of its own (the ``zmq`` peer) the
floor can be several times slower, or faster, than beside a live mesh. So rows 1 and 4
also measure the floor inside ours' worker, with the mesh's ranks (and host agent)
alive beside it, in blocks that alternate with ours' calls: both see the same CPU
state and the same load from other jobs, and the ratio of the two is the figure that
says how far a call is from the wire.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from bench.common import MiB, sample

#: Blocks per side in :func:`alternating` (each side gets ``blocks`` turns).
BLOCKS = 4


@dataclass(frozen=True)
class Alternated:
    """Seconds per call of two functions, sampled in alternating blocks."""

    ours: list[float]
    floor: list[float]


def alternating(
    ours: Callable[[], object],
    floor: Callable[[], object],
    iters: int,
    warmup: int,
    budget_s: float,
    blocks: int = BLOCKS,
) -> Alternated:
    """``iters`` samples of each function (after ``warmup`` calls of each), taken in
    ``blocks`` alternating blocks of ``iters // blocks``; ``budget_s`` caps each side's
    total time (each block keeps at least 20 samples)."""
    per_block = max(1, iters // blocks)
    block_budget = budget_s / blocks
    for _ in range(warmup):
        ours()
        floor()
    a: list[float] = []
    b: list[float] = []
    for _ in range(blocks):
        a += sample(ours, per_block, 0, block_budget)
        b += sample(floor, per_block, 0, block_budget)
    return Alternated(a, b)


class RawFloor:
    """One raw ZeroMQ server process (``bench.raw_zmq``) and the two floors measured
    against it: a 1-byte round trip, and a zero-copy send of a tensor's bytes plus a
    tiny ack (what a call that carries the tensor costs at the least)."""

    def __init__(self, ipc: bool = False, servers: int = 1, spin: float = 0.0) -> None:
        """``ipc``: over unix sockets, the transport of a local mesh (else tcp loopback,
        the floor every peer is compared with). ``servers``: how many server processes
        (:meth:`sender` with ``to_all`` sends to each). ``spin``: both ends spin this
        many seconds before a receive blocks, as our controller and ranks do."""
        from bench.raw_zmq import Servers

        self._servers = Servers(servers, ipc=ipc, spin=spin)
        self._sock = self._servers.socks[0]

    def ping(self) -> None:
        """One raw round trip."""
        self._servers.ping([self._sock])

    def ping_all(self) -> None:
        """One raw message to every server process, then all their replies (the floor
        of a gathered call)."""
        self._servers.ping(self._servers.socks)

    def sender(self, mib: int, to_all: bool = False) -> Callable[[], object]:
        """A function that sends ``mib`` MiB zero-copy and waits for the ack; ``to_all``:
        to every server process, then waits for all their acks (the floor of a gathered
        call carrying the tensor)."""
        import torch

        data = torch.ones(mib * MiB // 4).numpy().data.cast("B")
        socks = self._servers.socks if to_all else [self._sock]

        def send() -> None:
            for sock in socks:
                sock.send_multipart([b"d", data], copy=False)
            for sock in socks:
                assert int(sock.recv()) == len(data)

        return send

    def fetcher(self, mib: int) -> Callable[[], object]:
        """A function that asks the first server process for ``mib`` MiB and receives
        them (zero-copy on both sides: the floor of a call whose result is that big)."""
        size = mib * MiB
        ask = [b"g", str(size).encode()]
        sock = self._sock

        def fetch() -> None:
            sock.send_multipart(ask)
            assert len(sock.recv(copy=False)) == size

        return fetch

    def close(self) -> None:
        self._servers.close()
