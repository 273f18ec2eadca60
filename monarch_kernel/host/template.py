"""The warm template: imports torch once, then forks ranks on request and reaps them.

Started by the host agent as ``python -m monarch_kernel.host.template CMD_FD EVENT_FD``.
It reads one JSON command per line on CMD_FD and writes one JSON event per line on
EVENT_FD. It never creates a ZeroMQ context or initialises CUDA, so forking is safe.
The template is single-threaded: a SIGCHLD wakes its select loop through a wakeup fd.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import json
import os
import select
import signal
import sys
import time
from types import FrameType

from monarch_kernel.host.template_handle import CUT_IMPORT_SIGNAL, TemplateCommand
from monarch_kernel.rank.config import RankConfig
from monarch_kernel.wire.osutil import IdleCores, cpu_quota, die_with_parent, runs_in

#: Seconds ranks get to exit cleanly on SIGTERM before they are killed (the ``stop``
#: message's ``grace`` when it has none).
DEFAULT_GRACE = 3.0

#: Modules imported before the first fork so every rank starts with them loaded. The
#: actor API (not its mesh-starting part, which loads the controller) is imported by every
#: rank that runs an actor: about 30 ms of CPU once per host instead of once per rank.
PREIMPORT = ("zmq", "cloudpickle", "monarch_kernel.rank.runtime", "monarch_kernel.actor", "torch")
#: Modules imported once the template has forked a rank and then been idle for LATE_IDLE
#: seconds (never before the first forks: they would wait for it), so that ranks
#: forked later (restarted ones) have them: the first ``DistributedDataParallel(...)``
#: in a process imports ``torch._dynamo`` (about 1-2 s), which a rank restarted in the
#: middle of training would otherwise pay before it can rejoin. Set
#: ``MONARCH_KERNEL_PREIMPORT_LATE`` (comma-separated; empty: none) to change it.
PREIMPORT_LATE = "torch._dynamo"
LATE_IDLE = 1.0
#: ... and only after LATE_IDLE_STREAK such seconds in a row in each of which at least
#: LATE_IDLE_CORES of the host's CPUs were idle. Why: the import takes a core for a
#: second or two, and taken from ranks whose torch uses every core it slows them far
#: more than a core's share (their OpenMP threads wait at every parallel region for the
#: one that lost its core): the first steps of a one-rank training on a 2-core machine
#: took 0.76 s instead of 0.04 s. A new mesh's ranks are idle for a moment while they set
#: up, so one idle second is not enough. A host that never has a core to spare never
#: imports them (a restarted rank then imports them itself).
#: ``MONARCH_KERNEL_PREIMPORT_LATE_IDLE_CORES`` sets the idle CPUs needed in each of those
#: seconds (0: none, so any three idle seconds of the template do).
LATE_IDLE_CORES = 0.9
LATE_IDLE_STREAK = 3


def _idle_cores_wanted() -> float:
    """LATE_IDLE_CORES, or the environment's number (a malformed one is ignored)."""
    try:
        return float(os.environ.get("MONARCH_KERNEL_PREIMPORT_LATE_IDLE_CORES", LATE_IDLE_CORES))
    except ValueError:
        return LATE_IDLE_CORES


def _preimport() -> None:
    extra = [m for m in os.environ.get("MONARCH_KERNEL_PREIMPORT", "").split(",") if m]
    for name in (*PREIMPORT, *extra):
        try:
            importlib.import_module(name)
        except ImportError:
            pass
    if "torch" in sys.modules:
        from monarch_kernel.rank.pg.distributed import install_idempotent_init

        install_idempotent_init()
    _freeze_heap()


def _freeze_heap() -> None:
    """Move every object the template holds now (torch's, after its import: hundreds of
    thousands) out of the cyclic collector's reach (``gc.freeze``), as pre-forking
    servers do: a forked rank's collections, the full one its exit path runs included,
    then walk only the objects it made itself, and they no longer write to the shared
    pages of the template's objects (copy-on-write memory). Frozen objects are kept
    alive; these are module-level objects that live as long as the process anyway."""
    gc.collect()  # what is garbage already is not kept forever
    gc.freeze()


