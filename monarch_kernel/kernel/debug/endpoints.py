"""Gutter breakpoints in the notebook's own cells, for the actor endpoints they define.

An actor class defined in a notebook cell runs its endpoints on ranks, with the code the
kernel compiled (its file is the cell's dumped path, as JupyterLab names it). A gutter
breakpoint in such a cell goes to the kernel's own debugger (debugpy) as before, and is
also kept here and sent to the ranks of every live mesh (the control kind
``dap_breaks``, with the cell's source: the file may exist only on this machine). While
a rank has some, every endpoint call runs with them armed
(:class:`monarch_kernel.rank.debug.dap.EndpointBreaks`); a rank that stops prompts the visual
debugger, through its mesh's input router.
"""

from __future__ import annotations

import pickle
import threading
import weakref

from monarch_kernel.calls.gather import Gather
from monarch_kernel.calls.requester import CallOptions
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.wire import dumps
from monarch_kernel.wire import kinds as K

#: Seconds to wait for a mesh's ranks to take the breakpoints.
SEND_WAIT = 10.0
_OPTIONS = CallOptions(what="debugger breakpoints", control=True, waited=True)


class EndpointBreakpoints:
    """The breakpoints of the notebook's own cells, and which meshes have them."""

    def __init__(self) -> None:
        #: dumped cell path -> its gutter lines
        self.table: dict[str, list[int]] = {}
        self._version = 0
        self._sent: weakref.WeakKeyDictionary[MeshRuntime, int] = weakref.WeakKeyDictionary()
        self._lock = threading.Lock()
        self._syncing = threading.Lock()  # one sync at a time (control and shell threads)

    def set(self, path: str, lines: list[int]) -> None:
        """The cell at ``path`` has these breakpoints now (none: forget it)."""
        with self._lock:
            if lines:
                self.table[path] = list(lines)
            elif self.table.pop(path, None) is None:
                return
            self._version += 1

    def clear(self) -> None:
        with self._lock:
            if self.table:
                self.table.clear()
                self._version += 1

    def sync(self) -> list[str]:
        """Send the table to every live mesh that lacks this version; the errors (a mesh
        whose ranks did not take it says why, and is tried again next time)."""
        errors = []
        with self._syncing:
            with self._lock:
                version, table = self._version, dict(self.table)
            stale = [rt for rt in registry.live() if self._sent.get(rt, 0) != version]
            if not stale:
                return []
            table_with_sources = {p: (lines, _source(p)) for p, lines in table.items()}
            payload, buffers = dumps(table_with_sources, "breakpoints")
            for rt in stale:
                try:
                    _send(rt, payload, buffers)
                    self._sent[rt] = version
                except Exception as exc:  # one mesh's failure must not stop the others
                    errors.append(f"mesh {rt.name!r}: {type(exc).__name__}: {exc}")
        return errors


def _send(rt: MeshRuntime, payload: bytes, buffers: list[pickle.PickleBuffer]) -> None:
    ranks = [r for r in range(rt.world) if rt.ranks[r].alive]
    if not ranks:
        return
    gather = Gather(ranks, None, None, value_name="breakpoints")
    rt.request(ranks, {"k": K.DAP_BREAKS}, payload, buffers, gather, _OPTIONS)
    gather.future.get(SEND_WAIT)


def _source(path: str) -> str:
    """The dumped cell's source ('' if it is gone: its breakpoints then stop nowhere)."""
    try:
        with open(path, encoding="utf-8") as f:
            return f.read()
    except OSError:
        return ""
