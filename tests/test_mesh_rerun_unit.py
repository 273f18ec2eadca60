"""``%mesh``'s words for a re-run and for oversubscription, without processes: what
differs from a running mesh (and the resize that would do), the GPUs a local mesh sees
(counted without torch or CUDA), and the line about ranks sharing GPUs or cores."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from monarch_kernel.controller.lifecycle.failures import DEFAULT_GRACE
from monarch_kernel.kernel.args import mesh_parser
from monarch_kernel.kernel.mesh import oversubscribed
from monarch_kernel.kernel.mesh.create import MeshRequest
from monarch_kernel.kernel.mesh.oversubscribed import local_gpus, oversubscription
from monarch_kernel.shape import Shape

pytestmark = pytest.mark.unit


def request(**kw: Any) -> MeshRequest:
    base: dict[str, Any] = {
        "name": "t",
        "gpus": 2,
        "hosts": 1,
        "backend": "local",
        "env": {},
        "engine_options": {},
        "timeout": 120.0,
        "on_failure": "restart",
        "grace": DEFAULT_GRACE,
        "dist": False,
    }
    return MeshRequest(**(base | kw))


class Live:
    """What ``MeshRequest.differences`` reads of a running mesh."""

    def __init__(self, gpus: int = 2, hosts: int = 1, **kw: Any):
        extent = ({"hosts": hosts} if hosts > 1 else {}) | {"gpus": gpus}
        self.shape = Shape.from_extent(extent)
        self.n_hosts, self.per_host, self.world = hosts, gpus, hosts * gpus
        self.env: dict[str, str] = kw.get("env", {})
        self.backend = kw.get("backend", "local")
        self.on_failure = kw.get("on_failure", "restart")
        self.shrink_min = kw.get("shrink_min", 1)
        self.failures = types.SimpleNamespace(grace=kw.get("grace", DEFAULT_GRACE))
        self.detach_keep = kw.get("detach_keep", 0.0)


def test_the_same_spec_has_no_differences():
    assert request().differences(Live()) == []  # type: ignore[arg-type]
    assert request(timeout=5.0).differences(Live()) == []  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "asked, live, said",
    [
        ({"gpus": 3}, {}, ["--gpus 3 vs the live --gpus 2"]),
        ({"hosts": 2}, {}, ["--hosts 2 vs the live --hosts 1"]),
        ({"env": {"A": "1"}}, {}, ["--env A=1 vs the live mesh without --env"]),
        ({}, {"env": {"A": "1"}}, ["no --env vs the live --env A=1"]),
        (
            {"on_failure": "shrink:2"},
            {},
            ["--on-failure shrink:2 vs the live --on-failure restart"],
        ),
        (
            {"on_failure": "shrink"},
            {"on_failure": "shrink", "shrink_min": 2},
            ["--on-failure shrink vs the live --on-failure shrink:2"],
        ),
        ({"detachable": True}, {}, ["--detachable vs the live mesh without --detachable"]),
        ({}, {"detach_keep": 60.0}, ["no --detachable vs the live --detachable"]),
        ({"grace": 1.5}, {}, [f"--grace 1.5 vs the live --grace {DEFAULT_GRACE:g}"]),
    ],
)
def test_each_difference_is_named(asked, live, said):
    assert request(**asked).differences(Live(**live)) == said  # type: ignore[arg-type]


def test_a_size_change_alone_names_the_resize():
    def refusal(req: MeshRequest, live: Live) -> str:
        return req.refusal(live, req.differences(live))  # type: ignore[arg-type]

    assert "%mesh grow t --gpus +2." in refusal(request(gpus=4), Live())
    assert "%mesh shrink t --gpus 1." in refusal(request(gpus=1), Live())
    assert "%mesh grow t --hosts +1." in refusal(request(hosts=3), Live(hosts=2))
    assert "%mesh shrink t --hosts 1." in refusal(request(hosts=1), Live(hosts=2))
    # per-host ranks of a multi-host mesh, or a size with another change: no resize
    assert "resize" not in refusal(request(gpus=3, hosts=2), Live(hosts=2))
    assert "resize" not in refusal(request(gpus=3, env={"A": "1"}), Live())
    assert refusal(request(gpus=3), Live()).endswith(
        "To start it anew, which loses its ranks' state (their namespaces): "
        "%mesh stop t first, or add --replace"
    )


def test_replace_is_an_option_of_the_mesh_line():
    p = mesh_parser()
    assert p.parse_args(["t", "--gpus", "2"]).replace is False
    assert p.parse_args(["t", "--gpus", "2", "--replace"]).replace is True


@pytest.fixture
def no_torch(monkeypatch):
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def test_gpus_are_counted_from_the_driver_without_importing_torch(tmp_path, monkeypatch, no_torch):
    for i in range(4):
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(oversubscribed, "NVIDIA_GPUS_DIR", str(tmp_path))
    monkeypatch.setattr(oversubscribed.importlib.util, "find_spec", lambda name: object())
    assert local_gpus({}) == 4
    assert local_gpus({"CUDA_VISIBLE_DEVICES": "1,2"}) == 2
    assert local_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    assert local_gpus({}) == 1
    assert "torch" not in sys.modules
    # without torch the ranks are CPU ranks, whatever the driver has
    monkeypatch.setattr(oversubscribed.importlib.util, "find_spec", lambda name: None)
    assert local_gpus({}) == 0


def test_an_imported_torch_is_asked(monkeypatch, no_torch):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(device_count=lambda: 8))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert local_gpus({}) == 8


HOSTS = types.SimpleNamespace(launcher=object())  # a launcher no live mesh runs on


def test_more_ranks_than_cores_is_said(monkeypatch):
    monkeypatch.setattr(oversubscribed, "local_gpus", lambda env: 0)
    monkeypatch.setattr(oversubscribed, "cpu_count", lambda: 2)
    assert oversubscription(request(gpus=2), HOSTS) == ""  # type: ignore[arg-type]
    assert oversubscription(request(gpus=64), HOSTS) == (  # type: ignore[arg-type]
        "64 ranks on 2 CPU cores: each rank gets about 1/32 of a core; fine for trying "
        "things, slow for real work (--gpus sets ranks per host)"
    )
    assert "about 2/3 of a core" in oversubscription(request(gpus=3), HOSTS)  # type: ignore[arg-type]
    line = oversubscription(request(gpus=2, hosts=2), HOSTS)  # type: ignore[arg-type]
    assert line.startswith("4 ranks on 2 CPU cores: each rank gets about 1/2 of a core")
    assert "the local backend runs every --hosts on this machine" in line
    assert oversubscription(request(gpus=64, backend="ray"), HOSTS) == ""  # type: ignore[arg-type]


def test_ranks_sharing_a_gpu_is_said(monkeypatch):
    monkeypatch.setattr(oversubscribed, "local_gpus", lambda env: 8)
    monkeypatch.setattr(oversubscribed, "cpu_count", lambda: 2)  # not what a GPU mesh is told
    assert oversubscription(request(gpus=8), HOSTS) == ""  # type: ignore[arg-type]
    assert oversubscription(request(gpus=16), HOSTS) == (  # type: ignore[arg-type]
        "16 ranks on 8 GPUs: 2 ranks share GPU 0 (each host's rank i uses GPU i % 8); fine "
        "for trying things, slow and short of GPU memory for real work (--gpus sets ranks "
        "per host)"
    )
    # the local backend's hosts each start at GPU 0
    assert "2 ranks share GPU 0" in oversubscription(request(gpus=4, hosts=2), HOSTS)  # type: ignore[arg-type]
