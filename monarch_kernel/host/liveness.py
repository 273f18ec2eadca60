"""Is a silent controller gone, or only busy? What a host agent decides before it gives up
on its controller (and, on an ordinary mesh, takes its ranks down with it).

Silence alone does not say. A controller that is alive can be silent for many seconds:
a notebook cell running C code that holds the GIL (the controller's heartbeats come from
a Python thread), or a thousand ranks on two cores. Taking the mesh down then costs the
user its training state for nothing. So once the controller has been silent for the
agent's ``hb_timeout``, the agent asks what is known of it:

* a controller on this machine: whether its process still runs (pid and start time:
  :meth:`ControllerId.alive`);
* one on another machine: whether the agent's connection to it is up.
  :func:`arm_heartbeats` has libzmq ping the controller's end of a tcp connection; the
  controller's libzmq I/O thread answers without Python, and a connection whose peer
  stops answering for :data:`LINK_TIMEOUT` seconds (the process stopped, the machine
  died, the network is cut) is closed, which :class:`ControllerLink` sees. A killed
  controller's connection closes at once (its OS closes it). A unix-socket link (a
  controller on this machine, whose process says more) is not pinged: a ping timeout
  that fires on a starved machine would close a working connection.

The controller is lost only when one of these says it is gone; while they say it is
alive the agent waits, and logs once per silence that it does (:class:`SilentController`).
Invariant: a controller that is really gone is noticed within ``hb_timeout`` plus
:data:`LINK_TIMEOUT` (one on this machine within ``hb_timeout``); one whose process
runs (here) or whose libzmq answers (elsewhere) is never given up on, however long it
is silent.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from monarch_kernel.wire.desk import ControllerId

log = logging.getLogger("monarch_kernel.host")

#: Seconds between libzmq's pings on the agent's connection to its controller.
LINK_PING_INTERVAL = 1.0
#: Seconds without an answer to them after which libzmq closes the connection.
LINK_TIMEOUT = 10.0


def arm_heartbeats(sock: zmq.Socket[Any]) -> None:
    """Have libzmq ping the peer of ``sock``'s connections and close one whose peer stops
    answering (ZMTP 3.1 heartbeats). Set before ``connect``: it applies to connections
    made from then on."""
    sock.setsockopt(zmq.HEARTBEAT_IVL, int(LINK_PING_INTERVAL * 1000))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, int(LINK_TIMEOUT * 1000))


class ControllerLink:
    """Whether the agent's connection to its controller is up, from a socket monitor.

    True until told otherwise (a connection still being made counts as up: the
    controller it was made for was alive a moment ago)."""

    def __init__(self, out: zmq.Socket[Any]):
        """Follow ``out``, the agent's socket to its controller; poll :attr:`monitor` and
        call :meth:`on_events` when it is readable."""
        events = zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
        self.monitor: zmq.Socket[Any] = out.get_monitor_socket(events)
        self.up = True
        self.down_at = 0.0  #: time.time() the link went down (while not up)
        #: Connections made (handshakes done); libzmq pings a connection only from then.
        self.handshakes = 0

    def on_events(self) -> None:
        """Read the monitor's events."""
        import zmq.utils.monitor

        while True:
            try:
                event = zmq.utils.monitor.recv_monitor_message(self.monitor, zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            if event["event"] == zmq.EVENT_DISCONNECTED:
                if self.up:
                    self.down_at = time.time()
                self.up = False
            elif event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.up = True
                self.handshakes += 1

    def down_for(self) -> float:
        """Seconds the link has been down (0 while it is up)."""
        return time.time() - self.down_at if not self.up else 0.0

    def close(self) -> None:
        self.monitor.close(0)


def gone_reason(holder: ControllerId | None, link: ControllerLink) -> str | None:
    """Why the controller ``holder`` is known to be gone, or None while it is (or may be)
    alive. ``holder`` None (not known): the link alone says."""
    return _verdict(holder, link)[0]


def _verdict(holder: ControllerId | None, link: ControllerLink) -> tuple[str | None, str]:
    """(why it is gone or None, what says it lives)."""
    link.on_events()  # (an agent that does not poll the monitor reads it here)
    alive = holder.alive() if holder is not None else None
    if alive is False:
        return f"{_who(holder)} ended", ""
    if alive:
        return None, "its process runs"
    if not link.up:
        return f"the connection to {_who(holder)} closed", ""
    return None, "its connection answers"


def _who(holder: ControllerId | None) -> str:
    return holder.describe() if holder is not None else "the controller"


class SilentController:
    """The agent's verdict on a controller silent for longer than its ``hb_timeout``:
    :meth:`gone` says why it is gone, or None (it lives: wait); a wait is logged once
    per silence."""

    def __init__(self, host: int, link: ControllerLink):
        self.host = host
        self.link = link
        self._waiting_since: float | None = None  #: monotonic start of the silence waited out

    def heard(self) -> None:
        """The controller spoke: a silence after this is a new one."""
        if self._waiting_since is not None:
            log.warning(
                "host %s: the controller spoke again after %.0fs of silence",
                self.host,
                time.monotonic() - self._waiting_since,
            )
            self._waiting_since = None

    def gone(self, silence: float, holder: ControllerId | None) -> str | None:
        """``silence``: seconds since the controller was last heard."""
        why, alive = _verdict(holder, self.link)
        if why is None and self._waiting_since is None:
            self._waiting_since = time.monotonic() - silence
            log.warning(
                "host %s: %s silent for %.0fs, but %s: busy, not gone; the ranks keep running",
                self.host,
                _who(holder),
                silence,
                alive,
            )
        return why


#: The longest the clean-up after a SIGTERM waits to be re-parented, when its controller
#: (the parent) is still there: one killed outright may still be ending its threads.
REPARENT_WAIT = 2.0


def parent_ended(controller_pid: int | None, signalled: bool) -> bool:
    """Whether the controller that started this agent (the local launcher's, its
    parent ``controller_pid``; None: started otherwise) has ended: the agent was
    re-parented to another process.

    Its parent-death signal (SIGTERM) comes as soon as the controller's thread that
    started the agent ends; one killed outright ends its threads one by one, and until
    the last has ended the agent is the child of another of them (``getppid`` still
    names it). After a SIGTERM (``signalled``), the re-parenting is waited for (at most
    :data:`REPARENT_WAIT` seconds: a controller that lives and stopped its agents
    removes its directories itself)."""
    if controller_pid is None:
        return False
    gone = os.getppid() != controller_pid
    if not gone and signalled:
        deadline = time.monotonic() + REPARENT_WAIT
        while not gone and time.monotonic() < deadline:
            time.sleep(0.01)
            gone = os.getppid() != controller_pid
    return gone


__all__ = [
    "LINK_TIMEOUT",
    "ControllerLink",
    "SilentController",
    "arm_heartbeats",
    "gone_reason",
    "parent_ended",
]
