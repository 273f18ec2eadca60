"""torchrun-style SPMD programs over a process mesh (Monarch's ``monarch.spmd``).

:class:`SPMDActor` sets the torch elastic environment (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``, ``ROLE_*``,
``MASTER_ADDR``, ``MASTER_PORT``) from the rank's place in its mesh and runs a training
script or module there, as torchrun would::

    from monarch_kernel.actor import this_host
    from monarch_kernel.spmd import SPMDActor, setup_torch_elastic_env

    procs = this_host().spawn_procs(per_host={"gpus": 4})
    spmd = procs.spawn("_SPMDActor", SPMDActor)
    addr, port = spmd.slice(gpus=0).get_host_port.call_one(None).get()
    spmd.main.call(addr, port, ["train.py", "--lr", "0.1"]).get()

    setup_torch_elastic_env(procs)   # only the environment, for code of your own

Ranks of monarch_kernel already start with this environment (and a rendezvous port
chosen by the controller); these functions give Monarch's way of choosing it, and
``main`` Monarch's way of running a script. The last dimension of the mesh counts the
processes of a host (``LOCAL_RANK``), as in Monarch.
"""

from __future__ import annotations

import asyncio
import enum
import math
import os
import runpy
import socket
import sys

from monarch_kernel.actor.actor import Actor, endpoint
from monarch_kernel.actor.meshes import ProcMesh
from monarch_kernel.rank.context import current_rank, current_size
from monarch_kernel.wire.ports import PortReservation


class AddrType(enum.Enum):
    """Which address family ``get_host_port`` resolves the host name to (Monarch's
    ``monarch.tools.network.AddrType``): ``Default`` tries IPv6, then IPv4."""

    Default = enum.auto()
    IPv4 = enum.auto()
    IPv6 = enum.auto()


def get_ipaddr(hostname: str, port: int, addr_type: AddrType = AddrType.Default) -> str:
    """The IP address (``[v6]`` in brackets) ``hostname`` resolves to, for a TCP
    service on ``port``; RuntimeError when it resolves to none of ``addr_type``."""
    families = {
        AddrType.IPv4: [socket.AF_INET],
        AddrType.IPv6: [socket.AF_INET6],
        AddrType.Default: [socket.AF_INET6, socket.AF_INET],
    }.get(addr_type)
    if families is None:
        raise ValueError(f"Unknown AddrType: {addr_type!r}")
    for family in families:
        try:
            infos = socket.getaddrinfo(hostname, port, family, socket.SOCK_STREAM)
        except socket.gaierror:
            continue
        if infos:
            ip = str(infos[0][4][0])
            return f"[{ip}]" if family == socket.AF_INET6 else ip
    raise RuntimeError(f"{hostname}:{port} has no {addr_type.name} address")


