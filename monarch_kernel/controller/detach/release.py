"""A ``--detachable`` mesh on the side of the controller holding it.

:func:`enable` (once the mesh runs, or once a kernel attached to it) writes the mesh's
attach file (:mod:`.attach_file`) and keeps it current: a watcher rewrites it when a
rank restarts, a ``--setup`` cell is added or what runs on the mesh changes, so that a
kernel killed outright leaves a file the next kernel can attach with. The mesh's host
agents (:mod:`monarch_kernel.host.desk`) do the rest of the detaching by themselves.

When the kernel shuts down (``Restart Kernel``, interpreter exit) :func:`detach_all`
lets go of every detachable mesh instead of stopping it: the file is written a last
time, the agents are told (``detach``: their ``keep`` clock starts now), and the
controller's side closes (:meth:`MeshRuntime.release`). A ``taken_over`` from an agent
(another kernel attached with ``--force``) releases the mesh in this kernel too: its
requests fail saying who took it. A mesh stopped on purpose removes its file.
"""

from __future__ import annotations

import atexit
import base64
import logging
import threading
import time

from monarch_kernel.calls.requester import ActorSpec
from monarch_kernel.controller import attach_file
from monarch_kernel.controller.attach_file import (
    ActorRecord,
    AttachFile,
    HostEntry,
    JobRecord,
    RankEntry,
)
from monarch_kernel.controller.mesh import MeshRuntime
from monarch_kernel.controller.state.events import (
    MeshEvent,
    MeshPhaseChanged,
    RequestKind,
    RequestStarted,
)
from monarch_kernel.controller.state.records import HostInfo, MeshPhase, SetupCell
from monarch_kernel.launchers.base import ReservingHandle
from monarch_kernel.wire import Message
from monarch_kernel.wire import headers as H
from monarch_kernel.wire import kinds as K
from monarch_kernel.wire.codec import Header
from monarch_kernel.wire.desk import ControllerId, parse_duration
from monarch_kernel.wire.tempdirs import mark_owners

log = logging.getLogger("monarch_kernel.controller")

#: How long a detachable mesh runs on without a controller unless told (``--keep``).
DEFAULT_KEEP = 2 * 3600.0
#: Backends whose meshes can be detachable in this version.
DETACHABLE_BACKENDS = ("local", "join", "ray", "slurm")

#: Seconds between the watcher's looks at what the attach file should say.
WATCH_INTERVAL = 0.5
#: Request kinds the file lists as running: cells (calls come and go too fast to list).
LISTED = frozenset({RequestKind.CELL})


