"""A host agent's configuration: what its launcher (or the join endpoint) told it."""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from monarch_kernel.wire.desk import ControllerId

log = logging.getLogger("monarch_kernel.host")

#: The CURVE keys the agent passes on to its ranks when set.
CURVE_FIELDS = ("curve_server", "curve_public", "curve_secret")


@dataclass(frozen=True, slots=True, kw_only=True)
class AgentConfig:
    """The JSON line of ``launchers.base.HostConfig`` (plus ``advertise`` from a join)."""

    host: int  #: index of this host in the mesh
    key: str  #: the mesh's signing key, hex
    send: str  #: the controller's endpoint that sends to hosts and ranks
    recv: str  #: the controller's endpoint that receives from them
    #: seconds of controller silence before the agent asks whether it is gone (and, if
    #: it is, exits): see host/liveness.py
    hb_timeout: float = 10.0
    mesh: str = ""
    curve_server: str = ""
    curve_public: str = ""
    curve_secret: str = ""
    ranks: int = 1
    advertise: str = ""  #: the address other hosts reach this one at ("" : loopback)
    hostname: str = ""  #: this machine's name (default: ``socket.gethostname()``)
    #: A ``--detachable`` mesh: seconds the agent keeps its ranks running without a
    #: controller (0: not detachable, the agent exits with its controller).
    detach_keep: float = 0.0
    #: The controller that started the mesh (a detachable mesh's first holder).
    controller_pid: int = 0
    controller_host: str = ""
    controller_started: float = 0.0
    #: The mesh's attach file, removed by the agent when it stops with no controller.
    attach_file: str = ""
    #: The mesh's failure policy, applied by the agent while no controller holds it.
    on_failure: str = ""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> AgentConfig:
        """Build from the JSON form; keys this agent does not know are ignored (logged:
        a newer controller may say more)."""
        unknown = raw.keys() - _NAMES
        if unknown:
            log.debug("host agent configuration: ignoring keys %s", sorted(unknown))
        values = {k: v for k, v in raw.items() if k in _NAMES and v is not None}
        try:
            values["host"] = int(values["host"])
            values["hb_timeout"] = float(values.get("hb_timeout", 10.0))
            values["ranks"] = int(values.get("ranks", 1))
            for name in ("detach_keep", "controller_started"):
                values[name] = float(values.get(name, 0.0))
            values["controller_pid"] = int(values.get("controller_pid", 0))
        except KeyError as exc:
            raise ValueError(f"host agent configuration: missing key {exc.args[0]!r}") from None
        cfg = cls(**values)
        return cfg if cfg.hostname else replace(cfg, hostname=socket.gethostname())

    def controller(self) -> ControllerId | None:
        """The controller that started this agent (None where the launcher did not say)."""
        if not self.controller_pid:
            return None
        where = self.controller_host or self.hostname or socket.gethostname()
        return ControllerId(self.controller_pid, where, self.controller_started)

    def rank_part(self) -> dict[str, str]:
        """What the agent adds to its ranks' configurations from its own: the mesh key,
        the controller's addresses, the hostname, the CURVE keys when set."""
        out = {"key": self.key, "send": self.send, "recv": self.recv, "hostname": self.hostname}
        out.update({k: getattr(self, k) for k in CURVE_FIELDS if getattr(self, k)})
        if self.detach_keep > 0:
            out["detachable"] = "1"
        return out


_NAMES = frozenset(f.name for f in fields(AgentConfig))
