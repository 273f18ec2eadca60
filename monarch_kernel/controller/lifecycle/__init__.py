"""A mesh's processes from start to end: starting host agents and ranks (``startup``),
watching them (``supervision``: heartbeats, deaths, lost hosts; ``silence`` and
``busy_agents``: when a quiet agent counts as gone), what the failure policy does when a
request fails (``failures``, ``incident``), restarting ranks in place (``restart``), the
replicas made the same again after it (``replica_check``), and ``%mesh stacks``
(``stacks``). "A rank died and ..." starts here. Sits on ``state`` and ``messaging``."""

from monarch_kernel.controller.lifecycle.failures import FailureHandler
from monarch_kernel.controller.lifecycle.restart import Restarter
from monarch_kernel.controller.lifecycle.startup import Starter
from monarch_kernel.controller.lifecycle.supervision import Supervisor

__all__ = ["FailureHandler", "Restarter", "Starter", "Supervisor"]