class Detacher:
    """Keeps one detachable mesh's attach file and lets go of the mesh."""

    def __init__(self, runtime: MeshRuntime):
        self.runtime = runtime
        self.released = False
        self._started: dict[str, JobRecord] = {}  # request id -> it, while it may run
        self._written: tuple[object, ...] | None = None
        self._lock = threading.Lock()
        # Held from a snapshot to its write: the watch thread and a cell that changes
        # the recipe both save, and without it a snapshot taken before a setup cell was
        # registered could be written after the one that has it (a kernel killed then
        # leaves a file whose restarts skip that cell).
        self._save_lock = threading.Lock()
        self._wake = threading.Event()  # a cell started: write the file now

    # -- the file --------------------------------------------------------------------
    def snapshot(self) -> AttachFile:
        """The attach file as the mesh is now."""
        rt = self.runtime
        common = dict(rt.starter.common or {})
        skip = 1 if rt.n_hosts > 1 else 0  # the hosts dim is not per host
        keys = rt.transport.ids.curve_keys()
        return AttachFile(
            name=rt.name,
            run_id=rt.run_id,
            key=rt.key.hex(),
            created=rt.started_at,
            keep=rt.detach_keep,
            backend=rt.backend,
            per_host=dict(zip(rt.shape.labels[skip:], rt.shape.sizes[skip:])),
            n_hosts=rt.n_hosts,
            controller=ControllerId.of_this_process(),
            send=rt.transport.send_addr,
            recv=rt.transport.recv_addr,
            ipc_dir=rt.transport.ipc_dir,
            env=dict(rt.env),
            on_failure=str(rt.failures.policy),
            grace=rt.failures.grace,
            common=common,
            setup_cells=[_cell_json(c) for c in rt.setup_cells],
            hosts=[_host_entry(h, keys.hosts if keys else {}) for h in rt.hosts],
            ranks=[
                RankEntry(
                    r.rank,
                    r.host,
                    r.pid or 0,
                    r.hostname,
                    r.device,
                    r.peer.encode(),
                    r.peer_secret,
                    r.restarts,
                    r.slot,
                )
                for r in rt.ranks
            ],
            jobs=self.jobs(),
            actors=[_actor_record(spec) for spec in rt.actors.values()],
            curve=attach_file.curve_json(keys),
        )

    def jobs(self) -> list[JobRecord]:
        """What runs on the mesh now (the requests this controller started)."""
        requests = self.runtime.requests
        with self._lock:
            for rid in [rid for rid in self._started if requests.get(rid) is None]:
                del self._started[rid]
            return list(self._started.values())

    def follow(self, record: JobRecord) -> None:
        """List ``record`` (a request an earlier holder started) while it runs."""
        with self._lock:
            self._started[record.request] = record

    def save(self, force: bool = False) -> None:
        """Write the file if what it says changed (or ``force``); the last write is of
        the newest snapshot."""
        with self._save_lock:
            self._save(force)

    def _save(self, force: bool) -> None:
        snap = self.snapshot()
        fingerprint = (
            [(h.pid, h.desk) for h in snap.hosts],
            [(r.pid, r.restarts, tuple(r.peer)) for r in snap.ranks],
            [c["code"] for c in snap.setup_cells],
            [j.request for j in snap.jobs],
            [(a.name, a.ranks) for a in snap.actors],
            snap.on_failure,
        )
        if not force and fingerprint == self._written:
            return
        snap.write()
        self._written = fingerprint
        rt = self.runtime
        if rt.transport.ipc_dir:  # the sockets' directory outlives us: its owners now
            mark_owners(rt.transport.ipc_dir, [h.pid for h in snap.hosts if h.pid])

    # -- events ----------------------------------------------------------------------
    def on_event(self, event: MeshEvent) -> None:
        if isinstance(event, RequestStarted):
            if event.kind in LISTED and event.what:
                record = JobRecord(
                    event.request, list(event.ranks), event.kind.value, event.what, time.time()
                )
                with self._lock:
                    self._started[event.request] = record
                self._wake.set()
        elif isinstance(event, MeshPhaseChanged) and event.phase is MeshPhase.STOPPED:
            if not self.released:  # stopped on purpose: nothing to attach to any more
                self.snapshot().remove()
            _forget(self)

    def watch(self) -> None:
        """Keep the file current while the mesh lives (a daemon thread)."""
        rt = self.runtime
        while not rt.state.ended:
            self._wake.clear()
            try:
                self.save()
            except OSError as exc:
                log.warning("mesh %s: cannot write its attach file: %s", rt.name, exc)
            self._wake.wait(WATCH_INTERVAL)

    def on_taken_over(self, header: Header, msg: Message) -> None:
        """An agent says another kernel attached with ``--force`` (receiving thread)."""
        by = H.TakenOver.decode(header).by
        why = f"was taken over by the kernel (pid {by[0]}) on {by[1]} (%mesh attach --force)"
        log.warning("mesh %s %s", self.runtime.name, why)
        self.released = True
        _released[self.runtime.name] = why
        threading.Thread(target=self.runtime.release, args=(why,), daemon=True).start()

    # -- letting go ------------------------------------------------------------------
    def detach(self, why: str) -> None:
        """Let go of the mesh, leaving it running (see the module docstring)."""
        rt = self.runtime
        if rt.state.ended:
            return
        try:
            self.save(force=True)
        except OSError as exc:
            log.warning("mesh %s: cannot write its attach file: %s", rt.name, exc)
        for host in rt.hosts:
            rt.transport.send_host(host.index, H.Detach().encode())
        self.released = True
        _released[rt.name] = why
        rt.release(why)


_detachers: dict[int, Detacher] = {}
_detachers_lock = threading.Lock()
#: Why this process no longer holds a mesh it let go of, by name (for its errors).
_released: dict[str, str] = {}


def released_why(name: str) -> str | None:
    """``was taken over by ...`` when this process let go of mesh ``name`` (it runs on
    elsewhere), else None."""
    return _released.get(name)


def enable(runtime: MeshRuntime) -> Detacher:
    """Make ``runtime`` (a running detachable mesh, held by this controller) keep its
    attach file, and let go of it when this process ends."""
    detacher = Detacher(runtime)
    _released.pop(runtime.name, None)
    with _detachers_lock:
        _detachers[id(runtime)] = detacher
    runtime.events.subscribe(detacher.on_event, RequestStarted, MeshPhaseChanged)
    runtime.inbound.add_handler(K.TAKEN_OVER, detacher.on_taken_over)
    detacher.save(force=True)
    threading.Thread(target=detacher.watch, name="mk-attach-file", daemon=True).start()
    return detacher


