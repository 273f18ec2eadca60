"""How messages reach a mesh's processes and come back: the two ROUTER sockets and who
may speak on them (``transport``, ``sockets``, ``routing_ids``, the CURVE client key
ranks' listeners admit: ``listener_key``), flow control (``backlog``) and batched
broadcasts (``batching``), the receive token and the I/O thread (``receiver``), the
checks and the handler table for everything a rank or agent sends (``inbound``), what
ranks ask of the controller (``asks``, ``whereabouts``), and rank output routed to its
cell (``streams``). Sits on ``controller.state`` only."""

from monarch_kernel.controller.messaging.inbound import Inbound
from monarch_kernel.controller.messaging.receiver import Receiver
from monarch_kernel.controller.messaging.transport import Transport

__all__ = ["Inbound", "Receiver", "Transport"]
