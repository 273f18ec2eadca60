"""Actors in a module that starts with Monarch's canonical import line (``this_host``
included), as a user's module of actors does; ranks import it to unpickle the class."""

from __future__ import annotations

import sys

from monarch_kernel.actor import Actor, endpoint, host_mesh, this_host


class ImportProbe(Actor):
    @endpoint
    def controller_modules(self) -> list[str]:
        """The controller's modules this rank has loaded."""
        return sorted(m for m in sys.modules if m.startswith("monarch_kernel.controller"))

    @endpoint
    def stand_ins(self) -> list[str]:
        """Where this module's ``this_host`` and ``host_mesh`` come from."""
        return [f"{f.__module__}.{f.__name__}" for f in (this_host, host_mesh)]

    @endpoint
    def call_host_mesh(self, hosts: int) -> str:
        """Call ``host_mesh`` (the real one behind the stand-in) with a bad argument."""
        try:
            host_mesh(hosts=hosts)
        except ValueError as exc:
            return str(exc)
        return "no error"
