"""The torchrun environment contract, set in every rank before any user code runs."""

from __future__ import annotations

import os
from typing import Any


def torchrun_env(cfg: dict[str, Any]) -> dict[str, str]:
    """Environment variables DDP/FSDP/Lightning code expects from torchrun."""
    world = cfg["world_size"]
    local_world = cfg["local_world_size"]
    nodes = max(1, world // max(1, local_world))
    env = {
        "RANK": cfg["rank"],
        "LOCAL_RANK": cfg["local_rank"],
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": local_world,
        "GROUP_RANK": cfg["host"],
        "NODE_RANK": cfg["host"],
        "GROUP_WORLD_SIZE": nodes,
        "ROLE_RANK": cfg["rank"],
        "ROLE_WORLD_SIZE": world,
        "ROLE_NAME": "default",
        "MASTER_ADDR": cfg["master_addr"],
        "MASTER_PORT": cfg["master_port"],
        "TORCHELASTIC_RUN_ID": cfg["run_id"],
        "TORCHELASTIC_RESTART_COUNT": cfg.get("restart_count", 0),
        "TORCHELASTIC_MAX_RESTARTS": 0,
        "LT_DEVICES": local_world,
        "LT_NUM_NODES": nodes,
    }
    return {k: str(v) for k, v in env.items()}


def apply(cfg: dict[str, Any]) -> None:
    os.environ.update(torchrun_env(cfg))
    os.environ.update({k: str(v) for k, v in cfg.get("env", {}).items()})
