"""Who is who on one mesh's sockets: routing ids, CURVE keys and impostors.

Every peer's routing id is ``h<slot>`` (a host agent), ``r<slot>`` (a rank's inbox) or
``c<slot>`` (its control socket), followed on a CURVE mesh by its host's *tag*
(:func:`~monarch_kernel.wire.identity.ident_tag` of the client key that host was
given). Slots are the processes' wire ids (``records.Slots``); callers name ranks and
hosts by their logical index and get the slot's id.

On a CURVE mesh (tcp) each host agent gets its own client keypair (:meth:`admit_host`),
and a message is kept only if its routing id belongs to the host whose key
authenticated its connection (:meth:`sender_host`): a peer holding one host's key
cannot pose as another host or its ranks. On unix sockets there is no key (the
directory is the user's only) and every tag is empty.
"""

from __future__ import annotations

import logging

import zmq

from monarch_kernel.controller.messaging.sockets import CurveKeys
from monarch_kernel.controller.state.records import HostInfo, RankInfo, Slots
from monarch_kernel.launchers.base import Curve
from monarch_kernel.wire.identity import ident_tag

__all__ = ["RoutingIds"]

log = logging.getLogger("monarch_kernel.controller")


class RoutingIds:
    """Routing ids and admitted CURVE keys of one mesh's peers."""

    def __init__(
        self, name: str, ranks: list[RankInfo], hosts: list[HostInfo], slots: Slots
    ) -> None:
        self.name = name
        self._ranks, self._hosts, self._slots = ranks, hosts, slots
        #: The mesh's CURVE keys when it listens on tcp (None on unix sockets); set
        #: by the transport when it binds.
        self.curve: Curve | None = None
        #: Per host slot: the suffix of its routing ids (:func:`ident_tag` of its CURVE
        #: secret; empty on unix sockets), and the host slot each admitted client key
        #: (z85, the ZAP user id) was handed to.
        self._tags: dict[int, bytes] = {}
        self._key_host: dict[str, int] = {}
        #: Messages dropped because the authenticated key (ZAP user id) was not the key of
        #: the host their routing id or header claims (a peer posing as another host).
        self.impostors = 0
        self._impostor_logged = False

    # -- keys --------------------------------------------------------------------------
    def take_keys(self, keys: CurveKeys) -> Curve:
        """Take over an earlier controller's CURVE state (keys, admitted hosts, tags)."""
        curve = Curve(keys.public.encode(), keys.secret.encode())
        for host, (public, tag) in keys.hosts.items():
            curve.allowed.add(public.encode())
            self._key_host[public] = host
            self._tags[host] = tag.encode()
        return curve

    def curve_keys(self) -> CurveKeys | None:
        """This mesh's CURVE keys for its attach file (None on unix sockets)."""
        if self.curve is None:
            return None
        hosts = {h: (key, self._tags.get(h, b"").decode()) for key, h in self._key_host.items()}
        return CurveKeys(self.curve.public.decode(), self.curve.secret.decode(), hosts)

    def admit_host(self, host: int) -> tuple[str, str, str]:
        """A fresh CURVE client keypair for the host agent of slot ``host`` (its ranks
        use it too), admitted by the ZAP handler; a previous one of that host is no
        longer admitted. Returns ``(server public, client public, client secret)``
        (z85), or empty strings on unix sockets."""
        if self.curve is None:
            return ("", "", "")
        public, secret = zmq.curve_keypair()
        for key, h in list(self._key_host.items()):
            if h == host:
                del self._key_host[key]
                self.curve.allowed.discard(key.encode())
        self._key_host[public.decode()] = host
        self._tags[host] = ident_tag(secret)
        self.curve.allowed.add(public)
        return (self.curve.public.decode(), public.decode(), secret.decode())

    # -- routing ids -------------------------------------------------------------------
    def host_id(self, host: int) -> bytes:
        """Routing id of (logical) host agent ``host`` (``h<slot>`` + its host's tag)."""
        return self.host_slot_id(self._hosts[host].slot)

    def host_slot_id(self, slot: int) -> bytes:
        """Routing id of the host agent of slot ``slot``."""
        return b"h%d" % slot + self._tags.get(slot, b"")

    def rank_id(self, rank: int, kind: bytes = b"r") -> bytes:
        """Routing id of (logical) ``rank``'s inbox (``r``) or control socket (``c``)."""
        info = self._ranks[rank]
        return self._slot_id(info.slot, self._hosts[info.host].slot, kind)

    def _slot_id(self, slot: int, host_slot: int, kind: bytes = b"r") -> bytes:
        return kind + b"%d" % slot + self._tags.get(host_slot, b"")

    # -- who sent it -------------------------------------------------------------------
    def sender_host(self, frames: list[zmq.Frame]) -> int | None:
        """On a CURVE mesh, the slot of the host whose key authenticated the connection
        a message ``[identity, *frames]`` came on, if its routing id belongs to that
        host; None (the message is counted in :attr:`impostors` and must be dropped)
        otherwise. -1 on unix sockets (nothing to check: the user only)."""
        if self.curve is None:
            return -1
        ident = frames[0].bytes
        user = frames[-1].get("User-Id") if len(frames) > 1 else None
        host = self._key_host.get(user) if isinstance(user, str) else None
        if host is not None and ident in (self.host_slot_id(host), *self._rank_ids(ident, host)):
            return host
        self.impostor(f"routing id {ident[:40]!r} on a connection of host {host}")
        return None

    def _rank_ids(self, ident: bytes, host: int) -> tuple[bytes, ...]:
        kind, rest = ident[:1], ident[1:].partition(b".")[0]
        if kind not in (b"r", b"c") or not rest.isdigit():
            return ()
        slot = int(rest)
        if self._slots.rank_host.get(slot) != host:
            return ()
        return (self._slot_id(slot, host, kind),)

    def impostor(self, what: str) -> None:
        """Count a message dropped because it claims another host's identity."""
        self.impostors += 1
        if not self._impostor_logged:
            self._impostor_logged = True
            log.warning(
                "mesh %s dropped a message whose %s does not belong to its CURVE key "
                "(counted in impostors; logged once)",
                self.name,
                what,
            )
