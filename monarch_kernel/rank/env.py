"""The torchrun environment contract, set in every rank before any user code runs."""

from __future__ import annotations

import os
import sys

from monarch_kernel.rank.config import RankConfig


def torchrun_env(cfg: RankConfig) -> dict[str, str]:
    """Environment variables DDP/FSDP/Lightning code expects from torchrun."""
    world = cfg.world_size
    local_world = cfg.local_world_size
    nodes = max(1, world // max(1, local_world))
    env: dict[str, object] = {
        "RANK": cfg.rank,
        "LOCAL_RANK": cfg.local_rank,
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local_world,
        "GROUP_RANK": cfg.host,
        "NODE_RANK": cfg.host,
        "GROUP_WORLD_SIZE": nodes,
        "ROLE_RANK": cfg.rank,
        "ROLE_WORLD_SIZE": world,
        "ROLE_NAME": "default",
        "MASTER_ADDR": cfg.master_addr,
        "MASTER_PORT": cfg.master_port,
        "TORCHELASTIC_RUN_ID": cfg.run_id,
        "TORCHELASTIC_RESTART_COUNT": cfg.restart_count,
        "TORCHELASTIC_MAX_RESTARTS": 0,
        "LT_DEVICES": local_world,
        "LT_NUM_NODES": nodes,
    }
    if cfg.ifname:  # hosts on other machines: the interface the host joined on
        env["GLOO_SOCKET_IFNAME"] = env["NCCL_SOCKET_IFNAME"] = cfg.ifname
    return {k: str(v) for k, v in env.items()}


def apply(cfg: RankConfig) -> None:
    """Set the torchrun variables and the user's ``--env`` in this process."""
    os.environ.update(torchrun_env(cfg))
    user_env = dict(cfg.env)
    # Like torchrun: one intra-op thread per rank when several share a machine, unless
    # the user chose otherwise (torch is already imported, so tell it directly too).
    if cfg.local_world_size > 1 and "OMP_NUM_THREADS" not in user_env:
        user_env.setdefault("OMP_NUM_THREADS", os.environ.get("OMP_NUM_THREADS", "1"))
    os.environ.update(user_env)
    torch = sys.modules.get("torch")
    if torch is not None and "OMP_NUM_THREADS" in user_env:
        torch.set_num_threads(int(user_env["OMP_NUM_THREADS"]))
