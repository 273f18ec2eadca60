"""The re-formable process group: ``torch.distributed`` on a group the mesh can abort
(the stop button, a dead rank) and form again without losing the objects that hold it.
``distributed`` wraps ``init_process_group`` and is the face; ``backend`` is the
``mkgloo`` torch backend (gloo on CPU) forming every group of the rank at once;
``reformable`` the group itself, ``ops`` its collectives; ``spawn``/``worker``/``protocol``
the worker process that runs gloo, ``shm``/``adopt`` the tensors it shares. Sits on
``rank/replicas``."""

from monarch_kernel.rank.pg.distributed import abort_process_group, reform_process_group, state

__all__ = ["abort_process_group", "reform_process_group", "state"]
