"""The data-parallel replicas in a rank's namespace: finding the training objects,
counting optimizer steps (``opt_steps``), digests and syncing them from the most
advanced rank (``replicas``, ``state_copy``), and a DDP model's gradient bucket layout
(``ddp_layout``). The controller's half is ``controller/lifecycle/replica_check.py``.
Below ``rank/pg`` (the process group repairs DDP reducers with it)."""

from monarch_kernel.rank.replicas.replicas import digest_namespace, repair_ddp, sync_namespace

__all__ = ["digest_namespace", "repair_ddp", "sync_namespace"]
