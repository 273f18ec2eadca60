"""The environment a process-group worker runs NCCL (and gloo) with.

The user's own ``NCCL_*``, ``TORCH_NCCL_*``, ``GLOO_*`` and ``TORCH_GLOO*`` variables
reach the worker unchanged (``%mesh ... --env``). On top of them, one rule: **ranks that
share a GPU** (more ranks on a host than it has GPUs) each get an ``NCCL_HOSTID`` of
their own. NCCL up to 2.29 refuses two ranks of one communicator on one GPU ("Duplicate
GPU detected"), telling them apart by host and bus id; a distinct host id makes each
rank look like a host of its own, so NCCL connects them through its network transport
(sockets: ``NCCL_SOCKET_IFNAME=lo`` unless the mesh names an interface). That is slower
than NVLink or shared memory and meant for trying things on one GPU, which is what a
mesh of more ranks than GPUs is for.
"""

from __future__ import annotations

import socket
from collections.abc import Mapping

#: Prefixes of the variables a worker inherits from its rank.
INHERITED = ("GLOO_", "TORCH_GLOO", "NCCL_", "TORCH_NCCL_")


def worker_env(environ: Mapping[str, str], gpus_on_host: int) -> dict[str, str]:
    """The variables a worker sets before it forms its groups, from the rank's
    environment ``environ`` (the torchrun variables are in it) and the number of GPUs
    the rank sees (0 without CUDA)."""
    env = {k: v for k, v in environ.items() if k.startswith(INHERITED)}
    if shares_gpu(environ, gpus_on_host) and "NCCL_HOSTID" not in env:
        local_rank = environ.get("LOCAL_RANK", "0")
        env["NCCL_HOSTID"] = f"{socket.gethostname()}-mk-{local_rank}"
        env.setdefault("NCCL_SOCKET_IFNAME", "lo")
    return env


def shares_gpu(environ: Mapping[str, str], gpus_on_host: int) -> bool:
    """Whether this rank shares its GPU with another rank of its host."""
    try:
        local_world = int(environ.get("LOCAL_WORLD_SIZE", "1"))
    except ValueError:
        return False
    return gpus_on_host > 0 and local_world > gpus_on_host
