"""The kernel side of the JupyterLab extension (``labextension/``): the Meshes sidebar
and the status bar item.

The extension opens a comm to the target :data:`TARGET` when it connects to a kernel;
this module then pushes the meshes' state over it: at once, whenever a rank changes
state, dies or a mesh changes phase (events wake the sender), and about once a second
while a mesh runs (transfer rates move). Only changed state is sent. The extension never
polls, and nothing else listens: no extra port, no server extension.

Messages the extension sends back: ``{"action": "interrupt" | "restart" | "stop",
"mesh": NAME}``; each runs on a worker thread and its outcome is pushed as ``notice``.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Protocol, TypedDict

from monarch_kernel.actor import ProcMesh
from monarch_kernel.controller.mesh import MeshRuntime, registry
from monarch_kernel.controller.state.events import MeshPhaseChanged, RankDied, RankStateChanged
from monarch_kernel.controller.state.records import RankState
from monarch_kernel.wire.jsontypes import JsonObject

log = logging.getLogger("monarch_kernel.lab")

TARGET = "monarch_kernel.meshes"
#: Seconds between two pushes at most (rates move); a state change wakes it at once.
PERIOD = 1.0
#: Events that wake the sender at once ...
WAKING = (RankStateChanged, RankDied, MeshPhaseChanged)
#: ... but not more often than this: on a big mesh every rank's every change wakes it,
#: and each push is the whole state (at most four pushes a second, whatever the size).
MIN_GAP = 0.25


class LabRank(TypedDict):
    rank: int
    state: str  #: a ``RankState`` value


class LabHost(TypedDict, total=False):
    """One host's ranks: a small mesh lists them (``ranks``); a big one (the dashboard's
    heat-map threshold, :mod:`monarch_kernel.widgets.compact`) sends its first rank and
    one state code a rank (``first``, ``states``: ranks ``first``, ``first + 1`` ...),
    which the sidebar draws as a heat-map row; ``legend`` (in :class:`LabState`) maps
    the codes to states."""

    index: int
    name: str
    ranks: list[LabRank]
    first: int
    states: str


class LabMesh(TypedDict):
    """One mesh as the sidebar shows it (see docs/architecture.md, the extension's comm)."""

    name: str
    shape: str
    backend: str
    phase: str
    world: int
    alive: int
    dead: int
    rate: int  #: the mesh's control-plane bytes/s
    hosts: list[LabHost]


class LabState(TypedDict, total=False):
    """A ``kernel -> extension`` comm message (``legend``: code -> state, when a mesh
    sends its hosts' states as codes)."""

    meshes: list[LabMesh]
    notice: str
    legend: dict[str, str]


class Comm(Protocol):
    """What is used of an ipykernel comm (untyped there)."""

    comm_id: str

    def send(self, data: LabState) -> None: ...


class LabPublisher:
    """Pushes every mesh's state to the comms the JupyterLab extension opened."""

    def __init__(self) -> None:
        self._comms: dict[str, Comm] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._last: LabState | None = None
        self._counters: dict[str, tuple[float, int]] = {}  # mesh -> (time, bytes)
        self._rates: dict[str, float] = {}
        self._watched: set[str] = set()  # runtimes (by id) whose events wake us
        self._notice = ""
        self._thread: threading.Thread | None = None

    # -- comms ------------------------------------------------------------------------
    def on_open(self, comm: Any, _msg: Any) -> None:
        """The extension connected: remember its comm, send everything at once."""
        with self._lock:
            self._comms[comm.comm_id] = comm
            self._last = None  # the new one needs the whole state
        comm.on_msg(self._on_msg)
        comm.on_close(lambda _m, cid=comm.comm_id: self._comms.pop(cid, None))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="mk-lab", daemon=True)
            self._thread.start()
        self.wake()

    def wake(self) -> None:
        self._wake.set()

    def _on_msg(self, msg: JsonObject) -> None:
        data = msg.get("content", {}).get("data", {})
        action, name = data.get("action"), data.get("mesh")
        rt = registry.get(str(name))
        if rt is None or action not in ("interrupt", "restart", "stop"):
            self._say(f"{action} {name}: no such live mesh")
            return
        threading.Thread(
            target=self._act, args=(action, rt), name="mk-lab-action", daemon=True
        ).start()

    def _act(self, action: str, rt: MeshRuntime) -> None:
        procs = ProcMesh(rt)
        try:
            if action == "interrupt":
                procs.interrupt()
                self._say(f"{rt.name}: interrupt sent")
            elif action == "restart":
                dead = [i.rank for i in rt.ranks if i.state is RankState.DEAD]
                if not dead:
                    self._say(f"{rt.name}: no dead ranks to restart")
                    return
                procs.restart(dead)
                self._say(f"{rt.name}: restarted ranks {', '.join(map(str, dead))}")
            else:
                rt.stop()
                self._say(f"{rt.name}: stopped")
        except Exception as exc:  # shown in the sidebar
            self._say(f"{rt.name}: {action} failed: {exc}".split("\n")[0])

    def _say(self, text: str) -> None:
        self._notice = f"{time.strftime('%H:%M:%S')} {text}"
        self.wake()

    # -- the sender thread ------------------------------------------------------------
    def _run(self) -> None:
        while True:
            self._wake.wait(PERIOD)
            self._wake.clear()
            pushed = time.monotonic()
            try:
                self._push()
            except Exception:  # never let the thread die
                log.exception("pushing mesh state to JupyterLab failed")
            # the throttle: changes meanwhile are gathered into the next push
            time.sleep(max(0.0, pushed + MIN_GAP - time.monotonic()))

    def _push(self) -> None:
        with self._lock:
            comms = list(self._comms.values())
        if not comms:
            return
        state = LabState(meshes=[self._mesh(rt) for rt in registry.live()], notice=self._notice)
        if any("states" in h for m in state["meshes"] for h in m["hosts"]):
            from monarch_kernel.widgets.compact import LEGEND

            state["legend"] = LEGEND
        if state == self._last:
            return
        self._last = state
        for comm in comms:
            comm.send(state)

    def _mesh(self, rt: MeshRuntime) -> LabMesh:
        if str(id(rt)) not in self._watched:  # state changes wake the sender
            self._watched.add(str(id(rt)))
            rt.events.subscribe(lambda _ev: self._wake.set(), *WAKING)
        now = time.monotonic()
        total = rt.codec.bytes_in + rt.codec.bytes_out
        prev = self._counters.get(rt.name)
        self._counters[rt.name] = (now, total)
        if prev is not None and now > prev[0]:
            self._rates[rt.name] = max(0, total - prev[1]) / (now - prev[0])
        return {
            "name": rt.name,
            "shape": rt.shape.describe(),
            "backend": rt.backend,
            "phase": rt.state.value,
            "world": rt.world,
            "alive": sum(1 for i in rt.ranks if i.state in (RankState.IDLE, RankState.BUSY)),
            "dead": sum(1 for i in rt.ranks if i.state is RankState.DEAD),
            "rate": round(self._rates.get(rt.name, 0.0)),
            "hosts": _hosts(rt),
        }


