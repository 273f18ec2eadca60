"""``RankConfig``: built once from the spawn spec, the common part and the host agent's
additions; through JSON (the template's pipe) and back unchanged."""

from __future__ import annotations

import json

import pytest

from monarch_kernel.rank.config import ConfigError, RankConfig
from monarch_kernel.rank.env import torchrun_env

SPEC = {"rank": 3, "local_rank": 1, "coords": [1, 1], "host": 1, "restart_count": 2}
COMMON = {
    "labels": ["hosts", "gpus"],
    "sizes": [2, 2],
    "world_size": 4,
    "local_world_size": 2,
    "master_addr": "10.0.0.1",
    "master_port": 29500,
    "run_id": "run1",
    "mesh": "trainers",
    "env": {"A": "1"},
    "sys_path": ["/src"],
    "cwd": "/work",
}
AGENT = {
    "key": "ab" * 32,
    "send": "ipc:///tmp/s",
    "recv": "ipc:///tmp/r",
    "fanout": "ipc:///tmp/f",
    "hostname": "box",
    "log": "/tmp/rank3.log",
}


def test_build_merges_spec_over_common_over_agent():
    cfg = RankConfig.build(SPEC, COMMON, AGENT)
    assert cfg.rank == 3 and cfg.local_rank == 1 and cfg.host == 1
    assert cfg.coords == (1, 1) and cfg.labels == ("hosts", "gpus") and cfg.sizes == (2, 2)
    assert cfg.world_size == 4 and cfg.master_port == 29500 and cfg.mesh == "trainers"
    assert cfg.env == {"A": "1"} and cfg.sys_path == ("/src",)
    assert cfg.key == "ab" * 32 and cfg.fanout == "ipc:///tmp/f" and cfg.hostname == "box"
    assert cfg.curve_secret == "" and not cfg.uses_curve and cfg.peer_port == 0
    over = RankConfig.build(dict(SPEC, mesh="spec wins"), COMMON, dict(AGENT, mesh="agent"))
    assert over.mesh == "spec wins"


def test_json_round_trip():
    cfg = RankConfig.build(dict(SPEC, peer_secret="s", peer_port=4000), COMMON, AGENT)
    raw = json.loads(json.dumps(cfg.to_json()))
    assert RankConfig.from_json(raw) == cfg


def test_frozen():
    cfg = RankConfig.build(SPEC, COMMON, AGENT)
    with pytest.raises(AttributeError):
        cfg.rank = 1  # type: ignore[misc]


def test_unknown_and_missing_keys_are_errors():
    with pytest.raises(ConfigError, match=r"unknown keys \['rnak'\]"):
        RankConfig.build(dict(SPEC, rnak=1), COMMON, AGENT)
    with pytest.raises(ConfigError, match="missing key 'rank'"):
        RankConfig.build({}, COMMON, AGENT)
    with pytest.raises(ConfigError, match="'world_size'"):
        RankConfig.build(SPEC, dict(COMMON, world_size="four"), AGENT)


def test_mesh_name_falls_back_to_the_run_id():
    assert RankConfig.build(SPEC, dict(COMMON, mesh=""), AGENT).mesh_name == "run1"
    assert RankConfig.build(SPEC, COMMON, AGENT).mesh_name == "trainers"


def test_torchrun_env():
    env = torchrun_env(RankConfig.build(SPEC, COMMON, dict(AGENT, ifname="eth0")))
    assert env["RANK"] == "3" and env["LOCAL_RANK"] == "1" and env["WORLD_SIZE"] == "4"
    assert env["GROUP_RANK"] == env["NODE_RANK"] == "1" and env["GROUP_WORLD_SIZE"] == "2"
    assert env["MASTER_ADDR"] == "10.0.0.1" and env["MASTER_PORT"] == "29500"
    assert env["TORCHELASTIC_RUN_ID"] == "run1"
    assert env["TORCHELASTIC_RESTART_COUNT"] == "2"
    assert env["GLOO_SOCKET_IFNAME"] == env["NCCL_SOCKET_IFNAME"] == "eth0"
    assert "GLOO_SOCKET_IFNAME" not in torchrun_env(RankConfig.build(SPEC, COMMON, AGENT))
