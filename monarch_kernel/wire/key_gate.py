"""CURVE listeners that admit only a known set of client keys, on any ZeroMQ context.

A CURVE server alone admits every client that knows its public key and completes the
handshake with *some* keypair; ZAP (the ZeroMQ authentication protocol) is where a
server says which client keys it takes. :class:`KeyGate` is that list (and a count of
the keys it refused); :func:`guard` makes a socket a CURVE server whose handshakes the
gate decides, through one ZAP handler thread per context (started on first use,
stopped by :func:`close_gates` before the context is destroyed).

Used where the mesh's controller is not the listener: a detachable mesh's host agent
desk (admits the controller's key only) and a rank's TCP listeners (admit the
controller's listener key only, see ``rank.listener_gate``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

import zmq

log = logging.getLogger("monarch_kernel.wire")


class KeyGate:
    """The CURVE client keys (z85) a listener admits; thread-safe."""

    def __init__(self, allowed: Iterable[bytes | str] = ()):
        self._lock = threading.Lock()
        self.allowed: set[bytes] = {_key(k) for k in allowed if k}
        #: Handshakes refused (a client key not in :attr:`allowed`).
        self.refused = 0
        self._logged = False

    def admit(self, key: bytes | str) -> None:
        """Admit ``key`` from now on (a controller that attached, a new host)."""
        if key:
            with self._lock:
                self.allowed.add(_key(key))

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP's question: may the client with public key ``key`` (z85) connect?"""
        with self._lock:
            if key in self.allowed:
                return True
            self.refused += 1
            first, self._logged = not self._logged, True
        if first:
            log.warning("%s refused a CURVE key it does not know (counted; logged once)", domain)
        return False


def _key(key: bytes | str) -> bytes:
    return key.encode() if isinstance(key, str) else bytes(key)


_lock = threading.Lock()
#: One ZAP handler per context (by id: a context is not hashable in every pyzmq).
_handlers: dict[int, Any] = {}


def guard(sock: zmq.Socket[Any], secret: str, gate: KeyGate, domain: str) -> None:
    """Make ``sock`` (before it binds) a CURVE server with secret key ``secret`` (z85)
    that admits the clients ``gate`` admits."""
    ctx = sock.context
    with _lock:
        auth = _handlers.get(id(ctx))
        if auth is None:
            from zmq.auth.thread import ThreadAuthenticator

            auth = _handlers[id(ctx)] = ThreadAuthenticator(ctx, log=log)
            auth.start()
        auth.configure_curve_callback(domain, credentials_provider=gate)
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret.encode())
    sock.setsockopt(zmq.ZAP_DOMAIN, domain.encode())


def close_gates(ctx: zmq.Context[Any]) -> None:
    """Stop ``ctx``'s ZAP handler, if one was started (before ``ctx.destroy()``)."""
    with _lock:
        auth = _handlers.pop(id(ctx), None)
    if auth is not None:
        try:
            auth.stop()
        except zmq.ZMQError:
            pass
