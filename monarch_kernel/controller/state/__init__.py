"""What the controller knows about one mesh, and nothing it does: the records of its
ranks and hosts (``records``: ``RankInfo``, ``HostInfo``, ``MeshPhase``, the failure
policy, the recipe a restart re-creates), its phase and the condition threads wait on
(``phase``), its outstanding requests and which rank is busy (``requests``), the
lifecycle events every listener hears (``events``), and the registry of live meshes.
The lowest part of ``controller/``: it imports no other part of it."""

from monarch_kernel.controller.state.events import EventBus
from monarch_kernel.controller.state.records import MeshPhase, RankInfo
from monarch_kernel.controller.state.requests import RequestTable

__all__ = ["EventBus", "MeshPhase", "RankInfo", "RequestTable"]
