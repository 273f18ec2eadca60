"""A ``TrainingState`` loop's state kept through a rank's death: the public
``TrainingState`` (``state``, ``monarch_kernel.training``), a rank parked at a step
boundary obeying the controller's orders (``park``), the state offered as data-plane
handles (``parts``), and re-forming the group around a restarted rank (``reform``). The
controller's half is ``controller/training``. Sits on ``pg``, ``dataplane`` and
``replicas``."""

from monarch_kernel.rank.training.park import ParkedState
from monarch_kernel.rank.training.state import TrainingState

__all__ = ["ParkedState", "TrainingState"]
