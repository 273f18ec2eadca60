"""How a CUDA tensor's bytes travel from its owner to a receiver: the pure decision.

:func:`choose` looks only at facts (:class:`Facts`), so it is tested on any machine:

* ``IPC``: same host, the owner's tensor on CUDA, CUDA in the receiver, an allocator that
  shares through ``cudaIpcMemHandle``: the owner sends a CUDA IPC description of the
  tensor and the receiver copies device to device (``dataplane.cuda_ipc``); no byte goes
  through host memory.
* ``STAGED_PINNED``: CUDA on both ends but no IPC (another host, expandable segments,
  IPC turned off): the owner copies into pinned host memory, the bytes go over the data
  socket into pinned memory, and the receiver puts them on its device.
* ``HOST_BYTES``: a CPU tensor (shared memory or the socket, as always), or a CUDA tensor
  read by a process without CUDA (the copy stays on its CPU).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass

#: Set to 0 in the ranks' environment to turn CUDA IPC off (CUDA tensors are then staged
#: through pinned host memory, also between ranks of one host).
IPC_ENV = "MONARCH_KERNEL_CUDA_IPC"
#: The allocator settings torch reads (the second is the older name).
ALLOC_ENVS = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")


class Transport(enum.Enum):
    IPC = "ipc"
    STAGED_PINNED = "staged_pinned"
    HOST_BYTES = "host_bytes"


@dataclass(frozen=True)
class Facts:
    same_host: bool  #: the owner is a process of this host (its unix socket reaches it)
    owner_device: str  #: ``cpu`` or ``cuda`` (the owner's tensor)
    receiver_cuda: bool  #: the receiver can use CUDA
    alloc_conf: str = ""  #: the owner's CUDA allocator settings (``PYTORCH_ALLOC_CONF``)
    ipc_enabled: bool = True  #: not turned off with :data:`IPC_ENV`


def expandable_segments(conf: str) -> bool:
    """Whether allocator settings (``key:value`` pairs, comma separated) turn expandable
    segments on: their memory is shared through ``pidfd_getfd``, which unprivileged
    containers refuse (pytorch #165685), so IPC is not attempted."""
    for item in conf.split(","):
        key, _, value = item.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() in ("true", "1", "yes")
    return False


def choose(facts: Facts) -> Transport:
    """The transport for one read of a tensor (see the module's docstring)."""
    if facts.owner_device != "cuda" or not facts.receiver_cuda:
        return Transport.HOST_BYTES
    if facts.same_host and facts.ipc_enabled and not expandable_segments(facts.alloc_conf):
        return Transport.IPC
    return Transport.STAGED_PINNED


def alloc_conf(environ: dict[str, str] | None = None) -> str:
    """This process's allocator settings, as torch reads them (both names, joined)."""
    env = os.environ if environ is None else environ
    return ",".join(env[name] for name in ALLOC_ENVS if env.get(name))


def ipc_enabled(environ: dict[str, str] | None = None) -> bool:
    env = os.environ if environ is None else environ
    return env.get(IPC_ENV, "1").strip().lower() not in ("0", "false", "no", "off")
