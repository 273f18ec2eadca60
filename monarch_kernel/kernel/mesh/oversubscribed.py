"""More ranks than the machine has cores or GPUs: the one line ``%mesh`` says about it.

Allowed (trying things on a laptop is what a small machine is for), but said: how much of
a core, or how many ranks share a GPU, each rank gets. The hard cap on what the machine
holds is ``create``'s, and an error.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping
from fractions import Fraction
from typing import Protocol

from monarch_kernel.actor.hosts import HostMesh
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.wire.osutil import cpu_count


class MeshAsk(Protocol):
    """What a ``%mesh`` line asks for (``create.MeshRequest``)."""

    @property
    def backend(self) -> str: ...
    @property
    def hosts(self) -> int: ...
    @property
    def gpus(self) -> int: ...  # ranks per host
    @property
    def env(self) -> dict[str, str]: ...


#: One directory per GPU the NVIDIA driver drives (Linux): counting GPUs there needs
#: neither torch nor CUDA in the kernel.
NVIDIA_GPUS_DIR = "/proc/driver/nvidia/gpus"


def local_gpus(env: Mapping[str, str]) -> int:
    """GPUs the ranks of a local mesh with extra environment ``env`` see, counted
    without initialising CUDA here: 0 without torch (the ranks are CPU ranks then);
    else ``torch.cuda.device_count()`` if the notebook imported torch already, or the
    driver's GPUs; at most as many as ``CUDA_VISIBLE_DEVICES`` (``env``'s, else this
    process's) names."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            count = int(torch.cuda.device_count())
        except Exception:  # a broken CUDA install: no GPUs to share
            count = 0
    elif importlib.util.find_spec("torch") is None:
        return 0
    else:
        try:
            count = len(os.listdir(NVIDIA_GPUS_DIR))
        except OSError:
            count = 0
    visible = env.get("CUDA_VISIBLE_DEVICES", os.environ.get("CUDA_VISIBLE_DEVICES"))
    if visible is not None:
        count = min(count, len([d for d in visible.split(",") if d.strip()]))
    return count


def oversubscription(req: MeshAsk, hosts: HostMesh, replacing: MeshRuntime | None = None) -> str:
    """One line when the local backend would run more ranks on this machine (this mesh's
    and the other local meshes', but not ``replacing``'s) than it has GPUs or, without
    GPUs (or torch), CPU cores; else ''. With GPUs, each host agent's rank ``i`` uses GPU
    ``i % GPUs`` (:mod:`monarch_kernel.rank.device`), so the local backend's emulated
    hosts and meshes all start at GPU 0: the line says how many share the busiest GPU.
    Other backends: '' (their host agents do not report their cores or GPUs)."""
    if req.backend != "local":
        return ""
    others = [m for m in registry.live() if m.launcher is hosts.launcher and m is not replacing]
    held = sum(m.world for m in others)
    ranks = req.hosts * req.gpus + held
    hint = "--gpus sets ranks per host"
    if req.hosts > 1:
        hint += "; the local backend runs every --hosts on this machine"
    counted = f"{ranks} ranks" + (f" ({held} of them in other meshes)" if held else "")
    gpus = local_gpus(req.env)
    if gpus:
        agents = [(req.hosts, req.gpus)] + [(m.n_hosts, m.per_host) for m in others]
        busiest = sum(n * -(-per_host // gpus) for n, per_host in agents)  # on GPU 0
        if busiest <= 1:
            return ""
        return (
            f"{counted} on {gpus} GPU{'s' if gpus > 1 else ''}: {busiest} ranks share GPU 0 "
            f"(each host's rank i uses GPU i % {gpus}); fine for trying things, slow and "
            f"short of GPU memory for real work ({hint})"
        )
    cores = cpu_count()
    if ranks <= cores:
        return ""
    return (
        f"{counted} on {cores} CPU core{'s' if cores > 1 else ''}: each rank gets about "
        f"{_share(cores, ranks)} of a core; fine for trying things, slow for real work ({hint})"
    )


def _share(part: int, whole: int) -> str:
    """``1/32``, ``2/3``, ``0.41``: ``part / whole`` in few characters."""
    share = Fraction(part, whole)
    if share.denominator <= 10 or share.numerator == 1:
        return str(share)
    return f"{float(share):.2g}"
