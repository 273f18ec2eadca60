"""Peer calls: a rank (or the controller's own actors) calling the ranks of another
mesh directly, never through the controller. ``requester`` is a mesh reference's
``Requester`` in a rank (``attach`` picks it), ``client`` the one ``PeerClient`` a
process has, ``inline`` calls to the caller's own rank, ``reply`` where replies arrive,
``resolve`` finding a rank that moved. "Peer" in this package means only this."""

from monarch_kernel.actor.peer.client import PeerClient
from monarch_kernel.actor.peer.requester import PeerRequester, attach

__all__ = ["PeerClient", "PeerRequester", "attach"]
