"""The data-parallel replicas in a rank's namespace: finding the training objects,
counting optimizer steps (``opt_steps``), digests and syncing them from the most
advanced rank (``replicas``, ``state_copy``), a DDP model's gradient bucket layout
(``ddp_layout``), and sharded (FSDP2/HSDP) models: which ranks hold the same shards and
how shards travel (``shards``), and their reset after a step cut short (``fsdp_reset``).
The controller's half is ``controller/lifecycle/replica_check.py``.
Below ``rank/pg`` (the process group repairs DDP reducers with it)."""

from monarch_kernel.rank.replicas.replicas import digest_namespace, reset_ddp, sync_namespace

__all__ = ["digest_namespace", "reset_ddp", "sync_namespace"]
