"""A rank's configuration: one typed, frozen record built once by its host agent.

The controller's ``spawn_ranks`` carries a spec per rank and a ``common`` part shared by
those ranks (keys: :mod:`monarch_kernel.wire.kinds`); the host agent adds what it knows
(the mesh key, the controller's and its own addresses, its hostname, the rank's log,
the CURVE keys). :meth:`RankConfig.build` merges the three, :meth:`to_json` and
:meth:`from_json` carry it through the template's command pipe to the forked rank.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from monarch_kernel.wire.jsontypes import JsonObject

#: Keys the host agent passes on to its ranks from its own configuration when set.
CURVE_FIELDS = ("curve_server", "curve_public", "curve_secret")


class ConfigError(ValueError):
    """A rank configuration misses a required key or has one of the wrong type."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RankConfig:
    """Everything a rank process is told before it starts (see the module docstring)."""

    # -- the spec of this rank (controller) ---------------------------------------------
    rank: int  #: global (flat) rank (changes when a shrink renumbers the ranks)
    #: this process's wire id: its routing ids, the ``r`` of what it sends, its host
    #: agent's name for it (see ``controller.state.records.Slots``); never changes. -1: ``rank``.
    slot: int = -1
    local_rank: int = 0  #: index among the ranks of its host agent
    coords: tuple[int, ...] = ()  #: its point in the mesh, one index per dim
    host: int = 0  #: index of its host agent
    restart_count: int = 0  #: how many times this rank was restarted
    peer_secret: str = ""  #: CURVE secret of its TCP peer socket (CURVE meshes)
    peer_port: int = 0  #: the port to listen on again after a restart (0: any)
    # -- common to the mesh (controller) ------------------------------------------------
    labels: tuple[str, ...] = ()  #: mesh dims
    sizes: tuple[int, ...] = ()  #: mesh extent per dim
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"  #: torch.distributed rendezvous (rank 0's host)
    master_port: int = 0
    run_id: str = ""  #: unique id of this mesh's run
    mesh: str = ""  #: the mesh's name
    env: Mapping[str, str] = field(default_factory=dict)  #: user ``--env``
    sys_path: tuple[str, ...] = ()  #: the controller's import path
    cwd: str = ""  #: the controller's working directory
    #: CURVE secret (z85) of the listener keypair of the controller's meshes: its ranks
    #: connect to other ranks with it, and their TCP listeners admit only its public
    #: half (see ``rank.listener_gate``); "" without CURVE.
    listener_key: str = ""
    #: 1: the controller reads large results' buffers from the rank's shared memory
    #: (``wire.arena``; a local mesh on unix sockets whose controller has an arena).
    shm_results: int = 0
    # -- added by the host agent --------------------------------------------------------
    key: str = ""  #: the mesh's signing key, hex
    send: str = ""  #: the controller's endpoint that sends to ranks
    recv: str = ""  #: the controller's endpoint that receives from them
    fanout: str = ""  #: the host agent's fan-out socket
    fanin: str = ""  #: the host agent's fan-in socket ("": replies go to the controller)
    hostname: str = ""  #: the machine's name (its host agent's)
    log: str = ""  #: the rank's log file (in the agent's private 0700 directory)
    curve_server: str = ""  #: the controller's CURVE public key (z85); "" without CURVE
    curve_public: str = ""  #: this host's CURVE keypair (its ranks use it too)
    curve_secret: str = ""
    ifname: str = ""  #: the network interface gloo/NCCL use ("" : their choice)
    #: 1 in a ``--detachable`` mesh: the rank outlives its controller (it watches its
    #: connection and keeps what it would send while none is attached).
    detachable: int = 0

    def __post_init__(self) -> None:
        if self.slot < 0:
            object.__setattr__(self, "slot", self.rank)

    @property
    def mesh_name(self) -> str:
        """The mesh's name, else its run id (a rank's id in logs and failure paths)."""
        return self.mesh or self.run_id

    @property
    def uses_curve(self) -> bool:
        """Whether the mesh's sockets use CURVE (it may span machines)."""
        return bool(self.curve_secret)

    @classmethod
    def build(
        cls, spec: Mapping[str, Any], common: Mapping[str, Any], agent: Mapping[str, Any]
    ) -> RankConfig:
        """The configuration of the rank ``spec`` describes: ``spec`` merged over
        ``common`` (both from the controller's ``spawn_ranks``), over ``agent`` (what the
        host agent adds); a later source wins, as ``dict(agent, **common, **spec)``."""
        return cls.from_json({**agent, **common, **spec})

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RankConfig:
        """Build from the flat dict form (JSON-decoded); unknown keys are an error (a
        typo must not pass silently), missing ones take their defaults except
        ``rank``."""
        unknown = raw.keys() - _NAMES
        if unknown:
            raise ConfigError(f"rank configuration: unknown keys {sorted(unknown)}")
        if "rank" not in raw:
            raise ConfigError("rank configuration: missing key 'rank'")
        values: dict[str, Any] = {}
        try:
            for name, value in raw.items():
                if value is None:  # JSON null: the default
                    continue
                values[name] = _CONVERT[name](value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"rank configuration: key {name!r}: {exc}") from None
        values.setdefault("hostname", socket.gethostname())
        return cls(**values)

    def to_json(self) -> JsonObject:
        """The flat dict form (JSON-encodable); ``from_json`` gives this record back."""
        out = asdict(self)
        for name in ("coords", "labels", "sizes", "sys_path"):
            out[name] = list(out[name])
        out["env"] = dict(self.env)
        return out


def _str_tuple(value: Any) -> tuple[str, ...]:
    return tuple(str(v) for v in value)


def _int_tuple(value: Any) -> tuple[int, ...]:
    return tuple(int(v) for v in value)


def _env(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in dict(value).items()}


_NAMES = frozenset(f.name for f in fields(RankConfig))
#: field -> what turns its JSON value into the field's type
_CONVERT: dict[str, Callable[[Any], object]] = {f.name: str for f in fields(RankConfig)}
_CONVERT.update(
    rank=int,
    slot=int,
    local_rank=int,
    host=int,
    restart_count=int,
    peer_port=int,
    world_size=int,
    local_world_size=int,
    master_port=int,
    detachable=int,
    shm_results=int,
    coords=_int_tuple,
    labels=_str_tuple,
    sizes=_int_tuple,
    sys_path=_str_tuple,
    env=_env,
)