def detacher_of(runtime: MeshRuntime) -> Detacher | None:
    """The detacher of ``runtime`` if it is a detachable mesh held here."""
    with _detachers_lock:
        return _detachers.get(id(runtime))


def recipe_changed(runtime: MeshRuntime) -> None:
    """``runtime``'s setup cells or actors changed: a detachable mesh's attach file says
    so now (a kernel killed right after must not leave a file without them)."""
    detacher = detacher_of(runtime)
    if detacher is not None:
        try:
            detacher.save()
        except OSError as exc:
            log.warning("mesh %s: cannot write its attach file: %s", runtime.name, exc)


def detach_all(why: str = "was detached: its kernel shut down") -> list[str]:
    """Let go of every detachable mesh this process holds; their names."""
    with _detachers_lock:
        detachers = list(_detachers.values())
    names = []
    for d in detachers:
        try:
            d.detach(why)
            names.append(d.runtime.name)
        except Exception:  # the others still detach
            log.exception("detaching mesh %s failed", d.runtime.name)
    return names


def detach_option(
    backend: str, name: str | None, detachable: bool, keep: float | str | None
) -> float:
    """The ``detach_keep`` of a new mesh (seconds; 0: not detachable) from
    ``spawn_procs(detachable=, keep=)``; ValueError for what cannot be."""
    if not detachable:
        if keep is not None:
            raise ValueError("keep= applies to a detachable mesh: pass detachable=True too")
        return 0.0
    if backend not in DETACHABLE_BACKENDS:
        raise ValueError(
            f"a detachable mesh runs on the {', '.join(DETACHABLE_BACKENDS[:-1])} or "
            f"{DETACHABLE_BACKENDS[-1]} backend in this version, not {backend!r}"
        )
    if name is None:
        raise ValueError("a detachable mesh needs a name= (it is attached by name)")
    attach_file.file_for(name)  # a name that can be part of a file name
    if keep is None:
        return DEFAULT_KEEP
    return keep_seconds(keep)


def keep_seconds(keep: float | str) -> float:
    """``keep`` as seconds (a number, or ``"90s"``, ``"30m"``, ``"2h"``, ``"1d"``)."""
    if isinstance(keep, str):
        return parse_duration(keep)
    if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not keep > 0:
        raise ValueError(f"keep must be a positive number of seconds or e.g. '2h', got {keep!r}")
    return float(keep)


def _host_entry(h: HostInfo, keys: dict[int, tuple[str, str]]) -> HostEntry:
    public = keys.get(h.slot, ("", ""))[0]  # the transport keeps the keys by host slot
    held = h.handle.reservation if isinstance(h.handle, ReservingHandle) else None
    return HostEntry(
        h.index, h.pid or 0, h.hostname, h.addr, h.port, h.desk, h.dir, public, held, h.slot
    )


def _forget(detacher: Detacher) -> None:
    with _detachers_lock:
        _detachers.pop(id(detacher.runtime), None)


def _cell_json(cell: SetupCell) -> dict[str, object]:
    return {"code": cell.code, "label": cell.label, "header": list(cell.header), "key": cell.key}


def _actor_record(spec: ActorSpec) -> ActorRecord:
    owner = spec.owner.encode() if spec.owner is not None else None
    return ActorRecord(
        spec.name,
        base64.b64encode(spec.payload).decode(),
        [base64.b64encode(bytes(memoryview(b))).decode() for b in spec.buffers],
        sorted(spec.ranks),
        owner,
    )


def actor_spec(record: ActorRecord) -> ActorSpec:
    """An actor mesh's spawn from its form in the attach file."""
    return ActorSpec(
        record.name,
        base64.b64decode(record.payload),
        tuple(base64.b64decode(b) for b in record.buffers),
        frozenset(record.ranks),
        H.Owner.decode(record.owner) if record.owner else None,
    )


def setup_cell(raw: dict[str, object]) -> SetupCell:
    """A ``--setup`` cell from its form in the attach file."""
    header = raw.get("header") or ()
    key = raw.get("key")
    return SetupCell(
        str(raw["code"]),
        str(raw["label"]),
        tuple(str(h) for h in header) if isinstance(header, (list, tuple)) else (),
        str(key) if key is not None else None,
    )


# Registered after ``controller.mesh``'s stop-everything (imported above; atexit runs the
# last registered first): detachable meshes are let go before the rest are stopped.
atexit.register(detach_all)
