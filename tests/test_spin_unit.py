"""Spin, then block (``monarch_kernel.wire.spin``): on real ZeroMQ sockets, a waiter sees a
message that is there or comes while it spins, gives up after its spin, rests after
misses in a row (blocking at once, no CPU spent) and spins again on every
``RETRY_EVERY``-th wait, until a hit makes it spin every time again."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import zmq

from monarch_kernel.wire import spin as S

pytestmark = pytest.mark.unit


@pytest.fixture
def pair() -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://spin-test")
    b.connect("inproc://spin-test")
    try:
        yield a, b
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


def test_a_waiting_message_is_seen_at_once(pair):
    a, b = pair
    b.send(b"x")
    w = S.SpinWait(30.0)
    assert w.until_readable(a)
    assert w.misses == 0
    assert a.recv() == b"x"


def test_a_message_sent_while_spinning_ends_the_spin(pair):
    a, b = pair
    w = S.SpinWait(30.0)  # far longer than the other thread needs to send
    started = threading.Event()

    def later() -> None:
        started.wait()
        b.send(b"y")

    t = threading.Thread(target=later)
    t.start()
    started.set()
    try:
        assert w.until_readable(a)
    finally:
        t.join()
    assert w.misses == 0
    assert a.recv() == b"y"


def test_misses_make_the_waiter_rest_and_retry_now_and_then(pair):
    a, b = pair
    w = S.SpinWait(0.001)
    for i in range(S.MISSES_TO_REST):
        assert not w.until_readable(a)
        assert w.misses == i + 1
    # Resting: no spin (a spin that ran out would count one more miss) ...
    for _ in range(S.RETRY_EVERY - 1):
        assert not w.until_readable(a)
    assert w.misses == S.MISSES_TO_REST
    # ... but every RETRY_EVERY-th wait spins once more.
    assert not w.until_readable(a)
    assert w.misses == S.MISSES_TO_REST + 1
    # A retry that finds its message ends the rest: the next wait spins again.
    for _ in range(S.RETRY_EVERY - 1):
        assert not w.until_readable(a)
    b.send(b"z")
    assert w.until_readable(a)
    assert w.misses == 0
    assert a.recv() == b"z"
    assert not w.until_readable(a)
    assert w.misses == 1


def test_no_spin_configured_never_spins(pair):
    a, _ = pair
    w = S.SpinWait(0.0)
    assert not w.until_readable(a)
    assert w.misses == 0


def test_spin_seconds_from_the_environment(monkeypatch):
    cpus = len(os.sched_getaffinity(0))
    monkeypatch.delenv(S.SPIN_ENV, raising=False)
    expected = S.DEFAULT_SPIN_US / 1e6 if cpus >= 2 else 0.0
    assert S.spin_seconds() == expected
    monkeypatch.setenv(S.SPIN_ENV, "0")
    assert S.spin_seconds() == 0.0
    monkeypatch.setenv(S.SPIN_ENV, "-5")
    assert S.spin_seconds() == 0.0
    monkeypatch.setenv(S.SPIN_ENV, "350")
    assert S.spin_seconds() == (350e-6 if cpus >= 2 else 0.0)
    # A rank whose host agent runs as many ranks as there are CPUs never spins.
    assert S.spin_seconds(ranks_here=cpus) == 0.0
    monkeypatch.setenv(S.SPIN_ENV, "fast")
    with pytest.raises(ValueError, match=f"{S.SPIN_ENV}='fast'.*microseconds"):
        S.spin_seconds()
