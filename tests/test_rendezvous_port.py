"""The rendezvous port (``MASTER_PORT``) is the mesh's from the moment its host agent
picks it until rank 0's store listens on it (``wire.ports.PortReservation``).

The agent picks the port when it starts; rank 0 binds it at the first collective, maybe
minutes later. A port that was merely found free could be another program's by then:
rank 0's store failed with "address already in use" while the other ranks waited in
their connect to whatever held it, and the collective never ended (CI, once: a test's
first ``all_reduce`` waited out its 120 s).
"""

from __future__ import annotations

import errno
import socket

import pytest
import torch
from test_tensor_engine_stop import RANKS, _all_reduce_in

pytestmark = pytest.mark.local


def _master_port() -> torch.Tensor:
    import os

    return torch.tensor(int(os.environ["MASTER_PORT"]))


def test_the_rendezvous_port_cannot_be_taken_before_rank_0_listens_on_it():
    from monarch_kernel import inspect, remote
    from monarch_kernel.actor import this_host
    from monarch_kernel.mesh_controller import spawn_tensor_engine

    procs = this_host().spawn_procs(per_host={"gpus": RANKS})
    try:
        dm = spawn_tensor_engine(procs)
        master_port = remote(_master_port, propagate=lambda: torch.tensor(0))
        all_reduce = remote(_all_reduce_in, propagate=lambda t, pg: t.clone())
        with procs.activate():
            port = int(inspect(master_port(), gpus=0))
            # nothing listens on it yet (no collective ran), and yet a program cannot
            # bind it, and the kernel gives it to no bind to port 0
            plain = socket.socket()
            try:
                with pytest.raises(OSError, match="in use") as taken:
                    plain.bind(("", port))
                assert taken.value.errno == errno.EADDRINUSE, taken.value
            finally:
                plain.close()
            others = []
            try:
                for _ in range(500):
                    s = socket.socket()
                    others.append(s)
                    s.bind(("", 0))
                    assert s.getsockname()[1] != port
            finally:
                for s in others:
                    s.close()
            # rank 0's store listens on it: the first collective runs
            y = all_reduce(torch.ones(2), dm.process_group("gpus"))
            assert inspect(y, gpus=2).tolist() == [3.0, 3.0]
    finally:
        procs.stop()