class ImportCut(BaseException):
    """Raised by :data:`CUT_IMPORT_SIGNAL` into the late import: the template is to
    stop. A BaseException, so that the import's own ``except Exception`` lets it by."""


def _import_quietly(names: list[str]) -> None:
    """Import ``names``; one that fails to import is skipped."""
    for name in names:
        try:
            importlib.import_module(name)
        except Exception:
            pass


class Template:
    def __init__(self, cmd_fd: int, event_fd: int):
        self.cmd_fd = cmd_fd
        self.event_fd = event_fd
        self.children: dict[int, int] = {}  # pid -> rank
        self.run_ids: set[str] = set()  # meshes whose shared-memory files we clean up
        self.buf = b""
        self.grace = DEFAULT_GRACE
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)
        signal.set_wakeup_fd(self.wake_w)
        #: True while the loop imports PREIMPORT_LATE (seconds on a loaded machine)
        self.importing = False
        #: The host agent asked for the late import to be cut (it is stopping us): none
        #: starts after that either.
        self.cut = False
        #: A rank was forked: the late import, which serves only ranks forked later
        #: (restarted ones), waits for that, so that it never holds the first forks back.
        self.forked = False
        signal.signal(signal.SIGCHLD, self._on_child)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, self._on_term)
        signal.signal(CUT_IMPORT_SIGNAL, self._on_cut_import)

    def _on_child(self, *_: object) -> None:
        """SIGCHLD: the loop reaps (woken by the wakeup fd), except while it imports
        the late modules: ``torch._dynamo`` takes seconds under load, and a rank that
        dies meanwhile must be reported at once (its futures fail "within a second"),
        so the handler reaps then (the loop is in no ``emit`` while it imports). Only
        our ranks, by pid: a subprocess the import starts is its own to wait for."""
        if not self.importing:
            return
        for pid in list(self.children):
            try:
                done, status = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                continue
            if done:
                self._reaped(pid, status)

    def _import_late(self, names: list[str]) -> None:
        self.importing = True
        try:
            if self.cut:  # asked before the import began
                return
            _import_quietly(names)
            _freeze_heap()
        finally:
            self.importing = False

    def _on_cut_import(self, signum: int, frame: FrameType | None) -> None:
        """The host agent is stopping us (its ``exit`` command is written, or being
        written): stop importing, to read it.

        Invariants: at most one :class:`ImportCut` is raised per import (``importing``
        is cleared first), so the one ``suppress`` around the import catches it,
        wherever in the import (or its ``finally``) it lands; none is raised into our
        own bookkeeping (a rank's exit reaped but not yet emitted would be lost), nor
        can one be swallowed for good: the agent sends the signal again every half
        second while it waits for us."""
        self.cut = True
        if self.importing and not runs_in(frame, _NO_CUT):
            self.importing = False
            raise ImportCut

    def _on_term(self, *_: object) -> None:
        self.importing = False  # no cut inside the shutdown
        self.shutdown()
        os._exit(0)

    def emit(self, **event: object) -> None:
        os.write(self.event_fd, (json.dumps(event) + "\n").encode())

    def run(self) -> None:
        self.emit(e="template_ready", pid=os.getpid())
        late = os.environ.get("MONARCH_KERNEL_PREIMPORT_LATE", PREIMPORT_LATE)
        pending = [m for m in late.split(",") if m] if "torch" in sys.modules else []
        idle, streak = IdleCores(cpu_quota()), 0
        cores = _idle_cores_wanted()
        while True:
            try:
                wait = LATE_IDLE if pending else None
                ready, _, _ = select.select([self.cmd_fd, self.wake_r], [], [], wait)
            except InterruptedError:
                continue
            # (read at every wake-up, so that a timeout's figure is of that idle second)
            spare = idle.since_last() if pending else None
            if ready or not self.forked:
                streak = 0
            elif spare is None or spare >= cores:
                streak += 1
            else:
                streak = 0
            if not ready:  # idle: import what later forks should find loaded
                if streak >= LATE_IDLE_STREAK:
                    with contextlib.suppress(ImportCut):
                        self._import_late(pending)
                    pending = []
                continue
            if self.wake_r in ready:
                try:
                    os.read(self.wake_r, 4096)
                except BlockingIOError:
                    pass
            self.reap()
            if self.cmd_fd in ready:
                data = os.read(self.cmd_fd, 65536)
                if not data:  # host agent gone
                    self.shutdown()
                    return
                self.buf += data
                while b"\n" in self.buf:
                    line, self.buf = self.buf.split(b"\n", 1)
                    if self.handle(json.loads(line)) == "exit":
                        self.shutdown(self.grace)
                        return

    def shutdown(self, grace: float = DEFAULT_GRACE) -> None:
        self.stop_children(grace)
        from monarch_kernel.rank.dataplane.plane import cleanup_shm

        for run_id in self.run_ids:
            cleanup_shm(run_id)

    def handle(self, cmd: TemplateCommand) -> str | None:
        """One command from the host agent: ``fork`` a rank, or ``exit``."""
        op = cmd["op"]
        if op == "fork":
            self.fork(RankConfig.from_json(cmd["cfg"]))
        elif op == "exit":
            self.grace = float(cmd.get("grace", DEFAULT_GRACE))
            return "exit"
        return None

    def fork(self, cfg: RankConfig) -> None:
        """Fork the rank ``cfg`` describes; its exit is reaped and emitted later."""
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:
            try:
                signal.set_wakeup_fd(-1)
                for fd in (self.cmd_fd, self.event_fd, self.wake_r, self.wake_w):
                    os.close(fd)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                signal.signal(CUT_IMPORT_SIGNAL, signal.SIG_DFL)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                from monarch_kernel.rank.forked import run_forked

                run_forked(cfg, parent)
            finally:
                os._exit(1)
        self.children[pid] = cfg.slot  # ranks are known here by their slot (wire id)
        self.forked = True
        self.run_ids.add(cfg.run_id)
        self.emit(e="forked", rank=cfg.slot, pid=pid)

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._reaped(pid, status)

    def _reaped(self, pid: int, status: int) -> None:
        """Child ``pid`` ended with ``status``: if it is a rank, emit its exit."""
        rank = self.children.pop(pid, None)
        if rank is None:
            return
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
        sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
        self.emit(e="exit", rank=rank, pid=pid, code=code, signal=sig)

    def stop_children(self, grace: float = DEFAULT_GRACE) -> None:
        """SIGTERM every rank (they exit cleanly: ``atexit`` handlers, finalizers,
        ``destroy_process_group``), wait up to ``grace`` seconds, SIGKILL the rest;
        each exit is emitted."""
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while self.children and time.monotonic() < deadline:
            self.reap()
            time.sleep(0.01)
        for pid in list(self.children):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        while self.children:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                break
            rank = self.children.pop(pid, None)
            if rank is not None:
                sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
                code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
                self.emit(e="exit", rank=rank, pid=pid, code=code, signal=sig)


#: The template's own bookkeeping, which an :class:`ImportCut` must not cut short.
_NO_CUT = frozenset(
    f.__code__
    for f in (
        Template._on_child,
        Template._reaped,
        Template.emit,
        Template._on_term,
        Template.shutdown,
        Template.stop_children,
    )
)


def main() -> None:
    cmd_fd, event_fd = int(sys.argv[1]), int(sys.argv[2])
    die_with_parent(signal.SIGKILL, expected_parent=int(sys.argv[3]))
    _preimport()
    Template(cmd_fd, event_fd).run()
    # Nothing is left to end (events are written unbuffered): skip the interpreter's
    # finalization of torch's modules (a few tenths of a second, which a stopping
    # agent, and so a dead controller's processes, would wait for).
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