def _hosts(rt: MeshRuntime) -> list[LabHost]:
    """Each host's ranks and their states: listed for a small mesh; for a big one (the
    dashboard's grid threshold) one code a rank, when a host's ranks follow each other."""
    from monarch_kernel.widgets.compact import CODES, use_grid  # ipywidgets: imported late

    big = use_grid(rt.world)
    by_host: dict[int, list[LabRank]] = {}
    for info in rt.ranks:
        by_host.setdefault(info.host, []).append(LabRank(rank=info.rank, state=info.state.value))
    out: list[LabHost] = []
    for h, ranks in sorted(by_host.items()):
        host = LabHost(index=h, name=rt.hosts[h].hostname or f"host {h}")
        first = ranks[0]["rank"]
        if big and all(r["rank"] == first + i for i, r in enumerate(ranks)):
            host["first"] = first
            host["states"] = "".join(CODES[r["state"]] for r in ranks)
        else:
            host["ranks"] = ranks
        out.append(host)
    return out


publisher = LabPublisher()


def install(shell: Any) -> None:
    """Register the comm target (and wake the publisher after each cell: a ``%mesh``
    may have created a mesh)."""
    kernel = getattr(shell, "kernel", None)
    manager = getattr(kernel, "comm_manager", None)
    if manager is None:  # not in a kernel (plain IPython): nothing to talk to
        return
    manager.register_target(TARGET, publisher.on_open)
    shell.events.register("post_run_cell", lambda _result: publisher.wake())