class SPMDActor(Actor):
    """Sets the torch elastic environment of its rank and runs SPMD scripts there
    (Monarch's ``SPMDActor``). Spawn it on a whole process mesh; every rank's values
    come from ``current_rank()`` and ``current_size()``."""

    def __init__(self) -> None:
        super().__init__()
        point = current_rank()
        sizes = current_size()
        labels = list(sizes)
        gpu_dim = labels[-1] if labels else None  # the processes of one host
        self.local_rank: int = point[gpu_dim] if gpu_dim is not None else 0
        self.rank: int = point.rank
        self.local_world_size: int = sizes[gpu_dim] if gpu_dim is not None else 1
        self.nproc_per_node: int = self.local_world_size
        self.world_size: int = math.prod(sizes.values())
        self.group_rank: int = self.rank // self.local_world_size
        self.group_world_size: int = (
            self.world_size + self.local_world_size - 1
        ) // self.local_world_size
        #: The rendezvous port :meth:`get_host_port` gave out, held until the next one.
        self._port: PortReservation | None = None

    def _setup_env(self, master_addr: str, master_port: int) -> None:
        os.environ.update(
            {
                "MASTER_ADDR": master_addr,
                "MASTER_PORT": str(master_port),
                "RANK": str(self.rank),
                "LOCAL_RANK": str(self.local_rank),
                "LOCAL_WORLD_SIZE": str(self.local_world_size),
                "GROUP_RANK": str(self.group_rank),
                "GROUP_WORLD_SIZE": str(self.group_world_size),
                "ROLE_RANK": str(self.rank),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "ROLE_NAME": "rank",
                "WORLD_SIZE": str(self.world_size),
            }
        )

    @endpoint
    def get_host_port(self, use_ipaddr: AddrType | None) -> tuple[str, int]:
        """This host's name (or its address of family ``use_ipaddr``) and a free TCP
        port on it: the rendezvous of a process group whose rank 0 is here."""
        hostname = socket.gethostname()
        # held for the script's rank 0 to listen on (``wire.ports``): a port merely
        # found free may be another program's by the time the script starts
        if self._port is not None:
            self._port.release()
        self._port = PortReservation()
        port = self._port.port
        if use_ipaddr is None:
            return (hostname, port)
        return (get_ipaddr(hostname, port, use_ipaddr), port)

    @endpoint
    def setup_env(self, master_addr: str, master_port: int) -> None:
        """Set the torch elastic environment variables of this rank."""
        self._setup_env(master_addr, master_port)

    @endpoint
    def main(self, master_addr: str, master_port: int, script_args: list[str]) -> bool:
        """Set the environment, then run ``script_args`` as torchrun would: a script
        path and its arguments, or ``["-m", module, *args]``; ``__name__`` is
        ``"__main__"`` and ``sys.argv`` the arguments. True when it ran to the end;
        ValueError for empty ``script_args``."""
        self._setup_env(master_addr, master_port)
        if script_args and script_args[0] == "-m":
            if len(script_args) < 2:
                raise ValueError("-m needs a module name")
            module_name = script_args[1]
            sys.argv = [module_name, *script_args[2:]]
            runpy.run_module(module_name, run_name="__main__", alter_sys=True)
        elif script_args:
            sys.argv = list(script_args)
            runpy.run_path(script_args[0], run_name="__main__")
        else:
            raise ValueError("No script or module specified")
        return True


def _check_master(master_addr: str | None, master_port: int | None) -> None:
    if (master_addr is None) != (master_port is None):
        raise ValueError(
            "Either both master_addr and master_port must be specified or neither must be "
            "specified."
        )


def setup_torch_elastic_env(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: AddrType | None = None,
) -> None:
    """Set the torch elastic environment on every rank of ``proc_mesh`` (spawns an
    :class:`SPMDActor` named ``_SPMDActor``). Without ``master_addr``/``master_port``
    the first rank's host and a free port on it are the rendezvous."""
    _check_master(master_addr, master_port)
    am = proc_mesh.spawn("_SPMDActor", SPMDActor)
    if master_addr is None or master_port is None:
        first = dict.fromkeys(proc_mesh._labels, 0)
        master_addr, master_port = am.slice(**first).get_host_port.call_one(use_ipaddr).get()
    am.setup_env.call(master_addr, master_port).get()


async def setup_torch_elastic_env_async(
    proc_mesh: ProcMesh,
    master_addr: str | None = None,
    master_port: int | None = None,
    use_ipaddr: AddrType | None = None,
) -> None:
    """:func:`setup_torch_elastic_env` for async code (the event loop keeps running
    while the actors spawn)."""
    _check_master(master_addr, master_port)
    am = await asyncio.to_thread(proc_mesh.spawn, "_SPMDActor", SPMDActor)
    if master_addr is None or master_port is None:
        first = dict.fromkeys(proc_mesh._labels, 0)
        master_addr, master_port = await am.slice(**first).get_host_port.call_one(use_ipaddr)
    await am.setup_env.call(master_addr, master_port)


__all__ = [
    "AddrType",
    "SPMDActor",
    "get_ipaddr",
    "setup_torch_elastic_env",
    "setup_torch_elastic_env_async",
]
