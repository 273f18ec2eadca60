"""A rank's clean-up on its way out (``rank.forked._clean_up``) keeps the buffers of
messages still in flight: pyzmq's own atexit hook would drop them while libzmq's I/O
thread still writes them (a rank stopped in a flood of output died of SIGSEGV or
SIGABRT so, now and then, in ``test_rank_robust``).

Run in a process of its own: the clean-up runs the process's atexit handlers."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

pytestmark = pytest.mark.local

PROGRAM = textwrap.dedent(
    """
    import hashlib, os, sys, zmq
    from zmq.utils.garbage import gc as zmq_gc
    from monarch_kernel.rank import forked

    ctx = zmq.Context()
    where = "ipc://" + os.path.join(sys.argv[1], "s")
    writer = ctx.socket(zmq.PAIR)
    # nobody there yet: the message waits in libzmq's queue, its buffer held (with the
    # reader bound first, libzmq's I/O thread could move all of it before we count)
    writer.connect(where)
    payload = os.urandom(8 << 20)
    digest = hashlib.sha256(payload).hexdigest()
    writer.send(payload, copy=False)  # only pyzmq's collector holds it once we let go
    del payload
    kept = len(zmq_gc.refs)
    forked._clean_up()  # the rank's way out: actors, atexit handlers, streams
    print("in flight", kept, "kept", len(zmq_gc.refs), flush=True)
    reader = ctx.socket(zmq.PAIR)
    reader.bind(where)
    got = reader.recv()  # libzmq writes it only now
    print("intact", hashlib.sha256(got).hexdigest() == digest, flush=True)
    os._exit(0)  # as a rank ends
    """
)


def test_a_message_in_flight_keeps_its_buffer_through_the_clean_up():
    folder = tempfile.mkdtemp(prefix="mk-exit-", dir="/tmp")  # (a socket's path is short)
    try:
        done = subprocess.run(
            [sys.executable, "-c", PROGRAM, folder], capture_output=True, text=True, timeout=60
        )
    finally:
        shutil.rmtree(folder)
    assert done.returncode == 0, (done.returncode, done.stdout, done.stderr[-2000:])
    assert "in flight 1 kept 1" in done.stdout, done.stdout
    assert "intact True" in done.stdout, done.stdout
