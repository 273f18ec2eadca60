"""The wire-floor benchmark (bench/wire_floor.py) measures what it says: in every mode a
gathered call reaches real server processes and comes back, and the signed modes refuse
what a server of another mode (another signature, or none) sends."""

from __future__ import annotations

import os
import sys

import psutil
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from bench.raw_zmq import Servers  # noqa: E402
from bench.server_procs import ServerProcs  # noqa: E402
from bench.shm_floor import MODES as SHM_MODES  # noqa: E402
from bench.shm_floor import ShmServers  # noqa: E402
from bench.wire_floor import MODES, Wire, WireServers  # noqa: E402
from monarch_kernel.wire import WireError  # noqa: E402

pytestmark = [pytest.mark.local, pytest.mark.timeout(120)]


def test_every_mode_answers_a_gathered_call_and_leaves_no_process():
    for mode in MODES:
        servers = WireServers(2, mode)
        try:
            for _ in range(5):
                assert servers.call() == [None, None], mode
        finally:
            servers.close()
        # each server read the quit message and returned, none had to be killed
        assert [p.returncode for p in servers.procs] == [0, 0], mode


def test_shared_memory_servers_answer_and_leave_no_process_file_or_descriptor():
    fds = set(os.listdir("/proc/self/fd"))
    for mode in SHM_MODES:
        servers = ShmServers(3, mode)
        path = servers._path
        try:
            for _ in range(5):
                got = servers.call()
                assert got == ([b"p"] * 3 if mode == "raw" else [None] * 3), mode
        finally:
            servers.close()
        assert [p.returncode for p in servers.procs] == [0, 0, 0], mode  # each quit
        assert not os.path.exists(path), mode
    assert set(os.listdir("/proc/self/fd")) <= fds  # the eventfds are closed


def test_a_shared_memory_server_that_died_fails_the_call_instead_of_hanging_it():
    servers = ShmServers(2, "codec", timeout=1.0)
    try:
        assert servers.call() == [None, None]
        servers.procs[1].kill()
        servers.procs[1].wait()
        with pytest.raises(RuntimeError, match="1 of 2 shm-floor servers did not answer in 1s"):
            servers.call()
    finally:
        servers.close()
    assert all(p.returncode is not None for p in servers.procs)
    assert not os.path.exists(servers._path)


def test_raw_servers_answer_over_tcp_and_ipc_and_leave_nothing():
    for ipc in (False, True):
        servers = Servers(2, ipc=ipc)
        where = servers._dir
        try:
            for _ in range(5):
                servers.ping(servers.socks)
        finally:
            servers.close()
        assert [p.returncode for p in servers.procs] == [0, 0], ipc
        assert where is None or not os.path.exists(where)


def test_a_server_that_does_not_start_fails_with_its_name_and_leaves_no_process():
    with pytest.raises(RuntimeError, match=r"bench\.no_such_server server \d+ did not start"):
        ServerProcs("bench.no_such_server", [[], []], timeout=5.0)
    left = [c.pid for c in psutil.Process().children() if "no_such_server" in str(c.cmdline())]
    assert not left, left


def test_signed_modes_verify_what_they_receive():
    body = {"k": "c", "i": 1}
    hmac_frames = Wire("hmac").encode(dict(body), b"x")
    ours = Wire("signed")
    with pytest.raises(ValueError, match="signature"):
        ours.decode([_Frame(f) for f in hmac_frames])
    with pytest.raises(ValueError, match="signature"):
        Wire("hmac").decode([_Frame(f) for f in ours.encode(dict(body), b"x")])
    assert ours.decode([_Frame(f) for f in ours.encode(dict(body), b"x")]) == (body, b"x")
    # the codec mode is the real Codec: the signature alone is not enough to pass it
    with pytest.raises(WireError):
        Wire("codec").decode(ours.encode(dict(body), b"x"))


class _Frame:
    """What ``recv`` hands the decoder: an object with the frame's ``bytes``."""

    def __init__(self, data: bytes) -> None:
        self.bytes = data
