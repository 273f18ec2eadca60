"""Training that survives a dead rank: declare a rank's training state and its steps.

``TrainingState`` (defined in :mod:`monarch_kernel.rank.training.state`) is used inside
ranks (``%%remote`` cells)::

    from monarch_kernel.training import TrainingState
    state = TrainingState(model=ddp, optimizer=opt, data=sampler, extra={"losses": losses})
    while state.step < 1000:
        with state.stepping():
            ...one training step...

When a rank dies mid-step in a mesh whose failure policy is ``restart``, the others
wait at the step boundary, the dead rank is restarted and takes this state from a live
replica's memory (no checkpoint), and the loop goes on at the step that was in flight.
"""

from __future__ import annotations

from monarch_kernel.rank.training.state import TrainingState, is_peer_failure

__all__ = ["TrainingState", "is_peer_failure"]
