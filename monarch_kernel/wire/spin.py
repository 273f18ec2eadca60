"""Spin, then block: wait for a socket's next message without a wake-up when it is near.

A thread that blocks in ``recv`` sleeps; the message that wakes it pays the kernel's
wake-up of that thread and, on a machine whose CPU went idle meanwhile, the CPU's exit
from its idle state (tens of microseconds on virtual machines, more than a small
call's whole work). So a waiter that expects its reply soon first *spins*: it checks
the socket (``ZMQ_EVENTS``, which also runs libzmq's pending commands) up to
:data:`DEFAULT_SPIN_US` microseconds, yielding the CPU between checks (``sched_yield``:
a thread that the spinner's CPU should run meanwhile runs), and only then blocks.

Adaptive, as an adaptive mutex is: a spin that ran out (the message came later) counts
as a miss; after :data:`MISSES_TO_REST` misses in a row the waiter blocks at once, and
tries a spin again only every :data:`RETRY_EVERY`-th wait, so waits for long calls
(a training step) cost no CPU. ``MONARCH_KERNEL_SPIN_US=0`` turns it off; it is off on
a one-CPU machine, where a spinner only delays the thread it waits for.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import zmq

from monarch_kernel.wire.codec import readable
from monarch_kernel.wire.osutil import cpu_count

#: The environment variable that sets the spin (microseconds; 0: never spin).
SPIN_ENV = "MONARCH_KERNEL_SPIN_US"
#: How long a waiter spins before it blocks, by default: about one small call's time
#: from the request's send to its reply on a busy two-core machine.
DEFAULT_SPIN_US = 200
#: Misses in a row after which a waiter stops spinning (it waits for slow replies).
MISSES_TO_REST = 4
#: While resting, every this many waits spin once more (the replies may be quick again).
RETRY_EVERY = 16

_clock = time.perf_counter
_yield = getattr(os, "sched_yield", lambda: time.sleep(0))


def spin_seconds(ranks_here: int = 0) -> float:
    """The configured spin in seconds (a ValueError naming :data:`SPIN_ENV` if it is
    not a whole number); 0.0 where spinning is off: on a one-CPU machine, and for a
    rank whose host agent runs at least as many ranks as this process may use CPUs
    (``ranks_here``; 0 for the controller): spinning ranks would then take the CPUs
    that the ranks they wait for need."""
    raw = os.environ.get(SPIN_ENV, "")
    try:
        us = int(raw) if raw else DEFAULT_SPIN_US
    except ValueError:
        raise ValueError(
            f"{SPIN_ENV}={raw!r}: give a whole number of microseconds (0: off)"
        ) from None
    cpus = cpu_count()
    if cpus < 2 or ranks_here >= cpus:
        return 0.0
    return max(us, 0) / 1e6


class SpinWait:
    """One waiter's spin (one thread at a time uses it: the socket's reader)."""

    __slots__ = ("seconds", "misses", "waits")

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.misses = 0
        self.waits = 0

    def until_readable(self, sock: zmq.Socket[bytes]) -> bool:
        """Spin until ``sock`` has a message (True) or the spin is over (False, the
        caller blocks). Returns False at once while resting after misses."""
        return self.until(lambda: readable(sock))

    def until(self, ready: Callable[[], bool]) -> bool:
        """Spin until ``ready()`` (True) or the spin is over (False, the caller blocks).
        Returns False at once while resting after misses."""
        if not self.seconds:
            return False
        if self.misses >= MISSES_TO_REST:
            self.waits += 1
            if self.waits % RETRY_EVERY:
                return False
        end = _clock() + self.seconds
        while not ready():
            if _clock() > end:
                self.misses += 1
                return False
            _yield()
        self.misses = 0
        return True
