"""Training state recovered from the surviving replicas (``TrainingState`` loops): which
requests run training steps and which deaths they claim (``recovery``), the rounds of
one recovery (``rounds``: park, restart, re-form, offer, load, the cell again, resume)
and what a round needs of the mesh (``round_mesh``). The rank side is
``rank/training``. Sits on ``state``, ``messaging`` and ``lifecycle``."""

from monarch_kernel.controller.training.recovery import PeerRecovery
from monarch_kernel.controller.training.round_mesh import PeerMesh
from monarch_kernel.controller.training.rounds import Recovery

__all__ = ["PeerMesh", "PeerRecovery", "Recovery"]
